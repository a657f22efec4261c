"""Triton helpers of the dense kernels (AWQ int4 tiles in registers; the grouped kernels use
awq_mma) and the two small helpers both routes share: ``awq_column_shift`` and ``silu_mul``.

AutoAWQ packs 8 columns into one int32 with an interleave: logical column c of
an 8-column block sits at nibble ``(c % 2) * 4 + c // 2`` (i.e. nibble i holds
column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``). The helpers widen a packed tile to
logical column order and turn nibbles into floats without an int->float
conversion instruction (those issue at a quarter of the FMA rate): OR-ing a
nibble into the mantissa of 2**23 gives the float ``2**23 + q`` exactly, and
the difference of two such floats, ``(q - z)``, is exact too.
"""

import triton
import triton.language as tl

MAGIC_2P23_BITS = tl.constexpr(0x4B000000)  # float32 bit pattern of 2**23


@triton.jit
def unpack_awq_columns(packed, BLOCK_N: tl.constexpr):
    """int32 [rows, BLOCK_N // 8] -> int32 [rows, BLOCK_N] nibbles in logical column order."""
    wide = tl.interleave(packed, packed)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)
    return (wide >> awq_column_shift(tl.arange(0, BLOCK_N) % 8)[None, :]) & 0xF


@triton.jit
def awq_column_shift(column):
    """Bit offset of logical column ``column`` (0..7) in its AutoAWQ int32."""
    return ((column % 2) * 4 + column // 2) * 4


@triton.jit
def magic_float(nibbles):
    """int32 nibbles in [0, 15] -> float32 2**23 + nibble, exactly (bit trick, no I2F)."""
    return (nibbles | MAGIC_2P23_BITS).to(tl.float32, bitcast=True)


@triton.jit
def awq_tile_minus_zero(qweight_ptrs, qzeros_ptrs, mask, zero_mask, BLOCK_N: tl.constexpr):
    """(q - z) as exact float32 [rows, BLOCK_N] from packed pointers.

    ``qweight_ptrs`` is [rows, BLOCK_N // 8], ``qzeros_ptrs`` [1, BLOCK_N // 8]
    (one group's zero row, shared by every row of the tile).
    """
    q = unpack_awq_columns(tl.load(qweight_ptrs, mask=mask, other=0), BLOCK_N)
    z = unpack_awq_columns(tl.load(qzeros_ptrs, mask=zero_mask, other=0), BLOCK_N)
    return magic_float(q) - magic_float(z)


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up in float32."""
    return gate / (1.0 + tl.exp(-gate)) * up
