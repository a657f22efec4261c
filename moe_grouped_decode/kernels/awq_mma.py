"""AutoAWQ int4 weights dequantized straight into tensor-core fragments (mma.sync m16n8k16).

The grouped kernels multiply a few tokens by one expert's packed weights. On CUDA
cores that costs about four instructions per weight (unpack, convert, subtract the
zero, FMA); here one LOP3 and one 16-bit pair add turn two nibbles into one exact
fp16 (or bf16) pair q - z of an mma A fragment, and one mma covers 256 weights (16 x 16, times 8 token columns) with
float32 accumulation.

One warp, one 32-row chunk of the reduction (inside one AWQ group), 64 output
columns (8 packed int32 columns, ``c_0 .. c_7``)::

    lane (g, t) = (lane // 4, lane % 4) owns packed column c_g and, in 16-row block
    b = 0, 1, rows r = 16 b + 4 t + i (i = 0..3):

      words[lane, 4b + i]  = qweight[k0 + r, c_g]          int32, 8 nibbles = 8 columns
      x[lane, 4b + i]      = x[token g, k0 + r]            the B operand: token g in column g
      scales[lane, j]      = scales[group, 8 c_g + j]      j = 0..7
      zeros[lane]          = qzeros[group, c_g]

    PRMT(words[4b], words[4b + 1]) puts one column's nibbles of rows (r, r + 1) at
    bits 0-3 and 16-19 (or 4-7 and 20-23): LOP3 with the fp16 magic 1024 (64 for the
    upper nibble; bf16 shifts instead: 128) gives the pair (magic + q), and one
    16-bit pair add of -(magic + z) (built from the zero word the same way) the
    exact pair q - z of the A fragment. mma j takes columns 2j (A row g) and 2j + 1
    (A row g + 8), so per column and token

      D[col, tok] = scale[col] * sum_rows (q - z) * x[tok]

    and lane (g, t) gets D for columns 8 c_g + {2j, 2j + 1} and tokens {2t, 2t + 1}:
    output element 4j + c (c = 0..3) is column 2j + c // 2, token 2t + c % 2, in
    ``d_lo`` for j = 0, 1 and ``d_hi`` for j = 2, 3.

The A operand holds the integers q - z exactly, so the mma's products are exact and
only its float32 accumulation and the float32 scale multiply round, as in a float32
dequantize-then-multiply. (An earlier version took the zero out with a second mma
of -(magic + z): no pair adds, twice the mmas, and a float32 cancellation of
magic * sum x that cost many ULPs on outputs near zero.) ``SPLIT_X`` passes float32
activations as a hi + lo pair of 16-bit halves (two mmas each), for W2, whose input
(silu(gate) * up) is float32, when its config asks (``w2_act_split``; by default W2 rounds
them to one half). Under ``TRITON_INTERPRET=1`` (no PTX) ``awq_mma_chunk`` computes the
same lane layout with plain tensor ops, so CPU CI checks every index.
"""

import triton
import triton.language as tl

from .awq_tiles import INTERPRETED, awq_column_shift

_INLINE_PTX = tl.constexpr(not INTERPRETED.value)

CHUNK_ROWS = tl.constexpr(32)  # reduction rows per awq_mma_chunk call (two m16n8k16 blocks)
TILE_WORDS = tl.constexpr(8)  # packed int32 columns per warp (one per lane group g): 64 output columns
# A kernel's loop over the 32-row chunks of a whole N or K unrolls at compile time up to
# UNROLLED_CHUNKS chunks per warp (every chunk's loads issued up front, as at the shape the
# kernels were tuned for: qwen3.8's K = 2560 is 20 chunks for each of the prefill W13's four
# warps); a longer one runs as a loop the compiler unrolls CHUNK_LOOP_UNROLL chunks at a time,
# the same sums in the same order. A full unroll of hundreds of chunks (N = 7168 is 224) keeps
# Triton's compiler busy for minutes and spills.
UNROLLED_CHUNKS = tl.constexpr(20)
CHUNK_LOOP_UNROLL = tl.constexpr(4)

_LO, _HI = "0x000F000F", "0x00F000F0"


