"""Compact active-expert grouped decode: compaction, W13 + SiLU, W2 + combine.

Launches (no host sync; every grid is sized by the upper bound R = M * k; the
live segment count A is read from device memory and programs past it exit):

1. compaction (only when not fused): one program ranks the R routed rows by
   (expert, row) and writes ``sorted_rows``, ``active_experts``,
   ``segment_offsets`` and ``live_count``. With ``fuse_compaction`` every W13
   program recomputes this tiny rank in registers instead (R <= 128), saving a
   dependent launch; program (0, 0, 0) still writes the metadata.
2. W13: programs over (segment a, K-split s, column tile). Each reads its
   expert's W13 tile once per pass over the segment's rows, and writes float32
   partial sums ``partials[s, row, 2N]``.
3. W2: programs over (routed row, output column tile): sum the K-split
   partials in order, SiLU-and-mul, W2[topk_ids[row]] -> float32
   ``row_outputs[row]``. One program per row and tile, with no serial loop:
   at decode sizes the loads in flight, not the bandwidth, set the time.
4. combine: out[t] = sum_j topk_weights[t, j] * row_outputs[t*k + j], j in order.

A token's output depends only on its own activations, routing and weights
(fixed summation orders, no float atomics): bit-identical across runs and
batch positions.
"""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

from .awq_tiles import awq_tile_minus_zero, silu_mul
from .combine import combine_rows
from .configs import GroupedConfig

_FAR_EXPERT = tl.constexpr(1 << 30)  # sort key of padding rows: past every real expert


@triton.jit
def _load_experts(ids_ptr, r, rows):
    valid = r < rows
    return valid, tl.where(valid, tl.load(ids_ptr + r, mask=valid, other=0).to(tl.int32), _FAR_EXPERT)


