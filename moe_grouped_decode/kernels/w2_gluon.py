"""W2 of the grouped decode in Gluon: ``w2_tl``'s programs with their weights staged in shared memory.

Same programs (row, column tile), fragments, PTX (``awq_mma``'s, with SPLIT_X as ACT_SPLIT and
the scale multiply ``mul.rn``) and sums as ``w2_tl`` with the fused combine, so the same bits as
``w2_tl`` built with ``RN_SCALE`` and the same ACT_SPLIT. What differs is where a program keeps
its weights: ``w2_tl`` holds all five 32-row chunks in registers from before the PDL wait (128
or more registers: four programs per SM, two waves at M = 8); here ``cp.async`` copies them into
shared memory (at M = 8 64-65 registers with one activation half, four or three programs per SM;
52 KB; and none beside W13's programs, whose shared-memory carveout is smaller; docs/PERF.md
says why that is the gain), and the activations go through shared memory too (no ``act``
workspace round trip). The copies run AHEAD chunks ahead of the mma: a thread whose copy stalls
(all programs ask for their weights at once, more than the memory system holds in flight) would
otherwise not reach the chunks that have already landed::

    program (row, tile):  scales, zeros, W2 chunks 0..AHEAD-1 of the tile's columns -> smem  (cp.async)
                          wait for W13 (PDL)
                          act = silu(gate) * up from the row's partials, in split order
                            -> 16-bit values (hi + lo halves with ACT_SPLIT) in smem
                          for chunk c: copy chunk c + AHEAD; wait for chunk c;
                            warp w: awq_mma of chunk c on its 64 columns
                          -> row_out[row]
                          last of the token's k programs on this tile: combine into out
                            (float64 recompute of a token whose sums are not finite)

No interpreter support: where Gluon does not run, the plan launches ``w2_tl``.
"""

from .awq_mma import chunk_constraints, chunk_ptx
from .gluon_helpers import AVAILABLE
from .overflow import columns_overflowed, repair_token_columns
from .timeline import W2_SM_SLOT, W2_STAMP_COUNT


def shared_memory_fits(N: int, warps: int, act_split: bool, capability) -> bool:
    """Whether one program's shared memory (its tile's words of all N / 32 chunks, their scales
    and zero words, the activations) fits a GPU of compute ``capability`` (227 KB a program on
    Hopper and Blackwell, 163 KB on the A100 and Orin, 99 KB elsewhere). Where it does not (N in
    the thousands) the plan launches w2_tl; the chunk loop here unrolls over every chunk, so this
    also bounds the compile (3 s for N = 1408's 44 chunks)."""
    chunks = N // 32
    pad = 1 << max(0, (chunks - 1).bit_length())
    need = chunks * warps * 1024 + pad * (warps * 160 + (128 if act_split else 64))
    limit = (227 if capability[0] in (9, 10) else 163 if tuple(capability) in ((8, 0), (8, 7)) else 99) * 1024
    return need <= limit


