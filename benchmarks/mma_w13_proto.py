"""Prototype: W13 on tensor cores (mma.sync) with weights repacked into mma-fragment order.

    PYTHONPATH=. python benchmarks/mma_w13_proto.py sass        # CPU: sm_90 SASS counts
    PYTHONPATH=. python benchmarks/mma_w13_proto.py gpu [M,...] # H200: exactness + timing vs shipped W13

Weights as the A operand of mma.m16n8k16 (rows = output columns n, K = reduction),
the routed token as column 0 of the B operand. Lane (g, t) of a warp holds, per
16-row tile and 32-row group, one int32 of row g and one of row g + 8, each with
the 8 nibbles of k = 8t .. 8t + 7 (nibble j -> k 2j, nibble j + 4 -> k 2j + 1), so
one LOP3 makes one fp16 pair of the A fragment: (w & 0x000F000F) | 0x6400 pairs
= 1024 + q, (w & 0x00F000F0) | 0x5400 pairs = 64 + q, w >> 8 for the other two.
The zero point rides in the same mma chain as A = -(1024 + z) / -(64 + z) pairs,
so D = sum_k x_k (q_k - z); then D * scale in float32 per group.
"""
import sys

import torch
import triton
import triton.language as tl

INTERPRET = False

# memory layout of the repacked tensors, per expert:
#   words  [tiles = Nout / 16, chunks = K / 64, 32 lanes, 4]  int32  (v: (g, b0), (g+8, b0), (g, b1), (g+8, b1))
#   scales [tiles, chunks, 8 (g), 4]                           fp16   (same v)
#   zeros  [tiles, chunks, 8 (g), 4]                           uint8  z * 0x11 (both nibbles), same v


def repack_for_mma(qweight, scales, qzeros, group_size):
    """AutoAWQ [E, K, Nout/8] int32 (+ scales [E, K/G, Nout], qzeros [E, K/G, Nout/8]) -> fragment order."""
    from moe_grouped_decode.awq import unpack_int4
    assert group_size == 32
    E, K, _ = qweight.shape
    q = unpack_int4(qweight).to(torch.int32)          # [E, K, Nout]
    Nout = q.shape[-1]
    z = unpack_int4(qzeros).to(torch.int32)           # [E, K/G, Nout]
    tiles, chunks = Nout // 16, K // 64
    # q[e, k, n] with n = tile*16 + h*8 + g (h: row g or g+8), k = chunk*64 + b*32 + 8t + off
    q = q.reshape(E, chunks, 2, 4, 8, tiles, 2, 8)    # e, chunk, b, t, off, tile, h, g
    # off (0..7) -> nibble: off 2j -> nibble j, off 2j+1 -> nibble j + 4
    nib_of_off = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], device=qweight.device)
    shifts = (4 * nib_of_off).to(torch.int64)
    words = (q.to(torch.int64) << shifts.view(1, 1, 1, 1, 8, 1, 1, 1)).sum(dim=4)  # e, chunk, b, t, tile, h, g
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    # -> e, tile, chunk, lane = 4g + t, v = 2b + h
    words = words.permute(0, 4, 1, 6, 3, 2, 5).reshape(E, tiles, chunks, 32, 4).contiguous()
    s = scales.reshape(E, chunks, 2, tiles, 2, 8)      # e, chunk, b, tile, h, g
    s = s.permute(0, 3, 1, 5, 2, 4).reshape(E, tiles, chunks, 8, 4).contiguous()
    zz = z.reshape(E, chunks, 2, tiles, 2, 8).permute(0, 3, 1, 5, 2, 4).reshape(E, tiles, chunks, 8, 4)
    zz = (zz * 0x11).to(torch.uint8).contiguous()
    return words, s, zz


