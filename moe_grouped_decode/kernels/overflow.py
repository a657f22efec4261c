"""The combines' repair of a token whose sums came out non-finite: its columns again, in float64.

An input within its 16-bit range can overflow an intermediate the kernels keep narrower than
the float64 reference does: float32 in the grouped route (silu(gate) * up past 3.4e38: bf16
inputs from ~1e19 on unit-scale weights; for fp16, W2's 16-bit activations past 65504) and the
activation dtype in the prefill route (an fp16 activation or row output past 65504, whose
weighted sum may well be finite). Every such overflow leaves the token's sums non-finite in
every column (inf * 0 and inf - inf are NaN; an infinite activation reaches every column through
W2), so every combine (the launches, and the grouped W2's fused one) checks the columns it
stores and only then calls ``repair_token_columns``: finite tokens keep their bits and pay one
reduction; an overflowed one is recomputed as the reference computes it
(``ops.reference.reference_moe``) and rounds as it does, to +-Inf or to a finite value. The
recompute walks one hidden unit at a time, a loop no finite token enters (each program
recomputes the token's activations for its own columns: tens of milliseconds for an overflowed
token, nothing for the others).

The code sits in the fused W2 kernels' tails too, where it changes how ptxas allocates the
whole kernel: the launch table's per-token-count register caps (``w2_max_registers``) are
measured with it (docs/PERF.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .awq_tiles import awq_column_shift


@triton.jit
def _awq_float64(qweight_ptr, scales_ptr, qzeros_ptr, row, col, mask, COLS: tl.constexpr, G: tl.constexpr):
    """Dequantized W[row, col] of one expert's AutoAWQ [rows, COLS] matrix in float64
    ((q - z) * s, exact: a small integer times a 16-bit scale)."""
    shift = awq_column_shift(col % 8)
    word = col // 8
    q = (tl.load(qweight_ptr + row * (COLS // 8) + word, mask=mask, other=0) >> shift) & 0xF
    z = (tl.load(qzeros_ptr + (row // G) * (COLS // 8) + word, mask=mask, other=0) >> shift) & 0xF
    s = tl.load(scales_ptr + (row // G) * COLS + col, mask=mask, other=0.0)
    return (q - z).to(tl.float64) * s.to(tl.float64)


@triton.jit
def _sigmoid_float64(g):
    """1 / (1 + exp(-g)) in float64 without a float64 division (its slow path is a subroutine
    call, which changes how ptxas allocates the whole kernel): e = exp(-|g|) keeps 1 + e in
    [1, 2], its reciprocal starts from float32's and two Newton steps take it to float64's."""
    e = tl.exp(-tl.abs(g))
    d = 1.0 + e
    r = (1.0 / d.to(tl.float32)).to(tl.float64)
    r = r * (2.0 - d * r)
    r = r * (2.0 - d * r)
    return tl.where(g >= 0, r, e * r)


@triton.jit
def columns_overflowed(total, col_ok):
    """Whether any of the combine's float32 sums ``total`` (where ``col_ok``) is +-Inf or NaN (one
    value for the program)."""
    finite = tl.abs(total) < float("inf")  # false for NaN too
    return tl.max(tl.where(col_ok, tl.where(finite, 0, 1), 0), axis=0) > 0


@triton.jit
def repair_token_columns(t, col0, out_ptr, stride_om, x_ptr, stride_xm, topk_ids_ptr, topk_weights_ptr, num_experts,
                         w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, w2_qweight_ptr, w2_scales_ptr,
                         w2_qzeros_ptr, lanes, TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
                         COLUMNS: tl.constexpr, LANES: tl.constexpr):
    """out[t, col0 : col0 + COLUMNS] (those < K) = sum_j w[t, j] * W2(silu(gate) * up) in float64,
    rounded through float32 as torch rounds a float64 reference; a slot outside [0, num_experts)
    adds nothing. ``lanes``: arange(0, LANES) in the caller's layout (one lane a thread; Gluon
    callers name theirs); LANES columns at a time, and as many hidden units."""
    t = t.to(tl.int64)
    for c0 in range(0, tl.minimum(COLUMNS, K - col0), LANES):  # the columns < K
        cols = col0 + c0 + lanes
        col_ok = cols < K
        out = (lanes * 0).to(tl.float64)
        for j in range(TOP_K):  # loops, not unrolled: little code beside the combine's
            expert = tl.load(topk_ids_ptr + t * TOP_K + j).to(tl.int64)
            if (expert >= 0) & (expert < num_experts):
                weight = tl.load(topk_weights_ptr + t * TOP_K + j).to(tl.float64)
                w13_q = w13_qweight_ptr + expert * (K * 2 * N // 8)
                w13_s = w13_scales_ptr + expert * (K // G * 2 * N)
                w13_z = w13_qzeros_ptr + expert * (K // G * 2 * N // 8)
                w2_q = w2_qweight_ptr + expert * (N * K // 8)
                w2_s = w2_scales_ptr + expert * (N // G * K)
                w2_z = w2_qzeros_ptr + expert * (N // G * K // 8)
                for n0 in range(0, N, LANES):  # hidden units n0 + lanes
                    n = n0 + lanes
                    n_ok = n < N
                    gate = (lanes * 0).to(tl.float64)
                    up = gate
                    for k in range(K):
                        xk = tl.load(x_ptr + t * stride_xm + k).to(tl.float64)
                        gate += xk * _awq_float64(w13_q, w13_s, w13_z, k, n, n_ok, 2 * N, G)
                        up += xk * _awq_float64(w13_q, w13_s, w13_z, k, N + n, n_ok, 2 * N, G)
                    act = tl.where(n_ok, gate * _sigmoid_float64(gate) * up, 0.0)
                    for i in range(0, tl.minimum(LANES, N - n0)):
                        unit = tl.sum(tl.where(lanes == i, act, 0.0), axis=0)
                        out += weight * unit * _awq_float64(w2_q, w2_s, w2_z, n0 + i, cols, col_ok, K, G)
        tl.store(out_ptr + t * stride_om + cols, out.to(tl.float32).to(out_ptr.dtype.element_ty), mask=col_ok)
