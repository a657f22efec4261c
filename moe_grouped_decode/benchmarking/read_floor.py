"""The read floor: kernels that stream exactly the active experts' weight bytes (benchmarks only).

``read_active_experts`` reads every byte of W13 and W2 (packed weights, scales, zeros) of
each active expert once and does nothing else, so its time is the memory-read floor the
routes are judged against. Programs over (active slot a, block c of the expert's bytes): each
issues one wide load and no loop, so all loads of the grid can be in flight at once. The
expert ids come from ``active_experts[:live_count]`` in device memory: written by ``compact``
(one program that sorts the routed rows by expert: the "two-launch" floor, ``floor2``, two
dependent launches as the grouped op has), or from a list made ahead (the "one-launch" floor,
``floor1``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


_PAD_KEY = tl.constexpr(1 << 62)  # sort key of padding rows: past every (expert, row) key


@triton.jit
def _compact_kernel(ids_ptr, rows, sorted_rows_ptr, sorted_experts_ptr, active_experts_ptr, segment_offsets_ptr,
                    live_count_ptr, R_PAD: tl.constexpr):
    """One program: sort the routed rows by (expert, row), then number the segments.
    ``sorted_experts_ptr`` is scratch for R int32 (each sorted position's expert, so that a
    position can see its predecessor's)."""
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


@dataclass(frozen=True)
class Compaction:
    """Device buffers of ``compact`` for R routed rows (int32)."""

    sorted_rows: torch.Tensor  # [R] routed rows grouped by expert
    sorted_experts: torch.Tensor  # [R] scratch
    active_experts: torch.Tensor  # [R] the first live_count are the active experts, ascending
    segment_offsets: torch.Tensor  # [R + 1]
    live_count: torch.Tensor  # [1]

    @classmethod
    def alloc(cls, rows: int, device) -> "Compaction":
        def buffer(n):
            return torch.empty(n, dtype=torch.int32, device=device)

        return cls(buffer(rows), buffer(rows), buffer(rows), buffer(rows + 1), buffer(1))


def compact(topk_ids, buffers: Compaction) -> None:
    """Sort topk_ids' M*k routed rows by expert into ``buffers`` (one launch, one program)."""
    rows = topk_ids.numel()
    _compact_kernel[(1,)](
        topk_ids, rows, buffers.sorted_rows, buffers.sorted_experts, buffers.active_experts, buffers.segment_offsets,
        buffers.live_count, R_PAD=max(16, 1 << max(0, (rows - 1).bit_length())), num_warps=4,
    )


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_floor_kernel(
    active_experts_ptr, live_count_ptr, sink_ptr,
    p0, p1, p2, p3, p4, p5,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr, S5: tl.constexpr,
    BLOCK: tl.constexpr,
):
    a = tl.program_id(0)
    c = tl.program_id(1)
    if a >= tl.load(live_count_ptr):
        return
    expert = tl.load(active_experts_ptr + a).to(tl.int64)
    # block c of the concatenation of the six per-expert word ranges
    C0: tl.constexpr = (S0 + BLOCK - 1) // BLOCK
    C1: tl.constexpr = C0 + (S1 + BLOCK - 1) // BLOCK
    C2: tl.constexpr = C1 + (S2 + BLOCK - 1) // BLOCK
    C3: tl.constexpr = C2 + (S3 + BLOCK - 1) // BLOCK
    C4: tl.constexpr = C3 + (S4 + BLOCK - 1) // BLOCK
    if c < C0:
        base, first, size = p0 + expert * S0, c, S0
    elif c < C1:
        base, first, size = p1 + expert * S1, c - C0, S1
    elif c < C2:
        base, first, size = p2 + expert * S2, c - C1, S2
    elif c < C3:
        base, first, size = p3 + expert * S3, c - C2, S3
    elif c < C4:
        base, first, size = p4 + expert * S4, c - C3, S4
    else:
        base, first, size = p5 + expert * S5, c - C4, S5
    idx = first * BLOCK + tl.arange(0, BLOCK)
    words = tl.load(base + idx, mask=idx < size, other=0)
    tl.store(sink_ptr + a * tl.num_programs(1) + c, tl.reduce(words, 0, _xor))


READ_BLOCK = 2048  # int32 words per program: 16 per thread at 4 warps


def floor_blocks(tensors) -> int:
    return sum(triton.cdiv(t[0].numel() * t.element_size() // 4, READ_BLOCK) for t in tensors)


def read_active_experts(active_experts, live_count, sink, max_active: int, tensors) -> None:
    """Stream the weights of experts ``active_experts[:live_count]``; ``tensors`` are the six
    contiguous weight tensors. ``sink`` holds max_active * floor_blocks(tensors) int32."""
    flat = [t.view(t.shape[0], -1).view(torch.int32) for t in tensors]
    sizes = [f.shape[1] for f in flat]
    _read_floor_kernel[(max_active, floor_blocks(tensors))](
        active_experts, live_count, sink, *flat, *sizes, BLOCK=READ_BLOCK, num_warps=4,
    )


def floor2(topk_ids, buffers: Compaction, sink, max_active: int, tensors) -> None:
    """The two-launch read floor of one layer: ``compact`` then ``read_active_experts``."""
    compact(topk_ids, buffers)
    read_active_experts(buffers.active_experts, buffers.live_count, sink, max_active, tensors)
