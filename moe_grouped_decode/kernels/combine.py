"""The weighted combine shared by both routes: out[t] = sum_j w[t, j] * row_out[t*k + j].

Every combine checks the sums it stores: a token whose sums come out non-finite in the columns
a program holds is recomputed there in float64 (``overflow.py``); finite tokens keep their bits.
The grouped W2's fused combine (``combine_stored``, last-arriving program per token tile) does
the same as the combine launches."""

from __future__ import annotations

import triton
import triton.language as tl

from .overflow import columns_overflowed, repair_token_columns
from .pdl import wait_for_previous_launch


@triton.jit
def combine_sums(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, t, cols, col_ok, TOP_K: tl.constexpr,
                 K: tl.constexpr, rows=0, N_SPLITS: tl.constexpr = 1):
    """Columns ``cols`` of token t's output, summed in j order in float32: a token's bits depend
    on its own rows only. A slot whose id is outside [0, num_experts) adds nothing, whatever its
    weight (its row output is 0; the weight is masked, not the product, so a routed slot's
    ``acc += w * row`` stays the one FMA of every route). Row outputs are read from L2 (``.cg``):
    the grouped op's fused combine reads rows that other programs of the same launch wrote.
    N_SPLITS > 1: row outputs in that many parts of ``rows`` rows each (a W2 split over N), a
    slot's parts summed in split order first."""
    t = t.to(tl.int64)
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float32)
        expert = tl.load(topk_ids_ptr + t * TOP_K + j)
        weight = tl.where((expert >= 0) & (expert < num_experts), weight, 0.0)
        row = tl.load(row_out_ptr + (t * TOP_K + j) * K + cols, mask=col_ok, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, N_SPLITS):
            row += tl.load(row_out_ptr + (s * rows + t * TOP_K + j) * K + cols, mask=col_ok, other=0.0,
                           cache_modifier=".cg")
        acc += weight * row
    return acc


@triton.jit
def combine_stored(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, out_ptr, stride_om, x_ptr, stride_xm,
                   w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                   t, col0, TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                   COLUMNS: tl.constexpr, LANES: tl.constexpr):
    """out[t, col0 : col0 + COLUMNS] (those < K) = ``combine_sums``, stored; a token whose sums
    are not all finite there is recomputed in float64 (``repair_token_columns``, LANES lanes: the
    program's threads)."""
    cols = col0 + tl.arange(0, COLUMNS)
    col_ok = cols < K
    acc = combine_sums(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, t, cols, col_ok, TOP_K, K)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    if columns_overflowed(acc, col_ok):
        repair_token_columns(t, col0, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, topk_weights_ptr, num_experts,
                             w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr,
                             w2_qzeros_ptr, tl.arange(0, LANES), TOP_K, K, N, G, COLUMNS, LANES)


COMBINE_BLOCK = 256
COMBINE_WARPS = tl.constexpr(2)  # the combine launches' warps (the plan launches them so)


@triton.jit
def combine_kernel(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, num_experts,
                   w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                   TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """``combine_stored`` as a launch of its own: the grouped op per routed row without the fused
    combine."""
    wait_for_previous_launch(USE_PDL)  # the row outputs come from the launch before
    combine_stored(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, out_ptr, stride_om, x_ptr, stride_xm,
                   w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                   tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK_K, TOP_K, K, N, G, BLOCK_K,
                   32 * COMBINE_WARPS)


@triton.jit(do_not_specialize=["stride_om", "stride_xm"])
def combine_valid_kernel(row_out_ptr, topk_weights_ptr, topk_ids_ptr, out_ptr, stride_om, x_ptr, stride_xm,
                         w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr, w2_qzeros_ptr,
                         TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, E: tl.constexpr,
                         BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr = False):
    """The combine for the prefill route: a routed id outside [0, E) has no row output (the sort
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
        # the weight masked, not the product: acc += w * row stays one FMA, as combine_sums' (so
        # the grouped route over groups gives the per-row route's sums); row is 0 where unrouted
        acc += tl.where(routed, weight, 0.0) * row
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)
    if columns_overflowed(acc, col_ok):
        repair_token_columns(t, col0, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, topk_weights_ptr, E,
                             w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr,
                             w2_qzeros_ptr, tl.arange(0, 32 * COMBINE_WARPS), TOP_K, K, N, G, BLOCK_K,
                             32 * COMBINE_WARPS)
