"""W13 of the grouped decode in Gluon: ``w13_tl``'s programs with every load staged in shared memory.

Same programs, fragments, PTX (``awq_mma``) and partials as ``w13_tl`` with one warp, so the
same bits; what differs is how the bytes arrive. Triton's ``tl`` keeps a load in flight only in
registers (one or two 32-row chunks per warp, and its software pipeliner turns fragment loads
into 4-byte copies); here each program owns a STAGES-deep ring of shared-memory chunks filled
by 16-byte ``cp.async``, and the split's activations, scales and zero words are copied once up
front, so no chunk waits on a global load of its own. Then W13 is bound by the instructions it
issues, and this version issues fewer (docs/PERF.md)::

    program (row, split s, tile):
      group 0:  x[token, split] -> x_smem    scales, zeros of the split's groups -> s_smem, z_smem
                chunk 0 of W13[expert][split, tile] -> ring[0]
      group i:  chunk i -> ring[i]                          (i < STAGES)
      chunk c:  wait for group c; fragments <- ring[c % STAGES], x_smem[c], s_smem[c], z_smem[c]
                chunk c + STAGES -> ring[c % STAGES]        (after every lane has read it)
                awq_mma PTX -> float32 accumulators
      -> partials[s, row, tile's 64 columns]

With OVER_GROUPS the programs run over the on-device sort's groups (up to 8 * GROUP_BLOCKS rows
of one expert, as ``w13_tl``'s): the group's activation rows are copied per split, row 8 b + g
is column g of B operand b, and each column's partials go to its own row (the same bits as per
row).

Program 0 zeroes the W2 launch's combine counters. No interpreter support: where Gluon does
not run, the plan launches ``w13_tl``.
"""

from .awq_mma import chunk_constraints, chunk_ptx, tokens_constraints, tokens_ptx
from .gluon_helpers import AVAILABLE
from .timeline import W13_SM_SLOT, W13_STAMP_COUNT

