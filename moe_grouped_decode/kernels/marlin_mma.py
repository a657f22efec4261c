"""vLLM's Marlin int4 words dequantized straight into mma.sync fragments (m16n8k16).

``awq_mma.py`` does this for AutoAWQ's layout; this module does it for the tensors vLLM's
MARLIN MoE backend makes at load (``moe_grouped_decode.marlin_layout``), so that a grouped
kernel can read the one copy of a layer's weights vLLM's own kernel reads.

A Marlin tile is 16 reduction rows by 64 output columns, 128 words; word ``4 (4 g + t) + w``
of a tile row belongs to lane (g, t) and 16-column subtile w, and its 8 nibbles are exactly
that lane's A fragment of subtile w (the weights as the A operand, tokens in B's 8 columns)::

    a0 = rows (2t, 2t + 1)     of column 16 w + g       nibbles 0, 4  (mask LO, shift 0)
    a1 = rows (2t, 2t + 1)     of column 16 w + g + 8   nibbles 2, 6  (mask LO, shift 8)
    a2 = rows (2t + 8, 2t + 9) of column 16 w + g       nibbles 1, 5  (mask HI, shift 0)
    a3 = rows (2t + 8, 2t + 9) of column 16 w + g + 8   nibbles 3, 7  (mask HI, shift 8)

so one LOP3 per register gives (magic + q) pairs, with no PRMT (fp16: magic 1024 for the LO
mask, 64 for the HI one; bf16: magic 128, every nibble shifted to bits 0-3, by 0, 8, 4 and 12). One warp, one 32-row chunk
(two 16-row blocks b, inside one group), one tile of 64 columns::

    words[lane, 4 b + w]   Marlin word of lane (g, t), block b, subtile w (a 16-byte load per b)
    x[lane, 4 b + i]       x[token g, k0 + 16 b + 2 t + (0, 1, 8, 9)[i]]    (B operand)
    scales[lane, j]        scale of column g + 8 j (Marlin's grouped scale order: one 16-byte load)
    zeros[lane]            Marlin zero word 8 tile + g: nibble w (w + 4) is column 16 w + g (+ 8)

Output element 4 w + c of lane (g, t) (``d_lo`` for w = 0, 1, ``d_hi`` for w = 2, 3) is
column 16 w + g + 8 (c // 2), token 2 t + c % 2. As in ``awq_mma.py`` the A operand holds
q - z exactly and only the float32 accumulation and scale multiply round. Under
``TRITON_INTERPRET=1`` the same lanes are computed with tensor ops.
"""

import triton
import triton.language as tl

from .awq_mma import _LO, _HI, _INLINE_PTX, _constraints

MARLIN_TILE_COLUMNS = tl.constexpr(64)
MARLIN_TILE_WORDS = tl.constexpr(128)  # words of one 16-row tile row: 64 columns x 16 rows / 8


