"""The tuner (benchmarking/tune.py) without a GPU: reading a checkpoint's shape under vLLM's
parallelism, the decisions it makes from timings (grouped window, extra counts where margins are
thin, the route table, the launch-table entries), its command line, and its whole search and
measurement on the Triton interpreter with a clock and a vLLM timer given by the test
(tune_interpret_check.py)."""

import dataclasses
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


def test_the_co_serving_step_is_told_vllms_faster_backend_where_the_route_table_measured_it():
    r = tune.route_table((1, 8, 64), (5.0, 20.0, 90.0), (30.0, 40.0, 80.0),
                         {"marlin": (20.0, None, 100.0), "humming": (25.0, None, 85.0)})
    assert tune.vllm_best_by_count(r) == {1: 20.0, 64: 85.0}  # nothing at 8: no cut can be made there


@pytest.mark.parametrize("shape, over_humming", [((128, 8, 2048, 768, 128), True), ((512, 10, 2560, 160, 32), False)])
def test_the_co_serving_step_measures_hummings_tensors_where_the_kernel_reads_them(monkeypatch, shape, over_humming):
    """After Marlin's table (here cut after two of four counts), the same counts over Humming's
    tensors, where N tiles by 64 (not at N = 160); the progress bar counts every step it announced."""
    from moe_grouped_decode.benchmarking import coserve

    marlin = tables.CoserveTable(tokens=(1, 2), coserved_us=(5.0, 6.0), vllm_us={"marlin": (9.0, 9.0)})
    humming = dataclasses.replace(marlin, coserved_us=(5.5, 6.5))
    calls = []

    def fake_marlin(measure, tokens, step, log, generator, vllm_best_us):
        calls.append(("marlin", tuple(tokens), vllm_best_us))
        for m in tokens[:2]:
            step(f"co-served (marlin) M={m}")
        for m in tokens[2:]:
            step(f"co-served M={m}: not measured")
        step("vLLM's backends")
        return marlin

    def fake_humming(measure, table, step, log, generator):
        calls.append(("humming", table))
        for m in table.tokens:
            step(f"co-served (humming) M={m}")
        return humming

    monkeypatch.setattr(tune, "measure_coserve", fake_marlin)
    monkeypatch.setattr(tune, "measure_coserve_humming", fake_humming)
    steps = []

    class Counting(tune.Progress):
        def step(self, what):
            steps.append(what)

    tokens = (1, 2, 3, 4)
    progress = Counting(tune.coserve_steps(shape, tokens))
    measure = type("M", (), {"spec": tune.LayerSpec(shape, "fp16", "test")})()
    routes = tune.route_table((1, 2), (5.0, 6.0), (9.0, 9.0), {"marlin": (8.0, 9.0)})
    logged = []
    got = tune.measure_coserving(measure, tokens, routes, progress, "gen", logged.append)
    assert got == ((marlin, humming) if over_humming else (marlin, None))
    assert calls[0] == ("marlin", tokens, {1: 8.0, 2: 9.0})
    assert (calls[1:] == [("humming", marlin)]) is over_humming
    assert len(steps) == progress.total == (2 * len(tokens) + 1 if over_humming else len(tokens) + 1)
    assert over_humming or any("not over Humming's tensors: N = 160" in line for line in logged)


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
    # every variant of the two nearest sizes: at 36 tokens of Qwen3-30B TP2 an expert has 2.25 rows,
    # and only 8-row groups fit, but a 16-row config with W2's pieces unrolled can win there
    unrolled = [dataclasses.replace(candidates[1], w2_stages=12, w2_unrolled_pieces=16, w2_tiles_per_program=tiles)
                for tiles in (1, 4)]
    both = [candidates[0]] + unrolled + candidates[1:]
    assert tune.plausible_prefill(both, 36, (128, 8, 2048, 384, 128)) == [candidates[0]] + unrolled + [candidates[1]]


# --------------------------------------------------------------------------- a search the budget cuts short
# The search's own logic in process: the launches are the test's (every config agrees with the
# reference, or not where a test says so), the clock gives a cost per config and advances a fake
# time.time() by one second a timing, so a deadline of n timings cuts the search there.


