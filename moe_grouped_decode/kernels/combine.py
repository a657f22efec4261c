"""The weighted combine shared by both routes: out[t] = sum_j w[t, j] * row_out[t*k + j]."""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import launch_options, wait_for_previous_launch


@triton.jit
def combine_tile(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, t, cols, col_ok,
                 TOP_K: tl.constexpr, K: tl.constexpr):
    """Columns ``cols`` of token t's output, summed in j order in float32: a token's bits
    depend on its own rows only. Row outputs are read from L2 (``.cg``): the grouped
    op's fused combine reads rows that other programs of the same launch wrote."""
    t = t.to(tl.int64)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(row_out_ptr + (t * TOP_K + j) * K + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def combine_kernel(row_out_ptr, topk_weights_ptr, out_ptr, stride_om,
                    TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr):
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    wait_for_previous_launch(USE_PDL)  # the row outputs come from the launch before
    combine_tile(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, tl.program_id(0), cols, cols < K, TOP_K, K)


COMBINE_BLOCK = 256


def combine_rows(row_outputs, topk_weights, out, use_pdl: bool = False) -> None:
    """row_outputs float32 [M * k, K], topk_weights [M, k] contiguous -> out [M, K]."""
    M, K = out.shape
    combine_kernel[(M, triton.cdiv(K, COMBINE_BLOCK))](
        row_outputs, topk_weights, out, out.stride(0),
        TOP_K=topk_weights.shape[1], K=K, BLOCK_K=COMBINE_BLOCK, USE_PDL=use_pdl, num_warps=2,
        **launch_options(use_pdl),
    )


@triton.jit(do_not_specialize=["stride_om"])
def combine_valid_kernel(row_out_ptr, topk_weights_ptr, topk_ids_ptr, out_ptr, stride_om,
                         TOP_K: tl.constexpr, K: tl.constexpr, E: tl.constexpr, BLOCK_K: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
    """combine_tile for the prefill route: a routed id outside [0, E) has no row output (the sort
    leaves it out), so it contributes nothing to its token. Row outputs in any float dtype."""
    wait_for_previous_launch(USE_PDL)  # the row outputs come from the launch before
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
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
