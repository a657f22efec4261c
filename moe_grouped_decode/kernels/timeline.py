"""Per-program timestamps, the kernel side: where a layer's microseconds go (``benchmarks/timeline.py``).

With the ``TIMELINE`` constexpr (a field of the launch plan, off in every launch the op makes
for its callers, where the stamp pointer is None and the stamps compile out), the grouped
kernels store ``%globaltimer`` (nanoseconds, one clock for the whole GPU) at fixed
points of every program, one int64 per stamp::

    W13 program p (either W13 kernel):   w13[p] = (start, end, SM)
    W2 program (row, tile):               w2[row, tile] = (start, after the PDL wait,
                                          activations written, row output stored, end, SM)

SM is the number of the SM the program ran on (``%smid``, read at its start), so the tool can
say how the programs spread over the SMs. Timer reads are ordinary instructions, so a stamp
can land a few instructions from where it is written, and the timer ticks every 32 ns on the
H200; the tool reports medians over layers and programs, not single stamps.
"""

from __future__ import annotations

import triton
import triton.language as tl

GLOBALTIMER_PTX = tl.constexpr("mov.u64 $0, %globaltimer;")
SMID_PTX = tl.constexpr("mov.u32 $0, %smid;")

W13_STAMPS = ("start", "end", "sm")
W2_STAMPS = ("start", "after wait", "activations", "row stored", "end", "sm")
# int64s per program in the stamp buffers, and the SM's slot (the kernels index them with these)
W13_STAMP_COUNT = tl.constexpr(len(W13_STAMPS))
W2_STAMP_COUNT = tl.constexpr(len(W2_STAMPS))
W13_SM_SLOT = tl.constexpr(W13_STAMPS.index("sm"))
W2_SM_SLOT = tl.constexpr(W2_STAMPS.index("sm"))


@triton.jit
def now():
    """%globaltimer as an int64 scalar (not pure: every call reads the clock again)."""
    return tl.inline_asm_elementwise(GLOBALTIMER_PTX, "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def sm_id():
    """The SM this program runs on, as an int64 scalar."""
    return tl.inline_asm_elementwise(SMID_PTX, "=r", [], dtype=tl.int32, is_pure=True, pack=1).to(tl.int64)