def farthest_unsearched(order, n):
    """The largest log2 distance from a count not among the first ``n`` of ``order`` to one that is."""
    import math

    taken = order[:n]
    return max((min(abs(math.log2(m / s)) for s in taken) for m in order[n:]), default=0.0)


@pytest.mark.parametrize("counts, order", [
    (tune.PREFILL_SEARCH_TOKENS, [16384, 256, 2048, 8192, 1024, 4096, 512]),
    (tune.GROUPED_SEARCH_TOKENS, [128, 1, 16, 4, 64, 32, 8, 2]),
])
def test_the_search_visits_both_ends_then_splits_the_widest_gap(counts, order):
    assert tune.search_order(counts) == order
    assert tune.search_order(reversed(counts)) == order  # whatever order the counts come in
    assert sorted(order) == sorted(counts) and order[:2] == [max(counts), min(counts)]
    # cut anywhere after both ends, no count is left further from a searched one than ascending order leaves it
    # (which leaves the largest counts, all together); the spread only narrows as the search goes on
    spread = [farthest_unsearched(order, n) for n in range(2, len(order) + 1)]
    assert spread == sorted(spread, reverse=True)
    ascending = sorted(counts)
    assert all(farthest_unsearched(order, n) <= farthest_unsearched(ascending, n) for n in range(2, len(order)))
    assert farthest_unsearched(order, 3) < farthest_unsearched(ascending, 3) / 2
    assert tune.search_order([512, 256]) == [512, 256] and tune.search_order([64]) == [64]


def test_the_nearest_searched_count_is_nearest_in_log2_ties_to_the_larger():
    assert tune.nearest_searched(512, [256, 2048, 16384]) == 256
    assert tune.nearest_searched(1024, [256, 2048, 16384]) == 2048
    assert tune.nearest_searched(2048, [256, 16384]) is None  # three doublings either way: too far
    assert tune.nearest_searched(2048, [512, 16384]) == 512  # two doublings: the furthest kept
    assert tune.nearest_searched(4, [1, 16]) == 16
    assert tune.nearest_searched(4, []) is None


class FakeSearch:
    """A Measurement, launches and a clock for ``tune.search`` without kernels: ``cost(M, config)``
    in microseconds; each timing advances the fake time.time() by one second; ``disagree``:
    (M, config) pairs whose output differs from the reference; ``grouped``: the configs the
    grouped op was launched with."""

    def __init__(self, monkeypatch, shape, cost, disagree=()):
        import types

        import torch

        from moe_grouped_decode import ops

        self.now, self.timed, self.grouped, self.log = 0.0, [], [], []
        self.cost, self.disagree = cost, set(disagree)
        monkeypatch.setattr(tune, "time", types.SimpleNamespace(time=lambda: self.now))
        monkeypatch.setattr(ops, "alloc_workspace", lambda *args: None)
        monkeypatch.setattr(ops, "launch_prefill", lambda x, tw, ids, layer, out, config: self.launch(x, out, config))
        monkeypatch.setattr(ops, "launch_grouped", lambda x, tw, ids, layer, workspace, out, config: (
            self.grouped.append(config), self.launch(x, out, config)))
        spec = tune.LayerSpec(shape, "fp16", "fake")
        layers = [types.SimpleNamespace(w13_scales=torch.zeros(1, dtype=torch.float16))]
        self.measure = tune.Measurement(spec, layers, self.clock, None, torch.device("cpu"))
        self.measure.inputs = lambda M: ([None], [None], [torch.full((1, 8), float(M), dtype=torch.float16)])
        self.progress = tune.Progress(1, out=open(os.devnull, "w"))

    def launch(self, x, out, config):
        M = int(x[0, 0].item())
        out.fill_(2.0 if (M, config) in self.disagree else 1.0)

    def clock(self, step, calls, key):
        step(0)
        self.now += 1.0
        route, M, config = key
        self.timed.append((M, config))
        return self.cost(M, config)

    def search(self, route, counts, candidates, timings=None, searched=None):
        """``tune.search`` with a deadline after ``timings`` timings (None: no deadline)."""
        deadline = float("inf") if timings is None else self.now + timings - 0.5
        return tune.search(self.measure, route, counts, candidates, self.progress, deadline, self.log.append,
                           searched=searched)


# an (E, k, K, N, G) no table holds: the op's own configs are the built-in defaults; an expert has M / 16
# rows on average, so the fake clock's favourite group size (the nearest to it) changes with M
NEW_SHAPE = (64, 4, 1024, 512, 128)


