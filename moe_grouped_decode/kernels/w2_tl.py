"""W2 of the grouped decode in Triton ``tl``: SiLU-and-mul, W2 on tensor cores, the fused combine.

Programs (row, column tile); warp w takes the 64 columns of packed column tile
tile * WARPS + w over all N rows (N / 32 awq_mma chunks)::

    W2[topk_ids[row]] weights of the tile -> registers     (before the PDL wait: they stream
                                                            in while W13 finishes; past
                                                            HELD_CHUNKS chunks, in the mma loop)
    wait for W13
    act = silu(gate) * up from the row's W13 partials summed in split order
          -> activations[row]  (every program of the row writes the same values), barrier,
          each lane reads back its fragment rows, rounded to 16 bits (ACT_SPLIT: a hi + lo pair)
    mma -> float32 row_outputs[row, tile]
    FUSED_COMBINE: the last of a token's k programs on the tile (an int32 arrival counter per
          (token, tile), zeroed by the W13 launch) writes
          out[t, tile] = sum_j topk_weights[t, j] * row_outputs[t * k + j, tile]  (j order;
          combine.combine_stored: a token whose sums are not finite is recomputed in float64)

A token's output depends only on its own activations, routing and weights: fixed summation
orders, and the only atomics are integer arrival counts (which program combines changes, the
j-ordered sum it computes does not). ``w2_gluon.py`` runs the same programs with the weights
staged in shared memory: the same bits as this kernel built with RN_SCALE (the scale multiply
rounded on its own, which the Gluon kernel's PTX does and this kernel's, left to ptxas, fuses).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .awq_mma import CHUNK_LOOP_UNROLL, CHUNK_ROWS, TILE_WORDS, awq_mma_chunk, chunk_columns, chunk_lanes, chunk_rows
from .awq_tiles import silu_mul
from .combine import combine_stored
from .pdl import let_next_launch_start, wait_for_previous_launch
from .timeline import W2_SM_SLOT, W2_STAMP_COUNT, now, sm_id


# row_activations' widest tile: a larger N runs in tiles of this many units (a whole row of
# thousands in registers spills, and so do tiles of 1024 beside W2's chunk loop at N = 7168)
ACT_BLOCK = tl.constexpr(512)


@triton.jit
def activations_tile(partials_ptr, act_ptr, row, rows, n0, N: tl.constexpr, SPLITS: tl.constexpr,
                     BLOCK: tl.constexpr):
    n = n0 + tl.arange(0, BLOCK)
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        part = partials_ptr + (s * rows + row) * (2 * N) + n
        gate += tl.load(part, mask=n < N, other=0.0)
        up += tl.load(part + N, mask=n < N, other=0.0)
    tl.store(act_ptr + row * N + n, silu_mul(gate, up).to(act_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def row_activations(partials_ptr, act_ptr, row, rows, N: tl.constexpr, SPLITS: tl.constexpr, N_PAD: tl.constexpr):
    """act[row] = silu(gate) * up from the W13 partials summed in split order, in float32, stored in
    act's dtype [N]."""
    if N_PAD <= ACT_BLOCK:
        activations_tile(partials_ptr, act_ptr, row, rows, 0, N, SPLITS, N_PAD)
    else:
        for n0 in range(0, N, ACT_BLOCK):
            activations_tile(partials_ptr, act_ptr, row, rows, n0, N, SPLITS, ACT_BLOCK)


@triton.jit(do_not_specialize=["rows"])
def activations_kernel(partials_ptr, act_ptr, rows, N: tl.constexpr, SPLITS: tl.constexpr, N_PAD: tl.constexpr):
    """row_activations of row ``program_id`` into 16-bit ``act`` (what W2 over the sort's groups
    reads, rounded as the W2 per row rounds its own)."""
    row_activations(partials_ptr, act_ptr, tl.program_id(0), rows, N, SPLITS, N_PAD)


# The most chunks whose weights a program holds in registers from before the PDL wait (qwen3.8's
# N = 160 is 5; at 7, under the 128-register cap, the compiler spills)
HELD_CHUNKS = tl.constexpr(6)


@triton.jit
def _chunk_weights(qweight_base, scales_base, qzeros_base, c, t, e, word, word_ok, K: tl.constexpr, G: tl.constexpr):
    """Chunk c's words, scales and zero words of the lanes' packed columns ``word``."""
    PACKED_K: tl.constexpr = K // 8
    k_rows = chunk_rows(c * CHUNK_ROWS, t, e)
    group = c * CHUNK_ROWS // G
    return (tl.load(qweight_base + k_rows * PACKED_K + word, mask=word_ok, other=0),
            tl.load(scales_base + group * K + word * 8 + e, mask=word_ok, other=0.0),
            tl.load(qzeros_base + group * PACKED_K + word, mask=word_ok, other=0))


@triton.jit
def _chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N: tl.constexpr, HALF: tl.constexpr,
               IS_BF16: tl.constexpr, ACT_SPLIT: tl.constexpr, WARPS: tl.constexpr, RN_SCALE: tl.constexpr):
    """The row's activations of chunk c times its weights, added to the sums."""
    act = tl.load(act_ptr + row * N + chunk_rows(c * CHUNK_ROWS, t, e), mask=g == 0, other=0.0)
    act_hi = act.to(HALF)
    act_lo = (act - act_hi.to(tl.float32)).to(HALF) if ACT_SPLIT else act_hi
    d_lo, d_hi = awq_mma_chunk(words, act_hi, act_lo, scales, zeros, IS_BF16, ACT_SPLIT, WARPS, RN_SCALE)
    return acc_lo + d_lo, acc_hi + d_hi


