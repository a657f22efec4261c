"""Does the shape of W13's reads cost read rate, with no arithmetic at all? (CUDA only)

W13's programs read a 64-column tile: 32 bytes of each 160-byte weight row, so every row is
one 32-byte sector in a 128-byte line of its own (Nsight Compute: 1.1 sectors
per L2 request). The read floor's programs read contiguous blocks (4 sectors per
request). This reads exactly the same bytes (the packed W13 of 80 experts drawn from 512 by
default, ``--active``; cold in L2) in several shapes and prints the achieved TB/s of each::

    tile         program (expert slot, K-split, tile), 1 warp: 32 bytes of each of its rows (W13's)
    contig       the same programs, each reading its 16 KB as one contiguous range (the floor's)
    5 tiles      one (expert slot, K-split) per 8-warp CTA, lanes over (2 rows, 8 tiles of which 5
                 load, 2 lanes per tile): whole rows, two rows 4 apart per warp instruction (the
                 Gluon W13 ring's shared-row order)
    8 programs   8 consecutive W13 programs per 8-warp CTA
    padded rows  whole rows as [rows, 64 words] masked to 40: two adjacent rows per instruction
    flat rows    whole rows as flat ranges: 512 contiguous bytes per instruction (4-warp programs
                 of 32 or 128 rows; 1-warp programs of 128 or 64 rows in 32-row steps: a W13 whose
                 programs take all 5 tiles of a short split)

Then W2's bytes of the same experts, as the op's 4-warp `tl` W2 programs (64 columns per warp)
load them, each lane its own fragment words (4
bytes per lane, awq_mma's rows 16 (e // 4) + 4 t + e % 4), and the same bytes as plain rows (16
bytes per lane, 128 per row).

"us per call" is a CUDA graph's time over its calls, so it includes the gap between two kernels
of a graph; the first row of each table, a launch of empty 1-warp programs on the first shape's
grid, measures that gap. Every shape must read every word of the first expert set exactly once:
the XOR and the wrapping sum of its programs' checksums are checked against those of the words
before it is timed.

``PYTHONPATH=. python benchmarks/request_width.py [--reps 20] [--active 80]``.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import triton
import triton.language as tl

from moe_grouped_decode.kernels.awq_mma import chunk_lanes, chunk_rows
from moe_grouped_decode.benchmarking.replay import graph_replay_us

EXPERTS, K, WORDS = 512, 2560, 40  # qwen3.8-tp4 W13: [E, K, 2N / 8] int32
TILES = WORDS // 8  # 64-column tiles per row
W2_N, W2_WORDS = 160, K // 8  # W2: [E, N, K / 8] int32


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _add(a, b):  # int32, wrapping (tl.sum widens under the interpreter)
    return a + b


@triton.jit
def _fold(xors, sums, words):
    """One load's words into a program's checksums (see _sink)."""
    return xors ^ words, sums + words


@triton.jit
def _sink(sink_ptr, pid, xors, sums):
    """Program pid's checksums: the XOR and the wrapping int32 sum of every word it read."""
    tl.store(sink_ptr + 2 * pid, tl.reduce(xors, None, _xor))
    tl.store(sink_ptr + 2 * pid + 1, tl.reduce(sums, None, _add))


@triton.jit
def _no_reads(sink_ptr):
    """The launch-gap baseline: a program that reads nothing."""
    pass


