"""The weighted combine shared by both routes: out[t] = sum_j w[t, j] * row_out[t*k + j]."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _combine_kernel(row_out_ptr, topk_weights_ptr, out_ptr, stride_om,
                    TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Sums in j order in float32: a token's bits depend on its own rows only."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = tl.zeros([BLOCK_K], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float32)
        acc += weight * tl.load(row_out_ptr + (t * TOP_K + j) * K + cols, mask=col_ok, other=0.0)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


COMBINE_BLOCK = 256


def combine_rows(row_outputs, topk_weights, out) -> None:
    """row_outputs float32 [M * k, K], topk_weights [M, k] contiguous -> out [M, K]."""
    M, K = out.shape
    _combine_kernel[(M, triton.cdiv(K, COMBINE_BLOCK))](
        row_outputs, topk_weights, out, out.stride(0),
        TOP_K=topk_weights.shape[1], K=K, BLOCK_K=COMBINE_BLOCK, num_warps=2,
    )
