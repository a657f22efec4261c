"""The prefill route's on-device sort: routed rows grouped by expert into groups of at most T rows.

Four launches, fixed grids sized by R = M * k (no host sync), deterministic (a row's place
is its expert's offset + the rows of that expert in earlier blocks + its rank in its block)::

    [ranks]    program per block of BLOCK_ROWS rows: each row's rank among the earlier rows of
               its block with the same expert; the block's histogram -> block_counts[b, :]
    [prefix]   program per EXPERT_BLOCK experts: block_counts[:, e] -> exclusive prefix over
               blocks (in place, PREFIX_CHUNK blocks a step); expert_totals[e]
    [groups]   one program: expert_offsets = exclusive cumsum of the totals; each expert's
               cdiv(total, T) groups numbered in expert order; per group its expert, first
               sorted position and row count; num_groups
    [scatter]  program per block: sorted_rows[expert_offsets[e] + block_counts[b, e] + rank] = row

A routed id outside [0, E) is no row of any expert: it is left out of every group (the
combine skips it, so it contributes nothing to its token). The row counts are not specialized
on and the plan pads its tiles by the next power of two of M, so one warmup call per power of
two compiles every binary any M needs (no compile while serving).

With USE_PDL each launch may start while the one before it still runs (pdl.py): it waits for
it before its first load, then lets the next start. The next one therefore starts only once
every earlier launch has finished, so the prefill W13 may read the groups before its own wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import let_next_launch_start, wait_for_previous_launch

BLOCK_ROWS = 128  # rows per [ranks] / [scatter] program: the rank is a BLOCK_ROWS^2 comparison
EXPERT_BLOCK = 16  # experts per [prefix] program
PREFIX_CHUNK = 256  # blocks per [prefix] step: 256 x EXPERT_BLOCK counts, 32 per thread of 4 warps


@triton.jit
def _after_previous_launch(USE_PDL: tl.constexpr):
    """Wait for the previous launch, then let the next one start: after the wait, so that the next
    launch starting means this one's predecessor has finished (the prefill W13 relies on it)."""
    wait_for_previous_launch(USE_PDL)
    let_next_launch_start(USE_PDL)


@triton.jit
def _valid_experts(ids_ptr, r, rows, E: tl.constexpr):
    valid = r < rows
    expert = tl.load(ids_ptr + r, mask=valid, other=0)
    valid = valid & (expert >= 0) & (expert < E)
    return tl.where(valid, expert, 0).to(tl.int32), valid


@triton.jit(do_not_specialize=["rows"])
def ranks_kernel(ids_ptr, rows, ranks_ptr, block_counts_ptr, id_flag_ptr,
                 E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, CHECK_IDS: tl.constexpr = False,
                 USE_PDL: tl.constexpr = False):
    _after_previous_launch(USE_PDL)
    b = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    r = b * BLOCK + i
    expert, valid = _valid_experts(ids_ptr, r, rows, E)
    if CHECK_IDS:  # the debug mode's flag: a routed row whose id is outside [0, E)
        tl.store(id_flag_ptr + i * 0, tl.full([BLOCK], 1, tl.int32), mask=(r < rows) & ~valid)
    keyed = tl.where(valid, expert, -1)  # invalid rows match nothing
    same = (keyed[:, None] == keyed[None, :]) & (i[None, :] < i[:, None]) & valid[:, None]
    tl.store(ranks_ptr + r, tl.sum(same.to(tl.int32), axis=1), mask=r < rows)
    tl.store(block_counts_ptr + b * E_PAD + tl.arange(0, E_PAD), tl.histogram(expert, E_PAD, mask=valid))