def prefill_configs():
    from moe_grouped_decode.kernels.config import PrefillConfig

    return [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3, w2_stages=4)
            for rows in (8, 16, 32, 64, 128)]


def nearest_group_cost(M, config):
    import math

    return 100.0 + abs(math.log2(config.group_rows / (M * NEW_SHAPE[1] / NEW_SHAPE[0])))


def test_a_prefill_count_the_budget_leaves_keeps_its_nearest_searched_neighbours_best(monkeypatch):
    from moe_grouped_decode.kernels.config import prefill_config

    counts = list(tune.PREFILL_SEARCH_TOKENS)
    full = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost).search("prefill", counts, prefill_configs())
    rows = {M: c.block_rows for M, c in full.items()}
    assert rows == {256: 16, 512: 32, 1024: 64, 2048: 128, 4096: 128, 8192: 128, 16384: 128}
    fake = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost)
    # 16384 times two group sizes (the two nearest its experts' rows), 256 and 2048 four each: then the budget is spent
    searched: set = set()
    kept = fake.search("prefill", counts, prefill_configs(), timings=10, searched=searched)
    assert searched == {16384, 256, 2048} and {M for M, _ in fake.timed} == searched
    assert list(kept) == sorted(counts)
    nearest = {256: 256, 512: 256, 1024: 2048, 2048: 2048, 4096: 2048, 8192: 16384, 16384: 16384}
    assert kept == {M: full[near] for M, near in nearest.items()}
    assert kept[512] != full[512] and kept[1024] != full[1024]  # a neighbour's, not what their own search finds
    default = prefill_config(NEW_SHAPE, "cpu", "fp16", 16384)
    assert all(c != default for c in kept.values())
    for M in (512, 1024, 4096, 8192):
        assert f"[tune] prefill M={M}: not searched (budget spent): keeps M={nearest[M]}'s best {kept[M]}" in fake.log


def test_a_grouped_count_the_budget_leaves_keeps_its_neighbours_candidate_as_the_search_stores_it(monkeypatch):
    import dataclasses
    import math

    from moe_grouped_decode.kernels.config import GroupedConfig

    # one candidate a count, each fastest at its own: 1 at 1 token, ..., 8 at 128
    candidates = [dataclasses.replace(GroupedConfig().as_tl(), w13_ring_stages=stages) for stages in range(1, 9)]
    fake = FakeSearch(monkeypatch, NEW_SHAPE,
                      lambda M, config: 10.0 + abs(config.w13_ring_stages - 1 - math.log2(M)))
    kept = fake.search("grouped", tune.GROUPED_SEARCH_TOKENS, candidates, timings=3 * len(candidates))
    assert {M for M, _ in fake.timed} == {128, 1, 16}
    # the candidates themselves, as the search stores a searched count's best (the launches run them fitted)
    nearest = {1: 1, 2: 1, 4: 16, 8: 16, 16: 16, 32: 16, 64: 128, 128: 128}
    assert all(kept[M] is candidates[round(math.log2(near))] for M, near in nearest.items()), kept
    assert set(fake.grouped) == {c.fitted(NEW_SHAPE[2]) for c in candidates}
    assert "[tune] grouped M=4: not searched (budget spent): keeps M=16's best " + str(candidates[4]) in fake.log
    assert "[tune] grouped M=64: not searched (budget spent): keeps M=128's best " + str(candidates[7]) in fake.log


def test_a_far_or_ill_fitting_neighbours_best_is_not_kept(monkeypatch):
    """Only 16384 searched: counts more than two doublings away keep the op's own config, and
    so does 8192 (one doubling), where 16384's 128-row groups would not suit its rows."""
    from moe_grouped_decode.kernels.config import PrefillConfig, prefill_config

    wide = PrefillConfig(kernel="wgmma", block_rows=128, w13_block_k=64, w13_stages=3, w2_stages=4)
    shape = (2048, 4, 1024, 512, 128)  # an expert has M * 4 / 2048 rows: 16 at 8192, 32 at 16384
    fake = FakeSearch(monkeypatch, shape, lambda M, config: 100.0)
    kept = fake.search("prefill", tune.PREFILL_SEARCH_TOKENS, [wide], timings=1)
    assert {M for M, _ in fake.timed} == {16384} and kept[16384] is wide
    for M in (256, 512, 1024, 2048, 8192):
        assert kept[M] == prefill_config(shape, "cpu", "fp16", M), M
        assert any(line.startswith(f"[tune] prefill M={M}: not searched (budget spent, no searched count's best")
                   for line in fake.log), (M, fake.log)
    assert not tune.group_rows_fit(wide, 8192, shape) and tune.group_rows_fit(wide, 16384, shape)


