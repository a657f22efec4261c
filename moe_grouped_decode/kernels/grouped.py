"""Compact active-expert grouped decode: W13 (+ compaction), then W2 + SiLU + combine.

Launches (no host sync; every grid is sized by the static R = M * k rows)::

    topk_ids, x ──> [W13] program 0: sort rows by (expert, row) -> compaction,
                    │     zero the combine counters
                    │     programs (row, K-split, tile): W13[topk_ids[row]] tile
                    │     -> float32 partials[s, row, 2N]
                    ▼
                  [W2]  programs (row, column tile): weight loads first (PDL:
                          while W13 finishes), then act = silu(gate) * up from
                          the partials summed in split order, then -> float32
                          row_outputs[row]; the last of a token's k programs on
                          a tile (int32 arrival counter) writes
                          out[t, tile] = sum_j topk_weights[t, j] * row_outputs[t*k + j]

1. W13: every program but 0 takes one (routed row, K-split, column tile): ONE
   load of its whole-group tile of W13[topk_ids[row]] (rows x packed columns),
   its x slice, zeros and scales, then eight nibble-plane reductions. Programs
   index experts by routed row, so they need no compaction first; rows that
   share an expert read it again from L2 (the layer's active W13 is ~36 MB at
   M = 8, under the 60 MB of an H200), not from DRAM.
2. W2 (+ combine): see above. Without ``fused_combine`` the combine is a third
   launch (``combine.py``). With ``pdl`` (Hopper and newer) each launch lets the
   next one start early (programmatic dependent launch); the next one waits for
   it before reading what it wrote.

A token's output depends only on its own activations, routing and weights:
fixed summation orders, and the only atomics are integer arrival counts (which
program combines changes, the j-ordered sum it computes does not), so outputs
are bit-identical across runs and batch positions.
"""

from __future__ import annotations

from typing import Tuple

import triton
import triton.language as tl

from .awq_tiles import load_group_tile, load_plane_scales, nibble_plane_dot, plane_columns, silu_mul
from .combine import combine_rows, combine_tile
from .configs import GroupedConfig
from .pdl import launch_options, let_next_launch_start, pdl_supported, wait_for_previous_launch

_PAD_KEY = tl.constexpr(1 << 62)  # sort key of padding rows: past every (expert, row) key


