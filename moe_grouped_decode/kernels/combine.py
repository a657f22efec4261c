"""The weighted combine shared by both routes: out[t] = sum_j w[t, j] * row_out[t*k + j].

The combine launches check the sums they store: a token whose sums come out non-finite in the
columns a program holds is recomputed there in float64 (``overflow.py``). The grouped W2's fused
combine (``combine_tile``) does not."""

from __future__ import annotations

import triton
import triton.language as tl

from .overflow import columns_overflowed, repair_token_columns
from .pdl import wait_for_previous_launch


@triton.jit
def combine_sums(row_out_ptr, topk_weights_ptr, t, cols, col_ok, TOP_K: tl.constexpr, K: tl.constexpr):
    """Columns ``cols`` of token t's output, summed in j order in float32: a token's bits depend
    on its own rows only. Row outputs are read from L2 (``.cg``): the grouped op's fused combine
    reads rows that other programs of the same launch wrote."""
    t = t.to(tl.int64)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(row_out_ptr + (t * TOP_K + j) * K + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
    return acc


@triton.jit
def combine_tile(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, t, cols, col_ok,
                 TOP_K: tl.constexpr, K: tl.constexpr):
    """``combine_sums`` stored: the grouped W2's fused combine, which has no overflow repair (its
    code in W2's tail changes how the compiler allocates the whole kernel's registers)."""
    acc = combine_sums(row_out_ptr, topk_weights_ptr, t, cols, col_ok, TOP_K, K)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


COMBINE_BLOCK = 256
COMBINE_WARPS = tl.constexpr(2)  # the combine launches' warps (the plan launches them so)


@triton.jit
def combine_kernel(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, num_experts,
                   w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                   TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    wait_for_previous_launch(USE_PDL)  # the row outputs come from the launch before
    acc = combine_sums(row_out_ptr, topk_weights_ptr, t, cols, col_ok, TOP_K, K)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    if columns_overflowed(acc, col_ok):
        repair_token_columns(t, col0, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, topk_weights_ptr, num_experts,
                             w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr,
                             w2_qzeros_ptr, TOP_K, K, N, G, BLOCK_K, 32 * COMBINE_WARPS)


@triton.jit(do_not_specialize=["stride_om", "stride_xm"])
def combine_valid_kernel(row_out_ptr, topk_weights_ptr, topk_ids_ptr, out_ptr, stride_om, x_ptr, stride_xm,
                         w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                         TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, E: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """combine_tile for the prefill route: a routed id outside [0, E) has no row output (the sort
    leaves it out), so it contributes nothing to its token. Row outputs in any float dtype."""
    wait_for_previous_launch(USE_PDL)  # the row outputs come from the launch before
    t = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * BLOCK_K
    cols = col0 + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        expert = tl.load(topk_ids_ptr + t * TOP_K + j)
        routed = (expert >= 0) & (expert < E)
        weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float32)
        row = tl.load(row_out_ptr + (t * TOP_K + j) * K + cols, mask=col_ok & routed, other=0.0).to(tl.float32)
        # the weight masked, not the product: acc += w * row stays one FMA, as combine_tile's (so
        # the grouped route over groups gives the per-row route's sums); row is 0 where unrouted
        acc += tl.where(routed, weight, 0.0) * row
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    if columns_overflowed(acc, col_ok):
        repair_token_columns(t, col0, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, topk_weights_ptr, E,
                             w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr,
                             w2_qzeros_ptr, TOP_K, K, N, G, BLOCK_K, 32 * COMBINE_WARPS)