@triton.jit(do_not_specialize=["num_blocks"])
def prefix_kernel(block_counts_ptr, num_blocks, expert_totals_ptr,
                  E_PAD: tl.constexpr, CHUNK: tl.constexpr, EXPERTS: tl.constexpr, USE_PDL: tl.constexpr = False):
    _after_previous_launch(USE_PDL)
    e = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    # CHUNK blocks at a time with a running total: a tile over every block at once outgrows
    # the registers at large M and spills (the sort then costs more than the GEMMs)
    carried = tl.zeros([EXPERTS], tl.int32)
    for first in range(0, num_blocks, CHUNK):
        b = first + tl.arange(0, CHUNK)
        at = block_counts_ptr + b[:, None] * E_PAD + e[None, :]
        in_range = (b[:, None] < num_blocks) & (e[None, :] >= 0)
        counts = tl.load(at, mask=in_range, other=0)
        tl.store(at, carried[None, :] + tl.cumsum(counts, axis=0) - counts, mask=in_range)
        carried += tl.sum(counts, axis=0)
    tl.store(expert_totals_ptr + e, carried)


@triton.jit
def _max(a, b):
    return tl.maximum(a, b)


@triton.jit(do_not_specialize=["max_groups"])
def groups_kernel(expert_totals_ptr, expert_offsets_ptr, group_first_ptr, group_expert_ptr, group_start_ptr,
                  group_count_ptr, num_groups_ptr, max_groups,
                  E_PAD: tl.constexpr, G_PAD: tl.constexpr, T: tl.constexpr, USE_PDL: tl.constexpr = False):
    _after_previous_launch(USE_PDL)
    e = tl.arange(0, E_PAD)
    totals = tl.load(expert_totals_ptr + e)
    groups = (totals + T - 1) // T
    first = tl.cumsum(groups, axis=0) - groups
    tl.store(expert_offsets_ptr + e, tl.cumsum(totals, axis=0) - totals)
    tl.store(group_first_ptr + e, first)
    s = tl.arange(0, G_PAD)
    slot_ok = s < max_groups
    tl.store(group_expert_ptr + s, tl.full([G_PAD], -1, tl.int32), mask=slot_ok)
    tl.debug_barrier()  # every slot is -1 before the experts mark their first groups
    tl.store(group_expert_ptr + first, e, mask=groups > 0)
    tl.debug_barrier()  # the marks and the offsets are in memory before any thread reads them back
    owner = tl.associative_scan(tl.load(group_expert_ptr + s, mask=slot_ok, other=-1), 0, _max)
    live = tl.sum(groups, axis=0)
    in_use = s < live
    owner = tl.where(in_use, owner, 0)
    local = s - tl.load(group_first_ptr + owner, mask=in_use, other=0)
    start = tl.load(expert_offsets_ptr + owner, mask=in_use, other=0) + local * T
    count = tl.minimum(tl.load(expert_totals_ptr + owner, mask=in_use, other=0) - local * T, T)
    tl.store(group_expert_ptr + s, owner, mask=in_use)
    tl.store(group_start_ptr + s, start, mask=in_use)
    tl.store(group_count_ptr + s, count, mask=in_use)
    tl.store(num_groups_ptr, live)


@triton.jit(do_not_specialize=["rows"])
def scatter_kernel(ids_ptr, rows, ranks_ptr, block_counts_ptr, expert_offsets_ptr, sorted_rows_ptr,
                   E: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    _after_previous_launch(USE_PDL)
    b = tl.program_id(0)
    r = b * BLOCK + tl.arange(0, BLOCK)
    expert, valid = _valid_experts(ids_ptr, r, rows, E)
    position = (tl.load(expert_offsets_ptr + expert, mask=valid, other=0)
                + tl.load(block_counts_ptr + b * E_PAD + expert, mask=valid, other=0)
                + tl.load(ranks_ptr + r, mask=valid, other=0))
    tl.store(sorted_rows_ptr + position, r, mask=valid)


def max_groups(rows: int, num_experts: int, group_rows: int) -> int:
    """Groups of at most ``group_rows`` rows that R routed rows over E experts can need."""
    return triton.cdiv(rows, group_rows) + min(num_experts, rows)
