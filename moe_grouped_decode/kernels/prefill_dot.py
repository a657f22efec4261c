"""The prefill route's two GEMMs on ``tl.dot``: programs over groups of up to BLOCK_ROWS sorted rows of one expert.

The routed rows arrive sorted by expert (``expert_sort.py``: per group its expert, first sorted
position and row count). A program dequantizes one tile of its expert's weights per step of the
reduction and multiplies all the group's rows by it, so the dequantization is paid once per
BLOCK_ROWS rows and each weight byte is read once per group (the tiles of an expert's later groups
come from L2: a group's programs, and an expert's groups, sit next to each other in the grid)::

    [W13]  program (group, tile): x[token of each row] [BLOCK_ROWS, BLOCK_K] per step; the expert's
           gate columns tile * BLOCK_N .. + BLOCK_N and the same up columns side by side,
           (q - z) * scale in the activation dtype [BLOCK_K, 2 * BLOCK_N]; one tl.dot into float32
           -> act[sorted position, cols] = silu(gate) * up, rounded to the activation dtype
    [W2]   program (group, tile): act of the group's sorted positions [BLOCK_ROWS, 32] per step,
           W2 columns tile * BLOCK_N .. + BLOCK_N dequantized the same way; tl.dot into float32
           -> row_out[routed row, cols] in the activation dtype
    then the combine (combine.py): out[t] = sum_j topk_weights[t, j] * row_out[t * k + j]

A step spans whole AWQ groups or sits inside one (its rows divide G or are a multiple of it), so
its scales and zeros are one row per group. The weights are rounded to the activation dtype
before the product, as vLLM's own Triton AWQ kernels do; a row's bits depend on the config, not
on the other rows of its group.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .awq_tiles import INTERPRETED, awq_column_shift, silu_mul

STEP_ROWS = tl.constexpr(32)  # W2's reduction rows per step (N is a multiple of 32, not of 64)
# Triton's interpreter gets bfloat16 arithmetic wrong (numpy has no bfloat16): there the dequantize
# and tl.dot's operands go through float32, which gives the same bits (q - z has 5 bits, so its
# product with a 16-bit scale is exact in float32 before the one rounding, done by _round_to).
# Compiled kernels never take that branch.


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """float32 ``x`` rounded to nearest-even in ``dtype``. The interpreter's own float32 -> bfloat16
    conversion truncates, so bfloat16 rounds here in integers (finite values: the products of a
    nibble difference and a scale); float16 converts through numpy, which rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return x.to(dtype)


@triton.jit
def _dot(a, b, acc):
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _group_rows(pid_group, group_expert_ptr, group_start_ptr, group_count_ptr, sorted_rows_ptr,
                BLOCK_ROWS: tl.constexpr):
    """The group's expert, its sorted positions, whether each of the BLOCK_ROWS slots holds a row,
    and the routed row in each."""
    expert = tl.load(group_expert_ptr + pid_group).to(tl.int64)
    start = tl.load(group_start_ptr + pid_group)
    count = tl.load(group_count_ptr + pid_group)
    slot = tl.arange(0, BLOCK_ROWS)
    in_group = slot < count
    position = start + slot
    row = tl.load(sorted_rows_ptr + position, mask=in_group, other=0)
    return expert, position.to(tl.int64), in_group, row