def _chunk_asm(bf16: bool, split_x: bool, rn_scale: bool = False, token_blocks: int = 1) -> str:
    """PTX for one awq_mma_chunk: operands $0..$15 outputs (d_lo then d_hi), then the
    8 words, the 16-bit x pairs (4 registers, 4 more for SPLIT_X's lo halves), 4 scale
    pairs and 8 copies of the zero word. ``rn_scale``: the scale multiply as mul.rn (never
    contracted with the caller's accumulate). ``token_blocks`` > 1 (awq_mma_tokens): that many
    B operands of 8 token columns each, every A fragment dequantized once for all of them:
    16 outputs per block ($16 b .. $16 b + 15), then the words, 4 x registers per block, the
    scales and the zero word's copies."""
    if split_x and token_blocks > 1:
        raise ValueError("split_x takes one token block")
    kind = "bf16" if bf16 else "f16"
    words = 16 * token_blocks
    x = words + 8
    x_lo = x + 4 if split_x else None
    scales = x + 4 * token_blocks + (4 if split_x else 0)
    zero = scales + 4
    # the accumulator registers of token block b
    dreg = (lambda b, r: f"d{r}") if token_blocks == 1 else (lambda b, r: f"d{b}_{r}")
    # (shift, mask, magic) that brings column nibble position n (0..3 of a PRMT half) into a pair
    if bf16:
        extract = [(4 * n, _LO, "0x43004300") for n in range(4)]
        neg = ["0xC300C300"] * 4
    else:
        extract = [(0, _LO, "0x64006400"), (0, _HI, "0x54005400"), (8, _LO, "0x64006400"), (8, _HI, "0x54005400")]
        neg = ["0xE400E400", "0xD400D400", "0xE400E400", "0xD400D400"]
    d_decls = ".reg .f32 d<16>;" if token_blocks == 1 else " ".join(f".reg .f32 d{b}_<16>;" for b in range(token_blocks))
    lines = ["{", ".reg .b32 zp<2>, z<8>, s<8>;", d_decls, ".reg .b16 h<8>;"]
    if bf16:  # add.bf16x2 needs sm_90: a * 1 + z instead
        lines += [".reg .b32 one;", "mov.b32 one, 0x3F803F80;"]

    def shifted(src, prefix):
        """{shift: register holding src >> shift} for the shifts ``extract`` uses."""
        regs = {0: src}
        for shift in sorted({shift for shift, _, _ in extract} - {0}):
            regs[shift] = f"{prefix}s{shift}"
            lines.append(f".reg .b32 {regs[shift]};")
            lines.append(f"shr.u32 {regs[shift]}, {src}, {shift};")
        return regs

    # zero splats: PRMT 0x1010 repeats bytes 0-1 (nibbles 0-3: columns 0, 2, 4, 6),
    # 0x3232 bytes 2-3 (nibbles 4-7: columns 1, 3, 5, 7)
    for half, sel in ((0, "0x1010"), (1, "0x3232")):
        lines.append(f"prmt.b32 zp{half}, ${zero}, ${zero}, {sel};")
        regs = shifted(f"zp{half}", f"zp{half}")
        for n, (shift, mask, _) in enumerate(extract):
            lines.append(f"lop3.b32 z{2 * n + half}, {regs[shift]}, {mask}, {neg[n]}, 0xEA;")
    lines += [f"mov.f32 {dreg(b, r)}, 0f00000000;" for b in range(token_blocks) for r in range(16)]
    mma = f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32"
    for block in range(2):
        w = [f"${words + 4 * block + i}" for i in range(4)]
        # (token block, B operand): SPLIT_X's hi and lo halves both accumulate into block 0
        b_sets = [(tb, f"{{${x + 4 * tb + 2 * block}, ${x + 4 * tb + 2 * block + 1}}}") for tb in range(token_blocks)]
        if split_x:
            b_sets.append((0, f"{{${x_lo + 2 * block}, ${x_lo + 2 * block + 1}}}"))
        # wp<block><2p + half>: rows (4t + 2p, 4t + 2p + 1) interleaved; half 0 = nibbles 0-3, 1 = nibbles 4-7
        srcs = {}
        for p in range(2):
            for half, sel in ((0, "0x5410"), (1, "0x7632")):
                reg = f"wp{block}{2 * p + half}"
                lines.append(f".reg .b32 {reg};")
                lines.append(f"prmt.b32 {reg}, {w[2 * p]}, {w[2 * p + 1]}, {sel};")
                srcs[p, half] = shifted(reg, reg)
        for n, (_, mask, magic) in enumerate(extract):
            # mma n: A rows g / g + 8 = columns 2n / 2n + 1 (PRMT halves 0 / 1), k pairs of rows p = 0, 1
            lines.append("{ .reg .b32 a<4>;")
            for reg, (p, half) in enumerate(((0, 0), (0, 1), (1, 0), (1, 1))):
                lines.append(f"lop3.b32 a{reg}, {srcs[p, half][extract[n][0]]}, {mask}, {magic}, 0xEA;")
                # (magic + q) + -(magic + z) = q - z: exact in 16 bits (|q - z| <= 15)
                if bf16:
                    lines.append(f"fma.rn.bf16x2 a{reg}, a{reg}, one, z{2 * n + half};")
                else:
                    lines.append(f"add.f16x2 a{reg}, a{reg}, z{2 * n + half};")
            for tb, b in b_sets:
                d = "{" + ", ".join(dreg(tb, 4 * n + i) for i in range(4)) + "}"
                lines.append(f"{mma} {d}, {{a0, a1, a2, a3}}, {b}, {d};")
            lines.append("}")
    for n in range(4):
        if bf16:  # a bf16 is the upper half of its float32 (cvt.f32.bf16 would need sm_90)
            lines += [f"shl.b32 s{2 * n}, ${scales + n}, 16;", f"and.b32 s{2 * n + 1}, ${scales + n}, 0xFFFF0000;"]
        else:
            lines += [f"mov.b32 {{h{2 * n}, h{2 * n + 1}}}, ${scales + n};",
                      f"cvt.f32.f16 s{2 * n}, h{2 * n};", f"cvt.f32.f16 s{2 * n + 1}, h{2 * n + 1};"]
        for tb in range(token_blocks):
            for c in range(4):
                # rn_scale: .rn, so ptxas cannot fuse the scale multiply into the caller's accumulate (the
                # Gluon W2 uses it, with or without split_x; the tl W2 can, to give the same bits, in the
                # test that compares them)
                mul = "mul.rn.f32" if rn_scale else "mul.f32"
                lines.append(f"{mul} ${16 * tb + 4 * n + c}, {dreg(tb, 4 * n + c)}, s{2 * n + c // 2};")
    lines.append("}")
    return "\n".join(lines)