def _w2_tl(
    ids_ptr, num_experts,
    partials_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    act_ptr, row_out_ptr,
    rows,
    topk_weights_ptr, out_ptr, stride_om, arrivals_ptr,
    timeline_ptr,
    x_ptr, stride_xm, w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr, SPLITS: tl.constexpr, WARPS: tl.constexpr,
    N_PAD: tl.constexpr, TOP_K: tl.constexpr,
    IS_BF16: tl.constexpr, FUSED_COMBINE: tl.constexpr, USE_PDL: tl.constexpr,
    ACT_SPLIT: tl.constexpr, RN_SCALE: tl.constexpr, TIMELINE: tl.constexpr,
):
    """row_out[row, cols] = (silu(gate) * up)[row] @ W2[topk_ids[row]][:, cols], float32."""
    # the combine launch may start early; with the combine fused, W2 is the op's last launch and
    # whatever follows the op must not start before W2 is done
    let_next_launch_start(USE_PDL and not FUSED_COMBINE)
    row = tl.program_id(0)
    tile = tl.program_id(1)
    stamps = (row * tl.num_programs(1) + tile) * W2_STAMP_COUNT
    if TIMELINE:
        tl.store(timeline_ptr + stamps, now())
        tl.store(timeline_ptr + stamps + W2_SM_SLOT, sm_id())
    PACKED_K: tl.constexpr = K // 8
    CHUNKS: tl.constexpr = N // CHUNK_ROWS
    HALF: tl.constexpr = tl.bfloat16 if IS_BF16 else tl.float16
    expert = tl.load(ids_ptr + row)
    # an id outside [0, E): expert 0's weights are read (never out of bounds), the row's output is 0
    valid = (expert >= 0) & (expert < num_experts)
    expert = tl.where(valid, expert, 0).to(tl.int64)
    warp, g, t, e = chunk_lanes(WARPS)
    word = (tile * WARPS + warp) * TILE_WORDS + g
    word_ok = word < PACKED_K
    qweight_base = qweight_ptr + expert * (N * PACKED_K)
    scales_base = scales_ptr + expert * (N // G * K)
    qzeros_base = qzeros_ptr + expert * (N // G * PACKED_K)
    # up to HELD_CHUNKS chunks, all the tile's weights are held in registers from before the PDL
    # wait (they stream in while W13 finishes); more would spill: each chunk's are loaded in the
    # chunk loop instead
    HELD: tl.constexpr = CHUNKS <= HELD_CHUNKS
    weights = ()
    if HELD:
        for c in tl.static_range(CHUNKS):
            weights += (_chunk_weights(qweight_base, scales_base, qzeros_base, c, t, e, word, word_ok, K, G),)
    wait_for_previous_launch(USE_PDL)
    if TIMELINE:
        tl.store(timeline_ptr + stamps + 1, now())
    row_activations(partials_ptr, act_ptr, row, rows, N, SPLITS, N_PAD)
    tl.debug_barrier()  # every thread's act stores happen before any thread reads them back
    if TIMELINE:
        tl.store(timeline_ptr + stamps + 2, now())
    acc_lo = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    acc_hi = tl.zeros([32 * WARPS, 8], dtype=tl.float32)
    if HELD:
        for c in tl.static_range(CHUNKS):
            words, scales, zeros = weights[c]
            acc_lo, acc_hi = _chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N, HALF,
                                        IS_BF16, ACT_SPLIT, WARPS, RN_SCALE)
    else:
        for c in tl.range(0, CHUNKS, loop_unroll_factor=CHUNK_LOOP_UNROLL):
            words, scales, zeros = _chunk_weights(qweight_base, scales_base, qzeros_base, c, t, e, word, word_ok, K, G)
            acc_lo, acc_hi = _chunk_mma(act_ptr, row, c, words, scales, zeros, acc_lo, acc_hi, g, t, e, N, HALF,
                                        IS_BF16, ACT_SPLIT, WARPS, RN_SCALE)
    acc_lo = tl.where(valid, acc_lo, 0.0)
    acc_hi = tl.where(valid, acc_hi, 0.0)
    cols = chunk_columns(word, e)
    keep = (t == 0) & (e % 2 == 0) & word_ok
    tl.store(row_out_ptr + row * K + cols, acc_lo, mask=keep)
    tl.store(row_out_ptr + row * K + cols + 4, acc_hi, mask=keep)
    if TIMELINE:
        tl.store(timeline_ptr + stamps + 3, now())
    if FUSED_COMBINE:
        token = row // TOP_K
        tl.debug_barrier()  # every thread's row_out stores happen before the release below
        arrived = tl.atomic_add(arrivals_ptr + token * tl.num_programs(1) + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            combine_stored(row_out_ptr, topk_weights_ptr, ids_ptr, num_experts, out_ptr, stride_om, x_ptr, stride_xm,
                           w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr, qweight_ptr, scales_ptr, qzeros_ptr,
                           token, tile * (WARPS * TILE_WORDS * 8), TOP_K, K, N, G, WARPS * TILE_WORDS * 8, 32 * WARPS)
    if TIMELINE:
        tl.store(timeline_ptr + stamps + 4, now())


w2_tl_kernel = triton.jit(_w2_tl)
# the same kernel with binaries of its own, for the launches that prefer the largest carveout (carveout.py)
w2_tl_kernel_max_carveout = triton.jit(_w2_tl)
