"""The prefill route's two GEMMs: programs over groups of up to 8 * TB rows of one expert.

The routed rows arrive sorted by expert (``expert_sort.py``: per group its expert, first sorted
position and row count). Each program reads its expert's weights once for all its rows: the
rows are the columns of the mma's B operand (8 tokens per m16n8k16 column block, TB blocks per
program), and the AutoAWQ nibbles go straight into the A fragments (``awq_mma``), as in the
grouped route. A group's programs sit next to each other in the grid, and so do an expert's
groups, so a weight tile read again by the next group comes from L2::

    [W13]  program (group, tile): 32 gate and the same 32 up columns (4 + 4 packed words),
           WARPS warps over K (each a contiguous range of 32-row chunks), their sums added in
           one fixed tree -> act = silu(gate) * up, rounded to the activation dtype -> act[row]
    [W2]   program (group, column tile): warp w the 64 columns of packed tile tile * WARPS + w
           over all N rows (weights held in registers across the token blocks)
           -> row_out[row, cols] in the activation dtype
    then the combine (combine.py): out[t] = sum_j topk_weights[t, j] * row_out[t * k + j]

Both intermediates are stored in the activation dtype, as vLLM's fused_moe keeps them between
its launches: at M = 8192 the [R, K] row outputs are 420 MB in 16 bits, twice that in float32.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .awq_mma import (CHUNK_LOOP_UNROLL, CHUNK_ROWS, TILE_WORDS, UNROLLED_CHUNKS, awq_mma_chunk, awq_mma_tokens,
                      chunk_columns, chunk_lanes, chunk_rows)
from .awq_tiles import silu_mul


@triton.jit
def _group_of(pid_group, group_expert_ptr, group_start_ptr, group_count_ptr):
    expert = tl.load(group_expert_ptr + pid_group).to(tl.int64)
    return expert, tl.load(group_start_ptr + pid_group), tl.load(group_count_ptr + pid_group)


@triton.jit
def _token_rows(sorted_rows_ptr, start, count, tb, g, rows):
    """The routed row in column g of token block tb (lane group g), and whether there is one."""
    slot = tb * 8 + g
    ok = slot < count
    row = tl.load(sorted_rows_ptr + start + slot, mask=ok, other=0)
    return row, ok & (row < rows)


@triton.jit
def _chunk_mma(words, scales, zeros, x0, x1, x2, x3, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi,
               IS_BF16: tl.constexpr, TOKEN_BLOCKS: tl.constexpr, WARPS: tl.constexpr):
    """One 32-row chunk over TOKEN_BLOCKS B operands, added to each block's (lo, hi) float32
    sums (the blocks past TOKEN_BLOCKS stay as they are, never stored)."""
    if TOKEN_BLOCKS == 1:
        d0_lo, d0_hi = awq_mma_chunk(words, x0, x0, scales, zeros, IS_BF16, False, WARPS)
        a0_lo += d0_lo
        a0_hi += d0_hi
    elif TOKEN_BLOCKS == 2:
        d0_lo, d0_hi, d1_lo, d1_hi = awq_mma_tokens(words, x0, x1, x1, x1, scales, zeros, IS_BF16, 2, WARPS)
        a0_lo += d0_lo
        a0_hi += d0_hi
        a1_lo += d1_lo
        a1_hi += d1_hi
    else:
        d0_lo, d0_hi, d1_lo, d1_hi, d2_lo, d2_hi, d3_lo, d3_hi = awq_mma_tokens(
            words, x0, x1, x2, x3, scales, zeros, IS_BF16, 4, WARPS)
        a0_lo += d0_lo
        a0_hi += d0_hi
        a1_lo += d1_lo
        a1_hi += d1_hi
        a2_lo += d2_lo
        a2_hi += d2_hi
        a3_lo += d3_lo
        a3_hi += d3_hi
    return a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi


@triton.jit
def _b_operands(ptr, stride, line0, line1, line2, line3, ok0, ok1, ok2, ok3, k_rows, TOKEN_BLOCKS: tl.constexpr):
    """The B operands of a chunk: row ``line_b`` of ``ptr`` (stride ``stride``) at the chunk's rows
    for token block b; the blocks past TOKEN_BLOCKS repeat block 0's and are never used."""
    x0 = tl.load(ptr + line0 * stride + k_rows, mask=ok0, other=0.0)
    x1 = x0
    x2 = x0
    x3 = x0
    if TOKEN_BLOCKS > 1:
        x1 = tl.load(ptr + line1 * stride + k_rows, mask=ok1, other=0.0)
    if TOKEN_BLOCKS > 2:
        x2 = tl.load(ptr + line2 * stride + k_rows, mask=ok2, other=0.0)
        x3 = tl.load(ptr + line3 * stride + k_rows, mask=ok3, other=0.0)
    return x0, x1, x2, x3