if AVAILABLE:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from .gluon_helpers import async_copy, let_next_launch_start, now, sm_id

    def _w13_gluon(
        x_ptr, stride_xm, ids_ptr, num_experts, qweight_ptr, scales_ptr, qzeros_ptr, partials_ptr, rows, arrivals_ptr,
        num_arrivals, timeline_ptr, sorted_rows_ptr, group_expert_ptr, group_start_ptr, group_count_ptr,
        num_groups_ptr, id_flag_ptr,
        TOP_K: gl.constexpr, K: gl.constexpr, TWO_N: gl.constexpr, G: gl.constexpr, CHUNKS: gl.constexpr,
        CHUNKS_PAD: gl.constexpr, SPLITS: gl.constexpr, STAGES: gl.constexpr, ARRIVALS_PAD: gl.constexpr,
        IS_BF16: gl.constexpr, USE_PDL: gl.constexpr, TIMELINE: gl.constexpr, OVER_GROUPS: gl.constexpr = False,
        GROUP_BLOCKS: gl.constexpr = 1, CHECK_IDS: gl.constexpr = False,
    ):
        """partials[s, row, cols] = x[row // k, K-split s] @ W13[topk_ids[row]][K-split s, cols]
        (one warp; program 1 + (row * SPLITS + s) * TILES + tile, as w13_tl's)."""
        let_next_launch_start(USE_PDL)
        pid = gl.program_id(0)
        if TIMELINE:
            gl.store(timeline_ptr + pid * W13_STAMP_COUNT, now())
            gl.store(timeline_ptr + pid * W13_STAMP_COUNT + W13_SM_SLOT, sm_id())
        if pid == 0:
            if ARRIVALS_PAD > 0:
                flat: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
                a = gl.arange(0, ARRIVALS_PAD, layout=flat)
                gl.store(arrivals_ptr + a, gl.zeros([ARRIVALS_PAD], gl.int32, layout=flat), mask=a < num_arrivals)
            if TIMELINE:
                gl.store(timeline_ptr + 1, now())
            return
        PACKED_N: gl.constexpr = TWO_N // 8
        TILES: gl.constexpr = PACKED_N // 8
        SPLIT_ROWS: gl.constexpr = CHUNKS * 32
        EVEN: gl.constexpr = K % SPLIT_ROWS == 0  # the splits tile K: no chunk past K, no masks
        work = pid - 1
        tile = work % TILES
        split = (work // TILES) % SPLITS
        if OVER_GROUPS:
            group_id = work // (TILES * SPLITS)
            if group_id >= gl.load(num_groups_ptr):
                return
            expert = gl.load(group_expert_ptr + group_id).to(gl.int64)
            start = gl.load(group_start_ptr + group_id)
            count = gl.load(group_count_ptr + group_id)
        else:
            row = work // (TILES * SPLITS)
            expert = gl.load(ids_ptr + row)
            valid = (expert >= 0) & (expert < num_experts)
            if CHECK_IDS:  # the debug mode's flag, once per row
                gl.store(id_flag_ptr, 1, mask=(~valid) & (work % (TILES * SPLITS) == 0))
            # an id outside [0, E) reads expert 0 (never out of bounds); W2 zeroes that row's output
            expert = gl.where(valid, expert, 0).to(gl.int64)
            token = (row // TOP_K).to(gl.int64)
        k_first = split * SPLIT_ROWS

        # The ring: [STAGES, 32 rows, 8 words]. Shared row q of a stage holds chunk row
        # pi(q) = 16 (q // 16) + 4 (q % 4) + (q // 4) % 4, so that lane (g, t), element e, reading
        # shared row 16 (e // 4) + 4 (e % 4) + t, gets chunk row 16 (e // 4) + 4 t + e % 4 (awq_mma's
        # fragment row) and the reads are bank-conflict-free (bank 8 t + g; tests/test_w13_ring_plan.py).
        copy_layout: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [1, 1], [1, 0])
        ring = gl.allocate_shared_memory(gl.int32, [STAGES, 32, 8], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
        q = gl.arange(0, 32, layout=gl.SliceLayout(1, copy_layout))[:, None]
        chunk_row = (q & 16) | ((q & 3) << 2) | ((q >> 2) & 3)
        w = gl.arange(0, 8, layout=gl.SliceLayout(0, copy_layout))[None, :]
        # the split's chunk rows as pointers once; each stage's copy adds a constant
        src = qweight_ptr + expert * (K * PACKED_N) + tile * 8 + (k_first + chunk_row) * PACKED_N + w

        # The split's activations, scales and zero words, one 2-D copy each into group 0 (rows past
        # CHUNKS are padding, never read), then seen as one row per chunk (a rank-1 layout) to index.
        x_copy: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [1, 1], [1, 0])
        s_copy: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [1, 1], [1, 0])
        rows_2d: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [1, 0])
        if OVER_GROUPS:
            # the group's rows' activations of the split: [block b * CHUNKS_PAD + chunk, row g, 32]
            # holds row 8 b + g (token block b of the mma)
            xg_copy: gl.constexpr = gl.BlockedLayout([1, 1, 8], [1, 8, 4], [1, 1, 1], [2, 1, 0])
            xg_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [GROUP_BLOCKS * CHUNKS_PAD, 8, 32],
                                                gl.SwizzledSharedLayout(1, 1, 1, [2, 1, 0]))
            xgi = gl.arange(0, GROUP_BLOCKS * CHUNKS_PAD,
                            layout=gl.SliceLayout(1, gl.SliceLayout(2, xg_copy)))[:, None, None]
            xgc = xgi % CHUNKS_PAD
            xgn = (xgi // CHUNKS_PAD) * 8 + gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, xg_copy)))[
                None, :, None]
            xgr = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, xg_copy)))[None, None, :]
            xg_ok = xgn < count
            xg_token = (gl.load(sorted_rows_ptr + start + xgn, mask=xg_ok, other=0) // TOP_K).to(gl.int64)
            k_xg = k_first + xgc * 32
            async_copy.async_copy_global_to_shared(xg_smem, x_ptr + xg_token * stride_xm + k_xg + xgr,
                                                   mask=xg_ok & (xgc < CHUNKS) & (k_xg + xgr < K))
        else:
            x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [CHUNKS_PAD, 32], rows_2d)
        s_smem = gl.allocate_shared_memory(scales_ptr.dtype.element_ty, [CHUNKS_PAD, 64], rows_2d)
        z_smem = gl.allocate_shared_memory(gl.int32, [CHUNKS_PAD, 8], rows_2d)
        xc = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, x_copy))[:, None]
        xr = gl.arange(0, 32, layout=gl.SliceLayout(0, x_copy))[None, :]
        sc = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, s_copy))[:, None]
        sj = gl.arange(0, 64, layout=gl.SliceLayout(0, s_copy))[None, :]
        zc = gl.arange(0, CHUNKS_PAD, layout=gl.SliceLayout(1, copy_layout))[:, None]
        k_x, k_s, k_z = k_first + xc * 32, k_first + sc * 32, k_first + zc * 32
        if not OVER_GROUPS:
            async_copy.async_copy_global_to_shared(x_smem, x_ptr + token * stride_xm + k_x + xr,
                                                   mask=(xc < CHUNKS) & (k_x + xr < K))
        async_copy.async_copy_global_to_shared(
            s_smem, scales_ptr + expert * (K // G * TWO_N) + k_s // G * TWO_N + tile * 64 + sj,
            mask=(sc < CHUNKS) & (k_s < K) & (sj >= 0))
        async_copy.async_copy_global_to_shared(
            z_smem, qzeros_ptr + expert * (K // G * PACKED_N) + k_z // G * PACKED_N + tile * 8 + w,
            mask=(zc < CHUNKS) & (k_z < K) & (w >= 0))
        per_chunk: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
        if OVER_GROUPS:
            xg_rows = xg_smem._reinterpret(x_ptr.dtype.element_ty, [GROUP_BLOCKS * CHUNKS_PAD, 8, 32], rows_2d)
        else:
            x_rows = x_smem._reinterpret(x_ptr.dtype.element_ty, [CHUNKS_PAD, 32], per_chunk)
        s_rows = s_smem._reinterpret(scales_ptr.dtype.element_ty, [CHUNKS_PAD, 64], per_chunk)
        z_rows = z_smem._reinterpret(gl.int32, [CHUNKS_PAD, 8], per_chunk)
        for s in gl.static_range(STAGES):
            if s < CHUNKS:
                if EVEN:
                    async_copy.async_copy_global_to_shared(ring.index(s), src + s * 32 * PACKED_N)
                else:
                    async_copy.async_copy_global_to_shared(ring.index(s), src + s * 32 * PACKED_N,
                                                           mask=(k_first + s * 32 + chunk_row < K) & (w >= 0))
            async_copy.commit_group()

        # frag: [8 (g), 4 (t), 8 (e)], lane (g, t) = lane 4 g + t holding its 8 fragment elements
        frag: gl.constexpr = gl.BlockedLayout([1, 1, 8], [8, 4, 1], [1, 1, 1], [2, 1, 0])
        g = gl.arange(0, 8, layout=gl.SliceLayout(1, gl.SliceLayout(2, frag)))[:, None, None]
        t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, frag)))[None, :, None]
        e = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, frag)))[None, None, :]
        fill = gl.zeros([8, 4, 8], gl.int32, layout=frag)
        acc_lo = gl.zeros([8, 4, 8], gl.float32, layout=frag)
        acc_hi = gl.zeros([8, 4, 8], gl.float32, layout=frag)
        acc1_lo = acc_lo
        acc1_hi = acc_lo
        for c in gl.static_range(CHUNKS):
            async_copy.wait_group(STAGES - 1)
            # [32 (q), 8 (g)] -> [2 (e // 4), 4 (e % 4), 4 (t), 8 (g)] -> [g, t, e // 4, e % 4] -> [g, t, e]
            words = ring.index(c % STAGES).reshape([2, 4, 4, 8]).permute([3, 2, 0, 1]).reshape([8, 4, 8]).load(frag)
            # x row 16 (e // 4) + 4 t + e % 4: [32] -> [2, 4 (t), 4] -> [t, e // 4, e % 4] -> [t, e], in
            # every column g of the mma's B operand: only D's column 0 (lanes t = 0) is stored, and an
            # mma output column depends on its own B column only
            if OVER_GROUPS:
                # column g: row g's x at row 16 (e // 4) + 4 t + e % 4: [8, 32] -> [g, 2, 4 (t), 4] -> [g, t, e]
                x = xg_rows.index(c).reshape([8, 2, 4, 4]).permute([0, 2, 1, 3]).reshape([8, 4, 8]).load(frag)
                if GROUP_BLOCKS == 2:
                    x1 = xg_rows.index(CHUNKS_PAD + c).reshape([8, 2, 4, 4]).permute([0, 2, 1, 3]).reshape(
                        [8, 4, 8]).load(frag)
            else:
                x_te = x_rows.index(c).reshape([2, 4, 4]).permute([1, 0, 2]).reshape([4, 8]).load(
                    gl.SliceLayout(0, frag))
                x = gl.broadcast(gl.expand_dims(x_te, 0), fill)[0]
            scales_ge = s_rows.index(c).reshape([8, 8]).load(gl.SliceLayout(1, frag))
            if not EVEN:
                # a chunk past K (the last split's) holds stale shared memory (masked copies write
                # nothing): zero its activations and scales
                chunk_ok = k_first + c * 32 < K
                x = gl.where(chunk_ok, x, 0.0)
                if OVER_GROUPS and GROUP_BLOCKS == 2:
                    x1 = gl.where(chunk_ok, x1, 0.0)
                scales_ge = gl.where(chunk_ok, scales_ge, 0.0)
            scales = gl.broadcast(gl.expand_dims(scales_ge, 1), fill)[0]
            zeros = gl.broadcast(gl.expand_dims(gl.expand_dims(
                z_rows.index(c).load(gl.SliceLayout(1, gl.SliceLayout(2, frag))), 1), 2), fill)[0]
            gl.thread_barrier()  # every lane has read the stage before it is refilled
            if c + STAGES < CHUNKS:
                if EVEN:
                    async_copy.async_copy_global_to_shared(ring.index(c % STAGES), src + (c + STAGES) * 32 * PACKED_N)
                else:
                    async_copy.async_copy_global_to_shared(
                        ring.index(c % STAGES), src + (c + STAGES) * 32 * PACKED_N,
                        mask=(k_first + (c + STAGES) * 32 + chunk_row < K) & (w >= 0))
            async_copy.commit_group()
            if OVER_GROUPS and GROUP_BLOCKS == 2:
                d_lo, d_hi, d1_lo, d1_hi = gl.inline_asm_elementwise(
                    tokens_ptx(IS_BF16, 2), tokens_constraints(2), [words, x, x1, scales, zeros],
                    dtype=(gl.float32,) * 4, is_pure=True, pack=8)
                acc1_lo += d1_lo
                acc1_hi += d1_hi
            else:
                d_lo, d_hi = gl.inline_asm_elementwise(chunk_ptx(IS_BF16, False, False), chunk_constraints(False),
                                                       [words, x, scales, zeros],
                                                       dtype=(gl.float32, gl.float32), is_pure=True, pack=8)
            acc_lo += d_lo
            acc_hi += d_hi
        # awq_mma.chunk_columns: element 4 j + c is column 2 j + c // 2 (d_lo, j = 0, 1; d_hi +4)
        cols = (tile * 8 + g) * 8 + 2 * (e // 4) + (e % 4) // 2 + t * 0
        if OVER_GROUPS:
            # element 4 j + c of lane (g, t) is token column 2 t + c % 2: the group's row of that column
            slot = 2 * t + e % 2 + g * 0
            keep = slot < count
            out_row = gl.load(sorted_rows_ptr + start + slot, mask=keep, other=0)
        else:
            keep = (t == 0) & (e % 2 == 0) & (g >= 0)
            out_row = row
        out_base = partials_ptr + (split * rows + out_row) * TWO_N
        gl.store(out_base + cols, acc_lo, mask=keep)
        gl.store(out_base + cols + 4, acc_hi, mask=keep)
        if OVER_GROUPS and GROUP_BLOCKS == 2:
            slot1 = 8 + 2 * t + e % 2 + g * 0
            keep1 = slot1 < count
            out_base1 = partials_ptr + (split * rows + gl.load(sorted_rows_ptr + start + slot1, mask=keep1,
                                                               other=0)) * TWO_N
            gl.store(out_base1 + cols, acc1_lo, mask=keep1)
            gl.store(out_base1 + cols + 4, acc1_hi, mask=keep1)
        if TIMELINE:
            gl.store(timeline_ptr + pid * W13_STAMP_COUNT + 1, now())

    w13_gluon_kernel = gluon.jit(_w13_gluon)
    # the same kernel with binaries of its own, for the launches that prefer the largest carveout (carveout.py)
    w13_gluon_kernel_max_carveout = gluon.jit(_w13_gluon)