@triton.jit
def _tile_or_contig(w_ptr, experts_ptr, sink_ptr, K: tl.constexpr, WORDS: tl.constexpr, SPLIT_ROWS: tl.constexpr,
                    STEP_ROWS: tl.constexpr, CONTIG: tl.constexpr):
    """W13's programs (expert slot, SPLIT_ROWS-row split, 64-column tile), 1 warp, in steps of
    STEP_ROWS rows: their tile's 32 bytes of each row, or (CONTIG) as many contiguous bytes."""
    pid = tl.program_id(0)
    TILES: tl.constexpr = WORDS // 8
    SPLITS: tl.constexpr = K // SPLIT_ROWS
    tile = pid % TILES
    split = (pid // TILES) % SPLITS
    expert = tl.load(experts_ptr + pid // (TILES * SPLITS)).to(tl.int64)
    base = w_ptr + expert * (K * WORDS)
    r = tl.arange(0, STEP_ROWS)[:, None]
    w = tl.arange(0, 8)[None, :]
    xors = tl.zeros([STEP_ROWS, 8], dtype=tl.int32)
    sums = tl.zeros([STEP_ROWS, 8], dtype=tl.int32)
    for step in tl.static_range(SPLIT_ROWS // STEP_ROWS):
        if CONTIG:  # block (split, tile) of the expert's words, row-major inside it
            idx = (split * TILES + tile) * (SPLIT_ROWS * 8) + (step * STEP_ROWS + r) * 8 + w
        else:
            idx = (split * SPLIT_ROWS + step * STEP_ROWS + r) * WORDS + tile * 8 + w
        xors, sums = _fold(xors, sums, tl.load(base + idx))
    _sink(sink_ptr, pid, xors, sums)


@triton.jit
def _cta_items(w_ptr, experts_ptr, sink_ptr, K: tl.constexpr, WORDS: tl.constexpr, SPLIT_ROWS: tl.constexpr,
               ITEMS: tl.constexpr, SAME_SPLIT: tl.constexpr, SLOTS: tl.constexpr, STEP_ROWS: tl.constexpr):
    """One CTA reads the 32-byte tiles of ITEMS W13 programs, STEP_ROWS rows per step, lanes along
    (item, word) first: with SAME_SPLIT the CTA is one (expert slot, split) and its items are the 5
    tiles (padded to ITEMS, the rest masked); otherwise items ITEMS * pid .. of the W13 grid's
    (row, split, tile) order."""
    pid = tl.program_id(0)
    TILES: tl.constexpr = WORDS // 8
    SPLITS: tl.constexpr = K // SPLIT_ROWS
    item = tl.arange(0, ITEMS)[None, :, None]
    if SAME_SPLIT:
        work = pid * TILES + item
        ok = item < TILES
    else:
        work = pid * ITEMS + item
        ok = work < SLOTS * SPLITS * TILES
    tile = work % TILES
    split = (work // TILES) % SPLITS
    expert = tl.load(experts_ptr + work // (TILES * SPLITS), mask=ok, other=0).to(tl.int64)
    q = tl.arange(0, STEP_ROWS)[:, None, None]
    row = (q & ~31) | (q & 16) | ((q & 3) << 2) | ((q >> 2) & 3)  # the Gluon ring's shared-row order
    w = tl.arange(0, 8)[None, None, :]
    base = w_ptr + expert * (K * WORDS) + tile * 8 + w
    xors = tl.zeros([STEP_ROWS, ITEMS, 8], dtype=tl.int32)
    sums = tl.zeros([STEP_ROWS, ITEMS, 8], dtype=tl.int32)
    for step in tl.static_range(SPLIT_ROWS // STEP_ROWS):
        rows = split * SPLIT_ROWS + step * STEP_ROWS + row
        xors, sums = _fold(xors, sums, tl.load(base + rows * WORDS, mask=ok, other=0))
    _sink(sink_ptr, pid, xors, sums)


@triton.jit
def _padded_rows(w_ptr, experts_ptr, sink_ptr, K: tl.constexpr, WORDS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
                 STEP_ROWS: tl.constexpr):
    """Whole rows as a [rows, 64] block masked to the row's 40 words: a warp instruction covers two
    adjacent rows (16 lanes each, 10 of them loading)."""
    pid = tl.program_id(0)
    BLOCKS: tl.constexpr = K // BLOCK_ROWS
    expert = tl.load(experts_ptr + pid // BLOCKS).to(tl.int64)
    r = tl.arange(0, STEP_ROWS)[:, None]
    w = tl.arange(0, 64)[None, :]
    base = w_ptr + expert * (K * WORDS) + (pid % BLOCKS) * (BLOCK_ROWS * WORDS) + w
    xors = tl.zeros([STEP_ROWS, 64], dtype=tl.int32)
    sums = tl.zeros([STEP_ROWS, 64], dtype=tl.int32)
    for step in tl.static_range(BLOCK_ROWS // STEP_ROWS):
        xors, sums = _fold(xors, sums, tl.load(base + (step * STEP_ROWS + r) * WORDS, mask=w < WORDS, other=0))
    _sink(sink_ptr, pid, xors, sums)


@triton.jit
def _flat_rows(w_ptr, experts_ptr, sink_ptr, K: tl.constexpr, WORDS: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               STEP_ROWS: tl.constexpr, STEP_PAD: tl.constexpr):
    """Whole rows as flat ranges: BLOCK_ROWS per program in steps of STEP_ROWS rows (STEP_PAD >= the
    step's words), 512 contiguous bytes per warp instruction."""
    pid = tl.program_id(0)
    BLOCKS: tl.constexpr = K // BLOCK_ROWS
    expert = tl.load(experts_ptr + pid // BLOCKS).to(tl.int64)
    STEP: tl.constexpr = STEP_ROWS * WORDS
    i = tl.arange(0, STEP_PAD)
    base = w_ptr + expert * (K * WORDS) + (pid % BLOCKS) * (BLOCK_ROWS * WORDS) + i
    xors = tl.zeros([STEP_PAD], dtype=tl.int32)
    sums = tl.zeros([STEP_PAD], dtype=tl.int32)
    for step in tl.static_range(BLOCK_ROWS // STEP_ROWS):
        xors, sums = _fold(xors, sums, tl.load(base + step * STEP, mask=i < STEP, other=0))
    _sink(sink_ptr, pid, xors, sums)


@triton.jit
def _w2_tiles(w_ptr, experts_ptr, sink_ptr, N: tl.constexpr, PACKED_K: tl.constexpr, WARPS: tl.constexpr,
              FRAGMENTS: tl.constexpr):
    """W2 program (row slot, tile of WARPS x 64 columns): its 128 bytes of each of the N rows, either
    as the op's W2 loads them (each lane its fragment words, awq_mma's layout) or as plain rows."""
    pid = tl.program_id(0)
    TILES: tl.constexpr = PACKED_K // (8 * WARPS)
    tile = pid % TILES
    base = w_ptr + tl.load(experts_ptr + pid // TILES).to(tl.int64) * (N * PACKED_K)
    if FRAGMENTS:
        warp, g, t, e = chunk_lanes(WARPS)
        word = (tile * WARPS + warp) * 8 + g
        xors = tl.zeros([32 * WARPS, 8], dtype=tl.int32)
        sums = tl.zeros([32 * WARPS, 8], dtype=tl.int32)
        for c in tl.static_range(N // 32):
            xors, sums = _fold(xors, sums, tl.load(base + chunk_rows(c * 32, t, e) * PACKED_K + word))
    else:
        r = tl.arange(0, 32)[:, None]
        w = tile * (8 * WARPS) + tl.arange(0, 8 * WARPS)[None, :]
        xors = tl.zeros([32, 8 * WARPS], dtype=tl.int32)
        sums = tl.zeros([32, 8 * WARPS], dtype=tl.int32)
        for c in tl.static_range(N // 32):
            xors, sums = _fold(xors, sums, tl.load(base + (c * 32 + r) * PACKED_K + w))
    _sink(sink_ptr, pid, xors, sums)


CALLS_PER_SET = 5  # each expert set is read this many times per graph: 30+ calls, cold in L2 every time
_MARKER = 0x5A5A5A5A  # what a sink holds before the check launch


def _time_shapes(title: str, weights, expert_sets, sink, shapes, reps: int) -> None:
    """Check that every shape reads each word of the first expert set exactly once (XOR and
    wrapping sum of its programs' sinks; no sink past its programs written), then time them all,
    after a launch that reads nothing (the gap between two kernels of a graph)."""
    nbytes = expert_sets[0].numel() * weights[0].numel() * 4
    calls = CALLS_PER_SET * len(expert_sets)
    print(f"\n{title}: {nbytes / 1e6:.1f} MB per call; a CUDA graph of {calls} calls over {len(expert_sets)} "
          f"disjoint expert sets, median of {reps} replays")
    words = weights[expert_sets[0].long()].cpu().numpy().ravel()
    expected = (np.bitwise_xor.reduce(words), int(words.astype(np.int64).sum()) % 2**32)
    print("| shape | us per call | TB/s |\n| --- | --- | --- |")
    programs = next(iter(shapes.values()))[0]  # the first shape's grid
    gap = graph_replay_us(lambda i: _no_reads[(programs,)](sink, num_warps=1), calls, reps)
    print(f"| no reads ({programs} 1-warp programs) | {gap:.2f} | |", flush=True)
    for name, (programs, launch) in shapes.items():
        sink.fill_(_MARKER)
        launch(expert_sets[0])
        sinks = sink.cpu().numpy()
        read = (np.bitwise_xor.reduce(sinks[0:2 * programs:2]),
                int(sinks[1:2 * programs:2].astype(np.int64).sum()) % 2**32)
        if read != expected or (sinks[2 * programs:] != _MARKER).any():
            raise SystemExit(f"{name}: the programs did not read every word exactly once")
        us = graph_replay_us(lambda i, launch=launch: launch(expert_sets[i % len(expert_sets)]), calls, reps)
        print(f"| {name} | {us:.2f} | {nbytes / us / 1e6:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--active", type=int, default=80, help="experts per call (M = 8 routes ~75-80, M = 2 ~20)")
    args = parser.parse_args()
    active = args.active
    if not 1 <= active <= EXPERTS // 2:
        parser.error(f"--active must be 1..{EXPERTS // 2} (at least two disjoint expert sets)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = torch.randint(-2**31, 2**31 - 1, (EXPERTS, K, WORDS), dtype=torch.int32, device="cuda", generator=gen)
    # disjoint expert sets, one per call in turn: the sets (~200 MB of W13, ~100 MB of W2) overflow the
    # 60 MB L2, so every call finds its experts cold, as the bench's 32 layers do
    order = torch.randperm(EXPERTS, device="cuda", generator=gen).to(torch.int32)
    expert_sets = [order[i * active:(i + 1) * active] for i in range(EXPERTS // active)]
    sink = torch.empty(2 * active * K, dtype=torch.int32, device="cuda")  # 2 checksums per program

    def tile_or_contig(split_rows, step_rows, contig):
        programs = active * (K // split_rows) * TILES
        return programs, lambda ids: _tile_or_contig[(programs,)](
            weights, ids, sink, K, WORDS, split_rows, step_rows, CONTIG=contig, num_warps=1)

    def cta_items(split_rows, step_rows, same_split):
        ctas = active * (K // split_rows) if same_split else triton.cdiv(active * (K // split_rows) * TILES, 8)
        return ctas, lambda ids: _cta_items[(ctas,)](
            weights, ids, sink, K, WORDS, split_rows, 8, SAME_SPLIT=same_split, SLOTS=active, STEP_ROWS=step_rows,
            num_warps=8)

    def padded_rows(block_rows, step_rows, warps):
        programs = active * K // block_rows
        return programs, lambda ids: _padded_rows[(programs,)](
            weights, ids, sink, K, WORDS, block_rows, step_rows, num_warps=warps)

    def flat_rows(block_rows, step_rows, warps):
        programs = active * K // block_rows
        return programs, lambda ids: _flat_rows[(programs,)](
            weights, ids, sink, K, WORDS, block_rows, step_rows, triton.next_power_of_2(step_rows * WORDS),
            num_warps=warps)

    shapes = {
        "tile (W13's): 1-warp programs of 512 rows, 4 steps": tile_or_contig(512, 128, False),
        "tile: 1-warp programs of 256 rows, 2 steps": tile_or_contig(256, 128, False),
        "tile: 1-warp programs of 128 rows, 1 step": tile_or_contig(128, 128, False),
        "contig (the floor's): 1-warp programs of 16 KB, 4 steps": tile_or_contig(512, 128, True),
        "5 tiles per 8-warp CTA: 512 rows, 16 steps": cta_items(512, 32, True),
        "5 tiles per 8-warp CTA: 128 rows, 1 step": cta_items(128, 128, True),
        "8 programs per 8-warp CTA: 512 rows, 16 steps": cta_items(512, 32, False),
        "padded rows: 512 per 8-warp program, 16 steps": padded_rows(512, 32, 8),
        "padded rows: 512 per 4-warp program, 16 steps": padded_rows(512, 32, 4),
        "padded rows: 32 per 4-warp program, 1 step": padded_rows(32, 32, 4),
        "flat rows: 32 per 4-warp program": flat_rows(32, 32, 4),
        "flat rows: 128 per 4-warp program": flat_rows(128, 128, 4),
        "flat rows: 128 per 1-warp program, 4 steps": flat_rows(128, 32, 1),
        "flat rows: 64 per 1-warp program, 2 steps": flat_rows(64, 32, 1),
    }
    _time_shapes(f"W13 (packed words of {active} experts)", weights, expert_sets, sink, shapes, args.reps)

    w2 = torch.randint(-2**31, 2**31 - 1, (EXPERTS, W2_N, W2_WORDS), dtype=torch.int32, device="cuda", generator=gen)
    w2_programs = active * W2_WORDS // 32

    def w2_tiles(fragments):
        return w2_programs, lambda ids: _w2_tiles[(w2_programs,)](
            w2, ids, sink, W2_N, W2_WORDS, 4, FRAGMENTS=fragments, num_warps=4)

    w2_shapes = {"fragments (the op's W2 loads)": w2_tiles(True),
                 "rows (the same bytes, 4 rows of 128 per instruction)": w2_tiles(False)}
    _time_shapes(f"W2 (packed words of {active} experts; 4-warp programs of 64 columns per warp, the op's W2 "
                 "at M = 4 and 8)", w2, expert_sets, sink, w2_shapes, args.reps)


if __name__ == "__main__":
    main()
