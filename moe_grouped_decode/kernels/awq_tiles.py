"""Triton helpers shared by the grouped and dense kernels: AWQ int4 tiles in registers.

AutoAWQ packs 8 columns into one int32 with an interleave: logical column c of
an 8-column block sits at nibble ``(c % 2) * 4 + c // 2`` (i.e. nibble i holds
column ``[0, 2, 4, 6, 1, 3, 5, 7][i]``). The helpers widen a packed tile to
logical column order and turn nibbles into floats without an int->float
conversion instruction (those issue at a quarter of the FMA rate): OR-ing a
nibble into the mantissa of 2**23 gives the float ``2**23 + q`` exactly, and
the difference of two such floats, ``(q - z)``, is exact too.
"""

import os

import triton
import triton.language as tl

MAGIC_2P23_BITS = tl.constexpr(0x4B000000)  # float32 bit pattern of 2**23
_INLINE_PTX = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") != "1")


@triton.jit
def unpack_awq_columns(packed, BLOCK_N: tl.constexpr):
    """int32 [rows, BLOCK_N // 8] -> int32 [rows, BLOCK_N] nibbles in logical column order."""
    wide = tl.interleave(packed, packed)
    wide = tl.interleave(wide, wide)
    wide = tl.interleave(wide, wide)
    column_in_block = tl.arange(0, BLOCK_N) % 8
    shift = ((column_in_block % 2) * 4 + column_in_block // 2) * 4
    return (wide >> shift[None, :]) & 0xF


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


@triton.jit
def _magic_masked(bits, MASK: tl.constexpr):
    """float32 ``2**23 + (bits & MASK)`` exactly (MASK < 2**23): the AND and the OR
    of the magic exponent in one LOP3 (written as two operations, ptxas emits two,
    as LOP3 takes one immediate). The interpreter cannot run PTX."""
    if _INLINE_PTX:
        return tl.inline_asm_elementwise(
            "lop3.b32 $0, $1, $2, $3, 0xEA;",  # (a & b) | c
            "=r,r,r,r",
            [bits, tl.full(bits.shape, MASK, tl.int32), tl.full(bits.shape, MAGIC_2P23_BITS, tl.int32)],
            dtype=tl.float32, is_pure=True, pack=1,
        )
    else:
        return ((bits & MASK) | MAGIC_2P23_BITS).to(tl.float32, bitcast=True)


@triton.jit
def plane_columns(words, NIBBLE: tl.constexpr):
    """Logical columns of nibble NIBBLE of packed columns ``words`` (AutoAWQ order)."""
    COLUMN: tl.constexpr = (NIBBLE % 4) * 2 + NIBBLE // 4
    return words * 8 + COLUMN


@triton.jit
def _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW: tl.constexpr, NIBBLE: tl.constexpr):
    cols = plane_columns(words, NIBBLE)
    return tl.load(scales_ptr + groups[:, None] * SCALE_ROW + cols[None, :],
                   mask=group_ok[:, None] & word_ok[None, :], other=0.0)


@triton.jit
def load_plane_scales(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW: tl.constexpr):
    """The eight nibble planes' scales, [GROUPS, WORDS] each, as one tuple: all eight
    loads issue before any arithmetic (issued inside the plane loop, each plane would
    wait a memory latency of its own)."""
    return (
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 0),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 1),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 2),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 3),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 4),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 5),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 6),
        _plane_scale(scales_ptr, groups, group_ok, words, word_ok, SCALE_ROW, 7),
    )


@triton.jit
def nibble_plane_dot(packed, zeros, vec, scale, NIBBLE: tl.constexpr):
    """One nibble plane of a packed AWQ tile, reduced over its rows.

    ``packed`` int32 [GROUPS, G, WORDS] holds rows ``groups[g] * G + i`` and
    packed columns ``words``; ``zeros`` int32 [GROUPS, WORDS]; ``vec`` float32
    [GROUPS, G] the matching activations; ``scale`` [GROUPS, WORDS] the plane's
    scales (load_plane_scales). Nibble NIBBLE of every word is logical column
    ``plane_columns(words, NIBBLE)``, so a plane is a strided set of whole
    columns: no widening of the tile, no layout change. Returns sum_rows
    vec * (q - z) * scale (float32 [WORDS]): the rows of a group are summed
    first (inside each thread: see load_group_tile), then scaled, then the
    groups summed.

    Nibbles are not shifted down: nibble e <= 4 is masked in place, giving
    (q - z) * 16**e exactly (q * 16**e < 2**23 fits the magic float), and the
    exact power of two 16**-e goes into the scale; nibbles 5..7 are masked in
    the word shifted right by 12 (one shift per word for three planes). Every
    product is an exact power-of-two multiple of the unshifted one, so the
    rounding is the same.
    """
    SHIFT: tl.constexpr = 0 if NIBBLE <= 4 else 12
    POSITION: tl.constexpr = 4 * NIBBLE - SHIFT
    q = _magic_masked(packed >> SHIFT, 0xF << POSITION)
    z = _magic_masked(zeros >> SHIFT, 0xF << POSITION)
    per_group = tl.sum(vec[:, :, None] * (q - z[:, None, :]), axis=1)
    return tl.sum(per_group * (scale.to(tl.float32) * (1.0 / (1 << POSITION))), axis=0)


@triton.jit
def load_group_tile(qweight_ptr, qzeros_ptr, groups, group_ok, words, word_ok,
                    G: tl.constexpr, PACKED_WIDTH: tl.constexpr):
    """One load of whole groups of packed rows: int32 [GROUPS, G, WORDS] (row
    ``groups[g] * G + i`` at [g, i]) and the groups' zero rows [GROUPS, WORDS].
    ``PACKED_WIDTH`` is the int32 row length of both tensors.

    Dimension order matters: Triton's coalescing gives the lanes left over from
    the contiguous WORDS to the first of the equally strided dimensions, so
    groups go across lanes and the G rows of a group stay inside a thread,
    where their sum is a chain of FMAs rather than shuffles.
    """
    rows = groups[:, None] * G + tl.arange(0, G)[None, :]
    packed = tl.load(qweight_ptr + rows[:, :, None] * PACKED_WIDTH + words[None, None, :],
                     mask=group_ok[:, None, None] & word_ok[None, None, :], other=0)
    zeros = tl.load(qzeros_ptr + groups[:, None] * PACKED_WIDTH + words[None, :],
                    mask=group_ok[:, None] & word_ok[None, :], other=0)
    return rows, packed, zeros
