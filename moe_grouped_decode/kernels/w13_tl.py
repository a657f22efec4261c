"""W13 of the grouped decode in Triton ``tl``: split-K gate | up partials on tensor cores.

Programs (no host sync; the grid is sized by R = M * k routed rows, or over groups by the
sort's bound on its groups)::

    program 0:                     zero the W2 launch's combine counters
    program 1 + (row * SPLITS + s) * TILES + tile:
        W13[topk_ids[row]] rows of K-split s, 64 columns of ``tile``
        (warp w: chunks w * CHUNKS .. (w + 1) * CHUNKS - 1, each a 32-row awq_mma chunk)
        x[row // k] as column 0 of the mma's B operand
        -> float32 partials[s, row, 64 columns]

Programs index experts by routed row, so they need no compaction first; rows that share
an expert read it again from L2 (the layer's active W13 is ~36 MB at M = 8, under the
60 MB of an H200), not from DRAM. With OVER_GROUPS the programs run over the groups of the
on-device sort instead (``expert_sort.py``: up to 8 * GROUP_BLOCKS rows of one expert): program
1 + (group * SPLITS + s) * TILES + tile puts the group's row 8 b + g in column g of B operand b
(GROUP_BLOCKS = 1 or 2, each A fragment dequantized once for both), so each weight tile is read
once for all of them. An mma output column depends on its own B column only, so every row's
partials keep the per-row programs' bits. The warps' sums are added in one fixed tree, so a
row's bits depend on the split and the warps only. ``w13_gluon.py`` runs the same programs with
their loads staged in shared memory (same bits); this kernel is what runs where Gluon does
not (the interpreter, no Gluon, the switch off).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .awq_mma import CHUNK_ROWS, TILE_WORDS, awq_mma_chunk, awq_mma_tokens, chunk_columns, chunk_lanes, chunk_rows
from .pdl import let_next_launch_start
from .timeline import W13_SM_SLOT, W13_STAMP_COUNT, now, sm_id


def _w13_tl(
    x_ptr, stride_xm,
    ids_ptr, num_experts,
    qweight_ptr, scales_ptr, qzeros_ptr,
    partials_ptr,
    rows,
    arrivals_ptr, num_arrivals,
    timeline_ptr,
    sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
    id_flag_ptr,
    TOP_K: tl.constexpr, K: tl.constexpr, TWO_N: tl.constexpr, G: tl.constexpr,
    CHUNKS: tl.constexpr, WARPS: tl.constexpr, SPLITS: tl.constexpr,
    ARRIVALS_PAD: tl.constexpr, IS_BF16: tl.constexpr, USE_PDL: tl.constexpr, TIMELINE: tl.constexpr,
    OVER_GROUPS: tl.constexpr = False, GROUP_BLOCKS: tl.constexpr = 1, CHECK_IDS: tl.constexpr = False,
):
    """partials[s, row, cols] = x[row // k, K-split s] @ W13[topk_ids[row]][K-split s, cols]."""
    let_next_launch_start(USE_PDL)
    pid = tl.program_id(0)
    if TIMELINE:
        tl.store(timeline_ptr + pid * W13_STAMP_COUNT, now())
        tl.store(timeline_ptr + pid * W13_STAMP_COUNT + W13_SM_SLOT, sm_id())
    if pid == 0:
        if ARRIVALS_PAD > 0:
            a = tl.arange(0, ARRIVALS_PAD)
            tl.store(arrivals_ptr + a, tl.zeros([ARRIVALS_PAD], dtype=tl.int32), mask=a < num_arrivals)
        if TIMELINE:
            tl.store(timeline_ptr + 1, now())
        return
    PACKED_N: tl.constexpr = TWO_N // 8
    TILES: tl.constexpr = PACKED_N // TILE_WORDS
    SPLIT_ROWS: tl.constexpr = WARPS * CHUNKS * CHUNK_ROWS
    work = pid - 1
    tile = work % TILES
    split = (work // TILES) % SPLITS
    warp, g, t, e = chunk_lanes(WARPS)
    if OVER_GROUPS:
        group_id = work // (TILES * SPLITS)
        if group_id >= tl.load(num_groups_ptr):
            return
        expert = tl.load(group_expert_ptr + group_id).to(tl.int64)
        start = tl.load(group_start_ptr + group_id)
        count = tl.load(group_count_ptr + group_id)
        # B column g of token block b: the group's row 8 b + g (the sort leaves out ids outside
        # [0, E): the combine skips those rows)
        column_ok = g < count
        token = (tl.load(sorted_rows_ptr + start + g, mask=column_ok, other=0) // TOP_K).to(tl.int64)
        if GROUP_BLOCKS == 2:
            column1_ok = g + 8 < count
            token1 = (tl.load(sorted_rows_ptr + start + 8 + g, mask=column1_ok, other=0) // TOP_K).to(tl.int64)
        else:
            token1, column1_ok = token, column_ok
    else:
        row = work // (TILES * SPLITS)
        expert = tl.load(ids_ptr + row)
        valid = (expert >= 0) & (expert < num_experts)
        if CHECK_IDS:  # the debug mode's flag, once per row
            tl.store(id_flag_ptr, 1, mask=(~valid) & (work % (TILES * SPLITS) == 0))
        # an id outside [0, E) reads expert 0 (never out of bounds); W2 zeroes that row's output
        expert = tl.where(valid, expert, 0).to(tl.int64)
        token = (row // TOP_K).to(tl.int64)
        column_ok = g == 0
        token1, column1_ok = token, column_ok  # one token block
    word = tile * TILE_WORDS + g
    acc_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc1_lo = acc_lo
    acc1_hi = acc_lo
    for c in tl.static_range(CHUNKS):
        k0 = split * SPLIT_ROWS + (warp * CHUNKS + c) * CHUNK_ROWS
        k_rows = chunk_rows(k0, t, e)
        chunk_ok = k0 < K
        group = k0 // G
        words = tl.load(qweight_ptr + expert * (K * PACKED_N) + k_rows * PACKED_N + word, mask=chunk_ok, other=0)
        x = tl.load(x_ptr + token * stride_xm + k_rows, mask=chunk_ok & column_ok, other=0.0)
        scales = tl.load(scales_ptr + expert * (K // G * TWO_N) + group * TWO_N + word * 8 + e, mask=chunk_ok,
                         other=0.0)
        zeros = tl.load(qzeros_ptr + expert * (K // G * PACKED_N) + group * PACKED_N + word, mask=chunk_ok, other=0)
        if GROUP_BLOCKS == 2:
            x1 = tl.load(x_ptr + token1 * stride_xm + k_rows, mask=chunk_ok & column1_ok, other=0.0)
            d_lo, d_hi, d1_lo, d1_hi = awq_mma_tokens(words, x, x1, x1, x1, scales, zeros, IS_BF16, 2, WARPS)
            acc1_lo += d1_lo
            acc1_hi += d1_hi
        else:
            d_lo, d_hi = awq_mma_chunk(words, x, x, scales, zeros, IS_BF16, False, WARPS)
        acc_lo += d_lo
        acc_hi += d_hi
    if WARPS > 1:
        acc_lo = tl.sum(tl.reshape(acc_lo, [WARPS, 32, 8]), axis=0)
        acc_hi = tl.sum(tl.reshape(acc_hi, [WARPS, 32, 8]), axis=0)
        if GROUP_BLOCKS == 2:
            acc1_lo = tl.sum(tl.reshape(acc1_lo, [WARPS, 32, 8]), axis=0)
            acc1_hi = tl.sum(tl.reshape(acc1_hi, [WARPS, 32, 8]), axis=0)
    _, g, t, e = chunk_lanes(1)
    cols = chunk_columns(tile * TILE_WORDS + g, e)
    if OVER_GROUPS:
        # element 4 j + c of lane (g, t) is token column 2 t + c % 2: the group's row of that column
        slot = 2 * t + e % 2
        keep = slot < count
        out_row = tl.load(sorted_rows_ptr + start + slot, mask=keep, other=0)
    else:
        # lanes t = 0 hold token column 0 (this row's token) in their even elements
        keep = (t == 0) & (e % 2 == 0)
        out_row = row
    out_base = partials_ptr + (split * rows + out_row) * TWO_N
    tl.store(out_base + cols, acc_lo, mask=keep)
    tl.store(out_base + cols + 4, acc_hi, mask=keep)
    if GROUP_BLOCKS == 2:
        slot1 = 8 + 2 * t + e % 2
        keep1 = slot1 < count
        out_base1 = partials_ptr + (split * rows + tl.load(sorted_rows_ptr + start + slot1, mask=keep1, other=0)) * TWO_N
        tl.store(out_base1 + cols, acc1_lo, mask=keep1)
        tl.store(out_base1 + cols + 4, acc1_hi, mask=keep1)
    if TIMELINE:
        tl.store(timeline_ptr + pid * W13_STAMP_COUNT + 1, now())


w13_tl_kernel = triton.jit(_w13_tl)
# the same kernel with binaries of its own, for the launches that prefer the largest carveout (carveout.py)
w13_tl_kernel_max_carveout = triton.jit(_w13_tl)