@triton.jit
def _store_activations(acc, act_ptr, sorted_rows_ptr, start, count, tb, tile, rows, HI: tl.constexpr,
                       N: tl.constexpr, WARPS: tl.constexpr):
    """act = silu(gate) * up of one half (d_lo or d_hi) of a token block's sums: lane group g < 4
    holds gate words, g + 4 the up words of the same columns."""
    if WARPS > 1:
        acc = tl.sum(tl.reshape(acc, [WARPS, 32, 8]), axis=0)
    # [32 lanes (g, t), 8 (e)] -> [2 (gate, up), 4 (g % 4), 4 (t), 8 (e)] -> gate, up [4, 4, 8]
    gate, up = tl.split(tl.permute(tl.reshape(acc, [2, 4, 4, 8]), [1, 2, 3, 0]))
    g = tl.arange(0, 4)[:, None, None]
    t = tl.arange(0, 4)[None, :, None]
    e = tl.arange(0, 8)[None, None, :]
    token = 2 * t + e % 2  # element 4 j + c of lane (g, t): column 2 j + c // 2, token 2 t + c % 2
    slot = tb * 8 + token
    ok = slot < count
    row = tl.load(sorted_rows_ptr + start + slot, mask=ok, other=0)
    ok = ok & (row < rows)
    cols = chunk_columns(tile * 4 + g, e) + (4 if HI else 0)
    act = silu_mul(gate, up)
    tl.store(act_ptr + row.to(tl.int64) * N + cols, act.to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w13_chunk(k0, x_ptr, stride_xm, tok0, tok1, tok2, tok3, ok0, ok1, ok2, ok3, qweight_ptr, scales_ptr, qzeros_ptr,
               expert, word, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi, K: tl.constexpr,
               N: tl.constexpr, G: tl.constexpr, IS_BF16: tl.constexpr, TOKEN_BLOCKS: tl.constexpr,
               WARPS: tl.constexpr):
    """W13's chunk at reduction row k0 (each warp its own; none past K) added to the sums."""
    TWO_N: tl.constexpr = 2 * N
    PACKED_N: tl.constexpr = TWO_N // 8
    k_rows = chunk_rows(k0, t, e)
    chunk_ok = k0 < K
    group = k0 // G
    words = tl.load(qweight_ptr + expert * (K * PACKED_N) + k_rows * PACKED_N + word, mask=chunk_ok, other=0)
    scales = tl.load(scales_ptr + expert * (K // G * TWO_N) + group * TWO_N + word * 8 + e, mask=chunk_ok, other=0.0)
    zeros = tl.load(qzeros_ptr + expert * (K // G * PACKED_N) + group * PACKED_N + word, mask=chunk_ok, other=0)
    x0, x1, x2, x3 = _b_operands(x_ptr, stride_xm, tok0, tok1, tok2, tok3, chunk_ok & ok0, chunk_ok & ok1,
                                 chunk_ok & ok2, chunk_ok & ok3, k_rows, TOKEN_BLOCKS)
    return _chunk_mma(words, scales, zeros, x0, x1, x2, x3, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi,
                      IS_BF16, TOKEN_BLOCKS, WARPS)


@triton.jit(do_not_specialize=["stride_xm", "rows"])
def w13_prefill_kernel(
    x_ptr, stride_xm, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr, act_ptr, rows,
    TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, WARPS: tl.constexpr,
    TOKEN_BLOCKS: tl.constexpr, IS_BF16: tl.constexpr,
):
    """act[row, cols] = silu(x W13_gate) * (x W13_up) for the group's rows, 32 columns per program."""
    TILES: tl.constexpr = N // 32
    group_id = tl.program_id(0) // TILES
    tile = tl.program_id(0) % TILES
    if group_id >= tl.load(num_groups_ptr):
        return
    expert, start, count = _group_of(group_id, group_expert_ptr, group_start_ptr, group_count_ptr)
    warp, g, t, e = chunk_lanes(WARPS)
    # lane group g < 4: gate word tile * 4 + g; g >= 4: the up word of the same columns
    word = tl.where(g < 4, tile * 4 + g, N // 8 + tile * 4 + (g - 4))
    # the token of column g in each token block (blocks past TOKEN_BLOCKS: never loaded)
    row0, ok0 = _token_rows(sorted_rows_ptr, start, count, 0, g, rows)
    row1, ok1 = _token_rows(sorted_rows_ptr, start, count, 1, g, rows)
    row2, ok2 = _token_rows(sorted_rows_ptr, start, count, 2, g, rows)
    row3, ok3 = _token_rows(sorted_rows_ptr, start, count, 3, g, rows)
    tok0, tok1 = (row0 // TOP_K).to(tl.int64), (row1 // TOP_K).to(tl.int64)
    tok2, tok3 = (row2 // TOP_K).to(tl.int64), (row3 // TOP_K).to(tl.int64)
    CHUNKS_PER_WARP: tl.constexpr = (K // CHUNK_ROWS + WARPS - 1) // WARPS
    a0_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = a0_lo, a0_lo, a0_lo, a0_lo, a0_lo, a0_lo, a0_lo
    if CHUNKS_PER_WARP <= UNROLLED_CHUNKS:
        for c in tl.static_range(CHUNKS_PER_WARP):
            a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = _w13_chunk(
                (warp * CHUNKS_PER_WARP + c) * CHUNK_ROWS, x_ptr, stride_xm, tok0, tok1, tok2, tok3, ok0, ok1, ok2,
                ok3, qweight_ptr, scales_ptr, qzeros_ptr, expert, word, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo,
                a2_hi, a3_lo, a3_hi, K, N, G, IS_BF16, TOKEN_BLOCKS, WARPS)
    else:
        for c in tl.range(0, CHUNKS_PER_WARP, loop_unroll_factor=CHUNK_LOOP_UNROLL):
            a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = _w13_chunk(
                (warp * CHUNKS_PER_WARP + c) * CHUNK_ROWS, x_ptr, stride_xm, tok0, tok1, tok2, tok3, ok0, ok1, ok2,
                ok3, qweight_ptr, scales_ptr, qzeros_ptr, expert, word, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo,
                a2_hi, a3_lo, a3_hi, K, N, G, IS_BF16, TOKEN_BLOCKS, WARPS)
    _store_activations(a0_lo, act_ptr, sorted_rows_ptr, start, count, 0, tile, rows, False, N, WARPS)
    _store_activations(a0_hi, act_ptr, sorted_rows_ptr, start, count, 0, tile, rows, True, N, WARPS)
    if TOKEN_BLOCKS > 1:
        _store_activations(a1_lo, act_ptr, sorted_rows_ptr, start, count, 1, tile, rows, False, N, WARPS)
        _store_activations(a1_hi, act_ptr, sorted_rows_ptr, start, count, 1, tile, rows, True, N, WARPS)
    if TOKEN_BLOCKS > 2:
        _store_activations(a2_lo, act_ptr, sorted_rows_ptr, start, count, 2, tile, rows, False, N, WARPS)
        _store_activations(a2_hi, act_ptr, sorted_rows_ptr, start, count, 2, tile, rows, True, N, WARPS)
        _store_activations(a3_lo, act_ptr, sorted_rows_ptr, start, count, 3, tile, rows, False, N, WARPS)
        _store_activations(a3_hi, act_ptr, sorted_rows_ptr, start, count, 3, tile, rows, True, N, WARPS)


@triton.jit
def _store_rows(acc_lo, acc_hi, row_out_ptr, sorted_rows_ptr, start, count, tb, t, e, cols, word_ok, rows,
                K: tl.constexpr):
    """One token block's row outputs: lane (g, t) element e is token 2 t + e % 2 of the block,
    column chunk_columns(word, e) (+4 in d_hi)."""
    slot = tb * 8 + 2 * t + e % 2
    ok = slot < count
    out_row = tl.load(sorted_rows_ptr + start + slot, mask=ok, other=0)
    ok = ok & (out_row < rows) & word_ok
    base = row_out_ptr + out_row.to(tl.int64) * K + cols
    tl.store(base, acc_lo.to(row_out_ptr.dtype.element_ty), mask=ok)
    tl.store(base + 4, acc_hi.to(row_out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _w2_chunk(n0, act_ptr, row0, row1, row2, row3, ok0, ok1, ok2, ok3, qweight_ptr, scales_ptr, qzeros_ptr, expert,
              word, word_ok, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi, K: tl.constexpr,
              N: tl.constexpr, G: tl.constexpr, IS_BF16: tl.constexpr, TOKEN_BLOCKS: tl.constexpr,
              WARPS: tl.constexpr):
    """W2's chunk at reduction row n0 added to the sums."""
    PACKED_K: tl.constexpr = K // 8
    k_rows = chunk_rows(n0, t, e)
    group = n0 // G
    words = tl.load(qweight_ptr + expert * (N * PACKED_K) + k_rows * PACKED_K + word, mask=word_ok, other=0)
    scales = tl.load(scales_ptr + expert * (N // G * K) + group * K + word * 8 + e, mask=word_ok, other=0.0)
    zeros = tl.load(qzeros_ptr + expert * (N // G * PACKED_K) + group * PACKED_K + word, mask=word_ok, other=0)
    x0, x1, x2, x3 = _b_operands(act_ptr, N, row0.to(tl.int64), row1.to(tl.int64), row2.to(tl.int64),
                                 row3.to(tl.int64), ok0, ok1, ok2, ok3, k_rows, TOKEN_BLOCKS)
    return _chunk_mma(words, scales, zeros, x0, x1, x2, x3, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi,
                      IS_BF16, TOKEN_BLOCKS, WARPS)


@triton.jit(do_not_specialize=["rows"])
def w2_prefill_kernel(
    act_ptr, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr, row_out_ptr, rows,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, WARPS: tl.constexpr, TOKEN_BLOCKS: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    """row_out[row, cols] = act[row] @ W2[expert][:, cols] for the group's rows."""
    group_id = tl.program_id(0)
    tile = tl.program_id(1)
    if group_id >= tl.load(num_groups_ptr):
        return
    expert, start, count = _group_of(group_id, group_expert_ptr, group_start_ptr, group_count_ptr)
    PACKED_K: tl.constexpr = K // 8
    CHUNKS: tl.constexpr = N // CHUNK_ROWS
    warp, g, t, e = chunk_lanes(WARPS)
    word = (tile * WARPS + warp) * TILE_WORDS + g
    word_ok = word < PACKED_K
    row0, ok0 = _token_rows(sorted_rows_ptr, start, count, 0, g, rows)
    row1, ok1 = _token_rows(sorted_rows_ptr, start, count, 1, g, rows)
    row2, ok2 = _token_rows(sorted_rows_ptr, start, count, 2, g, rows)
    row3, ok3 = _token_rows(sorted_rows_ptr, start, count, 3, g, rows)
    a0_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = a0_lo, a0_lo, a0_lo, a0_lo, a0_lo, a0_lo, a0_lo
    if CHUNKS <= UNROLLED_CHUNKS:
        for c in tl.static_range(CHUNKS):
            a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = _w2_chunk(
                c * CHUNK_ROWS, act_ptr, row0, row1, row2, row3, ok0, ok1, ok2, ok3, qweight_ptr, scales_ptr,
                qzeros_ptr, expert, word, word_ok, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi,
                K, N, G, IS_BF16, TOKEN_BLOCKS, WARPS)
    else:
        for c in tl.range(0, CHUNKS, loop_unroll_factor=CHUNK_LOOP_UNROLL):
            a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi = _w2_chunk(
                c * CHUNK_ROWS, act_ptr, row0, row1, row2, row3, ok0, ok1, ok2, ok3, qweight_ptr, scales_ptr,
                qzeros_ptr, expert, word, word_ok, t, e, a0_lo, a0_hi, a1_lo, a1_hi, a2_lo, a2_hi, a3_lo, a3_hi,
                K, N, G, IS_BF16, TOKEN_BLOCKS, WARPS)
    cols = chunk_columns(word, e)
    _store_rows(a0_lo, a0_hi, row_out_ptr, sorted_rows_ptr, start, count, 0, t, e, cols, word_ok, rows, K)
    if TOKEN_BLOCKS > 1:
        _store_rows(a1_lo, a1_hi, row_out_ptr, sorted_rows_ptr, start, count, 1, t, e, cols, word_ok, rows, K)
    if TOKEN_BLOCKS > 2:
        _store_rows(a2_lo, a2_hi, row_out_ptr, sorted_rows_ptr, start, count, 2, t, e, cols, word_ok, rows, K)
        _store_rows(a3_lo, a3_hi, row_out_ptr, sorted_rows_ptr, start, count, 3, t, e, cols, word_ok, rows, K)
