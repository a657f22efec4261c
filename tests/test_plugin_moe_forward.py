"""The CUDA build's graph shape, compiled on CPU through vLLM's own backend and pass manager.

vLLM's CUDA build hides each MoE layer behind the opaque ``vllm::moe_forward``;
the plugin's pass must recognise that call for layers it admitted and swap it
for ``moe_grouped_decode::vllm_moe_forward_grouped`` (same schema) only in the
compile range the contract admits. ``tests/vllm_moe_forward_job.py`` builds a
real vLLM MoE layer (``FusedMoEFactory`` with the plugin's quantization config),
compiles a module calling ``torch.ops.vllm.moe_forward`` on it with
``VllmBackend`` in VLLM_COMPILE mode, and reports the post-grad graph of every
compile range, the rewrite counts, which expert op ran, and the numbers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from expecttest import assert_expected_inline

pytestmark = pytest.mark.vllm

JOB = Path(__file__).with_name("vllm_moe_forward_job.py")
# The fp16 bound of the evidence standard: max |out - ref| <= 2e-3 * max |ref|.
SCALED_MAX_ABS_BOUND = 2e-3


@pytest.fixture(scope="module")
def job():
    proc = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("MOE_FORWARD_JOB ")]
    assert proc.returncode == 0 and lines, f"job failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("MOE_FORWARD_JOB ") :])


def test_compile_ranges_split_at_the_window(job):
    # the contract's window 2..8 becomes a compile range of its own (2048 is max_num_batched_tokens)
    assert job["compile_ranges_endpoints"] == [1, 8, 2048]


def test_admitted_range_swaps_moe_forward(job):
    assert_expected_inline(
        job["graphs"]["(2, 8)"],
        """\
v5 = auto_functionalized(moe_grouped_decode.vllm_moe_forward_grouped.default, hidden_states=arg0, router_logits=arg2, shared_experts_input=None, input_ids=None, layer_name=arg4, hidden_dim_unpadded=0)
v6 = getitem(v5, 0)
v7 = getitem(v5, 1)
v8 = add.Tensor(v6, v7)
v9 = copy_.default(arg0, v7)""",
    )


def test_other_ranges_keep_vllm_moe_forward(job):
    assert_expected_inline(
        job["graphs"]["(9, 2048)"],
        """\
v5 = auto_functionalized(vllm.moe_forward.default, hidden_states=arg0, router_logits=arg2, shared_experts_input=None, input_ids=None, layer_name=arg4, hidden_dim_unpadded=0)
v6 = getitem(v5, 0)
v7 = getitem(v5, 1)
v8 = add.Tensor(v6, v7)
v9 = copy_.default(arg0, v7)""",
    )
    # M=1 lies outside the graph's symbolic range (Dynamo specialises 0/1), so nothing to admit either
    assert job["graphs"]["(1, 1)"] == job["graphs"]["(9, 2048)"]
    assert job["rewrites"] == {"awq_moe_dense": 0, "moe_forward": 1, "graphs": 3}


def test_one_info_line_for_the_whole_compile(job):
    # three graphs compiled (one per range), one of them changed: one line says what and why;
    # the lowering's per-graph "rewrote 0 of 0" lines (nothing to do on this graph shape) are gone
    compile_lines = [line for line in job["info_lines"] if "compile pass" in line or "GroupedDecodePass" in line]
    assert compile_lines == [
        "moe_grouped_decode: compile pass swapped 1 vllm::moe_forward call(s) for the grouped route in a graph "
        "for 2..8 tokens (model.layers.0.mlp.experts): layers admitted under contract 'moe-forward-test' "
        "(grouped route for 2..8 tokens); graphs for other token counts keep vLLM's op. "
        "Later graphs are logged at DEBUG."
    ]


@pytest.mark.parametrize(
    "num_tokens,expert_op",
    [
        ("4", "awq_moe_grouped_decode"),  # inside the window: the swapped op takes the grouped route
        ("12", "awq_moe_dense"),  # above it: vLLM's own moe_forward, the method's dense route
    ],
)
def test_route_taken_and_values(job, num_tokens, expert_op):
    result = job["results"][num_tokens]
    assert result["ops_run"] == [expert_op]
    assert not result["nan"]
    # grouped and dense CPU implementations accumulate identically: eager == compiled, bit for bit
    assert result["compiled_vs_eager_max_abs"] == 0.0
    assert result["rerun_identical"]
    assert result["compiled_vs_reference_max_abs"] <= SCALED_MAX_ABS_BOUND * result["reference_max_abs"]
