"""The prefill route's two GEMMs on Hopper's wgmma, the dequantized weights as its register A operand.

The GEMM runs transposed, out^T = W^T x^T: the weight columns are the wgmma's M (128 per program,
two m64 blocks; W13 also 64, one block: ``w13_tiles``), the group's sorted rows its N (BLOCK_ROWS
tokens), the reduction its K in steps of SUB pieces of 32 rows (each inside one AWQ group, whose
scales and zeros it takes). Each step's packed words go from global memory to a shared ring by
``cp.async`` and from there to registers, where PTX turns them into the A operand in the layout
wgmma reads from registers: no dequantized tile is ever stored to shared memory (the ``tl.dot``
kernels of ``prefill_dot.py`` store one per step, and wait on a barrier for it). The tokens' rows
(the B operand, K-major) go to a second ring by ``cp.async``. The scales and zero words, plain
loads, are requested a piece (W2) or a step (W13, ``SCALES_AHEAD``) before the piece that uses
them, so their latency overlaps work::

    [W13]  program (group, tile): the tile's 64 gate and the same 64 up columns (rows r = 0, 1 of A),
           or 32 and 32 (one m64 block, gate in warps 0-1, up in warps 2-3)
           per 32-row piece: words[32, 16] -> A[128, 32] (registers), or words[32, 8] -> A[64, 32]
                             x rows[BLOCK_ROWS, 32] -> B (shared)   acc[128, BLOCK_ROWS] += A @ B (wgmma)
           -> act[sorted position, cols] = silu(gate) * up, in the activation dtype
    [W2]   program (group, TILES_PER_PROGRAM tiles of 128 output columns): the group's act rows
           [BLOCK_ROWS, N] copied once to shared memory, then per tile N / 32 pieces as W13's
           (a ring of N / 32 stages keeps each piece in an allocation of its own: fewer barriers;
           past the config's unrolled pieces a loop over them)
           -> row_out[routed row, cols] in the activation dtype
    then the combine (combine.py), as the other prefill kernels.

A's rows and the words: thread (warp w, lane 4 g + t) holds, as the m16n8k16 fragment does in
each of wgmma's m64 blocks, rows g and g + 8 of block 16 w; with g = 4 gh + b, its rows in block r
are the nibbles 2 b and 2 b + 1 (h = 0, 1) of word 8 r + 2 w + gh of the tile (2 w + gh in a
one-block program), at reduction rows
2 t, 2 t + 1 (+8, +16, +24). A PRMT of the words of rows (k, k + 1) brings byte b of each into one
register, and one LOP3 per nibble gives the fp16 (bf16) pair (magic + q) of both rows, from which
one pair subtract of (magic + z) and one pair multiply by the column's scale make the pair of A:
(q - z) * scale rounded to the activation dtype, as the ``dot`` kernels and vLLM's Triton AWQ
kernels round it. Which logical column a row is (``_tile_columns``) is a permutation of the row's
bits, so the outputs are reordered by reshapes alone.

Gluon on Hopper only (no interpreter): elsewhere ``plan.prefill_config_run`` gives a wgmma config's
token counts the mma kernels (up to 32-row groups) or the dot kernels (above).
"""

from triton.language import constexpr as _constexpr

from .gluon_helpers import AVAILABLE

STEP_ROWS = 32  # reduction rows per piece of a step (the layouts below are built for 32: not a knob)
TILE_COLUMNS = 128  # A rows per program: two m64 blocks
# W2's 128-column tiles per program (the act rows copied once for them) and its pieces of a tile
# (N / 32) unrolled at compile time up to UNROLL_UP_TO (qwen3.8's N = 160 is 5) come from the
# config (``PrefillConfig.w2_tiles_per_program``, ``.w2_unrolled_pieces``). A larger N loops over
# its pieces (the same sums in the same order): unrolled, its registers grow with N (121-138 at
# N = 384-512, 168-195 at N = 768, spills at N = 1408 over 32-row groups) and so does its compile
# (22 s at N = 6144, spilling 2.7 KB)


