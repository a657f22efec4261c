"""The tuner (benchmarking/tune.py) without a GPU: reading a checkpoint's shape under vLLM's
parallelism, the decisions it makes from timings (grouped window, extra counts where margins are
thin, the route table, the launch-table entries), its command line, and its whole search and
measurement on the Triton interpreter with a clock and a vLLM timer given by the test
(tune_interpret_check.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_grouped_decode import tables
from moe_grouped_decode.benchmarking import tune

HERE = Path(__file__).resolve().parent

# config.json fields as the models' own checkpoints spell them (the MoE part only)
CHECKPOINTS = {
    "qwen3-30b-a3b": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "num_experts_per_tok": 8,
                       "hidden_size": 2048, "moe_intermediate_size": 768, "intermediate_size": 6144,
                       "torch_dtype": "bfloat16"}, 128),
    "mixtral-8x7b": ({"architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2,
                      "hidden_size": 4096, "intermediate_size": 14336, "torch_dtype": "float16"}, 128),
    "deepseek-v2-lite": ({"architectures": ["DeepseekV2ForCausalLM"], "n_routed_experts": 64, "num_experts_per_tok": 6,
                          "hidden_size": 2048, "moe_intermediate_size": 1408, "intermediate_size": 10944,
                          "n_shared_experts": 2, "torch_dtype": "bfloat16"}, 128),
    "qwen3.8": ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 512, "num_experts_per_tok": 10,
                 "hidden_size": 2560, "moe_intermediate_size": 640, "torch_dtype": "float16"}, 32),
}


def checkpoint(tmp_path, name):
    config, group = CHECKPOINTS[name]
    directory = tmp_path / name
    directory.mkdir()
    quant = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    (directory / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return directory


@pytest.mark.parametrize("name, tp, ep, shape, dtype", [
    ("qwen3-30b-a3b", 1, False, (128, 8, 2048, 768, 128), "bf16"),
    ("qwen3-30b-a3b", 2, False, (128, 8, 2048, 384, 128), "bf16"),
    ("mixtral-8x7b", 2, False, (8, 2, 4096, 7168, 128), "fp16"),  # intermediate_size is the experts' there
    ("deepseek-v2-lite", 1, False, (64, 6, 2048, 1408, 128), "bf16"),  # the routed experts', not the dense MLP's
    ("qwen3.8", 4, False, (512, 10, 2560, 160, 32), "fp16"),
    ("qwen3.8", 4, True, (128, 10, 2560, 640, 32), "fp16"),  # expert parallel: whole experts, E / 4 per rank
])
def test_one_ranks_shape_from_a_checkpoint(tmp_path, name, tp, ep, shape, dtype):
    spec = tune.spec_from_checkpoint(checkpoint(tmp_path, name), tp, ep)
    assert spec.shape == shape and spec.dtype == dtype
    assert spec.name == f"{name}-{'ep' if ep else 'tp'}{tp}"
    assert tune.spec_from_checkpoint(checkpoint(tmp_path / "again", name) if False else tmp_path / name, tp, ep,
                                     dtype="fp16").dtype == "fp16"


def test_checkpoints_it_cannot_read_are_named(tmp_path):
    with pytest.raises(ValueError, match="cannot read it"):
        tune.spec_from_checkpoint(tmp_path / "missing")
    directory = checkpoint(tmp_path, "qwen3-30b-a3b")
    with pytest.raises(ValueError, match="does not split over 5 tensor-parallel ranks"):
        tune.spec_from_checkpoint(directory, 5)
    data = json.loads((directory / "config.json").read_text())
    data["quantization_config"]["quant_method"] = "gptq"
    (directory / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="not an AWQ 4-bit checkpoint"):
        tune.spec_from_checkpoint(directory)


@pytest.mark.parametrize("text, problem", [("1,2,3", "give E,k,K,N,G"), ("8,2,4096,7168,100", "G=100"),
                                           ("8,2,4000,7168,128", "K=4000"), ("4,8,2048,768,128", "k=8 > E=4")])
def test_shapes_the_kernels_cannot_take_are_refused(text, problem):
    with pytest.raises(ValueError, match=problem):
        tune.check_spec(tune.spec_from_shape(text, "fp16"))


def test_the_grid_reaches_vllms_largest_step_and_brackets_decode():
    grid = tune.token_grid(tables.LARGEST_STEP)
    assert grid[0] == 1 and grid[-1] == tables.LARGEST_STEP and list(range(1, 7)) == list(grid[:6])
    assert all(b / a <= 1.5 for a, b in zip(grid[6:], grid[7:]))  # about three counts a doubling above decode
    assert tune.token_grid(1000)[-1] == 1000


def test_the_grouped_window_is_the_run_from_one_token():
    tokens = (1, 2, 32, 64, 128, 256)
    assert tune.grouped_window(tokens, (8, 10, 80, 180, 150, None), (30, 31, 120, 170, 200, 260)) == (1, 32)
    assert tune.grouped_window(tokens, (31, 10, 80, None, None, None), (30, 31, 120, 170, 200, 260)) is None
    assert tune.grouped_window((2, 4), (1, 1), (5, 5)) is None  # not measured at 1 token: no window


def test_thin_margins_get_a_count_between_neighbours():
    tokens = (1, 2, 64, 128, 1024, 4096)
    speedups = (3.0, 2.5, 1.02, 1.3, 0.9, 1.2)
    # 64 is thin (to 2 and to 128), 1024 loses (to 128 and to 4096); 1-2 are adjacent
    assert tune.thin_pairs(tokens, speedups) == [11, 91, 362, 2048]
    assert tune.thin_pairs(tokens, (3.0, 2.5, 1.5, 1.3, 1.2, 1.2)) == []


def test_route_table_takes_the_faster_route_per_count():
    r = tune.route_table((1, 8, 64), (5.0, 20.0, 90.0), (30.0, 40.0, 80.0),
                         {"marlin": (20.0, 40.0, 100.0), "humming": (25.0, None, 85.0)})
    assert r.grouped_tokens == (1, 8) and r.routes == ("grouped", "grouped", "prefill")
    assert r.plugin_us == (5.0, 20.0, 80.0)
    assert r.speedups() == [4.0, 2.0, 85.0 / 80.0]


def test_launch_table_entries_serve_every_count_up_to_their_own():
    from moe_grouped_decode.kernels.config import GroupedConfig

    entries = tune.launch_table_entries({8: GroupedConfig(w13_block_k=512), 1: GroupedConfig()}, "gluon")
    assert [(e["kernels"], e["M"], e["config"]["w13_block_k"]) for e in entries] == [("gluon", 1, 256), ("gluon", 8, 512)]


def test_refined_counts_get_their_own_entries_and_the_rest_keep_theirs():
    best = {256: "A", 1024: "B", 16384: "C"}
    counts = (128, 192, 256, 512, 1024, 4096, 10033, 16384)
    assert tune.entry_for(best, 1) == "A" and tune.entry_for(best, 257) == "B" and tune.entry_for(best, 20000) == "C"
    assert tune.per_count_entries(best, counts, {}) == best
    # 10033 now runs "B": 4096 keeps "C" (an entry of its own), 10033 takes "B", 16384 keeps "C"
    assert tune.per_count_entries(best, counts, {10033: "B"}) == {256: "A", 1024: "B", 4096: "C", 10033: "B",
                                                                   16384: "C"}
    # 192 now runs "B": 128 keeps "A" (its own entry), 256 keeps "A"
    assert tune.per_count_entries(best, counts, {192: "B"}) == {128: "A", 192: "B", 256: "A", 1024: "B",
                                                                 16384: "C"}
    # a refined count that keeps its config changes nothing
    assert tune.per_count_entries(best, counts, {512: "B", 10033: "C"}) == best


def test_refinement_takes_thin_prefill_counts_worst_first():
    tokens = (1, 8, 64, 256, 1024, 10033, 16384)
    routes = ("grouped", "grouped", "prefill", "prefill", "prefill", "prefill", "prefill")
    speedups = (3.0, 1.02, 1.08, 1.5, 0.9, 0.89, None)
    # 8 is the grouped route's; 256 has a wide margin; 1024 was searched; 16384 not measured
    assert tune.refine_counts(tokens, routes, speedups, searched=(256, 1024, 16384)) == [10033, 64]


def test_tune_on_the_interpreter_writes_a_table_the_plugin_reads(tmp_path):
    """The whole tune (search, measurement, refinement, table) on a tiny shape under
    TRITON_INTERPRET=1, with a clock and a vLLM timer given by the check (tune_interpret_check.py)."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent), MOE_GROUPED_DECODE_CACHE=str(tmp_path))
    result = subprocess.run([sys.executable, str(HERE / "tune_interpret_check.py"), str(tmp_path)], env=env,
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "tune interpreter check passed" in result.stdout


def test_prefill_search_times_group_sizes_near_the_rows_an_expert_has():
    from moe_grouped_decode.kernels.config import PrefillConfig

    candidates = [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3, w2_stages=4)
                  for rows in (8, 16, 32, 64, 128)]
    qwen = (512, 10, 2560, 160, 32)
    # 256 tokens: 5 rows an expert on average; 16384: 320
    assert [c.group_rows for c in tune.plausible_prefill(candidates, 256, qwen)] == [8, 16]
    assert [c.group_rows for c in tune.plausible_prefill(candidates, 16384, qwen)] == [64, 128]
    assert [c.group_rows for c in tune.plausible_prefill(candidates[:2], 16384, qwen)] == [8, 16]  # the nearest two