def test_with_nothing_searched_a_count_keeps_the_ops_own_config(monkeypatch):
    import torch

    from moe_grouped_decode.kernels.config import GroupedConfig, prefill_config
    from moe_grouped_decode.kernels.lookup import launch_choice

    fake = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost)
    searched: set = set()
    kept = fake.search("prefill", tune.PREFILL_SEARCH_TOKENS, prefill_configs(), timings=0, searched=searched)
    assert kept == {M: prefill_config(NEW_SHAPE, "cpu", "fp16", M) for M in tune.PREFILL_SEARCH_TOKENS}
    assert searched == set() and fake.timed == []
    assert any(line.startswith("[tune] prefill M=16384: not searched (budget spent, no searched count's best")
               and "keeps the op's own" in line for line in fake.log), fake.log
    kept = fake.search("grouped", tune.GROUPED_SEARCH_TOKENS, [GroupedConfig().as_tl()], timings=0)
    assert kept == {M: launch_choice(torch.device("cpu"), NEW_SHAPE, torch.float16, M, route="grouped").config
                    for M in tune.GROUPED_SEARCH_TOKENS}


def test_a_count_where_no_candidate_agrees_keeps_the_ops_own_config_not_a_neighbours(monkeypatch):
    from moe_grouped_decode.kernels.config import prefill_config

    candidates = prefill_configs()
    fake = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost, disagree={(512, c) for c in candidates})
    kept = fake.search("prefill", tune.PREFILL_SEARCH_TOKENS, candidates)
    assert kept[512] == prefill_config(NEW_SHAPE, "cpu", "fp16", 512)
    assert any(line.startswith("[tune] prefill M=512: not searched (no candidate ran): keeps the op's own")
               for line in fake.log), fake.log


def refinement_inputs(best: dict, speedup: dict):
    """(timings, table_of) for ``refine_prefill``: the prefill route at 100 us at each count of
    ``speedup``, Marlin at ``speedup`` times that, the table built over ``best``'s entries."""
    counts = tuple(sorted(speedup))
    timings = {M: tune.Timings(None, 100.0, {"marlin": 100.0 * speedup[M]}) for M in counts}

    def table_of(t):
        routes = tune.route_table(counts, [None] * len(counts), [t[m].prefill_us for m in counts],
                                  {"marlin": [t[m].vllm_us["marlin"] for m in counts]})
        return tables.MeasuredTable(gpu="Test GPU", shape=NEW_SHAPE, dtype="fp16", name="refine", generator="",
                                    versions={}, routes=routes, grouped=(), prefill=tune.launch_table_entries(best))

    return timings, table_of


def test_refinement_also_searches_counts_the_first_search_did_not_reach_worst_first(monkeypatch):
    """A prefill count the budget left (it runs a neighbour's best) is searched again when its margin
    is thin, the worst margin first, though the first search's entries name it."""
    from moe_grouped_decode.kernels.config import PrefillConfig

    counts = (256, 1024, 4096, 16384)
    best = {M: PrefillConfig(block_rows=16 if M < 1024 else 128, kernel="wgmma") for M in counts}
    speedup = {256: 1.5, 1024: 1.05, 4096: 1.3, 16384: 0.8}  # 16384 and 1024 were not searched
    timings, table_of = refinement_inputs(best, speedup)

    visited = []

    def search(measure, route, token_counts, candidates, progress, deadline, log=print, always=(), searched=None):
        visited.extend(token_counts)
        return {M: always[0] for M in token_counts}  # each keeps the config it runs: nothing changes

    monkeypatch.setattr(tune, "search", search)
    fake = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost)
    args = (fake.measure, timings, best, prefill_configs(), table_of, fake.progress, float("inf"), fake.log.append)
    assert tune.refine_prefill(*args, searched={256, 4096}) == best
    assert visited == [16384, 1024]
    visited.clear()
    assert tune.refine_prefill(*args) == best and visited == []  # without it: every count of best counts as searched


