"""The launcher's direct launches on the GPU (kernels/launcher.py): both ops, called again and
again over fresh inputs so that most launches skip Triton's dispatch, give the same bits as
Triton's own dispatch of every launch, and the direct path is really taken.

Runs on a CUDA GPU only (skipped elsewhere). The qwen3.8-tp4 contract's shape, fp16 and bf16,
at token counts on both routes and across the prefill route's power-of-two buckets; inputs
whose addresses are not 16-byte aligned (the ops copy them to an aligned buffer first: the Gluon
kernels cannot be lowered for them) between aligned ones.
"""

from __future__ import annotations

import pytest
import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.kernels import launcher
from moe_grouped_decode.ops import alloc_workspace

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = QWEN38_TP4.shape
TOKENS = (1, 3, 8, 31, 64, 200, 513, 2048)
ops = torch.ops.moe_grouped_decode


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def weights(request):
    return synthetic_moe_weights(E, K, N, G, dtype=request.param, seed=21, device="cuda")


def inputs(M: int, dtype, seed: int, aligned: bool):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    flat = torch.randn(M * K + 1, device="cuda", dtype=torch.float32, generator=gen).to(dtype)
    # one element in: every row's address 2 bytes off a 16-byte boundary
    x = (flat[:M * K] if aligned else flat[1:]).view(M, K)
    ids = torch.rand(M, E, device="cuda", generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
    tw = torch.rand(M, TOP_K, device="cuda", generator=gen)
    return x, tw / tw.sum(1, keepdim=True), ids


def run_both_ops(weights, M, x, tw, ids, workspace):
    grouped = ops.awq_moe_grouped_decode(x, tw, ids, *weights.op_args(), workspace) if M <= 64 else None
    dense = ops.awq_moe_dense(x, tw, ids, *weights.op_args())
    return grouped, dense


@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "misaligned"])
def test_direct_launches_give_tritons_bits(weights, aligned, monkeypatch):
    dtype = weights.w13_scales.dtype
    workspace = alloc_workspace(64, TOP_K, K, N, "cuda")
    launcher.clear()
    for M in TOKENS:
        for repeat in range(3):  # the first call of each specialization goes through Triton
            x, tw, ids = inputs(M, dtype, seed=1000 * M + repeat, aligned=aligned)
            monkeypatch.setattr(launcher, "ENABLED", True)
            direct = run_both_ops(weights, M, x, tw, ids, workspace)
            direct = [None if out is None else out.clone() for out in direct]
            monkeypatch.setattr(launcher, "ENABLED", False)
            dispatched = run_both_ops(weights, M, x, tw, ids, workspace)
            for name, a, b in zip(("grouped", "dense"), direct, dispatched):
                if a is None:
                    continue
                assert torch.isfinite(b).all(), f"{name} M={M}"
                assert torch.equal(a, b), f"{name} M={M} repeat {repeat}: the direct launch's bits differ"
    assert launcher._entries, "no launch was cached: the direct path was never taken"
    launcher.clear()