def _constraints(split_x: bool, token_blocks: int = 1) -> str:
    return ",".join(["=f"] * 16 * token_blocks + ["r"] * (8 + 4 * token_blocks + (4 if split_x else 0) + 4 + 8))


# One chunk's PTX and operand constraints, per dtype, activation split and scale rounding, built
# once (tables: Triton hashes a kernel's globals, not plain functions); awq_mma_chunk and the
# Gluon W13 and W2 (w13_gluon.py, w2_gluon.py) issue them.
_CHUNK_PTX = {(bf16, split_x, rn_scale): _chunk_asm(bf16, split_x, rn_scale)
              for bf16 in (False, True) for split_x in (False, True) for rn_scale in (False, True)}
_CHUNK_CONSTRAINTS = {split_x: _constraints(split_x) for split_x in (False, True)}
TOKEN_BLOCK_COUNTS = (2, 4)  # awq_mma_tokens' block counts (1 is awq_mma_chunk)
_TOKENS_PTX = {(bf16, blocks): _chunk_asm(bf16, False, False, blocks) for bf16 in (False, True)
               for blocks in TOKEN_BLOCK_COUNTS}
_TOKENS_CONSTRAINTS = {blocks: _constraints(False, blocks) for blocks in TOKEN_BLOCK_COUNTS}


@triton.constexpr_function
def chunk_ptx(is_bf16, split_x, rn_scale):
    """The PTX of one chunk, picked at compile time from constexpr flags."""
    return _CHUNK_PTX[bool(is_bf16), bool(split_x), bool(rn_scale)]


@triton.constexpr_function
def chunk_constraints(split_x):
    """The operand constraints of chunk_ptx's PTX."""
    return _CHUNK_CONSTRAINTS[bool(split_x)]


@triton.constexpr_function
def tokens_ptx(is_bf16, token_blocks):
    """The PTX of one chunk over ``token_blocks`` B operands (awq_mma_tokens)."""
    return _TOKENS_PTX[bool(is_bf16), int(token_blocks)]


@triton.constexpr_function
def tokens_constraints(token_blocks):
    return _TOKENS_CONSTRAINTS[int(token_blocks)]


@triton.jit
def _emulated_chunk(words, x, scales, zeros, WARPS: tl.constexpr):
    """awq_mma_chunk with tensor ops, for the interpreter: the same lanes, the same outputs."""
    shift = awq_column_shift(tl.arange(0, 8))
    q = (words[:, :, None] >> shift[None, None, :]) & 0xF  # [L, 8 rows, 8 columns]
    z = (zeros >> shift[None, :]) & 0xF  # [L, 8 columns]
    w = (q - z[:, None, :]).to(tl.float32)
    # per warp: A[g, rows (t, e), col] and B[rows (t, e), tok = g']
    w = tl.reshape(w, [WARPS, 8, 32, 8])
    xb = tl.reshape(x, [WARPS, 8, 32])
    d = tl.sum(w[:, :, None, :, :] * xb[:, None, :, :, None], axis=3)  # [W, g, tok, col]
    # lane (g, t) element 4j + c: column 2j + c // 2, token 2t + c % 2
    d = tl.reshape(d, [WARPS, 8, 4, 2, 4, 2])  # [W, g, t, c % 2, j, c // 2]
    d = tl.permute(d, [0, 1, 2, 4, 5, 3])  # [W, g, t, j, c // 2, c % 2]
    d = tl.reshape(d, [WARPS * 32, 2, 8])  # [lane, j // 2, 4 (j % 2) + c]
    # each lane's own scales: column 2j + c // 2 of its packed column
    s = tl.reshape(scales.to(tl.float32), [WARPS * 32, 4, 2])  # [lane, j, c // 2]
    s = tl.broadcast_to(s[:, :, :, None], [WARPS * 32, 4, 2, 2])  # [lane, j, c // 2, c % 2]
    d = d * tl.reshape(s, [WARPS * 32, 2, 8])
    d_lo, d_hi = tl.split(tl.permute(d, [0, 2, 1]))
    return d_lo, d_hi