def _marlin_chunk_asm(bf16: bool) -> str:
    """PTX for one marlin_mma_chunk: $0..$15 the outputs (d_lo then d_hi), $16..$23 the words
    (4 b + w), $24..$27 the 16-bit x pairs (2 b, 2 b + 1), $28..$31 the scale pairs, $32..$39
    copies of the zero word."""
    kind = "bf16" if bf16 else "f16"
    words, x, scales, zero = 16, 24, 28, 32
    lines = ["{", ".reg .b32 zp<2>, zs, zl<8>, s<8>, ws<4>, a<4>;", ".reg .f32 d<16>;"]
    if not bf16:
        lines += [".reg .b32 zh<8>;", ".reg .b16 h<8>;"]
    if bf16:  # add.bf16x2 needs sm_90: a * 1 + z instead
        lines += [".reg .b32 one;", "mov.b32 one, 0x3F803F80;"]
    # zero splats: PRMT 0x1010 repeats bytes 0-1 (nibbles 0-3: subtiles 0-3, column g),
    # 0x3232 bytes 2-3 (column g + 8); subtile w's nibble is then at bits 4w of each half
    lines += [f"prmt.b32 zp0, ${zero}, ${zero}, 0x1010;", f"prmt.b32 zp1, ${zero}, ${zero}, 0x3232;"]
    for w in range(4):
        for r in range(2):
            # zl: -(magic + z) with z at bits 0-3 of each half (the LO registers' magic)
            lines.append(f"shr.u32 zs, zp{r}, {4 * w};")
            neg_lo = "0xC300C300" if bf16 else "0xE400E400"
            lines.append(f"lop3.b32 zl{2 * w + r}, zs, {_LO}, {neg_lo}, 0xEA;")
            if not bf16:  # zh: z at bits 4-7 (the HI registers' magic, 64)
                lines.append(f"shl.b32 zs, zp{r}, 4;" if w == 0 else f"shr.u32 zs, zp{r}, {4 * (w - 1)};")
                lines.append(f"lop3.b32 zh{2 * w + r}, zs, {_HI}, 0xD400D400, 0xEA;")
    lines += [f"mov.f32 d{r}, 0f00000000;" for r in range(16)]
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    if bf16:
        # (shift, mask, zero splat of column half r) per register: every nibble brought to bits 0-3
        regs = [(0, _LO, "zl", 0), (8, _LO, "zl", 1), (4, _LO, "zl", 0), (12, _LO, "zl", 1)]
        magic = {_LO: "0x43004300"}
    else:
        regs = [(0, _LO, "zl", 0), (8, _LO, "zl", 1), (0, _HI, "zh", 0), (8, _HI, "zh", 1)]
        magic = {_LO: "0x64006400", _HI: "0x54005400"}
    for block in range(2):
        b = f"{{${x + 2 * block}, ${x + 2 * block + 1}}}"
        for w in range(4):
            word = f"${words + 4 * block + w}"
            for shift in sorted({s for s, _, _, _ in regs} - {0}):
                lines.append(f"shr.u32 ws{shift // 4 - 1}, {word}, {shift};")
            for reg, (shift, mask, splat, r) in enumerate(regs):
                src = word if shift == 0 else f"ws{shift // 4 - 1}"
                lines.append(f"lop3.b32 a{reg}, {src}, {mask}, {magic[mask]}, 0xEA;")
                # (magic + q) + -(magic + z) = q - z: exact in 16 bits (|q - z| <= 15)
                if bf16:
                    lines.append(f"fma.rn.bf16x2 a{reg}, a{reg}, one, {splat}{2 * w + r};")
                else:
                    lines.append(f"add.f16x2 a{reg}, a{reg}, {splat}{2 * w + r};")
            d = "{" + ", ".join(f"d{4 * w + i}" for i in range(4)) + "}"
            lines.append(f"{mma} {d}, {{a0, a1, a2, a3}}, {b}, {d};")
    for w in range(4):
        if bf16:  # a bf16 is the upper half of its float32
            lines += [f"shl.b32 s{2 * w}, ${scales + w}, 16;", f"and.b32 s{2 * w + 1}, ${scales + w}, 0xFFFF0000;"]
        else:
            lines += [f"mov.b32 {{h{2 * w}, h{2 * w + 1}}}, ${scales + w};",
                      f"cvt.f32.f16 s{2 * w}, h{2 * w};", f"cvt.f32.f16 s{2 * w + 1}, h{2 * w + 1};"]
        for c in range(4):
            lines.append(f"mul.f32 ${4 * w + c}, d{4 * w + c}, s{2 * w + c // 2};")
    lines.append("}")
    return "\n".join(lines)


_MARLIN_PTX = {bf16: _marlin_chunk_asm(bf16) for bf16 in (False, True)}
_MARLIN_CONSTRAINTS = tl.constexpr(_constraints(False))


@triton.constexpr_function
def marlin_chunk_ptx(is_bf16):
    return _MARLIN_PTX[bool(is_bf16)]