@triton.jit
def _awq_step(qweight_ptr, scales_ptr, qzeros_ptr, k0, words, cols, word_ok, col_ok, shifts, PACKED: tl.constexpr,
              COLS: tl.constexpr, G: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """(q - z) * scale of reduction rows k0 .. k0 + BLOCK_K over packed words ``words`` (their
    logical columns ``cols``), in the scales' dtype, [BLOCK_K, BLOCK_N]: the pointers sit at the
    expert's first row (``qweight_ptr``, ``qzeros_ptr``) and at its first column (``scales_ptr``).
    The step spans BLOCK_K // SUB AWQ groups of SUB rows (one, when BLOCK_K <= G)."""
    SUB: tl.constexpr = BLOCK_K if BLOCK_K < G else G
    SUBS: tl.constexpr = BLOCK_K // SUB
    j = tl.arange(0, SUBS)
    r = tl.arange(0, SUB)
    group = (k0 + j * SUB) // G
    packed = tl.load(qweight_ptr + ((k0 + j * SUB)[:, None, None] + r[None, :, None]) * PACKED
                     + words[None, None, :], mask=word_ok[None, None, :], other=0)
    zero_words = tl.load(qzeros_ptr + group[:, None] * PACKED + words[None, :], mask=word_ok[None, :], other=0)
    scales = tl.load(scales_ptr + group[:, None] * COLS + cols[None, :], mask=col_ok[None, :], other=0.0)
    # each word once per logical column it holds: [.., BLOCK_N // 8] -> [.., BLOCK_N]
    packed = tl.interleave(packed, packed)
    packed = tl.interleave(packed, packed)
    packed = tl.interleave(packed, packed)
    zero_words = tl.interleave(zero_words, zero_words)
    zero_words = tl.interleave(zero_words, zero_words)
    zero_words = tl.interleave(zero_words, zero_words)
    q = (packed >> shifts[None, None, :]) & 0xF
    z = (zero_words >> shifts[None, :]) & 0xF
    if INTERPRETED:  # the same correctly rounded product, through float32
        w = _round_to(((q - z[:, None, :]).to(tl.float32) * scales[:, None, :].to(tl.float32)), scales.dtype)
    else:
        # nibble | magic is the 16-bit float magic + nibble (fp16 1024, bf16 128: both hold it
        # exactly), so one subtract gives q - z exactly, with no integer-to-float conversion
        MAGIC: tl.constexpr = 0x4300 if scales.dtype == tl.bfloat16 else 0x6400
        q16 = (q | MAGIC).to(tl.int16).to(scales.dtype, bitcast=True)
        z16 = (z | MAGIC).to(tl.int16).to(scales.dtype, bitcast=True)
        w = (q16 - z16[:, None, :]) * scales[:, None, :]
    return tl.reshape(w, [BLOCK_K, BLOCK_N])


@triton.jit(do_not_specialize=["stride_xm"])
def w13_dot_kernel(
    x_ptr, stride_xm, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr, act_ptr,
    TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STAGES: tl.constexpr,
):
    """act[position, cols] = silu(x W13_gate) * (x W13_up) for the group's rows, BLOCK_N columns."""
    TILES: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
    PACKED: tl.constexpr = 2 * N // 8
    group_id = tl.program_id(0) // TILES
    tile = tl.program_id(0) % TILES
    if group_id >= tl.load(num_groups_ptr):
        return
    expert, position, in_group, row = _group_rows(group_id, group_expert_ptr, group_start_ptr, group_count_ptr,
                                                  sorted_rows_ptr, BLOCK_ROWS)
    token = (row // TOP_K).to(tl.int64)
    # one B operand of 2 * BLOCK_N columns: the tile's gate columns, then the same up columns (one
    # wgmma per step, twice as wide, instead of two that wait for each other)
    local = tl.arange(0, 2 * BLOCK_N)
    is_up = local >= BLOCK_N
    gate_cols = tile * BLOCK_N + local % BLOCK_N
    cols = tl.where(is_up, N + gate_cols, gate_cols)
    col_ok = gate_cols < N
    word_local = tl.arange(0, 2 * BLOCK_N // 8)
    gate_words = tile * (BLOCK_N // 8) + word_local % (BLOCK_N // 8)
    words = tl.where(word_local >= BLOCK_N // 8, N // 8 + gate_words, gate_words)
    word_ok = gate_words < N // 8
    shifts = awq_column_shift(local % 8)
    weights = qweight_ptr + expert * (K * PACKED)
    scales = scales_ptr + expert * (K // G * 2 * N)
    zeros = qzeros_ptr + expert * (K // G * PACKED)
    x_rows = x_ptr + token[:, None] * stride_xm + tl.arange(0, BLOCK_K)[None, :]
    acc = tl.zeros([BLOCK_ROWS, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=STAGES):
        x = tl.load(x_rows + k0, mask=in_group[:, None], other=0.0)
        w = _awq_step(weights, scales, zeros, k0, words, cols, word_ok, col_ok, shifts, PACKED, 2 * N, G, BLOCK_K,
                      2 * BLOCK_N)
        acc = _dot(x, w, acc)
    gate, up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_ROWS, 2, BLOCK_N]), [0, 2, 1]))
    act = silu_mul(gate, up)
    out_cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(act_ptr + position[:, None] * N + out_cols[None, :], act.to(act_ptr.dtype.element_ty),
             mask=in_group[:, None] & (out_cols < N)[None, :])


@triton.jit
def w2_dot_kernel(
    act_ptr, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr, row_out_ptr,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
    STAGES: tl.constexpr,
):
    """row_out[row, cols] = act[position] @ W2[expert][:, cols] for the group's rows, BLOCK_N columns."""
    group_id = tl.program_id(0)
    tile = tl.program_id(1)
    if group_id >= tl.load(num_groups_ptr):
        return
    expert, position, in_group, row = _group_rows(group_id, group_expert_ptr, group_start_ptr, group_count_ptr,
                                                  sorted_rows_ptr, BLOCK_ROWS)
    PACKED: tl.constexpr = K // 8
    words = tile * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    word_ok = words < PACKED
    col_ok = cols < K
    shifts = awq_column_shift(tl.arange(0, BLOCK_N) % 8)
    weights = qweight_ptr + expert * (N * PACKED)
    scales = scales_ptr + expert * (N // G * K)
    zeros = qzeros_ptr + expert * (N // G * PACKED)
    act_rows = act_ptr + position[:, None] * N + tl.arange(0, STEP_ROWS)[None, :]
    acc = tl.zeros([BLOCK_ROWS, BLOCK_N], dtype=tl.float32)
    for n0 in tl.range(0, N, STEP_ROWS, num_stages=STAGES):
        act = tl.load(act_rows + n0, mask=in_group[:, None], other=0.0)
        w = _awq_step(weights, scales, zeros, n0, words, cols, word_ok, col_ok, shifts, PACKED, K, G, STEP_ROWS,
                      BLOCK_N)
        acc = _dot(act, w, acc)
    tl.store(row_out_ptr + row[:, None].to(tl.int64) * K + cols[None, :], acc.to(row_out_ptr.dtype.element_ty),
             mask=in_group[:, None] & col_ok[None, :])