if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .gluon_helpers import async_copy, now, sm_id, wait_for_previous_launch

    def _w2_gluon(
        ids_ptr, num_experts, partials_ptr, qweight_ptr, scales_ptr, qzeros_ptr, row_out_ptr, rows,
        topk_weights_ptr, out_ptr, stride_om, arrivals_ptr, timeline_ptr,
        x_ptr, stride_xm, w13_qweight_ptr, w13_scales_ptr, w13_qzeros_ptr,
        K: gl.constexpr, N: gl.constexpr, G: gl.constexpr, SPLITS: gl.constexpr, WARPS: gl.constexpr,
        CHUNKS_PAD: gl.constexpr, AHEAD: gl.constexpr, ACT_SPLIT: gl.constexpr, TOP_K: gl.constexpr,
        IS_BF16: gl.constexpr, USE_PDL: gl.constexpr, TIMELINE: gl.constexpr,
    ):
        """row_out[row, cols] = (silu(gate) * up)[row] @ W2[topk_ids[row]][:, cols] and the fused
        combine, as w2_tl's (program (row, tile), warp w: 64 columns). Needs K // 8 to be a multiple
        of 8 * WARPS (the plan launches w2_tl otherwise)."""
        row = gl.program_id(0)
        tile = gl.program_id(1)
        stamps = (row * gl.num_programs(1) + tile) * W2_STAMP_COUNT
        if TIMELINE:
            gl.store(timeline_ptr + stamps, now())
            gl.store(timeline_ptr + stamps + W2_SM_SLOT, sm_id())
        PACKED_K: gl.constexpr = K // 8
        CHUNKS: gl.constexpr = N // 32
        gl.static_assert((AHEAD >= 1) and (AHEAD <= CHUNKS), "AHEAD: 1 to N / 32 chunks (the plan clamps it)")
        HALF: gl.constexpr = gl.bfloat16 if IS_BF16 else gl.float16
        expert = gl.load(ids_ptr + row)
        # an id outside [0, E): expert 0's weights are read (never out of bounds), the row's output is 0
        valid = (expert >= 0) & (expert < num_experts)
        expert = gl.where(valid, expert, 0).to(gl.int64)
        word0 = tile * (WARPS * 8)  # the program's first packed column; warp w has words word0 + 8 w + g

        # words: [chunk, warp, 32 rows (in w13_gluon's conflict-free order), 8 words], 16-byte copies
        w_copy: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 16, 2], [WARPS, 1, 1], [2, 1, 0])
        ww = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_copy)))[:, None, None]
        wq = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_copy)))[None, :, None]
        wj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_copy)))[None, None, :]
        chunk_row = (wq & 16) | ((wq & 3) << 2) | ((wq >> 2) & 3)
        w_src = qweight_ptr + expert * (N * PACKED_K) + chunk_row * PACKED_K + word0 + ww * 8 + wj
        w_smem = gl.allocate_shared_memory(gl.int32, [CHUNKS, WARPS, 32, 8],
                                           gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        # scales [chunk, warp, 64] and zeros [chunk, warp, 8] (a chunk lies inside one group)
        s_copy: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 4, 8], [1, WARPS, 1], [2, 1, 0])
        sc = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, gl.SliceLayout(2, s_copy)))[:, None, None]
        sw = gl.arange(0, WARPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, s_copy)))[None, :, None]
        sj = gl.arange(0, 64, layout=gl.SliceLayout(0, gl.SliceLayout(1, s_copy)))[None, None, :]
        s_smem = gl.allocate_shared_memory(scales_ptr.dtype.element_ty, [CHUNKS_PAD, WARPS, 64],
                                           gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        async_copy.async_copy_global_to_shared(
            s_smem, scales_ptr + expert * (N // G * K) + (sc * 32 // G) * K + (word0 + sw * 8) * 8 + sj,
            mask=(sc < CHUNKS) & (sw >= 0) & (sj >= 0))
        z_copy: gl.constexpr = gl.BlockedLayout([1, 1, 4], [1, 16, 2], [1, WARPS, 1], [2, 1, 0])
        zc = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, gl.SliceLayout(2, z_copy)))[:, None, None]
        zw = gl.arange(0, WARPS, layout=gl.SliceLayout(0, gl.SliceLayout(2, z_copy)))[None, :, None]
        zj = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, z_copy)))[None, None, :]
        z_smem = gl.allocate_shared_memory(gl.int32, [CHUNKS_PAD, WARPS, 8], gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
        async_copy.async_copy_global_to_shared(
            z_smem, qzeros_ptr + expert * (N // G * PACKED_K) + (zc * 32 // G) * PACKED_K + word0 + zw * 8 + zj,
            mask=(zc < CHUNKS) & (zw >= 0) & (zj >= 0))
        # the first AHEAD chunks' words now, one copy group each (the scales and zeros ride in the
        # first); the rest one chunk at a time inside the mma loop, so a thread stalled issuing
        # copies into a saturated memory system is not kept from the chunks that have landed
        for c in gl.static_range(AHEAD):
            async_copy.async_copy_global_to_shared(w_smem.index(c), w_src + c * 32 * PACKED_K)
            async_copy.commit_group()

        wait_for_previous_launch(USE_PDL)  # W13's partials are complete past here
        if TIMELINE:
            gl.store(timeline_ptr + stamps + 1, now())

        # act = silu(gate) * up (awq_tiles.silu_mul's formula) from the partials summed in split
        # order, [chunk, 32 rows], as 16-bit hi + lo halves (or one half) in shared memory
        a_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [WARPS, 1], [1, 0])
        ac = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, a_layout))[:, None]
        ar = gl.arange(0, 32, layout=gl.SliceLayout(0, a_layout))[None, :]
        n = ac * 32 + ar
        n_ok = n < N
        gate = gl.zeros([CHUNKS_PAD, 32], gl.float32, layout=a_layout)
        up = gl.zeros([CHUNKS_PAD, 32], gl.float32, layout=a_layout)
        for s in gl.static_range(SPLITS):
            part = partials_ptr + (s * rows + row) * (2 * N) + n
            gate += gl.load(part, mask=n_ok, other=0.0)
            up += gl.load(part + N, mask=n_ok, other=0.0)
        act = gate / (1.0 + gl.exp(-gate)) * up
        act_hi = act.to(HALF)
        if ACT_SPLIT:
            # sub.rn: not contracted with the product above (the tl W2 subtracts from a reloaded act)
            act_lo = gl.inline_asm_elementwise("sub.rn.f32 $0, $1, $2;", "=f,f,f", [act, act_hi.to(gl.float32)],
                                               dtype=gl.float32, is_pure=True, pack=1).to(HALF)
        rows_2d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        per_chunk: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        hi_rows = gl.allocate_shared_memory(HALF, [CHUNKS_PAD, 32], rows_2d, act_hi)._reinterpret(
            HALF, [CHUNKS_PAD, 32], per_chunk)
        if ACT_SPLIT:
            lo_rows = gl.allocate_shared_memory(HALF, [CHUNKS_PAD, 32], rows_2d, act_lo)._reinterpret(
                HALF, [CHUNKS_PAD, 32], per_chunk)
        s_rows = s_smem._reinterpret(scales_ptr.dtype.element_ty, [CHUNKS_PAD, WARPS, 64],
                                     gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        z_rows = z_smem._reinterpret(gl.int32, [CHUNKS_PAD, WARPS, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        if TIMELINE:
            gl.store(timeline_ptr + stamps + 2, now())

        # frag: [warp, 8 (g), 4 (t), 8 (e)]; awq_mma's lane layout per warp
        frag: gl.constexpr = gl.BlockedLayout([1, 1, 1, 8], [1, 8, 4, 1], [WARPS, 1, 1, 1], [3, 2, 1, 0])
        fw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, frag))))[:, None, None, None]
        g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, frag))))[None, :, None, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, frag))))[None, None, :, None]
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, frag))))[None, None, None, :]
        fill = gl.zeros([WARPS, 8, 4, 8], gl.int32, layout=frag)
        acc_lo = gl.zeros([WARPS, 8, 4, 8], gl.float32, layout=frag)
        acc_hi = gl.zeros([WARPS, 8, 4, 8], gl.float32, layout=frag)
        x_layout: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(0, frag))
        for c in gl.static_range(CHUNKS):
            if c + AHEAD < CHUNKS:
                async_copy.async_copy_global_to_shared(w_smem.index(c + AHEAD), w_src + (c + AHEAD) * 32 * PACKED_K)
                async_copy.commit_group()
            # chunk c's copy group is done once no more than the later chunks' groups are pending
            async_copy.wait_group(AHEAD if c + AHEAD < CHUNKS else CHUNKS - 1 - c)
            gl.thread_barrier()  # chunk c's words (and, at c = 0, the activations) from every thread
            # [warp, 32 (q), 8 (g)] -> [warp, e // 4, e % 4, t, g] -> [warp, g, t, e // 4, e % 4] -> [warp, g, t, e]
            words = w_smem.index(c).reshape([WARPS, 2, 4, 4, 8]).permute([0, 4, 3, 1, 2]).reshape(
                [WARPS, 8, 4, 8]).load(frag)
            # activation row 16 (e // 4) + 4 t + e % 4 in every B column (only D's column 0 is stored)
            x_hi = gl.broadcast(gl.expand_dims(gl.expand_dims(
                hi_rows.index(c).reshape([2, 4, 4]).permute([1, 0, 2]).reshape([4, 8]).load(x_layout), 0), 0), fill)[0]
            scales = gl.broadcast(gl.expand_dims(
                s_rows.index(c).reshape([WARPS, 8, 8]).load(gl.SliceLayout(2, frag)), 2), fill)[0]
            zeros = gl.broadcast(gl.expand_dims(gl.expand_dims(
                z_rows.index(c).load(gl.SliceLayout(2, gl.SliceLayout(3, frag))), 2), 3), fill)[0]
            # the scale multiply rounded on its own (mul.rn): the tl W2's bits with RN_SCALE
            if ACT_SPLIT:
                x_lo = gl.broadcast(gl.expand_dims(gl.expand_dims(
                    lo_rows.index(c).reshape([2, 4, 4]).permute([1, 0, 2]).reshape([4, 8]).load(x_layout), 0), 0),
                    fill)[0]
                d_lo, d_hi = gl.inline_asm_elementwise(chunk_ptx(IS_BF16, True, True), chunk_constraints(True),
                                                       [words, x_hi, x_lo, scales, zeros],
                                                       dtype=(gl.float32, gl.float32), is_pure=True, pack=8)
            else:
                d_lo, d_hi = gl.inline_asm_elementwise(chunk_ptx(IS_BF16, False, True), chunk_constraints(False),
                                                       [words, x_hi, scales, zeros],
                                                       dtype=(gl.float32, gl.float32), is_pure=True, pack=8)
            acc_lo += d_lo
            acc_hi += d_hi
        # awq_mma.chunk_columns: element 4 j + c is column 2 j + c // 2 (d_lo, j = 0, 1; d_hi +4)
        cols = (word0 + fw * 8 + g) * 8 + 2 * (e // 4) + (e % 4) // 2 + t * 0
        keep = (t == 0) & (e % 2 == 0) & (g >= 0) & (fw >= 0)
        acc_lo = gl.where(valid, acc_lo, 0.0)
        acc_hi = gl.where(valid, acc_hi, 0.0)
        gl.store(row_out_ptr + row * K + cols, acc_lo, mask=keep)
        gl.store(row_out_ptr + row * K + cols + 4, acc_hi, mask=keep)
        if TIMELINE:
            gl.store(timeline_ptr + stamps + 3, now())

        # the fused combine (combine.combine_stored's, in this kernel's layouts): the last of the
        # token's k programs on this tile sums its k row outputs in j order (a slot outside
        # [0, E) adds nothing) and recomputes a token whose sums are not finite in float64
        token = row // TOP_K
        gl.thread_barrier()  # every thread's row_out stores happen before the release below
        arrived = gl.atomic_add(arrivals_ptr + token * gl.num_programs(1) + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:
            c_layout: gl.constexpr = gl.BlockedLayout([2], [32], [WARPS], [0])
            tile_cols = word0 * 8 + gl.arange(0, WARPS * 64, layout=c_layout)
            t64 = token.to(gl.int64)
            total = gl.zeros([WARPS * 64], gl.float32, layout=c_layout)
            for j in gl.static_range(TOP_K):
                weight = gl.load(topk_weights_ptr + t64 * TOP_K + j).to(gl.float32)
                slot_expert = gl.load(ids_ptr + t64 * TOP_K + j)
                weight = gl.where((slot_expert >= 0) & (slot_expert < num_experts), weight, 0.0)
                total += weight * gl.load(row_out_ptr + (t64 * TOP_K + j) * K + tile_cols, cache_modifier=".cg")
            gl.store(out_ptr + t64 * stride_om + tile_cols, total.to(out_ptr.dtype.element_ty))
            if columns_overflowed(total, tile_cols >= 0):
                lanes = gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
                repair_token_columns(token, word0 * 8, out_ptr, stride_om, x_ptr, stride_xm, ids_ptr,
                                     topk_weights_ptr, num_experts, w13_qweight_ptr, w13_scales_ptr,
                                     w13_qzeros_ptr, qweight_ptr, scales_ptr, qzeros_ptr, lanes, TOP_K, K, N, G,
                                     WARPS * 64, 32 * WARPS)
        if TIMELINE:
            gl.store(timeline_ptr + stamps + 4, now())

    w2_gluon_kernel = gluon.jit(_w2_gluon)
    # the same kernel with binaries of its own, for the launches that prefer the largest carveout (carveout.py)
    w2_gluon_kernel_max_carveout = gluon.jit(_w2_gluon)