@triton.jit
def _emulated_marlin_chunk(words, x, scales, zeros, WARPS: tl.constexpr):
    """marlin_mma_chunk with tensor ops, for the interpreter: the same lanes, the same outputs."""
    v = tl.arange(0, 8)
    # value slot v (rows 2t + (0, 1, 8, 9)[v % 4], column half v // 4) sits at nibble (v % 2) 4 + v // 2
    q = (words[:, :, None] >> (4 * ((v % 2) * 4 + v // 2))[None, None, :]) & 0xF  # [L, 4b + w, v]
    w_of = tl.arange(0, 8)[None, :, None] % 4
    z = (zeros[:, :, None] >> (4 * (w_of + 4 * (v[None, None, :] // 4)))) & 0xF  # [L, 4b + w, v]
    a = (q - z).to(tl.float32)
    a = tl.reshape(a, [WARPS, 8, 4, 2, 4, 2, 4])  # [W, g, t, b, w, hi, i]
    a = tl.permute(a, [0, 1, 4, 5, 2, 3, 6])  # [W, g, w, hi, t, b, i]
    a = tl.reshape(a, [WARPS, 8, 8, 32])  # [W, g, (w, hi), (t, b, i)]
    xb = tl.reshape(x.to(tl.float32), [WARPS, 8, 32])  # [W, token, (t, b, i)]
    d = tl.sum(a[:, :, :, None, :] * xb[:, None, None, :, :], axis=4)  # [W, g, (w, hi), token]
    d = tl.reshape(d, [WARPS, 8, 4, 2, 4, 2])  # [W, g, w, hi, t, token % 2]
    d = tl.permute(d, [0, 1, 4, 2, 3, 5])  # [W, g, t, w, hi, token % 2]
    d = tl.reshape(d, [WARPS * 32, 4, 4])  # [lane, w, c]
    s = tl.reshape(scales.to(tl.float32), [WARPS * 32, 4, 2])  # [lane, w, hi]
    s = tl.reshape(tl.broadcast_to(s[:, :, :, None], [WARPS * 32, 4, 2, 2]), [WARPS * 32, 4, 4])
    d = tl.reshape(d * s, [WARPS * 32, 2, 8])  # [lane, w // 2, 4 (w % 2) + c]
    d_lo, d_hi = tl.split(tl.permute(d, [0, 2, 1]))
    return d_lo, d_hi


@triton.jit
def marlin_mma_chunk(words, x, scales, zeros, IS_BF16: tl.constexpr, WARPS: tl.constexpr):
    """One 32-row chunk of a warp's 64-column Marlin tile (layout in the module docstring) for
    every warp of the program: ``words`` int32, ``x`` 16-bit and ``scales`` [32 * WARPS, 8],
    ``zeros`` int32 [32 * WARPS, 1]. Returns float32 (d_lo, d_hi) [32 * WARPS, 8]."""
    if _INLINE_PTX:
        return tl.inline_asm_elementwise(marlin_chunk_ptx(IS_BF16), _MARLIN_CONSTRAINTS, [words, x, scales, zeros],
                                         dtype=(tl.float32, tl.float32), is_pure=True, pack=8)
    else:
        return _emulated_marlin_chunk(words, x, scales, zeros, WARPS)


@triton.jit
def marlin_chunk_rows(k0, t, e):
    """Reduction row of x element e of lane group t in the chunk starting at row k0."""
    return k0 + (e // 4) * 16 + 2 * t + e % 2 + 8 * ((e % 4) // 2)


@triton.jit
def marlin_word_offsets(t, g, e):
    """Word of element e (block e // 4, subtile e % 4) of lane (g, t) within its tile's row pair:
    (block row, word in the 128-word tile row)."""
    return e // 4, 4 * (4 * g + t) + e % 4


@triton.jit
def marlin_chunk_columns(g, e):
    """Column within the tile of element e in d_lo (add 32 for d_hi); its token is 2 t + e % 2."""
    return 16 * (e // 4) + g + 8 * ((e % 4) // 2)