@triton.jit
def awq_mma_chunk(words, x_hi, x_lo, scales, zeros, IS_BF16: tl.constexpr, SPLIT_X: tl.constexpr,
                  WARPS: tl.constexpr, RN_SCALE: tl.constexpr = False):
    """One 32-row chunk of a warp's 64 columns (layout in the module docstring), for every
    warp of the program: ``words`` int32, ``x_hi`` / ``x_lo`` 16-bit and ``scales`` [32 * WARPS, 8],
    ``zeros`` int32 [32 * WARPS, 1]. Returns float32 (d_lo, d_hi) [32 * WARPS, 8]; ``x_lo`` is
    read only with SPLIT_X (x = x_hi + x_lo). RN_SCALE: the scale multiply rounded on its own (the
    Gluon W2's PTX)."""
    if _INLINE_PTX:
        if SPLIT_X:
            return tl.inline_asm_elementwise(chunk_ptx(IS_BF16, True, RN_SCALE), chunk_constraints(True),
                                             [words, x_hi, x_lo, scales, zeros],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=8)
        else:
            return tl.inline_asm_elementwise(chunk_ptx(IS_BF16, False, RN_SCALE), chunk_constraints(False),
                                             [words, x_hi, scales, zeros],
                                             dtype=(tl.float32, tl.float32), is_pure=True, pack=8)
    else:
        x = x_hi.to(tl.float32)
        if SPLIT_X:
            x += x_lo.to(tl.float32)
        return _emulated_chunk(words, x, scales, zeros, WARPS)


@triton.jit
def chunk_lanes(WARPS: tl.constexpr):
    """Index tensors of the fragment layout: (warp, g, t) [32 * WARPS, 1] and e [1, 8]."""
    lane = tl.arange(0, 32 * WARPS)[:, None]
    return lane // 32, (lane % 32) // 4, lane % 4, tl.arange(0, 8)[None, :]


@triton.jit
def chunk_rows(k0, t, e):
    """Reduction row of element e of lane group t in the chunk starting at row k0."""
    return k0 + (e // 4) * 16 + 4 * t + e % 4


@triton.jit
def chunk_columns(word, e):
    """Output column (token column 0 or 1 aside) of element e in d_lo (add 4 for d_hi)."""
    return word * 8 + 2 * (e // 4) + (e % 4) // 2


@triton.jit
def awq_mma_tokens(words, x0, x1, x2, x3, scales, zeros, IS_BF16: tl.constexpr, TOKEN_BLOCKS: tl.constexpr,
                   WARPS: tl.constexpr):
    """awq_mma_chunk over TOKEN_BLOCKS (2 or 4) B operands of 8 tokens each, ``x0`` .. ``x3``
    (those past TOKEN_BLOCKS unread), every A fragment dequantized once for all of them. Returns
    (d_lo, d_hi) of block 0, then block 1, ... (2 * TOKEN_BLOCKS tensors)."""
    if _INLINE_PTX:
        if TOKEN_BLOCKS == 2:
            return tl.inline_asm_elementwise(tokens_ptx(IS_BF16, 2), tokens_constraints(2),
                                             [words, x0, x1, scales, zeros],
                                             dtype=(tl.float32,) * 4, is_pure=True, pack=8)
        else:
            return tl.inline_asm_elementwise(tokens_ptx(IS_BF16, 4), tokens_constraints(4),
                                             [words, x0, x1, x2, x3, scales, zeros],
                                             dtype=(tl.float32,) * 8, is_pure=True, pack=8)
    else:
        d0 = _emulated_chunk(words, x0.to(tl.float32), scales, zeros, WARPS)
        d1 = _emulated_chunk(words, x1.to(tl.float32), scales, zeros, WARPS)
        if TOKEN_BLOCKS == 2:
            return d0[0], d0[1], d1[0], d1[1]
        else:
            d2 = _emulated_chunk(words, x2.to(tl.float32), scales, zeros, WARPS)
            d3 = _emulated_chunk(words, x3.to(tl.float32), scales, zeros, WARPS)
            return d0[0], d0[1], d1[0], d1[1], d2[0], d2[1], d3[0], d3[1]