_ASM_FP16 = tl.constexpr("""
{
.reg .b32 zw, zs, a<4>, b<4>, m<4>, w<2>;
.reg .f32 d<4>, e<4>, s<4>;
.reg .b16 h<4>;
mov.b32 {h0, h1}, $16;
cvt.f32.f16 s0, h0;
cvt.f32.f16 s1, h1;
mov.b32 {h2, h3}, $17;
cvt.f32.f16 s2, h2;
cvt.f32.f16 s3, h3;
prmt.b32 zw, $18, 0, 0x1010;
shr.u32 zs, zw, 8;
lop3.b32 m0, zw, 0x000F000F, 0xE400E400, 0xEA;
lop3.b32 m1, zs, 0x000F000F, 0xE400E400, 0xEA;
lop3.b32 m2, zw, 0x00F000F0, 0xD400D400, 0xEA;
lop3.b32 m3, zs, 0x00F000F0, 0xD400D400, 0xEA;
lop3.b32 a0, $4, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, $5, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a2, $4, 0x00F000F0, 0x54005400, 0xEA;
lop3.b32 a3, $5, 0x00F000F0, 0x54005400, 0xEA;
shr.u32 w0, $4, 8;
shr.u32 w1, $5, 8;
lop3.b32 b0, w0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b1, w1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b2, w0, 0x00F000F0, 0x54005400, 0xEA;
lop3.b32 b3, w1, 0x00F000F0, 0x54005400, 0xEA;
mov.f32 d0, 0f00000000;
mov.f32 d1, 0f00000000;
mov.f32 d2, 0f00000000;
mov.f32 d3, 0f00000000;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {a0,a1,a2,a3}, {$8,$9}, {d0,d1,d2,d3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {m0,m1,m2,m3}, {$8,$9}, {d0,d1,d2,d3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {b0,b1,b2,b3}, {$10,$11}, {d0,d1,d2,d3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d0,d1,d2,d3}, {m0,m1,m2,m3}, {$10,$11}, {d0,d1,d2,d3};
mul.f32 $0, d0, s0;
mul.f32 $1, d1, s0;
mul.f32 $2, d2, s1;
mul.f32 $3, d3, s1;
prmt.b32 zw, $18, 0, 0x3232;
shr.u32 zs, zw, 8;
lop3.b32 m0, zw, 0x000F000F, 0xE400E400, 0xEA;
lop3.b32 m1, zs, 0x000F000F, 0xE400E400, 0xEA;
lop3.b32 m2, zw, 0x00F000F0, 0xD400D400, 0xEA;
lop3.b32 m3, zs, 0x00F000F0, 0xD400D400, 0xEA;
lop3.b32 a0, $6, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a1, $7, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 a2, $6, 0x00F000F0, 0x54005400, 0xEA;
lop3.b32 a3, $7, 0x00F000F0, 0x54005400, 0xEA;
shr.u32 w0, $6, 8;
shr.u32 w1, $7, 8;
lop3.b32 b0, w0, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b1, w1, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 b2, w0, 0x00F000F0, 0x54005400, 0xEA;
lop3.b32 b3, w1, 0x00F000F0, 0x54005400, 0xEA;
mov.f32 e0, 0f00000000;
mov.f32 e1, 0f00000000;
mov.f32 e2, 0f00000000;
mov.f32 e3, 0f00000000;
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {e0,e1,e2,e3}, {a0,a1,a2,a3}, {$12,$13}, {e0,e1,e2,e3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {e0,e1,e2,e3}, {m0,m1,m2,m3}, {$12,$13}, {e0,e1,e2,e3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {e0,e1,e2,e3}, {b0,b1,b2,b3}, {$14,$15}, {e0,e1,e2,e3};
mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {e0,e1,e2,e3}, {m0,m1,m2,m3}, {$14,$15}, {e0,e1,e2,e3};
fma.rn.f32 $0, e0, s2, $0;
fma.rn.f32 $1, e1, s2, $1;
fma.rn.f32 $2, e2, s3, $2;
fma.rn.f32 $3, e3, s3, $3;
}
""")
_CONSTRAINTS = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 15))


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _w13_mma_kernel(x_ptr, stride_xm, ids_ptr, words_ptr, scales_ptr, zeros_ptr, partials_ptr, rows,
                    TOP_K: tl.constexpr, K: tl.constexpr, NOUT: tl.constexpr, T: tl.constexpr, C: tl.constexpr,
                    NW: tl.constexpr, READ_ONLY: tl.constexpr):
    """partials[s, row, n] for the NW * T * 16 rows n of tile block tb (warp w: tiles w * T ..) and the
    C * 64 k of split s. READ_ONLY: the same loads, xor-reduced, no arithmetic (the access floor)."""
    NT: tl.constexpr = NOUT // 16
    NC: tl.constexpr = K // 64
    TB: tl.constexpr = NT // (T * NW)
    SPLITS: tl.constexpr = NC // C
    pid = tl.program_id(0)
    tb = pid % TB
    split = (pid // TB) % SPLITS
    row = pid // (TB * SPLITS)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    token = (row // TOP_K).to(tl.int64)
    lanes = tl.arange(0, 32 * NW)[:, None, None, None]
    lane = lanes % 32
    ti = tl.arange(0, T)[None, :, None, None]
    ci = tl.arange(0, C)[None, None, :, None]
    v = tl.arange(0, 4)[None, None, None, :]
    tile = (tb * NW + lanes // 32) * T + ti
    chunk = split * C + ci
    unit = (expert * NT + tile) * NC + chunk                       # [1, T, C, 1]
    words = tl.load(words_ptr + unit * 128 + lane * 4 + v)
    g = lane // 4
    t = lane % 4
    meta = unit * 32 + g * 4 + v
    scales = tl.load(scales_ptr + meta)
    zeros = tl.load(zeros_ptr + meta)
    # x as int32 pairs; lanes of B column g hold token g: only g == 0 is this row's token
    x_pairs = (x_ptr + token * stride_xm).to(tl.pointer_type(tl.int32), bitcast=True)
    x_index = chunk * 32 + t * 4 + v
    x_ok = g == 0
    x0 = tl.load(x_pairs + x_index, mask=x_ok, other=0)
    x1 = tl.load(x_pairs + x_index + 16, mask=x_ok, other=0)
    if READ_ONLY:
        total = words ^ zeros.to(tl.int32) ^ scales.to(tl.int16, bitcast=True).to(tl.int32)
        total = tl.reduce(tl.reduce(tl.reduce(tl.reduce(total, 3, _xor), 2, _xor), 1, _xor), 0, _xor)
        tl.store(partials_ptr + pid, total.to(tl.float32, bitcast=True))
        return
    d = tl.inline_asm_elementwise(
        _ASM_FP16, _CONSTRAINTS,
        [words, x0, x1, scales, zeros], dtype=tl.float32, is_pure=True, pack=4)
    acc = tl.sum(d, axis=2)                                        # [32, T, 4] c-fragment
    # c-fragment element i of lane (g, t): row n = tile*16 + g + 8 * (i // 2), token column 2t + i % 2
    lane3 = tl.arange(0, 32 * NW)[:, None, None]
    i3 = tl.arange(0, 4)[None, None, :]
    n = ((tb * NW + lane3 // 32) * T + tl.arange(0, T)[None, :, None]) * 16 + (lane3 % 32) // 4 + 8 * (i3 // 2)
    keep = (lane3 % 4 == 0) & (i3 % 2 == 0)
    tl.store(partials_ptr + (split * rows + row) * NOUT + n, acc, mask=keep)


def launch(x, ids, words, scales, zeros, partials, T, C, NW=1, read_only=False):
    M, K = x.shape
    rows = ids.numel()
    E, NT, NC = words.shape[:3]
    NOUT = NT * 16
    grid = (rows * (NC // C) * (NT // (T * NW)),)
    _w13_mma_kernel[grid](x, x.stride(0), ids, words, scales, zeros, partials, rows,
                          TOP_K=ids.shape[1], K=K, NOUT=NOUT, T=T, C=C, NW=NW, READ_ONLY=read_only, num_warps=NW)


# ---------------------------------------------------------------------------------------------
# The same on AutoAWQ tensors as they are (no repack): lane (g, t) loads the int32 of packed
# column c_g (8 logical columns) in k rows 4t .. 4t + 3 of each 16-row block; a PRMT of two rows'
# words puts one column's two nibbles of rows (k, k + 1) in bits 0-3 and 16-19 (or 4-7 and 20-23),
# so one LOP3 still makes one A-fragment pair. mma j takes columns 2j (row g) and 2j + 1 (row g + 8).


def _awq_mma_asm():
    lines = ["{", ".reg .b32 p, p8, q, q8, wx<2>, wy<2>, vx<2>, vy<2>, z<8>;", ".reg .f32 d<16>, s<8>;",
             ".reg .b16 h<8>;"]
    LO, HI = "0x000F000F", "0x00F000F0"
    MLO, MHI, NLO, NHI = "0x64006400", "0x54005400", "0xE400E400", "0xD400D400"
    # zero splats of the eight columns: z<j> = -(magic + z_j) in both halves
    lines += ["prmt.b32 p, $32, $32, 0x1010;", "shr.u32 p8, p, 8;", "prmt.b32 q, $32, $32, 0x3232;", "shr.u32 q8, q, 8;",
              f"lop3.b32 z0, p, {LO}, {NLO}, 0xEA;", f"lop3.b32 z2, p, {HI}, {NHI}, 0xEA;",
              f"lop3.b32 z4, p8, {LO}, {NLO}, 0xEA;", f"lop3.b32 z6, p8, {HI}, {NHI}, 0xEA;",
              f"lop3.b32 z1, q, {LO}, {NLO}, 0xEA;", f"lop3.b32 z3, q, {HI}, {NHI}, 0xEA;",
              f"lop3.b32 z5, q8, {LO}, {NLO}, 0xEA;", f"lop3.b32 z7, q8, {HI}, {NHI}, 0xEA;"]
    lines += [f"mov.f32 d{r}, 0f00000000;" for r in range(16)]
    for kb in range(2):
        w = [f"${16 + 4 * kb + i}" for i in range(4)]
        b = f"{{${24 + 2 * kb}, ${25 + 2 * kb}}}"
        for half in range(2):   # rows (4t, 4t+1) -> X0/Y0, rows (4t+2, 4t+3) -> X1/Y1
            lines += [f"prmt.b32 wx{half}, {w[2 * half]}, {w[2 * half + 1]}, 0x5410;",
                      f"prmt.b32 wy{half}, {w[2 * half]}, {w[2 * half + 1]}, 0x7632;",
                      f"shr.u32 vx{half}, wx{half}, 8;", f"shr.u32 vy{half}, wy{half}, 8;"]
        # mma j: (source X/Y register family, mask, magic) for columns 2j and 2j + 1
        plan = [("wx", "wy", LO, MLO), ("wx", "wy", HI, MHI), ("vx", "vy", LO, MLO), ("vx", "vy", HI, MHI)]
        for j, (fa, fb, mask, magic) in enumerate(plan):
            lines.append("{ .reg .b32 a<4>;")
            lines += [f"lop3.b32 a0, {fa}0, {mask}, {magic}, 0xEA;", f"lop3.b32 a1, {fb}0, {mask}, {magic}, 0xEA;",
                      f"lop3.b32 a2, {fa}1, {mask}, {magic}, 0xEA;", f"lop3.b32 a3, {fb}1, {mask}, {magic}, 0xEA;"]
            d = f"{{d{4 * j}, d{4 * j + 1}, d{4 * j + 2}, d{4 * j + 3}}}"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d}, {{a0, a1, a2, a3}}, {b}, {d};")
            za, zb = f"z{2 * j}", f"z{2 * j + 1}"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {d}, {{{za}, {zb}, {za}, {zb}}}, {b}, {d};")
            lines.append("}")
    for j in range(4):
        lines += [f"mov.b32 {{h{2 * j}, h{2 * j + 1}}}, ${28 + j};", f"cvt.f32.f16 s{2 * j}, h{2 * j};",
                  f"cvt.f32.f16 s{2 * j + 1}, h{2 * j + 1};"]
        for c in range(4):
            lines.append(f"mul.f32 ${4 * j + c}, d{4 * j + c}, s{2 * j + c // 2};")
    lines.append("}")
    return "\n".join(lines)


_AWQ_MMA_ASM = tl.constexpr(_awq_mma_asm())
_AWQ_MMA_CONSTRAINTS = tl.constexpr(",".join(["=f"] * 16 + ["r"] * 24))


@triton.jit
def _w13_awq_mma_kernel(x_ptr, stride_xm, ids_ptr, qweight_ptr, scales_ptr, qzeros_ptr, partials_ptr, rows,
                        TOP_K: tl.constexpr, K: tl.constexpr, TWO_N: tl.constexpr, GR: tl.constexpr):
    """partials[s, row, 64 columns of tile] over the GR groups of split s; one warp, AutoAWQ tensors."""
    PN: tl.constexpr = TWO_N // 8
    TILES: tl.constexpr = PN // 8
    SPLITS: tl.constexpr = K // 32 // GR
    pid = tl.program_id(0)
    tile = pid % TILES
    split = (pid // TILES) % SPLITS
    row = pid // (TILES * SPLITS)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    token = (row // TOP_K).to(tl.int64)
    lane = tl.arange(0, 32)[:, None]
    e = tl.arange(0, 8)[None, :]
    g = lane // 4
    t = lane % 4
    col_word = tile * 8 + g
    acc_lo = tl.zeros([32, 8], dtype=tl.float32)   # mma 0, 1 (columns 0..3): element 4j + c = c-register c of mma j
    acc_hi = tl.zeros([32, 8], dtype=tl.float32)   # mma 2, 3 (columns 4..7)
    for i in tl.static_range(GR):
        grp = split * GR + i
        k_rows = grp * 32 + (e // 4) * 16 + 4 * t + e % 4
        words = tl.load(qweight_ptr + expert * (K * PN) + k_rows * PN + col_word)
        x = tl.load(x_ptr + token * stride_xm + k_rows, mask=g == 0, other=0.0)
        scales = tl.load(scales_ptr + expert * (K // 32 * TWO_N) + grp * TWO_N + col_word * 8 + e)
        zeros = tl.load(qzeros_ptr + expert * (K // 32 * PN) + grp * PN + col_word)
        d_lo, d_hi = tl.inline_asm_elementwise(
            _AWQ_MMA_ASM, _AWQ_MMA_CONSTRAINTS, [words, x, scales, zeros], dtype=(tl.float32, tl.float32),
            is_pure=True, pack=8)
        acc_lo += d_lo
        acc_hi += d_hi
    col = 2 * (e // 4) + (e % 4) // 2
    keep = (t == 0) & (e % 2 == 0)
    base = partials_ptr + (split * rows + row) * TWO_N + col_word * 8
    tl.store(base + col, acc_lo, mask=keep)
    tl.store(base + 4 + col, acc_hi, mask=keep)


def launch_awq(x, ids, qweight, scales, qzeros, partials, GR):
    M, K = x.shape
    rows = ids.numel()
    TWO_N = scales.shape[-1]
    grid = (rows * (K // 32 // GR) * (TWO_N // 64),)
    _w13_awq_mma_kernel[grid](x, x.stride(0), ids, qweight, scales, qzeros, partials, rows,
                              TOP_K=ids.shape[1], K=K, TWO_N=TWO_N, GR=GR, num_warps=1)


def sass(configs):
    sys.path.insert(0, "benchmarks")
    from sass_stats import compile_kernel, stats
    ptrs = {"x_ptr": "*fp16", "ids_ptr": "*i32", "words_ptr": "*i32", "scales_ptr": "*fp16", "zeros_ptr": "*u8",
            "partials_ptr": "*fp32"}
    for T, C in configs:
        kern = compile_kernel(_w13_mma_kernel, dict(TOP_K=10, K=2560, NOUT=320, T=T, C=C, NW=1, READ_ONLY=False),
                              ptrs, 1, dict(stride_xm=2560, rows=80))
        stats(f"mma T={T} C={C}", kern, T * 16 * C * 64)
    ptrs = {"x_ptr": "*fp16", "ids_ptr": "*i32", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "qzeros_ptr": "*i32",
            "partials_ptr": "*fp32"}
    for GR in (2, 4, 8):
        kern = compile_kernel(_w13_awq_mma_kernel, dict(TOP_K=10, K=2560, TWO_N=320, GR=GR), ptrs, 1,
                              dict(stride_xm=2560, rows=80))
        stats(f"awq-order mma GR={GR}", kern, 64 * GR * 32)


def gpu(Ms):
    import moe_grouped_decode.ops  # noqa: F401
    from moe_grouped_decode.awq import synthetic_moe_weights, dequantize
    from moe_grouped_decode.bench import _random_routing
    from moe_grouped_decode.contract import QWEN38_TP4 as c
    from moe_grouped_decode.kernels import configs, grouped
    from moe_grouped_decode.ops import alloc_workspace, workspace_views
    from moe_grouped_decode.ops.cuda import graph_replay_us
    E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
    LAYERS = 32
    layers = [synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=1000 + i, device="cuda") for i in range(LAYERS)]
    packed = [repack_for_mma(w.w13_qweight, w.w13_scales, w.w13_qzeros, G) for w in layers]
    gen = torch.Generator().manual_seed(0)
    workspace = alloc_workspace(8, k, K, N, "cuda")
    results = []
    for M in Ms:
        routings = [_random_routing(M, k, E, gen) for _ in range(LAYERS)]
        ids = [r[0].cuda() for r in routings]
        tws = [r[1].cuda() for r in routings]
        xs = [torch.randn(M, K, generator=gen).half().cuda() for _ in range(LAYERS)]
        out = torch.empty_like(xs[0])
        views = workspace_views(workspace, M * k, K, N)
        config = configs.grouped_config((E, k, K, N, G), "fp16", M)
        # exactness of the prototype against float64 (one layer)
        w = layers[0]
        ref = torch.empty(M * k, 2 * N, dtype=torch.float64)
        for r in range(M * k):
            e = int(ids[0].view(-1)[r])
            wd = dequantize(w.w13_qweight[e].cpu(), w.w13_scales[e].cpu(), w.w13_qzeros[e].cpu(), G).double()
            ref[r] = xs[0][r // k].double().cpu() @ wd
        for T, C, NW in ((4, 1, 1), (1, 4, 4)):
            splits = 40 // C
            partials = torch.full((splits, M * k, 2 * N), float("nan"), device="cuda")
            launch(xs[0], ids[0], *packed[0], partials, T, C, NW)
            got = partials.double().sum(0).cpu()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            part = torch.empty(splits, M * k, 2 * N, device="cuda")
            us = graph_replay_us(lambda i: launch(xs[i], ids[i], *packed[i], part, T, C, NW), LAYERS)
            hot = graph_replay_us(lambda i: launch(xs[0], ids[0], *packed[0], part, T, C, NW), LAYERS)
            read = graph_replay_us(lambda i: launch(xs[i], ids[i], *packed[i], part, T, C, NW, True), LAYERS)
            results.append((M, f"mma T={T} C={C} warps={NW}", us, err, hot, read))
            print(f"[mma] M={M} T={T} C={C} NW={NW}: {us:.2f} us (hot L2 {hot:.2f}, its loads alone {read:.2f}), "
                  f"scaled max err {err:.2e}", flush=True)
        for GR in (2, 4, 8):
            splits = 80 // GR
            partials = torch.full((splits, M * k, 2 * N), float("nan"), device="cuda")
            launch_awq(xs[0], ids[0], *layers[0].op_args()[:3], partials, GR)
            got = partials.double().sum(0).cpu()
            err = (got - ref).abs().max().item() / ref.abs().max().item()
            part = torch.empty(splits, M * k, 2 * N, device="cuda")
            us = graph_replay_us(lambda i: launch_awq(xs[i], ids[i], *layers[i].op_args()[:3], part, GR), LAYERS)
            hot = graph_replay_us(lambda i: launch_awq(xs[0], ids[0], *layers[0].op_args()[:3], part, GR), LAYERS)
            results.append((M, f"awq-order mma GR={GR}", us, err, hot, float("nan")))
            print(f"[mma] M={M} awq-order GR={GR}: {us:.2f} us (hot {hot:.2f}) err {err:.2e}", flush=True)
        shipped = graph_replay_us(lambda i: grouped.grouped_decode(
            xs[i], tws[i], ids[i], *layers[i].op_args(), views, out, config, stages=("w13",)), LAYERS)
        shipped_hot = graph_replay_us(lambda i: grouped.grouped_decode(
            xs[0], tws[0], ids[0], *layers[0].op_args(), views, out, config, stages=("w13",)), LAYERS)
        results.append((M, "shipped w13", shipped, float("nan"), shipped_hot, float("nan")))
        print(f"[mma] M={M} shipped W13: {shipped:.2f} us", flush=True)
    print("\n| M | kernel | us (L2 cold) | us (hot L2) | its loads alone | scaled max err |\n"
          "| --- | --- | --- | --- | --- | --- |")
    for M, name, us, err, hot, read in results:
        print(f"| {M} | {name} | {us:.2f} | {hot:.2f} | {read:.2f} | {err:.1e} |")


if __name__ == "__main__":
    if sys.argv[1] == "sass":
        sass(((4, 4), (2, 8), (4, 8), (1, 8)))
    else:
        gpu([int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else "2,8").split(",")])
