"""The small helpers the kernels share: AutoAWQ's column order, ``silu_mul`` and ``INTERPRETED``.

AutoAWQ packs 8 columns into one int32 with an interleave: logical column c of an 8-column block
sits at nibble ``(c % 2) * 4 + c // 2`` (i.e. nibble i holds column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``).
"""

import os

import triton
import triton.language as tl

# Under Triton's interpreter (TRITON_INTERPRET=1, CPU CI) no PTX runs and bfloat16 arithmetic is
# numpy's: the kernels that care take a plain-tensor branch on this constexpr.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def awq_column_shift(column):
    """Bit offset of logical column ``column`` (0..7) in its AutoAWQ int32."""
    return ((column % 2) * 4 + column // 2) * 4


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32."""
    return gate / (1.0 + tl.exp(-gate)) * up
