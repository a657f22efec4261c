"""Benchmark-only: a kernel that streams exactly the active experts' weight bytes.

It reads every byte of W13 and W2 (packed weights, scales, zeros) of each
active expert once and does nothing else, so its time is the memory-read floor
the grouped op is judged against. Programs over (active slot a, block c of the
expert's bytes): each issues one wide load and no loop, so all loads of the
grid can be in flight at once. The expert id comes from ``active_experts[a]``
with ``live_count`` read from device memory, like the grouped op's (after a
compaction launch: the "two-launch" floor, or from a list made ahead: the
"one-launch" floor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
