"""The grouped decode over vLLM's Marlin tensors: W13 split-K partials, then SiLU-and-mul, W2
and the weighted combine, per routed row (no host sync, grids sized by R = M * k rows).

The tensors are those vLLM's MARLIN MoE backend holds after its load step
(``moe_grouped_decode.marlin_layout``: N padded to N_p, W13 columns ``[gate N_p | up N_p]``)::

    w13_qweight [E, K / 16, 4 N_p]    w13_scales [E, K / G, 2 N_p]    w13_qzeros [E, K / G, 2 N_p / 8]
    w2_qweight  [E, N_p / 16, 2 K]    w2_scales  [E, N_p / G, K]      w2_qzeros  [E, N_p / G, K / 8]

Programs::

    W13: program 0 zeroes the fused combine's arrival counters (ARRIVALS_PAD > 0: W2 fuses it);
         program 1 + (row * SPLITS + s) * TILES + tile, TILES = ceil(N / 64) tiles of gate and as
         many of up (a tile of padding only is never read; the padded columns of the last tile
         are computed and not stored)
         -> float32 partials[s, row, 2N] (gate then up, unpadded)
    act (a launch of its own where the config's act_launch): program (row, block of
         ACT_LAUNCH_BLOCK units): silu(gate) * up from the partials -> act[row] (16-bit)
    W2:  program (row, column tile, N split): silu(gate) * up from the partials -> act[row]
         (16-bit) over the split's N / N_SPLITS rows (ACT_READY: the act launch wrote them), then
         each of WARPS column warps takes 64 output columns over those rows, its ROW_WARPS warps
         every ROW_WARPS-th 32-row chunk each, their sums added -> float32 row_out[split, row, K];
         FUSED_COMBINE: the last of a token's k x N_SPLITS programs on the tile (an int32 arrival
         counter per (token, tile)) writes the token's combined columns
    combine (a launch of its own without FUSED_COMBINE):
         out[t] = sum_j topk_weights[t, j] * (sum_s row_out[s, t * k + j])  (s, then j order)

``launch_humming_grouped`` runs the same kernels over the tensors vLLM's HUMMING backend holds
(``moe_grouped_decode.humming_layout``: Marlin's words and grouped scales, each sublayer padded
at its ends, zero points in plain nibble order, gathered into Marlin's order as they load).

Every sum has a fixed order for a given launch config (splits, warps, chunks, row warps, N
splits, j), so a token's bits depend on its own inputs and that config only. An id outside
[0, E) reads expert 0 and its row output is 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import tables
from ..humming_layout import humming_padded_sizes, humming_tensor_shapes
from .awq_mma import CHUNK_LOOP_UNROLL, CHUNK_ROWS, UNROLLED_CHUNKS, chunk_lanes
from .awq_tiles import silu_mul
from .combine import combine_sums
from .marlin_mma import (MARLIN_TILE_COLUMNS, MARLIN_TILE_WORDS, marlin_chunk_columns, marlin_chunk_rows,
                         marlin_mma_chunk, marlin_word_offsets)
from .pdl import launch_options, let_next_launch_start, wait_for_previous_launch
from .w2_tl import ACT_BLOCK, HELD_CHUNKS, activations_tile, row_activations


@triton.jit
def _scale_columns(g, e, SCALES_GROUPED: tl.constexpr):
    """Where the scale of column g + 8 e of a 64-column tile is stored within the tile: vLLM's
    grouped order (column i + 8 j at 8 i + j) or its channelwise one (in every 32 columns, column
    8 a + 2 i + b at 8 i + 2 a + b; vLLM writes it where G >= N)."""
    if SCALES_GROUPED:
        return 8 * g + e
    else:
        return 32 * (e // 4) + 8 * (g // 2) + 2 * (e % 4) + g % 2


@triton.jit
def _zero_word(word, PLAIN_ZEROS: tl.constexpr):
    """A zero-point word in Marlin's nibble order (column 16 w + g at nibble w, + 8 at w + 4) from
    Humming's plain one (at nibbles 2 w and 2 w + 1): the two halves' nibbles gathered."""
    if PLAIN_ZEROS:
        even = word & 0x0F0F0F0F
        odd = (word >> 4) & 0x0F0F0F0F
        even = (even | (even >> 4)) & 0x00FF00FF
        odd = (odd | (odd >> 4)) & 0x00FF00FF
        return ((even | (even >> 8)) & 0xFFFF) | (((odd | (odd >> 8)) & 0xFFFF) << 16)
    else:
        return word


@triton.jit
def marlin_w13_kernel(
    x_ptr, stride_xm, ids_ptr, num_experts,
    qweight_ptr, scales_ptr, qzeros_ptr,
    partials_ptr, rows, arrivals_ptr, num_arrivals,
    TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, N_P: tl.constexpr, G: tl.constexpr,
    CHUNKS: tl.constexpr, WARPS: tl.constexpr, SPLITS: tl.constexpr, SCALES_GROUPED: tl.constexpr,
    IS_BF16: tl.constexpr, USE_PDL: tl.constexpr, ARRIVALS_PAD: tl.constexpr = 0,
    STORED_COLUMNS: tl.constexpr = 0, STORED_ROWS: tl.constexpr = 0, UP_TILE: tl.constexpr = 0,
    PLAIN_ZEROS: tl.constexpr = False,
):
    """partials[s, row, cols] = x[row // k, K-split s] @ W13[topk_ids[row]][K-split s, cols].

    Marlin's tensors by default; Humming's (``humming_layout``) with STORED_COLUMNS / STORED_ROWS
    (the padded [K, 2N] the tensors hold), UP_TILE (up's first tile) and PLAIN_ZEROS."""
    let_next_launch_start(USE_PDL)
    HALF_TILES: tl.constexpr = (N + MARLIN_TILE_COLUMNS - 1) // MARLIN_TILE_COLUMNS  # real tiles of gate (of up)
    TILES: tl.constexpr = 2 * HALF_TILES
    SPLIT_ROWS: tl.constexpr = WARPS * CHUNKS * CHUNK_ROWS
    COLUMNS: tl.constexpr = STORED_COLUMNS if STORED_COLUMNS > 0 else 2 * N_P  # Marlin: [gate N_p | up N_p]
    K_ROWS: tl.constexpr = STORED_ROWS if STORED_ROWS > 0 else K
    FIRST_UP_TILE: tl.constexpr = UP_TILE if UP_TILE > 0 else N_P // MARLIN_TILE_COLUMNS
    ROW_WORDS: tl.constexpr = 2 * COLUMNS  # a 16-row tile row of W13's stored [K, 2 N]
    pid = tl.program_id(0)
    if ARRIVALS_PAD > 0:
        if pid == 0:
            a = tl.arange(0, ARRIVALS_PAD)
            tl.store(arrivals_ptr + a, tl.zeros([ARRIVALS_PAD], dtype=tl.int32), mask=a < num_arrivals)
            return
        pid -= 1
    tile = pid % TILES
    split = (pid // TILES) % SPLITS
    row = (pid // (TILES * SPLITS)).to(tl.int64)
    half = tile // HALF_TILES  # 0 gate, 1 up
    padded_tile = half * FIRST_UP_TILE + tile % HALF_TILES
    expert = tl.load(ids_ptr + row)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int64)
    token = (row // TOP_K).to(tl.int64)
    warp, g, t, e = chunk_lanes(WARPS)
    block, word = marlin_word_offsets(t, g, e)
    qweight_base = qweight_ptr + expert * (K_ROWS // 16 * ROW_WORDS) + padded_tile * MARLIN_TILE_WORDS + word
    scales_base = scales_ptr + expert * (K_ROWS // G * COLUMNS) + padded_tile * MARLIN_TILE_COLUMNS + _scale_columns(g, e, SCALES_GROUPED)
    qzeros_base = qzeros_ptr + expert * (K_ROWS // G * (COLUMNS // 8)) + padded_tile * 8 + g
    acc_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        k0 = split * SPLIT_ROWS + (warp * CHUNKS + c) * CHUNK_ROWS
        group = k0 // G
        words = tl.load(qweight_base + (k0 // 16 + block) * ROW_WORDS)
        x = tl.load(x_ptr + token * stride_xm + marlin_chunk_rows(k0, t, e), mask=g == 0, other=0.0)
        scales = tl.load(scales_base + group * COLUMNS)
        zeros = _zero_word(tl.load(qzeros_base + group * (COLUMNS // 8)), PLAIN_ZEROS)
        d_lo, d_hi = marlin_mma_chunk(words, x, scales, zeros, IS_BF16, WARPS)
        acc_lo += d_lo
        acc_hi += d_hi
    if WARPS > 1:
        acc_lo = tl.sum(tl.reshape(acc_lo, [WARPS, 32, 8]), axis=0)
        acc_hi = tl.sum(tl.reshape(acc_hi, [WARPS, 32, 8]), axis=0)
    _, g, t, e = chunk_lanes(1)
    col = (tile % HALF_TILES) * MARLIN_TILE_COLUMNS + marlin_chunk_columns(g, e)  # within gate (up)
    keep = (t == 0) & (e % 2 == 0)  # token column 0: this row's token
    out_base = partials_ptr + (split * rows + row) * (2 * N) + half * N
    tl.store(out_base + col, acc_lo, mask=keep & (col < N))
    tl.store(out_base + col + 32, acc_hi, mask=keep & (col + 32 < N))


@triton.jit
def _w2_chunk_weights(qweight_base, scales_base, qzeros_base, c, block, COLUMNS: tl.constexpr, G: tl.constexpr,
                      PLAIN_ZEROS: tl.constexpr):
    """Chunk c's words, scales and zero words (in Marlin's nibble order) of the lanes' tile;
    COLUMNS: the stored W2's columns (K, or Humming's padded K)."""
    k0 = c * CHUNK_ROWS
    group = k0 // G
    return (tl.load(qweight_base + (k0 // 16 + block) * (2 * COLUMNS)), tl.load(scales_base + group * COLUMNS),
            _zero_word(tl.load(qzeros_base + group * (COLUMNS // 8)), PLAIN_ZEROS))


@triton.jit
def _w2_chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N: tl.constexpr,
                  IS_BF16: tl.constexpr, WARPS: tl.constexpr):
    k_rows = marlin_chunk_rows(c * CHUNK_ROWS, t, e)
    act = tl.load(act_ptr + row * N + k_rows, mask=(g == 0) & (k_rows < N), other=0.0)
    d_lo, d_hi = marlin_mma_chunk(words, act, scales, zeros, IS_BF16, WARPS)
    return acc_lo + d_lo, acc_hi + d_hi


@triton.jit
def _span_activations(partials_ptr, act_ptr, row, rows, n_lo, SPAN: tl.constexpr, N: tl.constexpr,
                      SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """act[row, n_lo : n_lo + SPAN] = silu(gate) * up from the W13 partials summed in split order
    (``row_activations``' sums, over one N split's rows only: the rows its program reads back), in
    tiles of BLOCK (a power of 2)."""
    for n0 in range(0, SPAN, BLOCK):
        n = n_lo + n0 + tl.arange(0, BLOCK)
        inside = n0 + tl.arange(0, BLOCK) < SPAN
        gate = tl.zeros([BLOCK], dtype=tl.float32)
        up = tl.zeros([BLOCK], dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            part = partials_ptr + (s * rows + row) * (2 * N) + n
            gate += tl.load(part, mask=inside, other=0.0)
            up += tl.load(part + N, mask=inside, other=0.0)
        tl.store(act_ptr + row * N + n, silu_mul(gate, up).to(act_ptr.dtype.element_ty), mask=inside)


# the act launch's block of a row's N: one warp's two 16-byte loads a lane per split (one
# float4 of gate, one of up), and at large N and few rows N / 128 programs a row spread the
# reduction over the SMs
ACT_LAUNCH_BLOCK = 128


@triton.jit(do_not_specialize=["rows"])
def marlin_act_kernel(partials_ptr, act_ptr, rows, N: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """act[row, block's units] = silu(gate) * up from the W13 partials summed in split order from
    zeros, stored in act's dtype: W2's own sums (``row_activations``), so the same bits."""
    let_next_launch_start(USE_PDL)
    wait_for_previous_launch(USE_PDL)
    activations_tile(partials_ptr, act_ptr, tl.program_id(0), rows, tl.program_id(1) * BLOCK, N, SPLITS, BLOCK)


@triton.jit
def marlin_w2_kernel(
    ids_ptr, num_experts, partials_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    act_ptr, row_out_ptr, rows,
    topk_weights_ptr, out_ptr, stride_om, arrivals_ptr,
    K: tl.constexpr, N: tl.constexpr, N_P: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr,
    WARPS: tl.constexpr, N_PAD: tl.constexpr, SCALES_GROUPED: tl.constexpr, IS_BF16: tl.constexpr,
    USE_PDL: tl.constexpr, TOP_K: tl.constexpr = 1, FUSED_COMBINE: tl.constexpr = False,
    ROW_WARPS: tl.constexpr = 1, N_SPLITS: tl.constexpr = 1, STORED_COLUMNS: tl.constexpr = 0,
    PLAIN_ZEROS: tl.constexpr = False, ACT_READY: tl.constexpr = False,
):
    """row_out[split, row, cols] = (silu(gate) * up)[row, split's rows] @ W2[topk_ids[row]][split's
    rows, cols], float32. Humming's tensors: N_P their padded N, STORED_COLUMNS their padded K,
    PLAIN_ZEROS. ACT_READY: act holds the activations already (the previous launch wrote them)."""
    COLUMNS: tl.constexpr = STORED_COLUMNS if STORED_COLUMNS > 0 else K
    # with the combine fused, W2 is the op's last launch: what follows must not start before it ends
    let_next_launch_start(USE_PDL and not FUSED_COMBINE)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    # N_SPLITS programs share a (row, column tile), each over N / N_SPLITS rows: more programs, and
    # shorter chains, where few rows times K / 128 tiles leave the SMs idle (large N, few tokens)
    SPLIT_CHUNKS: tl.constexpr = N // CHUNK_ROWS // N_SPLITS
    if N_SPLITS > 1:
        n_split = tl.program_id(2)
    else:
        n_split = 0
    # ROW_WARPS warps share a column tile, each taking every ROW_WARPS-th chunk of the split's rows:
    # a shorter chain of dependent loads per warp where few rows leave the SMs half idle
    ITERS: tl.constexpr = SPLIT_CHUNKS // ROW_WARPS
    tl.static_assert(ITERS * ROW_WARPS * N_SPLITS * CHUNK_ROWS == N,
                     "the row warps times the N splits must divide N's 32-row chunks")
    first_chunk = n_split * SPLIT_CHUNKS
    # the first HELD iterations' weights are loaded before the wait for W13 (they stream in while it
    # finishes), the rest in the chunk loop after it
    HELD: tl.constexpr = min(ITERS, HELD_CHUNKS)
    expert = tl.load(ids_ptr + row)
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int64)
    LANE_WARPS: tl.constexpr = WARPS * ROW_WARPS
    warp, g, t, e = chunk_lanes(LANE_WARPS)
    row_warp = warp // WARPS  # which of the ROW_WARPS chunk sequences the lane's warp takes
    col_tile = tile * WARPS + warp % WARPS
    block, word = marlin_word_offsets(t, g, e)
    qweight_base = qweight_ptr + expert * (N_P // 16 * 2 * COLUMNS) + col_tile * MARLIN_TILE_WORDS + word
    scales_base = scales_ptr + expert * (N_P // G * COLUMNS) + col_tile * MARLIN_TILE_COLUMNS + _scale_columns(g, e, SCALES_GROUPED)
    qzeros_base = qzeros_ptr + expert * (N_P // G * (COLUMNS // 8)) + col_tile * 8 + g
    held = ()
    for i in tl.static_range(HELD):
        held += (_w2_chunk_weights(qweight_base, scales_base, qzeros_base, first_chunk + i * ROW_WARPS + row_warp,
                                   block, COLUMNS, G, PLAIN_ZEROS),)
    wait_for_previous_launch(USE_PDL)
    if not ACT_READY:
        if N_SPLITS > 1:
            _span_activations(partials_ptr, act_ptr, row, rows, first_chunk * CHUNK_ROWS, SPLIT_CHUNKS * CHUNK_ROWS,
                              N, SPLITS, min(N_PAD // N_SPLITS, ACT_BLOCK))
        else:
            row_activations(partials_ptr, act_ptr, row, rows, N, SPLITS, N_PAD)
        tl.debug_barrier()  # every thread's act stores happen before any thread reads them back
    acc_lo = tl.zeros([32 * LANE_WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * LANE_WARPS, 8], dtype=tl.float32)
    for i in tl.static_range(HELD):
        words, scales, zeros = held[i]
        acc_lo, acc_hi = _w2_chunk_mma(act_ptr, row, first_chunk + i * ROW_WARPS + row_warp, words, scales, zeros,
                                       acc_lo, acc_hi, g, t, e, N, IS_BF16, LANE_WARPS)
    if ITERS - HELD <= UNROLLED_CHUNKS:
        for i in tl.static_range(HELD, ITERS):
            c = first_chunk + i * ROW_WARPS + row_warp
            words, scales, zeros = _w2_chunk_weights(qweight_base, scales_base, qzeros_base, c, block, COLUMNS, G,
                                                     PLAIN_ZEROS)
            acc_lo, acc_hi = _w2_chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N,
                                           IS_BF16, LANE_WARPS)
    else:
        for i in tl.range(HELD, ITERS, loop_unroll_factor=CHUNK_LOOP_UNROLL):
            c = first_chunk + i * ROW_WARPS + row_warp
            words, scales, zeros = _w2_chunk_weights(qweight_base, scales_base, qzeros_base, c, block, COLUMNS, G,
                                                     PLAIN_ZEROS)
            acc_lo, acc_hi = _w2_chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N,
                                           IS_BF16, LANE_WARPS)
    if ROW_WARPS > 1:  # the chunk sequences' sums, in the compiler's fixed tree order
        acc_lo = tl.sum(tl.reshape(acc_lo, [ROW_WARPS, 32 * WARPS, 8]), axis=0)
        acc_hi = tl.sum(tl.reshape(acc_hi, [ROW_WARPS, 32 * WARPS, 8]), axis=0)
        warp, g, t, e = chunk_lanes(WARPS)
        col_tile = tile * WARPS + warp
    acc_lo = tl.where(valid, acc_lo, 0.0)
    acc_hi = tl.where(valid, acc_hi, 0.0)
    col = col_tile * MARLIN_TILE_COLUMNS + marlin_chunk_columns(g, e)
    keep = (t == 0) & (e % 2 == 0)
    out_row = row_out_ptr + (n_split * rows + row) * K
    tl.store(out_row + col, acc_lo, mask=keep)
    tl.store(out_row + col + 32, acc_hi, mask=keep)
    if FUSED_COMBINE:
        token = row // TOP_K
        tl.debug_barrier()  # every thread's row_out stores happen before the release below
        arrived = tl.atomic_add(arrivals_ptr + token * tl.num_programs(1) + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K * N_SPLITS - 1:
            cols = tile * (WARPS * MARLIN_TILE_COLUMNS) + tl.arange(0, WARPS * MARLIN_TILE_COLUMNS)
            col_ok = cols < K
            acc = combine_sums(row_out_ptr, topk_weights_ptr, ids_ptr, num_experts, token, cols, col_ok, TOP_K, K,
                               rows, N_SPLITS)
            tl.store(out_ptr + token.to(tl.int64) * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def marlin_combine_kernel(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, out_ptr, stride_om, rows,
                          TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
                          N_SPLITS: tl.constexpr = 1):
    """out[t, cols] = sum_j topk_weights[t, j] * (sum_s row_out[s, t * k + j, cols]) in s, then j
    order; an id outside [0, E) adds nothing."""
    wait_for_previous_launch(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    acc = combine_sums(row_out_ptr, topk_weights_ptr, topk_ids_ptr, num_experts, t, cols, col_ok, TOP_K, K, rows,
                       N_SPLITS)
    tl.store(out_ptr + t * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=col_ok)


@dataclass(frozen=True)
class MarlinGroupedConfig:
    """Launch config of the grouped decode over Marlin tensors: W13's warps and 32-row chunks per
    warp (a K split is warps x chunks x 32 rows; it must divide K), W2's column warps (64 output
    columns each; 64 x warps must divide K), its row warps per column warp (each every
    ``w2_row_warps``-th 32-row chunk of its rows) and its N splits (programs that each take
    N / ``w2_n_splits`` rows of a column tile); both powers of 2 whose product divides N / 32.
    ``act_launch``: silu(gate) * up in a launch of its own (the same bits)."""

    w13_warps: int = 4
    w13_chunks: int = 4
    w2_warps: int = 2
    fused_combine: bool = True  # the last of a token's W2 programs on a tile combines it (one launch fewer)
    w2_row_warps: int = 1
    w2_n_splits: int = 1
    # the activations in a launch of their own between W13 and W2: each row's reduced once over
    # the K splits' partials, not once per W2 column tile (at large N and few tokens each W2
    # program otherwise reads more partials than weights)
    act_launch: bool = False

    def splits(self, hidden_size: int, intermediate_size: int) -> int:
        """W13's K splits for K = ``hidden_size``; ValueError where the config does not tile the
        layer (K, N = ``intermediate_size``)."""
        rows = self.w13_warps * self.w13_chunks * CHUNK_ROWS.value
        if hidden_size % rows or hidden_size % (MARLIN_TILE_COLUMNS.value * self.w2_warps):
            raise ValueError(f"config {self} does not tile K = {hidden_size}: a K split is {rows} rows, "
                             f"a W2 program {MARLIN_TILE_COLUMNS.value * self.w2_warps} columns")
        row_warps, n_splits = self.w2_row_warps, self.w2_n_splits
        if any(v < 1 or v & (v - 1) for v in (row_warps, n_splits)) or \
                intermediate_size % (CHUNK_ROWS.value * row_warps * n_splits):
            raise ValueError(f"config {self} does not tile N = {intermediate_size}: its W2 row warps and N splits, "
                             f"each a power of 2, take {CHUNK_ROWS.value} rows each in turn")
        return hidden_size // rows


COMBINE_BLOCK = 256


def config_from_entry(entry: dict) -> MarlinGroupedConfig:
    """A launch-table entry's config (``tables.CoserveTable.launch``); ValueError naming a bad one."""
    try:
        return MarlinGroupedConfig(**entry["config"])
    except (KeyError, TypeError) as error:
        raise ValueError(f"co-served launch-table entry {entry!r}: {error}") from error


def coserved_config(gpu: str, shape, dtype: str, num_tokens: int, layout: str = "marlin") -> MarlinGroupedConfig:
    """The launch config the co-served kernel runs at M = ``num_tokens`` for ``shape`` (E, k, K, N, G)
    and ``dtype`` ("fp16"/"bf16") on ``gpu`` over vLLM's ``layout`` ("marlin"/"humming") tensors:
    the measured co-serving table's entry (an entry serves every M up to its own, the last every M
    above), else the default; one that cannot tile the layer's K and N falls back to the default.
    Asked at every eager call: kept per table generation."""
    key = (gpu, tuple(shape), dtype, num_tokens, layout, tables.generation())
    config = _CONFIGS.get(key)
    if config is None:
        config = _CONFIGS[key] = _coserved_config(gpu, tuple(shape), dtype, num_tokens, layout)
    return config


_CONFIGS: dict = {}


def _coserved_config(gpu: str, shape, dtype: str, num_tokens: int, layout: str) -> MarlinGroupedConfig:
    table = tables.config_table(gpu, tuple(shape), dtype)
    coserve = None if table is None else table.coserve_table(layout)
    entries = sorted(coserve.launch, key=lambda e: e["M"]) if coserve is not None else []
    config = MarlinGroupedConfig()
    if entries:
        config = config_from_entry(next((e for e in entries if num_tokens <= e["M"]), entries[-1]))
    try:
        config.splits(shape[2], shape[3])
    except ValueError:
        config = MarlinGroupedConfig()
    return config


def launch_marlin_grouped(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_qweight, w13_scales,
                          w13_qzeros, w2_qweight, w2_scales, w2_qzeros, intermediate_size: int, group_size: int,
                          scales_grouped: bool, config: MarlinGroupedConfig = MarlinGroupedConfig(), use_pdl: bool = False,
                          out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """out [M, K] = the MoE layer of Marlin tensors (module docstring) for x [M, K] routed by
    topk_ids / topk_weights [M, k]; ``scales_grouped``: which order vLLM wrote the scales in
    (``MarlinMoeWeights.scales_grouped``). Scratch is allocated per call (a measurement path)."""
    M, K = x.shape
    E = w13_qweight.shape[0]
    N, G = intermediate_size, group_size
    N_p = w2_qweight.shape[1] * 16
    if tuple(w13_qweight.shape) != (E, K // 16, 4 * N_p) or tuple(w2_qweight.shape) != (E, N_p // 16, 2 * K):
        raise ValueError(f"Marlin weights of shapes {tuple(w13_qweight.shape)}, {tuple(w2_qweight.shape)} are not "
                         f"a layer of K = {K}, N_p = {N_p}")
    if N > N_p or N % CHUNK_ROWS.value or G % CHUNK_ROWS.value or N_p % G or K % G:
        raise ValueError(f"N = {N}, N_p = {N_p}, G = {G}, K = {K}: needs N <= N_p, N and G multiples of 32, "
                         f"N_p and K of G")
    wanted = {"w13_scales": (E, K // G, 2 * N_p), "w13_qzeros": (E, K // G, 2 * N_p // 8),
              "w2_scales": (E, N_p // G, K), "w2_qzeros": (E, N_p // G, K // 8)}
    _check_shapes(wanted, (w13_scales, w13_qzeros, w2_scales, w2_qzeros))
    return _launch(x, topk_weights, topk_ids, (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros),
                   N, G, N_p, scales_grouped, config, use_pdl, out, {}, {})


def _check_shapes(wanted: dict, tensors, where: str = "") -> None:
    """ValueError naming the first of ``tensors`` whose shape is not ``wanted``'s (name -> shape, in order)."""
    for (name, shape), tensor in zip(wanted.items(), tensors):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}{where}")


def launch_humming_grouped(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, w13_weight,
                           w13_weight_scale, w13_zero_point, w2_weight, w2_weight_scale, w2_zero_point,
                           intermediate_size: int, group_size: int,
                           config: MarlinGroupedConfig = MarlinGroupedConfig(), use_pdl: bool = False,
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """:func:`launch_marlin_grouped` over the tensors vLLM's Humming backend holds
    (``humming_layout``: Marlin's words and grouped scales, each sublayer padded at its ends, zero
    points in plain nibble order). Up's columns must start on a 64-column tile: N a multiple of 64."""
    M, K = x.shape
    E = w13_weight.shape[0]
    N, G = intermediate_size, group_size
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(K, N)
    if N % MARLIN_TILE_COLUMNS.value or G % CHUNK_ROWS.value or K % G or N % G or 128 % G:
        raise ValueError(f"N = {N}, G = {G}, K = {K}: the kernel over Humming's tensors needs N a multiple of "
                         f"{MARLIN_TILE_COLUMNS.value} (gate and up on whole tiles), G of 32 dividing 128, K and N "
                         "of G")
    wanted = humming_tensor_shapes(E, K, N, G)
    tensors = (w13_weight, w13_weight_scale, w13_zero_point, w2_weight, w2_weight_scale, w2_zero_point)
    _check_shapes(wanted, tensors, f" for Humming's layer of K = {K}, N = {N}, G = {G}")
    w13_layout = dict(STORED_COLUMNS=w13_columns, STORED_ROWS=k_rows, UP_TILE=N // MARLIN_TILE_COLUMNS.value,
                      PLAIN_ZEROS=True)
    return _launch(x, topk_weights, topk_ids, tensors, N, G, n_rows, True, config, use_pdl, out, w13_layout,
                   dict(STORED_COLUMNS=w2_columns, PLAIN_ZEROS=True))


def _launch(x, topk_weights, topk_ids, tensors, N: int, G: int, N_p: int, scales_grouped: bool,
            config: MarlinGroupedConfig, use_pdl: bool, out: Optional[torch.Tensor], w13_layout: dict,
            w2_layout: dict) -> torch.Tensor:
    """The launches over a checked layer's six tensors (``N_p``: W2's stored rows; ``*_layout``:
    the kernels' constexprs for a layout other than Marlin's)."""
    w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros = tensors
    M, K = x.shape
    top_k = topk_ids.shape[1]
    E = w13_qweight.shape[0]
    if w13_scales.dtype != x.dtype or w2_scales.dtype != x.dtype:
        raise ValueError(f"the scales must be in the activations' dtype {x.dtype} (the kernels read their bits as it)")
    if not all(t.is_contiguous() for t in tensors) or x.stride(1) != 1 or (out is not None and out.stride(1) != 1):
        raise ValueError("the weights must be contiguous, x and out of unit column stride")
    splits = config.splits(K, N)
    R = M * top_k
    dev, dtype = x.device, x.dtype
    n_splits = config.w2_n_splits
    partials = torch.empty(splits, R, 2 * N, dtype=torch.float32, device=dev)
    act = torch.empty(R, N, dtype=dtype, device=dev)
    row_out = torch.empty(n_splits, R, K, dtype=torch.float32, device=dev)
    if out is None:
        out = torch.empty(M, K, dtype=dtype, device=dev)
    if M == 0:
        return out
    is_bf16 = dtype == torch.bfloat16
    tiles = 2 * triton.cdiv(N, MARLIN_TILE_COLUMNS.value)
    w2_tiles = K // (MARLIN_TILE_COLUMNS.value * config.w2_warps)
    fused = config.fused_combine
    arrivals = torch.empty(M * w2_tiles if fused else 1, dtype=torch.int32, device=dev)
    marlin_w13_kernel[(int(fused) + R * splits * tiles,)](
        x, x.stride(0), topk_ids, E, w13_qweight, w13_scales, w13_qzeros, partials, R, arrivals, arrivals.numel(),
        TOP_K=top_k, K=K, N=N, N_P=N_p, G=G, CHUNKS=config.w13_chunks, WARPS=config.w13_warps, SPLITS=splits,
        SCALES_GROUPED=scales_grouped, IS_BF16=is_bf16, USE_PDL=use_pdl,
        ARRIVALS_PAD=triton.next_power_of_2(arrivals.numel()) if fused else 0, num_warps=config.w13_warps,
        **w13_layout)
    if config.act_launch:
        # PDL chain W13 -> act -> W2: each waits for the previous launch's end before reading its
        # outputs, so W2's wait covers W13's too (the arrival counters its program 0 zeroes)
        block = min(triton.next_power_of_2(N), ACT_LAUNCH_BLOCK)
        marlin_act_kernel[(R, triton.cdiv(N, block))](
            partials, act, R, N=N, SPLITS=splits, BLOCK=block, USE_PDL=use_pdl, num_warps=1,
            **launch_options(use_pdl))
    marlin_w2_kernel[(R, w2_tiles) if n_splits == 1 else (R, w2_tiles, n_splits)](
        topk_ids, E, partials, w2_qweight, w2_scales, w2_qzeros, act, row_out, R,
        topk_weights, out, out.stride(0), arrivals,
        K=K, N=N, N_P=N_p, G=G, SPLITS=splits, WARPS=config.w2_warps, N_PAD=triton.next_power_of_2(N),
        SCALES_GROUPED=scales_grouped, IS_BF16=is_bf16, USE_PDL=use_pdl, TOP_K=top_k, FUSED_COMBINE=fused,
        ROW_WARPS=config.w2_row_warps, N_SPLITS=n_splits, ACT_READY=config.act_launch,
        num_warps=config.w2_warps * config.w2_row_warps, **w2_layout, **launch_options(use_pdl))
    if not fused:
        marlin_combine_kernel[(M, triton.cdiv(K, COMBINE_BLOCK))](
            row_out, topk_weights, topk_ids, E, out, out.stride(0), R, TOP_K=top_k, K=K, BLOCK_K=COMBINE_BLOCK,
            USE_PDL=use_pdl, N_SPLITS=n_splits, num_warps=2, **launch_options(use_pdl))
    return out