@triton.jit
def _compact_rows(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                  live_count_ptr, R_PAD: tl.constexpr):
    """One program: sort the routed rows by (expert, row), then number the segments.

    ``sorted_experts_ptr`` is scratch for R int32 (each sorted position's
    expert, so that a position can see its predecessor's).
    """
    r = tl.arange(0, R_PAD)
    valid = r < rows
    expert = tl.load(ids_ptr + r, mask=valid, other=0).to(tl.int64)
    key = tl.sort(tl.where(valid, expert * R_PAD + r, _PAD_KEY))
    expert = (key // R_PAD).to(tl.int32)
    tl.store(sorted_rows_ptr + r, (key % R_PAD).to(tl.int32), mask=valid)
    tl.store(sorted_experts_ptr + r, expert, mask=valid)
    tl.debug_barrier()  # the predecessor's expert was written by another thread
    before = tl.load(sorted_experts_ptr + r - 1, mask=valid & (r > 0), other=-1)
    opens = valid & (before != expert)
    segment = tl.cumsum(opens.to(tl.int32), axis=0) - 1
    tl.store(active_experts_ptr + segment, expert, mask=opens)
    tl.store(segment_offsets_ptr + segment, r, mask=opens)
    live = tl.sum(opens.to(tl.int32), axis=0)
    tl.store(segment_offsets_ptr + live, rows)
    tl.store(live_count_ptr, live)


@triton.jit
def _compact_kernel(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                    live_count_ptr, R_PAD: tl.constexpr):
    _compact_rows(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                  live_count_ptr, R_PAD)


@triton.jit
def _w13_kernel(
    x_ptr, stride_xm,
    ids_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    partials_ptr,
    rows,
    sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr,
    arrivals_ptr, num_arrivals,
    TOP_K: tl.constexpr, K: tl.constexpr, TWO_N: tl.constexpr, G: tl.constexpr,
    GROUPS: tl.constexpr, WORDS: tl.constexpr, R_PAD: tl.constexpr, ARRIVALS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """partials[s, row, cols] = x[row // k, K-split s] @ W13[topk_ids[row]][K-split s, cols].

    Program 0 writes the compaction and zeroes the W2 launch's ``num_arrivals``
    combine counters; program 1 + ((row * SPLITS) + s) * TILES + tile does the
    GROUPS * G rows of split s and the 8 * WORDS columns of ``tile``.
    """
    let_next_launch_start(USE_PDL)
    pid = tl.program_id(0)
    if pid == 0:
        _compact_rows(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                      live_count_ptr, R_PAD)
        if ARRIVALS_PAD > 0:
            a = tl.arange(0, ARRIVALS_PAD)
            tl.store(arrivals_ptr + a, tl.zeros([ARRIVALS_PAD], dtype=tl.int32), mask=a < num_arrivals)
        return
    PACKED_N: tl.constexpr = TWO_N // 8
    NUM_GROUPS: tl.constexpr = K // G
    TILES: tl.constexpr = (PACKED_N + WORDS - 1) // WORDS
    SPLITS: tl.constexpr = (NUM_GROUPS + GROUPS - 1) // GROUPS
    work = pid - 1
    tile = work % TILES
    split = (work // TILES) % SPLITS
    row = work // (TILES * SPLITS)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    token = (row // TOP_K).to(tl.int64)
    groups = split * GROUPS + tl.arange(0, GROUPS)
    group_ok = groups < NUM_GROUPS
    words = tile * WORDS + tl.arange(0, WORDS)
    word_ok = words < PACKED_N
    k_rows, packed, zeros = load_group_tile(
        qweight_ptr + expert * (K * PACKED_N), qzeros_ptr + expert * (NUM_GROUPS * PACKED_N),
        groups, group_ok, words, word_ok, G, PACKED_N)
    scales = load_plane_scales(scales_ptr + expert * (NUM_GROUPS * TWO_N), groups, group_ok, words, word_ok, TWO_N)
    x = tl.load(x_ptr + token * stride_xm + k_rows, mask=group_ok[:, None], other=0.0).to(tl.float32)
    out_base = partials_ptr + (split * rows + row) * TWO_N
    for nibble in tl.static_range(8):
        acc = nibble_plane_dot(packed, zeros, x, scales[nibble], nibble)
        tl.store(out_base + plane_columns(words, nibble), acc, mask=word_ok)


@triton.jit
def _act_of_groups(partials_ptr, row, rows, groups, group_ok, G: tl.constexpr, N: tl.constexpr, SPLITS: tl.constexpr):
    """silu(gate) * up of a routed row's intermediate rows ``groups[g] * G + i`` ([GROUPS, G]),
    the W13 K-split partials summed in split order."""
    n = groups[:, None] * G + tl.arange(0, G)[None, :]
    ok = group_ok[:, None] & (n < N)
    gate = tl.zeros(n.shape, dtype=tl.float32)
    up = tl.zeros(n.shape, dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        part = partials_ptr + (s * rows + row) * (2 * N) + n
        gate += tl.load(part, mask=ok, other=0.0)
        up += tl.load(part + N, mask=ok, other=0.0)
    return silu_mul(gate, up)


@triton.jit
def _w2_rows_kernel(
    ids_ptr,
    partials_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    row_out_ptr,
    rows,
    topk_weights_ptr, out_ptr, stride_om, arrivals_ptr,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr, WORDS: tl.constexpr,
    GROUPS_A: tl.constexpr, GROUPS_B: tl.constexpr, TOP_K: tl.constexpr,
    FUSED_COMBINE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """row_out[row, cols] = (silu(gate) * up)[row] @ W2[topk_ids[row]][:, cols], float32.

    The N // G groups of W2 rows are two power-of-two chunks (GROUPS_A, then
    GROUPS_B padded, 0 for none). Every weight load issues before the wait for
    the W13 launch and before any arithmetic, so all of a program's weight bytes
    are in flight while W13 finishes. With FUSED_COMBINE, the last of a token's
    k programs on a column tile to arrive (an int32 counter per (token, tile),
    zeroed by the W13 launch) sums the token's k row outputs of that tile in j
    order into ``out``.
    """
    # the combine launch may start early; with the combine fused, W2 is the op's last launch and
    # whatever follows the op must not start before W2 is done
    let_next_launch_start(USE_PDL and not FUSED_COMBINE)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    PACKED_K: tl.constexpr = K // 8
    NUM_GROUPS: tl.constexpr = N // G
    expert = tl.load(ids_ptr + row).to(tl.int64)
    words = tile * WORDS + tl.arange(0, WORDS)
    word_ok = words < PACKED_K
    qweight_base = qweight_ptr + expert * (N * PACKED_K)
    scales_base = scales_ptr + expert * (NUM_GROUPS * K)
    qzeros_base = qzeros_ptr + expert * (NUM_GROUPS * PACKED_K)
    groups_a = tl.arange(0, GROUPS_A)
    ok_a = groups_a < NUM_GROUPS
    _, packed_a, zeros_a = load_group_tile(qweight_base, qzeros_base, groups_a, ok_a, words, word_ok, G, PACKED_K)
    scales_a = load_plane_scales(scales_base, groups_a, ok_a, words, word_ok, K)
    if GROUPS_B > 0:
        groups_b = GROUPS_A + tl.arange(0, GROUPS_B)
        ok_b = groups_b < NUM_GROUPS
        _, packed_b, zeros_b = load_group_tile(qweight_base, qzeros_base, groups_b, ok_b, words, word_ok, G, PACKED_K)
        scales_b = load_plane_scales(scales_base, groups_b, ok_b, words, word_ok, K)
    wait_for_previous_launch(USE_PDL)
    act_a = _act_of_groups(partials_ptr, row, rows, groups_a, ok_a, G, N, SPLITS)
    if GROUPS_B > 0:
        act_b = _act_of_groups(partials_ptr, row, rows, groups_b, ok_b, G, N, SPLITS)
    for nibble in tl.static_range(8):
        acc = nibble_plane_dot(packed_a, zeros_a, act_a, scales_a[nibble], nibble)
        if GROUPS_B > 0:
            acc += nibble_plane_dot(packed_b, zeros_b, act_b, scales_b[nibble], nibble)
        tl.store(row_out_ptr + row * K + plane_columns(words, nibble), acc, mask=word_ok)
    if FUSED_COMBINE:
        token = row // TOP_K
        tl.debug_barrier()  # every thread's row_out stores happen before the release below
        arrived = tl.atomic_add(arrivals_ptr + token * tl.num_programs(1) + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            cols = tile * (8 * WORDS) + tl.arange(0, 8 * WORDS)
            combine_tile(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, token, cols, cols < K, TOP_K, K)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _prev_pow2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def w2_group_chunks(num_groups: int) -> Tuple[int, int]:
    """N // G groups as (largest power of two, the rest padded to a power of two or 0)."""
    first = _prev_pow2(num_groups)
    rest = num_groups - first
    return first, (_next_pow2(rest) if rest else 0)


STAGES = ("w13", "w2", "combine")


def launched_stages(config: GroupedConfig) -> Tuple[str, ...]:
    """The stages that are launches of their own under ``config``."""
    return STAGES if not config.fused_combine else ("w13", "w2")


def compact(topk_ids, sorted_rows, sorted_experts, active_experts, segment_offsets, live_count) -> None:
    """Launch the compaction alone (one program) over topk_ids' M*k rows; the grouped
    op does it inside its W13 launch, the benchmark's read floor uses this."""
    rows = topk_ids.numel()
    _compact_kernel[(1,)](
        topk_ids, rows, sorted_rows, sorted_experts, active_experts, segment_offsets, live_count,
        R_PAD=max(16, _next_pow2(rows)), num_warps=4,
    )


def grouped_decode(
    hidden_states, topk_weights, topk_ids,
    w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size: int,
    scratch, out, config: GroupedConfig, stages: Tuple[str, ...] = STAGES,
) -> None:
    """Launch the grouped decode into ``out`` [M, K].

    ``scratch`` holds the workspace regions as attributes (``ops.workspace_views``):
    int32 ``sorted_rows``, ``sorted_experts`` (compaction scratch), ``active_experts``,
    ``segment_offsets``, ``live_count``, ``combine_arrivals`` (>= M * ceil(K / w2_block_k));
    float32 ``gate_up_partials`` (>= config.w13_splits(K, G) * M * k * 2N, flat) and
    ``row_outputs`` [M * k, K]. ``config`` must be
    ``fitted`` to the shape; topk_ids and topk_weights contiguous [M, k].
    ``stages`` launches a subset, for the benchmark's per-kernel breakdown only.
    """
    M, K = hidden_states.shape
    top_k = topk_ids.shape[1]
    N = w2_qweight.shape[1]
    G = group_size
    rows = M * top_k
    splits = config.w13_splits(K, G)
    w13_words = config.w13_block_n // 8
    w2_tiles = triton.cdiv(K, config.w2_block_k)
    use_pdl = config.pdl and pdl_supported(hidden_states.device)
    num_arrivals = M * w2_tiles if config.fused_combine else 0
    if num_arrivals > scratch.combine_arrivals.numel():
        raise ValueError(f"grouped_decode: {num_arrivals} combine counters needed, the workspace holds "
                         f"{scratch.combine_arrivals.numel()}")
    if "w13" in stages:
        _w13_kernel[(1 + rows * splits * triton.cdiv(2 * N // 8, w13_words),)](
            hidden_states, hidden_states.stride(0),
            topk_ids,
            w13_qweight, w13_scales, w13_qzeros,
            scratch.gate_up_partials,
            rows,
            scratch.sorted_rows, scratch.sorted_experts, scratch.active_experts, scratch.segment_offsets,
            scratch.live_count, scratch.combine_arrivals, num_arrivals,
            TOP_K=top_k, K=K, TWO_N=2 * N, G=G,
            GROUPS=config.w13_block_k // G, WORDS=w13_words, R_PAD=max(16, _next_pow2(rows)),
            ARRIVALS_PAD=_next_pow2(num_arrivals) if num_arrivals else 0, USE_PDL=use_pdl,
            num_warps=config.w13_warps,
        )
    if "w2" in stages:
        groups_a, groups_b = w2_group_chunks(N // G)
        _w2_rows_kernel[(rows, w2_tiles)](
            topk_ids,
            scratch.gate_up_partials,
            w2_qweight, w2_scales, w2_qzeros,
            scratch.row_outputs,
            rows,
            topk_weights, out, out.stride(0), scratch.combine_arrivals,
            K=K, N=N, G=G, SPLITS=splits, WORDS=config.w2_block_k // 8,
            GROUPS_A=groups_a, GROUPS_B=groups_b, TOP_K=top_k,
            FUSED_COMBINE=config.fused_combine, USE_PDL=use_pdl,
            num_warps=config.w2_warps, **launch_options(use_pdl),
        )
    if not config.fused_combine and "combine" in stages:
        combine_rows(scratch.row_outputs, topk_weights, out, use_pdl)
