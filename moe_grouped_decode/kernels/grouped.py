"""Compact active-expert grouped decode: W13 (+ compaction), then W2 + SiLU + combine.

Launches (no host sync; every grid is sized by the static R = M * k rows)::

    topk_ids, x ──> [W13] program 0: zero the combine counters (tl W13: and sort
                    │     rows by (expert, row) -> compaction)
                    │     programs (row, K-split, tile): W13[topk_ids[row]] tile
                    │     -> float32 partials[s, row, 2N]
                    ▼     (the Gluon W13, w13_ring.py, where it runs: same programs)
                  [W2]  programs (row, column tile): weight loads first (PDL:
                          while W13 finishes), then act = silu(gate) * up from
                          the partials summed in split order, then -> float32
                          row_outputs[row]; the last of a token's k programs on
                          a tile (int32 arrival counter) writes
                          out[t, tile] = sum_j topk_weights[t, j] * row_outputs[t*k + j]
                        with the Gluon W13: one more grid row, whose tile-0
                          program writes the compaction

1. W13: every program but 0 takes one (routed row, K-split, 64-column tile) on
   tensor cores (``awq_mma``: AutoAWQ nibbles dequantized straight into mma
   fragments, 32-row chunks, the token as column 0 of the B operand). Programs
   index experts by routed row, so they need no compaction first; rows that
   share an expert read it again from L2 (the layer's active W13 is ~36 MB at
   M = 8, under the 60 MB of an H200), not from DRAM.
   With ``w13_ring_stages`` (the default), the same programs run as a Gluon
   kernel (``w13_ring.py``) whose loads go through shared memory: same bits,
   fewer instructions; program 0 then only zeroes the counters and the W2
   launch's one extra program writes the compaction.
2. W2 (+ combine): see above; every program of a row sums the row's partials
   again (cheap in L2; fewer, longer splits as M grows keep it small), and
   64 columns per warp go through ``awq_mma`` with the float32 activations
   rounded to 16 bits (or, with ``w2_act_split``, as a 16-bit hi + lo pair).
   With ``w2_ring`` (every table entry), the same
   programs run as a Gluon kernel (``w2_ring.py``) that keeps its weights in
   shared memory instead of registers: same bits as this kernel with RN_SCALE
   (the scale multiply rounded on its own). At M = 8 its 8-warp programs' 52 KB
   of shared memory keep them off the SMs W13's programs hold (the carveout,
   docs/PERF.md), so W13 runs alone and ends earlier; the 4-warp programs of
   M = 2 and 4 (26 KB) start beside W13. It copies its weights a few chunks
   ahead of its mma, so the mma runs while the later chunks stream in. Without ``fused_combine`` the combine is a third
   launch (``combine.py``). With ``pdl`` (Hopper and newer) each launch lets the
   next one start early (programmatic dependent launch); the next one waits for
   it before reading what it wrote.

With a ``timeline`` (benchmarks/timeline.py only), every program of both launches also stamps
the GPU's clock at fixed points (kernels/timeline.py); without one, the stamps compile out.

A token's output depends only on its own activations, routing and weights:
fixed summation orders, and the only atomics are integer arrival counts (which
program combines changes, the j-ordered sum it computes does not), so outputs
are bit-identical across runs and batch positions.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl

from .awq_mma import CHUNK_ROWS, TILE_WORDS, awq_mma_chunk, chunk_columns, chunk_lanes, chunk_rows
from .. import env
from . import MIN_CUDA_CAPABILITY, cuda_capability, w13_ring, w2_ring
from .carveout import prefer_max_shared_carveout
from .awq_tiles import silu_mul
from .combine import combine_rows, combine_tile
from .configs import GroupedConfig
from .pdl import launch_options, let_next_launch_start, pdl_supported, wait_for_previous_launch
from .timeline import (W2_SM_SLOT, W2_STAMP_COUNT, W2_STAMPS, W13_SM_SLOT, W13_STAMP_COUNT, W13_STAMPS, Timeline, now,
                       sm_id)

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
    CHUNKS: tl.constexpr, WARPS: tl.constexpr, SPLITS: tl.constexpr, R_PAD: tl.constexpr,
    ARRIVALS_PAD: tl.constexpr, IS_BF16: tl.constexpr, USE_PDL: tl.constexpr,
    timeline_ptr, TIMELINE: tl.constexpr,
    # not read: the binary's launch attribute (kernels/carveout.py), so each setting has a binary of its own
    MAX_SHARED_CARVEOUT: tl.constexpr = False,
):
    """partials[s, row, cols] = x[row // k, K-split s] @ W13[topk_ids[row]][K-split s, cols].

    Program 0 writes the compaction and zeroes the W2 launch's ``num_arrivals``
    combine counters; program 1 + ((row * SPLITS) + s) * TILES + tile does the 64
    columns of ``tile`` over the WARPS * CHUNKS 32-row chunks of split s: warp w
    takes chunks w * CHUNKS .. (w + 1) * CHUNKS - 1 on tensor cores (awq_mma), then
    the warps' sums are added (one fixed reduction tree).
    """
    let_next_launch_start(USE_PDL)
    pid = tl.program_id(0)
    stamps = timeline_ptr + pid * W13_STAMP_COUNT
    if TIMELINE:
        tl.store(stamps, now())
        tl.store(stamps + W13_SM_SLOT, sm_id())
    if pid == 0:
        _compact_rows(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                      live_count_ptr, R_PAD)
        if ARRIVALS_PAD > 0:
            a = tl.arange(0, ARRIVALS_PAD)
            tl.store(arrivals_ptr + a, tl.zeros([ARRIVALS_PAD], dtype=tl.int32), mask=a < num_arrivals)
        if TIMELINE:
            tl.store(stamps + 1, now())
        return
    PACKED_N: tl.constexpr = TWO_N // 8
    TILES: tl.constexpr = PACKED_N // TILE_WORDS
    SPLIT_ROWS: tl.constexpr = WARPS * CHUNKS * CHUNK_ROWS
    work = pid - 1
    tile = work % TILES
    split = (work // TILES) % SPLITS
    row = work // (TILES * SPLITS)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    token = (row // TOP_K).to(tl.int64)
    warp, g, t, e = chunk_lanes(WARPS)
    word = tile * TILE_WORDS + g
    acc_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        k0 = split * SPLIT_ROWS + (warp * CHUNKS + c) * CHUNK_ROWS
        k_rows = chunk_rows(k0, t, e)
        chunk_ok = k0 < K
        group = k0 // G
        words = tl.load(qweight_ptr + expert * (K * PACKED_N) + k_rows * PACKED_N + word, mask=chunk_ok, other=0)
        x = tl.load(x_ptr + token * stride_xm + k_rows, mask=chunk_ok & (g == 0), other=0.0)
        scales = tl.load(scales_ptr + expert * (K // G * TWO_N) + group * TWO_N + word * 8 + e, mask=chunk_ok,
                         other=0.0)
        zeros = tl.load(qzeros_ptr + expert * (K // G * PACKED_N) + group * PACKED_N + word, mask=chunk_ok, other=0)
        d_lo, d_hi = awq_mma_chunk(words, x, x, scales, zeros, IS_BF16, False, WARPS)
        acc_lo += d_lo
        acc_hi += d_hi
    if WARPS > 1:
        acc_lo = tl.sum(tl.reshape(acc_lo, [WARPS, 32, 8]), axis=0)
        acc_hi = tl.sum(tl.reshape(acc_hi, [WARPS, 32, 8]), axis=0)
    # lanes t = 0 hold token column 0 (this row's token) in their even elements
    _, g, t, e = chunk_lanes(1)
    cols = chunk_columns(tile * TILE_WORDS + g, e)
    keep = (t == 0) & (e % 2 == 0)
    out_base = partials_ptr + (split * rows + row) * TWO_N
    tl.store(out_base + cols, acc_lo, mask=keep)
    tl.store(out_base + cols + 4, acc_hi, mask=keep)
    if TIMELINE:
        tl.store(stamps + 1, now())


@triton.jit
def _row_activations(partials_ptr, act_ptr, row, rows, N: tl.constexpr, SPLITS: tl.constexpr, N_PAD: tl.constexpr):
    """act[row] = silu(gate) * up from the W13 partials summed in split order, float32 [N]."""
    n = tl.arange(0, N_PAD)
    gate = tl.zeros([N_PAD], dtype=tl.float32)
    up = tl.zeros([N_PAD], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        part = partials_ptr + (s * rows + row) * (2 * N) + n
        gate += tl.load(part, mask=n < N, other=0.0)
        up += tl.load(part + N, mask=n < N, other=0.0)
    tl.store(act_ptr + row * N + n, silu_mul(gate, up), mask=n < N)


@triton.jit
def _w2_rows_kernel(
    ids_ptr,
    partials_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    act_ptr, row_out_ptr,
    rows,
    topk_weights_ptr, out_ptr, stride_om, arrivals_ptr,
    sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr, live_count_ptr,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr, WARPS: tl.constexpr,
    N_PAD: tl.constexpr, TOP_K: tl.constexpr,
    IS_BF16: tl.constexpr, FUSED_COMBINE: tl.constexpr, USE_PDL: tl.constexpr,
    COMPACT: tl.constexpr, R_PAD: tl.constexpr,
    timeline_ptr, TIMELINE: tl.constexpr, RN_SCALE: tl.constexpr = False, ACT_SPLIT: tl.constexpr = False,
    # not read: the binary's launch attribute (kernels/carveout.py), so each setting has a binary of its own
    MAX_SHARED_CARVEOUT: tl.constexpr = False,
):
    """row_out[row, cols] = (silu(gate) * up)[row] @ W2[topk_ids[row]][:, cols], float32.

    Program (row, tile): warp w takes the 64 columns of packed column tile
    tile * WARPS + w over all N rows (N / 32 chunks on tensor cores). Every weight
    load issues before the wait for the W13 launch, so a program's weight bytes
    are in flight while W13 finishes. Then the row's activations, from the W13
    partials summed in split order (every program of the row computes the same
    values and writes them to ``act`` [row, N]; a barrier, then each lane reads
    back its fragment rows), rounded to 16 bits, one mma per chunk (ACT_SPLIT: split into a
    16-bit hi + lo pair, two mma). With
    FUSED_COMBINE, the last of a token's k programs on a column tile to arrive (an
    int32 counter per (token, tile), zeroed by the W13 launch) sums the token's k
    row outputs of that tile in j order into ``out``. RN_SCALE: the scale multiply as mul.rn, the
    Gluon W2's (w2_ring.py) bits, for the test that compares the two. With COMPACT (the Gluon W13, which
    cannot sort, ran before), the grid has one more row, whose tile-0 program writes the
    compaction (nothing in the op reads it; it depends only on topk_ids).
    """
    # the combine launch may start early; with the combine fused, W2 is the op's last launch and
    # whatever follows the op must not start before W2 is done
    let_next_launch_start(USE_PDL and not FUSED_COMBINE)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    stamps = timeline_ptr + (row * tl.num_programs(1) + tile) * W2_STAMP_COUNT
    if TIMELINE:
        tl.store(stamps, now())
        tl.store(stamps + W2_SM_SLOT, sm_id())
    if COMPACT:
        if row == rows:
            if tile == 0:
                _compact_rows(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr,
                              segment_offsets_ptr, live_count_ptr, R_PAD)
            if TIMELINE:
                tl.store(stamps + 4, now())
            return
    PACKED_K: tl.constexpr = K // 8
    CHUNKS: tl.constexpr = N // CHUNK_ROWS
    HALF: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    expert = tl.load(ids_ptr + row).to(tl.int64)
    warp, g, t, e = chunk_lanes(WARPS)
    word = (tile * WARPS + warp) * TILE_WORDS + g
    word_ok = word < PACKED_K
    qweight_base = qweight_ptr + expert * (N * PACKED_K)
    scales_base = scales_ptr + expert * (N // G * K)
    qzeros_base = qzeros_ptr + expert * (N // G * PACKED_K)
    weights = ()
    for c in tl.static_range(CHUNKS):
        k_rows = chunk_rows(c * CHUNK_ROWS, t, e)
        group = c * CHUNK_ROWS // G
        weights += ((
            tl.load(qweight_base + k_rows * PACKED_K + word, mask=word_ok, other=0),
            tl.load(scales_base + group * K + word * 8 + e, mask=word_ok, other=0.0),
            tl.load(qzeros_base + group * PACKED_K + word, mask=word_ok, other=0),
        ),)
    wait_for_previous_launch(USE_PDL)
    if TIMELINE:
        tl.store(stamps + 1, now())
    _row_activations(partials_ptr, act_ptr, row, rows, N, SPLITS, N_PAD)
    tl.debug_barrier()  # every thread's act stores happen before any thread reads them back
    if TIMELINE:
        tl.store(stamps + 2, now())
    acc_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    for c in tl.static_range(CHUNKS):
        act = tl.load(act_ptr + row * N + chunk_rows(c * CHUNK_ROWS, t, e), mask=g == 0, other=0.0)
        act_hi = act.to(HALF)
        act_lo = (act - act_hi.to(tl.float32)).to(HALF) if ACT_SPLIT else act_hi
        words, scales, zeros = weights[c]
        d_lo, d_hi = awq_mma_chunk(words, act_hi, act_lo, scales, zeros, IS_BF16, ACT_SPLIT, WARPS, RN_SCALE)
        acc_lo += d_lo
        acc_hi += d_hi
    cols = chunk_columns(word, e)
    keep = (t == 0) & (e % 2 == 0) & word_ok
    tl.store(row_out_ptr + row * K + cols, acc_lo, mask=keep)
    tl.store(row_out_ptr + row * K + cols + 4, acc_hi, mask=keep)
    if TIMELINE:
        tl.store(stamps + 3, now())
    if FUSED_COMBINE:
        token = row // TOP_K
        tl.debug_barrier()  # every thread's row_out stores happen before the release below
        arrived = tl.atomic_add(arrivals_ptr + token * tl.num_programs(1) + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            tile_cols = tile * (WARPS * TILE_WORDS * 8) + tl.arange(0, WARPS * TILE_WORDS * 8)
            combine_tile(row_out_ptr, topk_weights_ptr, out_ptr, stride_om, token, tile_cols, tile_cols < K, TOP_K, K)
    if TIMELINE:
        tl.store(stamps + 4, now())


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _check_device(device: torch.device) -> Tuple[int, int]:
    """The tensor-core kernels need MIN_CUDA_CAPABILITY; returns the device's capability."""
    capability = cuda_capability(device)
    if capability != (0, 0) and capability < MIN_CUDA_CAPABILITY:
        raise RuntimeError(f"grouped_decode: the kernels need compute capability {MIN_CUDA_CAPABILITY[0]}."
                           f"{MIN_CUDA_CAPABILITY[1]} or newer (tensor-core mma.sync); {device} is "
                           f"{capability[0]}.{capability[1]}")
    return capability