def test_refinement_times_the_neighbours_configs_whatever_their_group_size(monkeypatch):
    """A refined count also times the configs the other measured counts run, right after its own
    and the nearest count's first, though the group-size filter would leave them out: a config can
    win for what that filter does not weigh."""
    from moe_grouped_decode.kernels.config import PrefillConfig

    counts = (16, 64, 1024, 4096, 16384)
    unrolled = PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=64, w13_stages=3, w2_stages=16,
                             w2_unrolled_pieces=16)
    wide, narrow = prefill_configs()[4], prefill_configs()[0]
    best = {16: narrow, 64: unrolled, 16384: wide}
    speedup = {16: 1.5, 64: 1.3, 1024: 0.9, 4096: 0.95, 16384: 1.2}  # 1024 and 4096 are thin, unsearched
    timings, table_of = refinement_inputs(best, speedup)

    timed = {}

    def search(measure, route, token_counts, candidates, progress, deadline, log=print, always=(), searched=None):
        (M,) = token_counts
        timed[M] = list(always) + list(candidates)
        return {M: always[0]}  # each keeps the config it runs

    monkeypatch.setattr(tune, "search", search)
    fake = FakeSearch(monkeypatch, NEW_SHAPE, nearest_group_cost)
    assert tune.configs_by_distance(counts, 1024, str) == ["4096", "64", "16384", "16"]  # ties: the smaller
    assert unrolled not in tune.plausible_prefill(prefill_configs() + [unrolled], 4096, NEW_SHAPE)
    tune.refine_prefill(fake.measure, timings, best, prefill_configs(), table_of, fake.progress, float("inf"),
                        fake.log.append, searched={16, 64, 16384})
    assert list(timed) == [1024, 4096]
    # 1024 runs the wide groups (16384's entry) as 4096 does: its own first, then 64's, then 16's
    assert timed[1024][:3] == [wide, unrolled, narrow] and len(timed[1024]) == len(set(timed[1024]))
    # 4096: its neighbours both run its own config, timed once; then 64's and 16's
    assert timed[4096][:3] == [wide, unrolled, narrow] and timed[4096].count(wide) == 1


def test_prefill_candidates_follow_the_shape(monkeypatch):
    """On Hopper the search adds, for a W2 tile of 9-16 pieces (N = 288 to 512), configs with
    those pieces unrolled and a ring stage each; for a layer of few W2 programs, one and two tiles
    a program; a shape of neither gets neither, and every candidate is a distinct config. (Without
    the shipped tables, whose configs the search also tries: a table tuned with these variants
    would hold some of them.)"""
    from moe_grouped_decode import tables
    from moe_grouped_decode.benchmarking.tune import prefill_candidates

    monkeypatch.setattr(tables, "shipped_tables", lambda: [])

    def extra(shape):
        found = prefill_candidates((9, 0), shape)
        assert len(found) == len(set(found))
        unrolled = {(c.block_rows, c.w2_stages, c.w2_tiles_per_program) for c in found if c.w2_unrolled_pieces > 8}
        tiles = {(c.block_rows, c.w2_tiles_per_program) for c in found
                 if c.w2_tiles_per_program < 4 and c.w2_unrolled_pieces == 8}
        return unrolled, tiles

    assert extra((128, 8, 2048, 384, 128)) == ({(16, 12, 1), (16, 12, 4), (32, 12, 1), (32, 12, 4)},
                                               {(16, 1), (16, 2), (32, 1), (32, 2)})
    assert extra((512, 10, 2048, 512, 128)) == ({(16, 16, 1), (16, 16, 4), (32, 16, 1), (32, 16, 4)}, set())
    assert extra((512, 10, 2560, 160, 32)) == (set(), set())
    assert extra((64, 6, 2048, 1408, 128))[0] == set()  # 44 pieces: too many to unroll
    assert prefill_candidates((9, 0)) == prefill_candidates((9, 0), (512, 10, 2560, 160, 32))
    assert all(c.kernel != "wgmma" for c in prefill_candidates((8, 0), (128, 8, 2048, 384, 128)))