@triton.jit
def _segments_of_rows(ids_ptr, rows, R_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Segment structure of up to R_PAD routed rows, in registers.

    Returns per row j (vectors of R_PAD): validity, expert, whether it opens
    its expert's segment (no earlier row has its expert), and its expert's
    segment index (the number of distinct experts below it). The O(R^2)
    comparisons run in [CHUNK, R_PAD] slices over the other rows i, so the
    per-row vectors stay a few registers wide.
    """
    j = tl.arange(0, R_PAD)
    valid, expert = _load_experts(ids_ptr, j, rows)
    earlier_twins = tl.zeros([R_PAD], dtype=tl.int32)
    segment = tl.zeros([R_PAD], dtype=tl.int32)
    for i0 in tl.static_range(0, R_PAD, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        i_valid, expert_i = _load_experts(ids_ptr, i, rows)
        same = expert_i[:, None] == expert[None, :]
        earlier_twins += tl.sum((same & (i[:, None] < j[None, :])).to(tl.int32), axis=0)
        i_opens = (tl.sum((same & (j[None, :] < i[:, None])).to(tl.int32), axis=1) == 0) & i_valid
        segment += tl.sum((i_opens[:, None] & (expert_i[:, None] < expert[None, :])).to(tl.int32), axis=0)
    opens = (earlier_twins == 0) & valid
    return valid, expert, opens, segment


@triton.jit
def _write_compaction(ids_ptr, rows, valid, expert, opens, segment,
                      sorted_rows_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr,
                      R_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Store the compaction: each row's sorted position is its rank by (expert, row)."""
    j = tl.arange(0, R_PAD)
    rank = tl.zeros([R_PAD], dtype=tl.int32)
    for i0 in tl.static_range(0, R_PAD, CHUNK):
        i = i0 + tl.arange(0, CHUNK)
        _, expert_i = _load_experts(ids_ptr, i, rows)
        before = (expert_i[:, None] < expert[None, :]) | ((expert_i[:, None] == expert[None, :]) & (i[:, None] < j[None, :]))
        rank += tl.sum(before.to(tl.int32), axis=0)
    tl.store(sorted_rows_ptr + rank, j, mask=valid)
    tl.store(active_experts_ptr + segment, expert, mask=opens)
    tl.store(segment_offsets_ptr + segment, rank, mask=opens)
    live = tl.sum(opens.to(tl.int32), axis=0)
    tl.store(segment_offsets_ptr + live, rows)
    tl.store(live_count_ptr, live)


@triton.jit
def _compact_small_kernel(ids_ptr, rows, sorted_rows_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr,
                          R_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Compaction of R <= R_PAD rows by one program, all in registers."""
    valid, expert, opens, segment = _segments_of_rows(ids_ptr, rows, R_PAD, CHUNK)
    _write_compaction(ids_ptr, rows, valid, expert, opens, segment,
                      sorted_rows_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr, R_PAD, CHUNK)


@triton.jit
def _compact_tiled_kernel(ids_ptr, rows, sorted_rows_ptr, opens_ptr, active_experts_ptr, segment_offsets_ptr,
                          live_count_ptr, BLOCK: tl.constexpr):
    """Compaction of any R by one program, in BLOCK x BLOCK tiles of the O(R^2) rank.

    Pass 1 scatters each row to its sorted position and flags segment openers
    (in sorted order); pass 2 numbers the openers with a running prefix sum.
    """
    for i0 in range(0, rows, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        i_valid = i < rows
        e_i = tl.load(ids_ptr + i, mask=i_valid, other=0).to(tl.int32)
        rank = tl.zeros([BLOCK], dtype=tl.int32)
        dups = tl.zeros([BLOCK], dtype=tl.int32)
        for j0 in range(0, rows, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            j_valid = j < rows
            e_j = tl.load(ids_ptr + j, mask=j_valid, other=0).to(tl.int32)
            same_before = (e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None]) & j_valid[None, :]
            lower = (e_j[None, :] < e_i[:, None]) & j_valid[None, :]
            rank += tl.sum((lower | same_before).to(tl.int32), axis=1)
            dups += tl.sum(same_before.to(tl.int32), axis=1)
        tl.store(sorted_rows_ptr + rank, i, mask=i_valid)
        tl.store(opens_ptr + rank, (dups == 0).to(tl.int32), mask=i_valid)
    tl.debug_barrier()  # pass 2 reads what other threads scattered
    live = 0
    for p0 in range(0, rows, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        p_valid = p < rows
        opens = tl.load(opens_ptr + p, mask=p_valid, other=0)
        segment = live + tl.cumsum(opens, axis=0) - 1
        row = tl.load(sorted_rows_ptr + p, mask=p_valid, other=0)
        expert = tl.load(ids_ptr + row, mask=p_valid, other=0).to(tl.int32)
        is_open = (opens == 1) & p_valid
        tl.store(active_experts_ptr + segment, expert, mask=is_open)
        tl.store(segment_offsets_ptr + segment, p, mask=is_open)
        live += tl.sum(opens, axis=0)
    tl.store(segment_offsets_ptr + live, rows)
    tl.store(live_count_ptr, live)


@triton.jit
def _w13_kernel(
    x_ptr, stride_xm,
    ids_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    sorted_rows_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr,
    partials_ptr,
    rows,
    TOP_K: tl.constexpr, K: tl.constexpr, TWO_N: tl.constexpr, G: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr,
    FUSED: tl.constexpr, R_PAD: tl.constexpr, CHUNK: tl.constexpr,
):
    """partials[s, row, :] = x[row // k, K-split s] @ W13[e][K-split s, :] for the rows of segment a."""
    a = tl.program_id(0)
    split = tl.program_id(1)
    tile = tl.program_id(2)
    if FUSED:
        r = tl.arange(0, R_PAD)
        valid, expert_of, opens, segment = _segments_of_rows(ids_ptr, rows, R_PAD, CHUNK)
        if (a == 0) & (split == 0) & (tile == 0):
            _write_compaction(ids_ptr, rows, valid, expert_of, opens, segment,
                              sorted_rows_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr, R_PAD, CHUNK)
        if a >= tl.sum(opens.to(tl.int32), axis=0):
            return
        expert = tl.max(tl.where(opens & (segment == a), expert_of, -1), axis=0)
        in_segment = valid & (expert_of == expert)
        # slot of each member row in the segment (members keep row order)
        slot_of = tl.cumsum(in_segment.to(tl.int32), axis=0) - 1
        count = tl.sum(in_segment.to(tl.int32), axis=0)
    else:
        if a >= tl.load(live_count_ptr):
            return
        expert = tl.load(active_experts_ptr + a)
        start = tl.load(segment_offsets_ptr + a)
        count = tl.load(segment_offsets_ptr + a + 1) - start
    expert = expert.to(tl.int64)

    PACKED_N: tl.constexpr = TWO_N // 8
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < TWO_N
    packed_cols = tile * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    packed_ok = packed_cols < PACKED_N
    k_steps: tl.constexpr = K // BLOCK_K
    steps_per_split: tl.constexpr = (k_steps + SPLIT_K - 1) // SPLIT_K
    k_lo = split * steps_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + steps_per_split * BLOCK_K, K)
    qweight_base = qweight_ptr + expert * (K * PACKED_N)
    scales_base = scales_ptr + expert * ((K // G) * TWO_N)
    qzeros_base = qzeros_ptr + expert * ((K // G) * PACKED_N)
    kk = tl.arange(0, BLOCK_K)

    for p0 in range(0, count, ROWS):
        slots = p0 + tl.arange(0, ROWS)
        slot_ok = slots < count
        if FUSED:
            pick = in_segment[None, :] & (slot_of[None, :] == slots[:, None])
            row = tl.sum(tl.where(pick, r[None, :], 0), axis=1)
        else:
            row = tl.load(sorted_rows_ptr + start + slots, mask=slot_ok, other=0)
        token = (row // TOP_K).to(tl.int64)
        acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            x = tl.load(x_ptr + token[:, None] * stride_xm + (k0 + kk)[None, :], mask=slot_ok[:, None], other=0.0)
            group = k0 // G
            w = awq_tile_minus_zero(
                qweight_base + (k0 + kk)[:, None] * PACKED_N + packed_cols[None, :],
                qzeros_base + group * PACKED_N + packed_cols[None, :],
                packed_ok[None, :], packed_ok[None, :], BLOCK_N,
            )
            scale = tl.load(scales_base + group * TWO_N + cols, mask=col_ok, other=0.0).to(tl.float32)
            dot = tl.sum(x.to(tl.float32)[:, :, None] * w[None, :, :], axis=1)
            acc += dot * scale[None, :]
        out_ptrs = partials_ptr + (split * rows + row)[:, None] * TWO_N + cols[None, :]
        tl.store(out_ptrs, acc, mask=slot_ok[:, None] & col_ok[None, :])


@triton.jit
def _w2_rows_kernel(
    ids_ptr,
    partials_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    row_out_ptr,
    rows,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """row_out[row, cols] = (silu(gate) * up)[row] @ W2[topk_ids[row]][:, cols], float32.

    The K-split partials are summed in split order. No loop carries a memory
    dependency: every load of a program can be in flight at once.
    """
    row = tl.program_id(0)
    tile = tl.program_id(1)
    PACKED_K: tl.constexpr = K // 8
    TWO_N: tl.constexpr = 2 * N
    expert = tl.load(ids_ptr + row).to(tl.int64)
    cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    packed_cols = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    packed_ok = packed_cols < PACKED_K
    qweight_base = qweight_ptr + expert * (N * PACKED_K)
    scales_base = scales_ptr + expert * ((N // G) * K)
    qzeros_base = qzeros_ptr + expert * ((N // G) * PACKED_K)
    nn = tl.arange(0, BLOCK_N)
    out = tl.zeros([BLOCK_K], dtype=tl.float32)
    for n0 in tl.static_range(0, N, BLOCK_N):
        gate = tl.zeros([BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_N], dtype=tl.float32)
        for s in tl.static_range(SPLIT_K):
            part = partials_ptr + (s * rows + row) * TWO_N + n0 + nn
            gate += tl.load(part)
            up += tl.load(part + N)
        act = silu_mul(gate, up)
        group = n0 // G
        w = awq_tile_minus_zero(
            qweight_base + (n0 + nn)[:, None] * PACKED_K + packed_cols[None, :],
            qzeros_base + group * PACKED_K + packed_cols[None, :],
            packed_ok[None, :], packed_ok[None, :], BLOCK_K,
        )
        scale = tl.load(scales_base + group * K + cols, mask=col_ok, other=0.0).to(tl.float32)
        out += tl.sum(act[:, None] * w, axis=0) * scale
    tl.store(row_out_ptr + row * K + cols, out, mask=col_ok)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


STAGES = ("compact", "w13", "w2", "combine")
COMPACT_TILE = 64  # tile of the O(R^2) rank when R exceeds the in-register limit
COMPACT_CHUNK = 16  # rows compared per slice in the in-register compaction


def compact(topk_ids, sorted_rows, segment_opens, active_experts, segment_offsets, live_count) -> None:
    """Launch the standalone compaction (one program) over topk_ids' M*k rows."""
    rows = topk_ids.numel()
    if rows <= 128:
        _compact_small_kernel[(1,)](
            topk_ids, rows, sorted_rows, active_experts, segment_offsets, live_count,
            R_PAD=max(16, _next_pow2(rows)), CHUNK=COMPACT_CHUNK, num_warps=4,
        )
    else:
        _compact_tiled_kernel[(1,)](
            topk_ids, rows, sorted_rows, segment_opens, active_experts, segment_offsets, live_count,
            BLOCK=COMPACT_TILE, num_warps=4,
        )


def grouped_decode(
    hidden_states, topk_weights, topk_ids,
    w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size: int,
    sorted_rows, segment_opens, active_experts, segment_offsets, live_count, partials, row_outputs,
    out, config: GroupedConfig, stages: Tuple[str, ...] = STAGES,
) -> None:
    """Launch the grouped decode into ``out`` [M, K]; scratch tensors come from the workspace.

    ``partials`` is float32 with room for ``config.split_k * M * k * 2N``,
    ``row_outputs`` float32 [M * k, K]; topk_ids and topk_weights must be contiguous [M, k].
    ``stages`` launches a subset, for the benchmark's per-kernel breakdown only.
    """
    M, K = hidden_states.shape
    top_k = topk_ids.shape[1]
    E = w13_qweight.shape[0]
    N = w2_qweight.shape[1]
    rows = M * top_k
    if not config.fuse_compaction and "compact" in stages:
        compact(topk_ids, sorted_rows, segment_opens, active_experts, segment_offsets, live_count)
    w13_grid = (min(rows, E), config.split_k, triton.cdiv(2 * N, config.w13_block_n))
    if "w13" in stages:
        _w13_kernel[w13_grid](
            hidden_states, hidden_states.stride(0),
            topk_ids,
            w13_qweight, w13_scales, w13_qzeros,
            sorted_rows, active_experts, segment_offsets, live_count,
            partials,
            rows,
            TOP_K=top_k, K=K, TWO_N=2 * N, G=group_size,
            SPLIT_K=config.split_k, BLOCK_K=config.w13_block_k, BLOCK_N=config.w13_block_n, ROWS=config.w13_rows,
            FUSED=config.fuse_compaction, R_PAD=max(16, _next_pow2(rows)), CHUNK=COMPACT_CHUNK,
            num_warps=config.w13_warps,
        )
    if "w2" in stages:
        _w2_rows_kernel[(rows, triton.cdiv(K, config.w2_block_k))](
            topk_ids,
            partials,
            w2_qweight, w2_scales, w2_qzeros,
            row_outputs,
            rows,
            K=K, N=N, G=group_size,
            SPLIT_K=config.split_k, BLOCK_K=config.w2_block_k, BLOCK_N=config.w2_block_n,
            num_warps=config.w2_warps,
        )
    if "combine" in stages:
        combine_rows(row_outputs, topk_weights, out)