STAGES = ("w13", "w2", "combine")


def launched_stages(config: GroupedConfig) -> Tuple[str, ...]:
    """The stages that are launches of their own under ``config``."""
    return STAGES if not config.fused_combine else ("w13", "w2")


def ring_available(capability: Tuple[int, int]) -> bool:
    """Whether the Gluon W13 (w13_ring.py) runs: Gluon present, compiling for a GPU of
    ``capability`` (not under the interpreter, capability (0, 0)), and not switched off
    (VLLM_AWQ_MOE_GROUPED_DECODE_GLUON=0). Every launch path asks this, through uses_w13_ring."""
    return w13_ring.AVAILABLE and capability != (0, 0) and env.gluon_w13_enabled()


def uses_w13_ring(config: GroupedConfig, capability: Tuple[int, int]) -> bool:
    """Whether W13 runs as the Gluon ring kernel: asked for by the config (a ring depth,
    1-warp programs) and available. Otherwise the tl kernel runs; at the same split both
    give the same bits."""
    return config.w13_ring_stages > 0 and config.w13_warps == 1 and ring_available(capability)


def uses_w2_ring(config: GroupedConfig, capability: Tuple[int, int], hidden_size: int) -> bool:
    """Whether W2 runs as the Gluon kernel (w2_ring.py): asked for by the config, Gluon running
    (ring_available: the same conditions and switch as the Gluon W13), the fused combine, and
    every warp's 64 columns inside K. Otherwise the tl W2 runs."""
    return (config.w2_ring and config.fused_combine and w2_ring.AVAILABLE and ring_available(capability)
            and (hidden_size // 8) % (TILE_WORDS.value * config.w2_warps) == 0)


def compact(topk_ids, sorted_rows, sorted_experts, active_experts, segment_offsets, live_count) -> None:
    """Launch the compaction alone (one program) over topk_ids' M*k rows; the grouped
    op does it inside its W13 launch (its W2 launch with the ring W13), the benchmark's
    read floor uses this."""
    rows = topk_ids.numel()
    _compact_kernel[(1,)](
        topk_ids, rows, sorted_rows, sorted_experts, active_experts, segment_offsets, live_count,
        R_PAD=max(16, _next_pow2(rows)), num_warps=4,
    )


def _grids(rows: int, K: int, N: int, config: GroupedConfig, ring: bool) -> Tuple[int, Tuple[int, int]]:
    """Programs of the W13 launch and the W2 launch's (rows, column tiles) grid."""
    w13_programs = 1 + rows * config.w13_splits(K) * (2 * N // 8 // TILE_WORDS.value)
    return w13_programs, (rows + int(ring), triton.cdiv(K, config.w2_block_k))


def alloc_timeline(num_tokens: int, top_k: int, hidden_size: int, intermediate_size: int, config: GroupedConfig,
                   device: torch.device) -> Timeline:
    """Stamp buffers (kernels/timeline.py) for one grouped call of ``num_tokens`` tokens under the
    fitted ``config``, filled with -1 (a program that never stamps leaves it: no time and no SM)."""
    w13_programs, w2_grid = _grids(num_tokens * top_k, hidden_size, intermediate_size, config,
                                   uses_w13_ring(config, cuda_capability(device)))
    return Timeline(torch.full((w13_programs, len(W13_STAMPS)), -1, dtype=torch.int64, device=device),
                    torch.full((*w2_grid, len(W2_STAMPS)), -1, dtype=torch.int64, device=device))


def grouped_decode(
    hidden_states, topk_weights, topk_ids,
    w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size: int,
    scratch, out, config: GroupedConfig, stages: Tuple[str, ...] = STAGES, timeline: Optional[Timeline] = None,
) -> list:
    """Launch the grouped decode into ``out`` [M, K]; return what the W13 and W2 launches returned
    (their compiled kernels on a GPU).

    ``scratch`` holds the workspace regions as attributes (``ops.workspace_views``):
    int32 ``sorted_rows``, ``sorted_experts`` (compaction scratch), ``active_experts``,
    ``segment_offsets``, ``live_count``, ``combine_arrivals`` (>= M * ceil(K / w2_block_k));
    float32 ``gate_up_partials`` (>= config.w13_splits(K) * M * k * 2N, flat), ``activations``
    [M * k, N] and ``row_outputs`` [M * k, K]. ``config`` must be ``fitted`` to the shape;
    topk_ids and topk_weights contiguous [M, k]. The tensor-core tiles need G and N in
    whole 32-row chunks (AWQ's group sizes 32, 64 and 128 are).
    ``stages`` launches a subset, for the benchmark's per-kernel breakdown only; ``timeline``
    (``alloc_timeline``, on a GPU) receives per-program timestamps, for benchmarks/timeline.py only.
    """
    M, K = hidden_states.shape
    top_k = topk_ids.shape[1]
    N = w2_qweight.shape[1]
    G = group_size
    if G % CHUNK_ROWS.value or N % CHUNK_ROWS.value:
        raise ValueError(f"grouped_decode: group size {G} and intermediate size {N} must be multiples of "
                         f"{CHUNK_ROWS.value} (the tensor-core chunk)")
    if config.w13_block_k != config.w13_chunks * CHUNK_ROWS.value * config.w13_warps:
        raise ValueError(f"grouped_decode: {config} is not fitted (GroupedConfig.fitted)")
    if config.w2_copy_ahead < 1:  # the range the Gluon W2 was measured and tested with
        raise ValueError(f"grouped_decode: w2_copy_ahead (the Gluon W2's weight chunks copied ahead of its mma) "
                         f"must be at least 1, got {config.w2_copy_ahead}")
    capability = _check_device(hidden_states.device)
    rows = M * top_k
    splits = config.w13_splits(K)
    ring = uses_w13_ring(config, capability)
    w13_programs, w2_grid = _grids(rows, K, N, config, ring)
    use_pdl = config.pdl and pdl_supported(hidden_states.device)
    is_bf16 = hidden_states.dtype == torch.bfloat16
    num_arrivals = M * w2_grid[1] if config.fused_combine else 0
    if num_arrivals > scratch.combine_arrivals.numel():
        raise ValueError(f"grouped_decode: {num_arrivals} combine counters needed, the workspace holds "
                         f"{scratch.combine_arrivals.numel()}")
    if timeline is not None:
        if capability == (0, 0):
            raise ValueError("grouped_decode: the timeline reads the GPU's clock (inline PTX); it needs a GPU")
        if timeline.w13.shape != (w13_programs, len(W13_STAMPS)) or timeline.w2.shape != (*w2_grid, len(W2_STAMPS)):
            raise ValueError("grouped_decode: the timeline is not sized for this call and config (alloc_timeline)")
        for stamps in (timeline.w13, timeline.w2):
            if stamps.dtype != torch.int64 or not stamps.is_contiguous() or stamps.device != hidden_states.device:
                raise ValueError(f"grouped_decode: timeline stamps must be contiguous int64 on {hidden_states.device}, "
                                 f"got {stamps.dtype} on {stamps.device} (alloc_timeline)")
    # without a timeline the kernels compile the stamps out; any pointer fills the argument
    w13_stamps = timeline.w13 if timeline is not None else scratch.live_count
    w2_stamps = timeline.w2 if timeline is not None else scratch.live_count
    launched = []
    if "w13" in stages and ring:
        launched.append(w13_ring.w13_ring_kernel[(w13_programs,)](
            hidden_states, hidden_states.stride(0), topk_ids, w13_qweight, w13_scales, w13_qzeros,
            scratch.gate_up_partials, rows, scratch.combine_arrivals, num_arrivals, w13_stamps,
            TOP_K=top_k, K=K, TWO_N=2 * N, G=G, CHUNKS=config.w13_chunks, CHUNKS_PAD=_next_pow2(config.w13_chunks),
            SPLITS=splits, STAGES=config.w13_ring_stages,
            ARRIVALS_PAD=_next_pow2(num_arrivals) if num_arrivals else 0, IS_BF16=is_bf16, USE_PDL=use_pdl,
            TIMELINE=timeline is not None, MAX_SHARED_CARVEOUT=config.max_shared_carveout, num_warps=1,
        ))
    elif "w13" in stages:
        launched.append(_w13_kernel[(w13_programs,)](
            hidden_states, hidden_states.stride(0),
            topk_ids,
            w13_qweight, w13_scales, w13_qzeros,
            scratch.gate_up_partials,
            rows,
            scratch.sorted_rows, scratch.sorted_experts, scratch.active_experts, scratch.segment_offsets,
            scratch.live_count, scratch.combine_arrivals, num_arrivals,
            TOP_K=top_k, K=K, TWO_N=2 * N, G=G,
            CHUNKS=config.w13_chunks, WARPS=config.w13_warps, SPLITS=splits, R_PAD=max(16, _next_pow2(rows)),
            ARRIVALS_PAD=_next_pow2(num_arrivals) if num_arrivals else 0, IS_BF16=is_bf16, USE_PDL=use_pdl,
            timeline_ptr=w13_stamps, TIMELINE=timeline is not None, MAX_SHARED_CARVEOUT=config.max_shared_carveout,
            num_warps=config.w13_warps,
        ))
    if "w2" in stages and uses_w2_ring(config, capability, K):
        launched.append(w2_ring.w2_ring_kernel[w2_grid](
            topk_ids, scratch.gate_up_partials, w2_qweight, w2_scales, w2_qzeros, scratch.row_outputs, rows,
            topk_weights, out, out.stride(0), scratch.combine_arrivals,
            scratch.sorted_rows, scratch.sorted_experts, scratch.active_experts, scratch.segment_offsets,
            scratch.live_count, w2_stamps,
            K=K, N=N, G=G, SPLITS=splits, WARPS=config.w2_warps, CHUNKS_PAD=_next_pow2(N // CHUNK_ROWS.value),
            AHEAD=min(config.w2_copy_ahead, N // CHUNK_ROWS.value), ACT_SPLIT=config.w2_act_split,
            TOP_K=top_k, IS_BF16=is_bf16, USE_PDL=use_pdl, COMPACT=ring, R_PAD=max(16, _next_pow2(rows)),
            TIMELINE=timeline is not None, MAX_SHARED_CARVEOUT=config.max_shared_carveout, num_warps=config.w2_warps,
            **launch_options(use_pdl),
            **config.w2_compile_options(capability),
        ))
    elif "w2" in stages:
        launched.append(_w2_rows_kernel[w2_grid](
            topk_ids,
            scratch.gate_up_partials,
            w2_qweight, w2_scales, w2_qzeros,
            scratch.activations, scratch.row_outputs,
            rows,
            topk_weights, out, out.stride(0), scratch.combine_arrivals,
            scratch.sorted_rows, scratch.sorted_experts, scratch.active_experts, scratch.segment_offsets,
            scratch.live_count,
            K=K, N=N, G=G, SPLITS=splits, WARPS=config.w2_warps, N_PAD=_next_pow2(N), TOP_K=top_k,
            IS_BF16=is_bf16, FUSED_COMBINE=config.fused_combine, USE_PDL=use_pdl,
            COMPACT=ring, R_PAD=max(16, _next_pow2(rows)), timeline_ptr=w2_stamps, TIMELINE=timeline is not None,
            MAX_SHARED_CARVEOUT=config.max_shared_carveout, ACT_SPLIT=config.w2_act_split, num_warps=config.w2_warps,
            **launch_options(use_pdl),
            **config.w2_compile_options(capability),
        ))
    if not config.fused_combine and "combine" in stages:
        combine_rows(scratch.row_outputs, topk_weights, out, use_pdl)
    if config.max_shared_carveout and capability != (0, 0):  # the interpreter runs no CUfunction
        for kernel in launched:
            prefer_max_shared_carveout(kernel)
    return launched