def w13_programs_per_group(tiles: str, N: int) -> int:
    """W13's programs per sorted group: 64 columns each ("wide") or 32 ("narrow")."""
    return -(-N // (64 if tiles == "wide" else 32))


# fp16: nibble 2b at bits 0-3 | 0x6400 is 1024 + q, nibble 2b + 1 at bits 4-7 | 0x5400 is 64 + q;
# bf16: each nibble shifted to bits 0-3 | 0x4300 is 128 + q
_F16_ASM = _constexpr("""{
.reg .b32 x, a0, a1;
prmt.b32 x, $2, $3, $4;
lop3.b32 a0, x, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, x, 0x00F000F0, 0x54005400, 0xEA;
sub.f16x2 a0, a0, $6;
sub.f16x2 a1, a1, $8;
mul.rn.f16x2 $0, a0, $10;
mul.rn.f16x2 $1, a1, $11;
}""")
_BF16_ASM = _constexpr("""{
.reg .b32 x, x4, a0, a1;
prmt.b32 x, $2, $3, $4;
shr.u32 x4, x, 4;
lop3.b32 a0, x, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 a1, x4, 0x000F000F, 0x43004300, 0xEA;
sub.rn.bf16x2 a0, a0, $6;
sub.rn.bf16x2 a1, a1, $8;
mul.rn.bf16x2 $0, a0, $10;
mul.rn.bf16x2 $1, a1, $11;
}""")
# the zero word's byte b as the pairs (magic + z) of both nibbles (the same in both halves)
_F16_ZERO_ASM = _constexpr("""{
.reg .b32 x;
prmt.b32 x, $2, $2, $3;
lop3.b32 $0, x, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, x, 0x00F000F0, 0x54005400, 0xEA;
}""")
_BF16_ZERO_ASM = _constexpr("""{
.reg .b32 x, x4;
prmt.b32 x, $2, $2, $3;
shr.u32 x4, x, 4;
lop3.b32 $0, x, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 $1, x4, 0x000F000F, 0x43004300, 0xEA;
}""")

try:  # a Triton whose Gluon lacks this Hopper API keeps the other prefill kernels (plan.wgmma_runs)
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

    HOPPER_AVAILABLE = AVAILABLE
except ImportError:
    HOPPER_AVAILABLE = False

if HOPPER_AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .gluon_helpers import async_copy, let_next_launch_start, wait_for_previous_launch

    # [32 (k), 16 (word of the tile), 4 (byte b)]: k = 2 t + {0, 1} (+8, +16, +24), word = 8 r + 2 w + gh,
    # lanes (t, b, gh), warps w: the threads' share of A before its rows are spelled out
    _WORDS3 = gl.BlockedLayout([2, 1, 1], [4, 2, 4], [1, 4, 1], [0, 2, 1])
    _WORDS2 = gl.SliceLayout(2, _WORDS3)  # [32, 16]: the words each thread needs (lanes b share them)
    _COLS2 = gl.SliceLayout(0, _WORDS3)  # [16, 4]: per (word, byte)
    _COPY_WORDS = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])  # [32, 16] int32, 16 bytes a thread
    _COPY_ROWS = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])  # [rows, 32] 16-bit, 16 bytes a thread
    _COPY_WORDS_NARROW = gl.BlockedLayout([1, 2], [8, 4], [4, 1], [1, 0])  # [32, 8] int32, 8 bytes a thread
    # the words ring: conflict-free reads of rows 2 t (+1) by the four t of a warp (16 or 8 words a row)
    _RING_WORDS = gl.SwizzledSharedLayout(4, 2, 4, [1, 0])
    _RING_WORDS_NARROW = gl.SwizzledSharedLayout(2, 2, 4, [1, 0])
    _RING_ROWS = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=16, rank=2)

    @gluon.jit
    def _group_of(group_id, group_expert_ptr, group_start_ptr, group_count_ptr):
        """A sorted group's expert, its first sorted position and its row count (expert_sort.py)."""
        # read before the wait for the previous launch (PDL): from L2, never an L1 line of an earlier call
        expert = gl.load(group_expert_ptr + group_id, cache_modifier=".cg").to(gl.int64)
        return (expert, gl.load(group_start_ptr + group_id, cache_modifier=".cg"),
                gl.load(group_count_ptr + group_id, cache_modifier=".cg"))

    @gluon.jit
    def _selectors():
        """PRMT selectors: byte b of two words into bytes 0 and 2 ([1, 1, 4] over _WORDS3), and a zero
        word's byte b into bytes 0 and 2 ([1, 4] over _COLS2)."""
        b3 = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, _WORDS3)))[None, None, :]
        b2 = gl.arange(0, 4, layout=gl.SliceLayout(0, _COLS2))[None, :]
        return b3 * 0x1111 + 0x4400, b2 * 0x0101

    @gluon.jit
    def _tile_columns(word_base, word_stride_r, HALF: gl.constexpr):
        """[2 HALF, 4] over _COLS2 (word of the tile wd, byte b; the first HALF words are one half of
        the tile, gate or W2's columns, the next HALF the up words): the packed column of each word
        (base + (wd // HALF) * stride + wd % HALF), the logical columns of its nibbles 2 b and
        2 b + 1, and wd % HALF (the word's place in its half)."""
        wd = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(1, _COLS2))[:, None]
        b = gl.arange(0, 4, layout=gl.SliceLayout(0, _COLS2))[None, :]
        word = word_base + (wd // HALF) * word_stride_r + wd % HALF + b * 0
        # AutoAWQ: nibble p holds column 2 (p % 4) + p // 4 of its word's 8; p = 2 b + h
        col_lo = word * 8 + 2 * ((2 * b) % 4) + (2 * b) // 4
        col_hi = word * 8 + 2 * ((2 * b + 1) % 4) + (2 * b + 1) // 4
        return word, col_lo, col_hi, wd % HALF + b * 0

    @gluon.jit
    def _zero_pairs(zero_words, zero_pick, IS_BF16: gl.constexpr):
        """(magic + z) pairs [1, 16, 4] of nibbles 2 b and 2 b + 1 of each zero word [16, 4]."""
        asm: gl.constexpr = _BF16_ZERO_ASM if IS_BF16 else _F16_ZERO_ASM
        lo, hi = gl.inline_asm_elementwise(asm, "=r,=r,r,r", [zero_words, gl.broadcast(zero_pick, zero_words)[0]],
                                           dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return lo[None, :, :], hi[None, :, :]

    @gluon.jit
    def _dequantize(words, zero_lo, zero_hi, scale_lo, scale_hi, pick, IS_BF16: gl.constexpr,
                    A_LAYOUT: gl.constexpr):
        """A [128, 32] in ``A_LAYOUT`` from one piece's words [32, 16] (``_WORDS2``): per (word, byte b)
        [1, 16, 4] the (magic + z) pairs of nibbles 2 b (lo) and 2 b + 1 (hi) (``_zero_pairs``), the
        scales of those two columns, and ``pick``, the PRMT selectors of byte b (``_selectors``)."""
        w3 = gl.broadcast(words[:, :, None], pick)[0]
        asm: gl.constexpr = _BF16_ASM if IS_BF16 else _F16_ASM
        lo, hi = gl.inline_asm_elementwise(
            asm, "=r,=r,r,r,r,r,r,r,r,r,r,r",
            [w3, gl.broadcast(pick, w3)[0], gl.broadcast(zero_lo, w3)[0], gl.broadcast(zero_hi, w3)[0],
             gl.broadcast(scale_lo, w3)[0], gl.broadcast(scale_hi, w3)[0]],
            dtype=(scale_lo.dtype, scale_lo.dtype), is_pure=True, pack=2)
        a = gl.join(lo, hi)
        if words.shape[1] == 16:  # [k, word (r, w1, w0, gh), byte (b1, b0), h] -> A row 64 r + 16 w + 8 h + 4 gh + b
            a = gl.reshape(a, [32, 2, 2, 2, 2, 2, 2, 2])
            a = gl.permute(a, [1, 2, 3, 7, 4, 5, 6, 0])
            a = gl.reshape(a, [128, 32])
        else:  # [k, word (w1, w0, gh), byte (b1, b0), h] -> A row 16 w + 8 h + 4 gh + b
            a = gl.reshape(a, [32, 2, 2, 2, 2, 2, 2])
            a = gl.permute(a, [1, 2, 6, 3, 4, 5, 0])
            a = gl.reshape(a, [64, 32])
        return gl.convert_layout(a, A_LAYOUT)

    @gluon.jit
    def _in_column_order(acc, n: gl.constexpr):
        """acc [128, n] with its rows reordered from A's (64 r + 16 w + 8 h + 4 gh + b) to the tile's
        logical columns (64 r + 32 w1 + 16 w0 + 8 gh + 4 b0 + 2 h + b1); acc [64, n] from 16 w + 8 h +
        4 gh + b to 32 w1 + 16 w0 + 8 gh + 4 b0 + 2 h + b1: reshapes, no data moved."""
        if acc.shape[0] == 128:
            a = gl.reshape(acc, [2, 2, 2, 2, 2, 2, 2, n])  # r, w1, w0, h, gh, b1, b0
            a = gl.permute(a, [0, 1, 2, 4, 6, 3, 5, 7])  # r, w1, w0, gh, b0, h, b1
        else:
            a = gl.reshape(acc, [2, 2, 2, 2, 2, 2, n])  # w1, w0, h, gh, b1, b0
            a = gl.permute(a, [0, 1, 3, 5, 2, 4, 6])  # w1, w0, gh, b0, h, b1
        return gl.reshape(a, [acc.shape[0], n])

    @gluon.jit
    def _wait_for_step(STAGES: gl.constexpr):
        """This step's copies landed (every thread's; the ring holds STAGES - 1 steps ahead) and every
        thread is past the previous step's wgmma."""
        async_copy.wait_group(STAGES - 2)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _piece_scales(k0, expert_scales, expert_zeros, col_lo, col_hi, ok, COLS: gl.constexpr, G: gl.constexpr,
                      PACKED: gl.constexpr):
        """The scales of reduction rows k0 .. k0 + 31 (one AWQ group's) and their packed zero words."""
        group = k0 // G
        s_lo = gl.load(expert_scales + group * COLS + col_lo, mask=ok, other=0.0)[None, :, :]
        s_hi = gl.load(expert_scales + group * COLS + col_hi, mask=ok, other=0.0)[None, :, :]
        return s_lo, s_hi, gl.load(expert_zeros + group * PACKED, mask=ok, other=0)

    @gluon.jit
    def _w13_copy_words(step, u, ring_words, words_src, word_ok, PACKED: gl.constexpr, STAGES: gl.constexpr,
                        SUB: gl.constexpr):
        """Piece u of step ``step`` (32 reduction rows): its words into the step's ring stage."""
        async_copy.async_copy_global_to_shared(ring_words.index((step % STAGES) * SUB + u),
                                               words_src + (step * SUB + u) * 32 * PACKED, mask=word_ok)

    @gluon.jit
    def _w13_copy_rows(step, u, ring_rows, rows_src, row_ok, STAGES: gl.constexpr, SUB: gl.constexpr):
        """Piece u of step ``step``: its token rows into the step's ring stage."""
        async_copy.async_copy_global_to_shared(ring_rows.index((step % STAGES) * SUB + u),
                                               rows_src + (step * SUB + u) * 32, mask=row_ok)

    @gluon.jit
    def _w13_copy_step(step, ring_words, ring_rows, words_src, rows_src, word_ok, row_ok, PACKED: gl.constexpr,
                       STAGES: gl.constexpr, SUB: gl.constexpr):
        """Step ``step``'s words and token rows into its ring stage, a piece's words beside its rows:
        the compiler puts a barrier between two copies into one ring, so alternating the rings
        takes SUB - 1 barriers, not 2 (SUB - 1)."""
        for u in gl.static_range(SUB):
            _w13_copy_words(step, u, ring_words, words_src, word_ok, PACKED, STAGES, SUB)
            _w13_copy_rows(step, u, ring_rows, rows_src, row_ok, STAGES, SUB)

    @gluon.jit
    def _w2_copy_piece(j, piece, stage, words_src, first_tile, copy_ok, PACKED: gl.constexpr, TILES: gl.constexpr,
                       SUB: gl.constexpr):
        """W2 piece j's words (tile j // SUB, reduction rows 32 ``piece`` .., piece = j % SUB, given
        as a constant where the caller knows it) into the shared buffer ``stage``."""
        async_copy.async_copy_global_to_shared(stage, words_src + piece * 32 * PACKED + (j // SUB) * 16,
                                               mask=(first_tile + j // SUB < TILES) & copy_ok)

    @gluon.jit
    def _w2_piece(s, j, tile, acc, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src, first_tile, copy_ok,
                  expert_scales, expert_zeros, word, col_lo, col_hi, local, pick, zero_pick, A_LAYOUT: gl.constexpr,
                  K: gl.constexpr, G: gl.constexpr, PACKED: gl.constexpr, TILES: gl.constexpr, SUB: gl.constexpr,
                  STEPS: gl.constexpr, STAGES: gl.constexpr, PIECE_RINGS: gl.constexpr, IS_BF16: gl.constexpr):
        """W2's piece s of ``tile`` (step j of the program) into ``acc``, with its scales and zero
        words (requested a piece before) and the next piece's requested; returns (acc, the next
        piece's scales and zero words)."""
        a_lo, a_hi, a_zw = s_lo, s_hi, zw
        next_tile = tile + (s + 1) // SUB  # the next piece: this tile's next 32 rows, or the next tile's first
        s_lo, s_hi, zw = _piece_scales(((s + 1) % SUB) * 32, expert_scales + next_tile * 128,
                                       expert_zeros + next_tile * 16 + word, col_lo, col_hi,
                                       (next_tile < TILES) & (j + 1 < STEPS) & (local >= 0), K, G, PACKED)
        z_lo, z_hi = _zero_pairs(a_zw, zero_pick, IS_BF16)
        _wait_for_step(STAGES)
        if j + STAGES - 1 < STEPS:
            if PIECE_RINGS:  # this tile's last piece (s = 0) or the next tile's piece s - 1, into
                # stage s - 1 (mod SUB), whose wgmma every thread waited for
                _w2_copy_piece(j + STAGES - 1, (s + SUB - 1) % SUB, piece_words[(s + SUB - 1) % SUB],
                               words_src, first_tile, copy_ok, PACKED, TILES, SUB)
            else:
                nj = j + STAGES - 1
                _w2_copy_piece(nj, nj % SUB, ring_words.index(nj % STAGES), words_src, first_tile, copy_ok,
                               PACKED, TILES, SUB)
        async_copy.commit_group()
        if PIECE_RINGS:
            words = piece_words[s].load(_WORDS2)
        else:
            words = ring_words.index(j % STAGES).load(_WORDS2)
        a = _dequantize(words, z_lo, z_hi, a_lo, a_hi, pick, IS_BF16, A_LAYOUT)
        acc = warpgroup_mma(a, act_smem.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(0, deps=[acc])
        return acc, s_lo, s_hi, zw

    @gluon.jit
    def _w2_tile(tt, first_tile, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src, copy_ok, expert_scales,
                 expert_zeros, word, col_lo, col_hi, local, pick, zero_pick, out_row, row_out_ptr, count, c, n,
                 MMA: gl.constexpr, STORE: gl.constexpr, A_LAYOUT: gl.constexpr, K: gl.constexpr, G: gl.constexpr,
                 PACKED: gl.constexpr, TILES: gl.constexpr, SUB: gl.constexpr, STEPS: gl.constexpr,
                 STAGES: gl.constexpr, PIECE_RINGS: gl.constexpr, IS_BF16: gl.constexpr, UNROLLED: gl.constexpr,
                 BLOCK_ROWS: gl.constexpr):
        """The program's tile ``tt``: its SUB pieces into an accumulator, stored to its 128 columns of the
        group's rows; returns the next piece's scales and zero words."""
        tile = first_tile + tt
        acc = gl.zeros([128, BLOCK_ROWS], gl.float32, layout=MMA)
        if UNROLLED:
            for s in gl.static_range(SUB):
                acc, s_lo, s_hi, zw = _w2_piece(
                    s, tt * SUB + s, tile, acc, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src,
                    first_tile, copy_ok, expert_scales, expert_zeros, word, col_lo, col_hi, local, pick, zero_pick,
                    A_LAYOUT, K, G, PACKED, TILES, SUB, STEPS, STAGES, PIECE_RINGS, IS_BF16)
        else:
            for s in range(SUB):
                acc, s_lo, s_hi, zw = _w2_piece(
                    s, tt * SUB + s, tile, acc, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src,
                    first_tile, copy_ok, expert_scales, expert_zeros, word, col_lo, col_hi, local, pick, zero_pick,
                    A_LAYOUT, K, G, PACKED, TILES, SUB, STEPS, STAGES, PIECE_RINGS, IS_BF16)
        out = gl.convert_layout(_in_column_order(acc, BLOCK_ROWS).to(row_out_ptr.dtype.element_ty), STORE)
        gl.store(row_out_ptr + out_row * K + tile * 128 + c, out, mask=(n < count) & (tile < TILES) & (c >= 0))
        return s_lo, s_hi, zw

    @gluon.jit
    def _w13_tile(
        x_ptr, stride_xm, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, group_id, word_base,
        qweight_ptr, scales_ptr, qzeros_ptr, act_ptr,
        TOP_K: gl.constexpr, K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, BLOCK_ROWS: gl.constexpr,
        STAGES: gl.constexpr, IS_BF16: gl.constexpr, SUB: gl.constexpr, SCALES_AHEAD: gl.constexpr,
        HALF: gl.constexpr, USE_PDL: gl.constexpr,
    ):
        """One program's tile: the HALF gate words from ``word_base`` (8 HALF columns) and the same up
        words, as A's 16 HALF rows (HALF = 8: two m64 blocks, gate then up; HALF = 4: one, gate in
        warps 0-1 and up in warps 2-3)."""
        ROWS: gl.constexpr = 16 * HALF
        PACKED: gl.constexpr = 2 * N // 8
        STEPS: gl.constexpr = K // (32 * SUB)
        expert, start, count = _group_of(group_id, group_expert_ptr, group_start_ptr, group_count_ptr)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_ROWS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
        copy_words: gl.constexpr = _COPY_WORDS if HALF == 8 else _COPY_WORDS_NARROW
        ring_layout: gl.constexpr = _RING_WORDS if HALF == 8 else _RING_WORDS_NARROW

        # a step's words: the tile's gate words, then the same up words
        ck = gl.arange(0, 32, layout=gl.SliceLayout(1, copy_words))[:, None]
        cw = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, copy_words))[None, :]
        word_ok = (word_base + cw % HALF < N // 8) & (ck >= 0)
        words_src = qweight_ptr + expert * (K * PACKED) + ck * PACKED + word_base + cw % HALF + (cw // HALF) * (N // 8)
        if SUB == 4:  # one ring per piece: the compiler orders two copies into one allocation by a barrier
            piece_words = (gl.allocate_shared_memory(gl.int32, [STAGES, 32, 2 * HALF], ring_layout),
                           gl.allocate_shared_memory(gl.int32, [STAGES, 32, 2 * HALF], ring_layout),
                           gl.allocate_shared_memory(gl.int32, [STAGES, 32, 2 * HALF], ring_layout),
                           gl.allocate_shared_memory(gl.int32, [STAGES, 32, 2 * HALF], ring_layout))
            piece_rows = (gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_ROWS, 32], _RING_ROWS),
                          gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_ROWS, 32], _RING_ROWS),
                          gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_ROWS, 32], _RING_ROWS),
                          gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES, BLOCK_ROWS, 32], _RING_ROWS))
        else:
            ring_words = gl.allocate_shared_memory(gl.int32, [STAGES * SUB, 32, 2 * HALF], ring_layout)
            ring_rows = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [STAGES * SUB, BLOCK_ROWS, 32], _RING_ROWS)
        # the first steps' words need only the group's expert, which the sort's launch before the
        # scatter wrote: requested before the wait for the scatter (PDL), their latency overlaps it
        for s in gl.static_range(STAGES - 1):
            if s < STEPS:  # a K of fewer steps than the ring holds reads nothing past the expert
                if SUB == 4:
                    for u in gl.static_range(SUB):
                        async_copy.async_copy_global_to_shared(piece_words[u].index(s),
                                                               words_src + (s * SUB + u) * 32 * PACKED, mask=word_ok)
                else:
                    for u in gl.static_range(SUB):
                        _w13_copy_words(s, u, ring_words, words_src, word_ok, PACKED, STAGES, SUB)
        wait_for_previous_launch(USE_PDL)
        let_next_launch_start(USE_PDL)  # after the wait: W2 reads the sort's groups before its own
        # a step's token rows: x rows in the sort's order
        rr = gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(1, _COPY_ROWS))[:, None]
        rk = gl.arange(0, 32, layout=gl.SliceLayout(0, _COPY_ROWS))[None, :]
        row_ok = (rr < count) & (rk >= 0)
        token = (gl.load(sorted_rows_ptr + start + rr, mask=rr < count, other=0) // TOP_K).to(gl.int64)
        rows_src = x_ptr + token * stride_xm + rk
        for s in gl.static_range(STAGES - 1):  # the first commit group holds every word copied above
            if s < STEPS:
                if SUB == 4:
                    for u in gl.static_range(SUB):
                        async_copy.async_copy_global_to_shared(piece_rows[u].index(s), rows_src + (s * SUB + u) * 32,
                                                               mask=row_ok)
                else:
                    for u in gl.static_range(SUB):
                        _w13_copy_rows(s, u, ring_rows, rows_src, row_ok, STAGES, SUB)
            async_copy.commit_group()

        pick, zero_pick = _selectors()
        word, col_lo, col_hi, local = _tile_columns(word_base, N // 8, HALF)
        ok = word_base + local < N // 8
        expert_scales = scales_ptr + expert * (K // G * 2 * N)
        expert_zeros = qzeros_ptr + expert * (K // G * PACKED) + word
        acc = gl.zeros([ROWS, BLOCK_ROWS], gl.float32, layout=mma)
        if SUB <= 2:
            # the step's scales and zero words: requested a step ahead (SCALES_AHEAD: their latency then
            # overlaps a whole step, for 11-15 more registers) or at the step's start, before its wait
            if SCALES_AHEAD:
                s_lo, s_hi, zw = _piece_scales(0, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N, G, PACKED)
                if SUB == 2:
                    s_lo1, s_hi1, zw1 = _piece_scales(32, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N, G, PACKED)
            for i in range(STEPS):
                if SCALES_AHEAD:
                    a_lo, a_hi, a_zw = s_lo, s_hi, zw
                    k_next = gl.minimum(i + 1, STEPS - 1) * SUB * 32  # the last step requests its own again
                    s_lo, s_hi, zw = _piece_scales(k_next, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N, G,
                                                   PACKED)
                    if SUB == 2:
                        a_lo1, a_hi1, a_zw1 = s_lo1, s_hi1, zw1
                        s_lo1, s_hi1, zw1 = _piece_scales(k_next + 32, expert_scales, expert_zeros, col_lo, col_hi, ok,
                                                          2 * N, G, PACKED)
                else:
                    a_lo, a_hi, a_zw = _piece_scales(i * SUB * 32, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N,
                                                     G, PACKED)
                    if SUB == 2:
                        a_lo1, a_hi1, a_zw1 = _piece_scales(i * SUB * 32 + 32, expert_scales, expert_zeros, col_lo, col_hi,
                                                            ok, 2 * N, G, PACKED)
                z_lo, z_hi = _zero_pairs(a_zw, zero_pick, IS_BF16)
                if SUB == 2:
                    z_lo1, z_hi1 = _zero_pairs(a_zw1, zero_pick, IS_BF16)
                _wait_for_step(STAGES)
                if i + STAGES - 1 < STEPS:  # into the stage of step i - 1, whose wgmma every thread waited for
                    _w13_copy_step(i + STAGES - 1, ring_words, ring_rows, words_src, rows_src, word_ok, row_ok, PACKED,
                                   STAGES, SUB)
                async_copy.commit_group()
                stage = (i % STAGES) * SUB
                a = _dequantize(ring_words.index(stage).load(_WORDS2), z_lo, z_hi, a_lo, a_hi, pick, IS_BF16, a_layout)
                acc = warpgroup_mma(a, ring_rows.index(stage).permute((1, 0)), acc, is_async=True)
                if SUB == 2:
                    a1 = _dequantize(ring_words.index(stage + 1).load(_WORDS2), z_lo1, z_hi1, a_lo1, a_hi1, pick,
                                     IS_BF16, a_layout)
                    acc = warpgroup_mma(a1, ring_rows.index(stage + 1).permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
        else:
            # steps of SUB >= 4 pieces (one wait and barrier for all): each piece's scales and zero
            # words requested a piece ahead, across the step's end too
            n_lo, n_hi, n_zw = _piece_scales(0, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N, G, PACKED)
            for i in range(STEPS):
                _wait_for_step(STAGES)
                if i + STAGES - 1 < STEPS:  # into the stage of step i - 1, whose wgmma every thread waited for
                    if SUB == 4:
                        for u in gl.static_range(SUB):
                            k0 = ((i + STAGES - 1) * SUB + u) * 32
                            async_copy.async_copy_global_to_shared(piece_words[u].index((i + STAGES - 1) % STAGES),
                                                                   words_src + k0 * PACKED, mask=word_ok)
                            async_copy.async_copy_global_to_shared(piece_rows[u].index((i + STAGES - 1) % STAGES),
                                                                   rows_src + k0, mask=row_ok)
                    else:
                        _w13_copy_step(i + STAGES - 1, ring_words, ring_rows, words_src, rows_src, word_ok, row_ok,
                                       PACKED, STAGES, SUB)
                async_copy.commit_group()
                for u in gl.static_range(SUB):
                    a_lo, a_hi, a_zw = n_lo, n_hi, n_zw
                    k_next = gl.minimum(i * SUB + u + 1, STEPS * SUB - 1) * 32  # the last piece requests its own
                    n_lo, n_hi, n_zw = _piece_scales(k_next, expert_scales, expert_zeros, col_lo, col_hi, ok, 2 * N,
                                                     G, PACKED)
                    z_lo, z_hi = _zero_pairs(a_zw, zero_pick, IS_BF16)
                    if SUB == 4:
                        words_u = piece_words[u].index(i % STAGES)
                        rows_u = piece_rows[u].index(i % STAGES)
                    else:
                        words_u = ring_words.index((i % STAGES) * SUB + u)
                        rows_u = ring_rows.index((i % STAGES) * SUB + u)
                    a = _dequantize(words_u.load(_WORDS2), z_lo, z_hi, a_lo, a_hi, pick, IS_BF16, a_layout)
                    acc = warpgroup_mma(a, rows_u.permute((1, 0)), acc, is_async=True)
                acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)

        out = gl.permute(gl.reshape(_in_column_order(acc, BLOCK_ROWS), [2, 8 * HALF, BLOCK_ROWS]), [1, 2, 0])
        if HALF == 4:  # gate and up in different warps: bring each column's pair into one thread
            out = gl.convert_layout(out, gl.BlockedLayout([1, 1, 2], [8, 4, 1], [4, 1, 1], [2, 1, 0]))
        gate, up = gl.split(out)
        act = (gate / (1.0 + gl.exp(-gate)) * up).to(act_ptr.dtype.element_ty)
        store: gl.constexpr = gl.BlockedLayout([HALF, 1], [8, 4], [1, 4], [0, 1])
        act = gl.convert_layout(act, store)
        c = gl.arange(0, 8 * HALF, layout=gl.SliceLayout(1, store))[:, None]
        n = gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(0, store))[None, :]
        cols = word_base * 8 + c
        gl.store(act_ptr + (start + n).to(gl.int64) * N + cols, act, mask=(cols < N) & (n < count))

    @gluon.jit
    def w13_wgmma_kernel(
        x_ptr, stride_xm, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
        qweight_ptr, scales_ptr, qzeros_ptr, act_ptr,
        TOP_K: gl.constexpr, K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, BLOCK_ROWS: gl.constexpr,
        STAGES: gl.constexpr, IS_BF16: gl.constexpr, SUB: gl.constexpr = 1, SCALES_AHEAD: gl.constexpr = False,
        TILES: gl.constexpr = "wide", USE_PDL: gl.constexpr = False,
    ):
        """act[position, cols] = silu(x W13_gate) * (x W13_up) for the group's rows; a step is SUB pieces
        of 32 reduction rows (one wait and one barrier for all of them). TILES (``w13_tiles``): "wide",
        programs of 64 gate and 64 up columns (the last one padded where 64 does not divide N), or
        "narrow", of 32 and 32 (none padded where 32 divides N). USE_PDL: launched to start while the
        sort's scatter runs; it reads the groups before waiting for it (the sort's launches each
        wait before letting the next start, so the groups are complete once this one runs)."""
        HALF: gl.constexpr = 8 if TILES == "wide" else 4  # gate words per program
        PER_GROUP: gl.constexpr = (N + 8 * HALF - 1) // (8 * HALF)
        pid = gl.program_id(0)
        group_id = pid // PER_GROUP
        if group_id < gl.load(num_groups_ptr, cache_modifier=".cg"):
            _w13_tile(x_ptr, stride_xm, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr,
                      group_id, (pid % PER_GROUP) * HALF, qweight_ptr, scales_ptr, qzeros_ptr, act_ptr,
                      TOP_K, K, N, G, BLOCK_ROWS, STAGES, IS_BF16, SUB, SCALES_AHEAD, HALF, USE_PDL)
        elif pid == 0:  # no groups (every id outside [0, E)): one program still waits, so W13 ends after the sort
            wait_for_previous_launch(USE_PDL)

    @gluon.jit
    def w2_wgmma_kernel(
        act_ptr, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr, num_groups_ptr,
        qweight_ptr, scales_ptr, qzeros_ptr, row_out_ptr,
        K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, BLOCK_ROWS: gl.constexpr,
        TILES_PER_PROGRAM: gl.constexpr, STAGES: gl.constexpr, IS_BF16: gl.constexpr, USE_PDL: gl.constexpr = False,
        UNROLL_UP_TO: gl.constexpr = 8,
    ):
        """row_out[row, cols] = act[position] @ W2[expert][:, cols] for the group's rows,
        TILES_PER_PROGRAM tiles of 128 columns per program. USE_PDL: launched to start while W13
        runs; it reads the sort's groups and requests its first weights before waiting for W13 (W13
        lets it start only after its own wait, so the sort is complete once this one runs)."""
        PACKED: gl.constexpr = K // 8
        TILES: gl.constexpr = K // 128
        PROGRAMS: gl.constexpr = (TILES + TILES_PER_PROGRAM - 1) // TILES_PER_PROGRAM  # per group
        SUB: gl.constexpr = N // 32  # steps per tile
        pid = gl.program_id(0)
        group_id = pid // PROGRAMS
        first_tile = (pid % PROGRAMS) * TILES_PER_PROGRAM
        if group_id >= gl.load(num_groups_ptr, cache_modifier=".cg"):
            return
        expert, start, count = _group_of(group_id, group_expert_ptr, group_start_ptr, group_count_ptr)
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_ROWS, 16])
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)

        # step j: tile first_tile + j // SUB, reduction rows 32 (j % SUB) ..
        ck = gl.arange(0, 32, layout=gl.SliceLayout(1, _COPY_WORDS))[:, None]
        cw = gl.arange(0, 16, layout=gl.SliceLayout(0, _COPY_WORDS))[None, :]
        words_src = qweight_ptr + expert * (N * PACKED) + ck * PACKED + first_tile * 16 + cw
        copy_ok = (cw >= 0) & (ck >= 0)
        STEPS: gl.constexpr = TILES_PER_PROGRAM * SUB
        # a tile's pieces unrolled at compile time up to UNROLL_UP_TO; more (a large N) loop
        UNROLLED: gl.constexpr = SUB <= UNROLL_UP_TO
        # a ring of as many stages as a tile has pieces: piece s always in stage s, one allocation
        # each (the compiler puts a barrier between two copies into one allocation)
        PIECE_RINGS: gl.constexpr = STAGES == SUB and UNROLLED
        piece_words = ()
        ring_words = None
        if PIECE_RINGS:
            for p in gl.static_range(SUB):
                piece_words += (gl.allocate_shared_memory(gl.int32, [32, 16], _RING_WORDS),)
        else:
            ring_words = gl.allocate_shared_memory(gl.int32, [STAGES, 32, 16], _RING_WORDS)
        for p in gl.static_range(STAGES - 1):  # before the wait for W13 (PDL): the weights are not W13's
            if p < STEPS:
                stage = piece_words[p] if PIECE_RINGS else ring_words.index(p % STAGES)
                _w2_copy_piece(p, p % SUB, stage, words_src, first_tile, copy_ok, PACKED, TILES, SUB)
        wait_for_previous_launch(USE_PDL)
        let_next_launch_start(USE_PDL)
        # the group's act rows (contiguous: act is in sorted positions), once: [SUB, rows, 32]; one
        # commit group with the words above, then empty ones, so step j waits as the ring counts
        rr = gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(1, _COPY_ROWS))[:, None]
        rk = gl.arange(0, 32, layout=gl.SliceLayout(0, _COPY_ROWS))[None, :]
        row_ok = (rr < count) & (rk >= 0)
        act_smem = gl.allocate_shared_memory(act_ptr.dtype.element_ty, [SUB, BLOCK_ROWS, 32], _RING_ROWS)
        if UNROLLED:
            for s in gl.static_range(SUB):
                async_copy.async_copy_global_to_shared(act_smem.index(s), act_ptr + (start + rr).to(gl.int64) * N
                                                       + s * 32 + rk, mask=row_ok)
        else:
            for s in range(SUB):
                async_copy.async_copy_global_to_shared(act_smem.index(s), act_ptr + (start + rr).to(gl.int64) * N
                                                       + s * 32 + rk, mask=row_ok)
        for p in gl.static_range(STAGES - 1):
            async_copy.commit_group()

        pick, zero_pick = _selectors()
        word, col_lo, col_hi, local = _tile_columns(0, 8, 8)
        expert_scales = scales_ptr + expert * (N // G * K)
        expert_zeros = qzeros_ptr + expert * (N // G * PACKED)
        store: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 4], [0, 1])
        c = gl.arange(0, 128, layout=gl.SliceLayout(1, store))[:, None]
        n = gl.arange(0, BLOCK_ROWS, layout=gl.SliceLayout(0, store))[None, :]
        out_row = gl.load(sorted_rows_ptr + start + n, mask=n < count, other=0).to(gl.int64)
        # a piece's scales and zero words, requested a piece ahead: their global-load latency overlaps
        # the previous piece's work (at no cost in programs per SM here)
        s_lo, s_hi, zw = _piece_scales(0, expert_scales + first_tile * 128, expert_zeros + first_tile * 16 + word,
                                       col_lo, col_hi, (first_tile < TILES) & (local >= 0), K, G, PACKED)
        if TILES_PER_PROGRAM == 1:  # one tile: each piece's step j a constant, as its ring prefetch's bound
            s_lo, s_hi, zw = _w2_tile(
                0, first_tile, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src, copy_ok, expert_scales,
                expert_zeros, word, col_lo, col_hi, local, pick, zero_pick, out_row, row_out_ptr, count, c, n, mma,
                store, a_layout, K, G, PACKED, TILES, SUB, STEPS, STAGES, PIECE_RINGS, IS_BF16, UNROLLED, BLOCK_ROWS)
        else:
            for tt in range(TILES_PER_PROGRAM):
                s_lo, s_hi, zw = _w2_tile(
                    tt, first_tile, s_lo, s_hi, zw, piece_words, ring_words, act_smem, words_src, copy_ok,
                    expert_scales, expert_zeros, word, col_lo, col_hi, local, pick, zero_pick, out_row, row_out_ptr,
                    count, c, n, mma, store, a_layout, K, G, PACKED, TILES, SUB, STEPS, STAGES, PIECE_RINGS, IS_BF16,
                    UNROLLED, BLOCK_ROWS)
        async_copy.wait_group(0)
