"""No call of the plugin's ops synchronizes the host (GPU only; skipped without CUDA).

A decode step inside vLLM runs both ops at every MoE layer: the grouped op for the
admitted token counts, the dense op for the others (and for prefill). A host sync
there (``.item()``, ``.cpu()``, ``nonzero``, a blocking copy) stalls the step and
breaks CUDA-graph capture. Each call below runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on every synchronizing
CUDA call torch makes, after one warmup call of the same shape outside it (the
first call JIT-compiles kernels and grows the allocator's pool, neither of which
happens inside a step). The checked call routes differently from the warmup, so
data-dependent sizes (the rows per expert, the sort's group count) change, and its output must equal
the same call made outside the check, bit for bit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.env import GLUON_W13_ENV
from moe_grouped_decode.kernels.config import OVER_GROUPS_FROM_TOKENS
from moe_grouped_decode.ops import alloc_workspace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = (QWEN38_TP4.num_experts, QWEN38_TP4.top_k, QWEN38_TP4.hidden_size,
                     QWEN38_TP4.intermediate_size, QWEN38_TP4.group_size)
# the grouped window's edges and the launch table's entries in between (every count has its own
# plan), and both sides of where the route goes over the sort's groups
GROUPED_TOKENS = sorted({1, 2, 3, 4, 8, 9, 16, 33, OVER_GROUPS_FROM_TOKENS - 1, OVER_GROUPS_FROM_TOKENS, 64,
                         QWEN38_TP4.max_tokens})
# the prefill route, inside and past the grouped window (it serves any M)
DENSE_TOKENS = [1, 2, 8, 9, 16, 64, 65, 256, 1024, 2048]

grouped_op = torch.ops.moe_grouped_decode.awq_moe_grouped_decode
dense_op = torch.ops.moe_grouped_decode.awq_moe_dense


@contextlib.contextmanager
def host_sync_is_an_error():
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def weights(request):
    return synthetic_moe_weights(E, K, N, G, dtype=request.param, seed=21, device="cuda")


@pytest.fixture(scope="module")
def workspace():
    return alloc_workspace(QWEN38_TP4.max_tokens, TOP_K, K, N, "cuda")


def step_inputs(M: int, dtype, seed: int):
    """Activations and a router's top-k (distinct experts per token, float32 weights), on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ids = torch.rand(M, E, generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
    tw = torch.rand(M, TOP_K, generator=gen)
    return x.cuda(), tw.div(tw.sum(1, keepdim=True)).cuda(), ids.cuda()


def test_the_check_catches_a_host_sync():
    # the control: without it a passing test below would prove nothing
    value = torch.ones(4, device="cuda")
    with host_sync_is_an_error(), pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        value.sum().item()
    with host_sync_is_an_error(), pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
        value.cpu()


@pytest.mark.parametrize("gluon", ["1", "0"], ids=["gluon", "tl"])
@pytest.mark.parametrize("M", GROUPED_TOKENS)
def test_grouped_op_never_syncs(weights, workspace, M, gluon, monkeypatch):
    monkeypatch.setenv(GLUON_W13_ENV, gluon)
    grouped_op(*step_inputs(M, weights.dtype, seed=M), *weights.op_args(), workspace)  # warmup
    inputs = step_inputs(M, weights.dtype, seed=100 + M)
    expected = grouped_op(*inputs, *weights.op_args(), workspace).clone()
    torch.cuda.synchronize()
    with host_sync_is_an_error():
        out = grouped_op(*inputs, *weights.op_args(), workspace)
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("M", DENSE_TOKENS)
def test_dense_op_never_syncs(weights, M):
    dense_op(*step_inputs(M, weights.dtype, seed=M), *weights.op_args())  # warmup
    inputs = step_inputs(M, weights.dtype, seed=200 + M)
    expected = dense_op(*inputs, *weights.op_args()).clone()
    torch.cuda.synchronize()
    with host_sync_is_an_error():
        out = dense_op(*inputs, *weights.op_args())
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.int16), expected.view(torch.int16))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("M", [2, 8])
def test_a_step_of_layers_never_syncs(weights, workspace, M):
    """Several layers back to back, each one's output the next one's input, as in a decode step:
    no call waits for an earlier one's result on the host."""
    layers = [weights, synthetic_moe_weights(E, K, N, G, dtype=weights.dtype, seed=22, device="cuda")]
    x, tw, ids = step_inputs(M, weights.dtype, seed=300 + M)
    for layer in layers:  # warmup
        grouped_op(x, tw, ids, *layer.op_args(), workspace)
        dense_op(x, tw, ids, *layer.op_args())
    torch.cuda.synchronize()
    with host_sync_is_an_error():
        h = x
        for layer in layers:
            h = h + grouped_op(h, tw, ids, *layer.op_args(), workspace)
            h = h + dense_op(h, tw, ids, *layer.op_args())
    torch.cuda.synchronize()
    assert torch.isfinite(h).all()
