"""Dense-route AWQ MoE: a tensor-core grouped GEMM over expert-aligned row blocks.

Launches (all grids fixed by the upper bound, no host sync):

1. align (one program): counts rows per expert over all E experts, pads each
   count to a multiple of BLOCK_M, and writes ``sorted_rows`` (padding slots
   hold the sentinel R), the expert of every row block and the live block count.
   A row's slot is (its expert's padded start) + (rows of that expert before
   it), so the layout is deterministic.
2. W13 + SiLU: programs over (row block, gate/up column tile): two ``tl.dot``
   per K step, then act = silu(gate) * up, float32, per routed row.
3. W2: programs over (row block, output column tile) -> float32 row outputs.
4. combine: out[t] = sum_j topk_weights[t, j] * row_out[t*k + j], j in order.

Exactness: the tensor cores multiply activations by the *integer* (q - z),
exact in fp16 and bf16, and the per-group scale is applied to the float32
dot result (every K step lies inside one group). The float32 activations
entering W2 are split into a high and a low 16-bit part (two dots), so bf16
keeps float32-like accuracy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .awq_tiles import awq_tile_minus_zero, silu_mul
from .combine import combine_rows
from .configs import DenseConfig


@triton.jit
def _align_kernel(ids_ptr, rows, num_experts, padded_capacity, max_blocks,
                  counts_ptr, row_rank_ptr, sorted_rows_ptr, block_expert_ptr, num_blocks_ptr,
                  BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, BLOCK: tl.constexpr, BLOCK_B: tl.constexpr):
    e_idx = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e_idx, tl.zeros([E_PAD], dtype=tl.int32))
    for p0 in range(0, padded_capacity, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        tl.store(sorted_rows_ptr + p, tl.full([BLOCK], 0, tl.int32) + rows, mask=p < padded_capacity)
    tl.debug_barrier()
    # rank of each row among the earlier rows of its expert: running counts in memory
    for i0 in range(0, rows, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        i_valid = i < rows
        e = tl.load(ids_ptr + i, mask=i_valid, other=0).to(tl.int32)
        same = (e[None, :] == e[:, None]) & i_valid[None, :]
        local = tl.sum((same & (i[None, :] < i[:, None])).to(tl.int32), axis=1)
        total = tl.sum(same.to(tl.int32), axis=1)
        base = tl.load(counts_ptr + e, mask=i_valid, other=0)
        tl.store(row_rank_ptr + i, base + local, mask=i_valid)
        tl.debug_barrier()
        # the last row of each expert in this tile advances that expert's count
        tl.store(counts_ptr + e, base + total, mask=i_valid & (local == total - 1))
        tl.debug_barrier()
    counts = tl.load(counts_ptr + e_idx, mask=e_idx < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.cumsum(padded, axis=0) - padded
    tl.debug_barrier()
    tl.store(counts_ptr + e_idx, start)
    tl.store(num_blocks_ptr, tl.sum(padded, axis=0) // BLOCK_M)
    tl.debug_barrier()
    for i0 in range(0, rows, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        i_valid = i < rows
        e = tl.load(ids_ptr + i, mask=i_valid, other=0).to(tl.int32)
        slot = tl.load(counts_ptr + e, mask=i_valid, other=0) + tl.load(row_rank_ptr + i, mask=i_valid, other=0)
        tl.store(sorted_rows_ptr + slot, i, mask=i_valid)
    # block b belongs to the active expert with the largest start <= b * BLOCK_M
    active = counts > 0
    for b0 in range(0, max_blocks, BLOCK_B):
        b = b0 + tl.arange(0, BLOCK_B)
        owns = active[None, :] & (start[None, :] <= (b * BLOCK_M)[:, None])
        owner = tl.max(tl.where(owns, e_idx[None, :], 0), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < max_blocks)


@triton.jit
def _dense_w13_kernel(
    x_ptr, stride_xm,
    qweight_ptr, scales_ptr, qzeros_ptr,
    sorted_rows_ptr, block_expert_ptr, num_blocks_ptr,
    act_ptr,
    rows,
    TOP_K: tl.constexpr, K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    block = tl.program_id(0)
    tile = tl.program_id(1)
    if block >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    row = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = row < rows
    token = (row // TOP_K).to(tl.int64)
    TWO_N: tl.constexpr = 2 * N
    PACKED_N: tl.constexpr = TWO_N // 8
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    gate_packed = tile * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    packed_ok = gate_packed < N // 8
    up_packed = gate_packed + N // 8
    qweight_base = qweight_ptr + expert * (K * PACKED_N)
    scales_base = scales_ptr + expert * ((K // G) * TWO_N)
    qzeros_base = qzeros_ptr + expert * ((K // G) * PACKED_N)
    kk = tl.arange(0, BLOCK_K)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + token[:, None] * stride_xm + (k0 + kk)[None, :], mask=row_ok[:, None], other=0.0)
        group = k0 // G
        w_rows = qweight_base + (k0 + kk)[:, None] * PACKED_N
        z_row = qzeros_base + group * PACKED_N
        w_gate = awq_tile_minus_zero(w_rows + gate_packed[None, :], z_row + gate_packed[None, :],
                                     packed_ok[None, :], packed_ok[None, :], BLOCK_N)
        w_up = awq_tile_minus_zero(w_rows + up_packed[None, :], z_row + up_packed[None, :],
                                   packed_ok[None, :], packed_ok[None, :], BLOCK_N)
        s_gate = tl.load(scales_base + group * TWO_N + n, mask=n_ok, other=0.0).to(tl.float32)
        s_up = tl.load(scales_base + group * TWO_N + N + n, mask=n_ok, other=0.0).to(tl.float32)
        gate += tl.dot(x, w_gate.to(x.dtype)) * s_gate[None, :]
        up += tl.dot(x, w_up.to(x.dtype)) * s_up[None, :]
    act = silu_mul(gate, up)
    tl.store(act_ptr + row[:, None] * N + n[None, :], act, mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _dense_w2_kernel(
    act_ptr,
    qweight_ptr, scales_ptr, qzeros_ptr,
    sorted_rows_ptr, block_expert_ptr, num_blocks_ptr,
    row_out_ptr,
    rows,
    K: tl.constexpr, N: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    block = tl.program_id(0)
    tile = tl.program_id(1)
    if block >= tl.load(num_blocks_ptr):
        return
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    row = tl.load(sorted_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = row < rows
    PACKED_K: tl.constexpr = K // 8
    cols = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    col_ok = cols < K
    packed_cols = tile * (BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
    packed_ok = packed_cols < PACKED_K
    qweight_base = qweight_ptr + expert * (N * PACKED_K)
    scales_base = scales_ptr + expert * ((N // G) * K)
    qzeros_base = qzeros_ptr + expert * ((N // G) * PACKED_K)
    nn = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_K], dtype=tl.float32)
    for n0 in range(0, N, BLOCK_N):
        act = tl.load(act_ptr + row[:, None].to(tl.int64) * N + (n0 + nn)[None, :], mask=row_ok[:, None], other=0.0)
        act_hi = act.to(DOT_DTYPE)
        act_lo = (act - act_hi.to(tl.float32)).to(DOT_DTYPE)
        group = n0 // G
        w = awq_tile_minus_zero(
            qweight_base + (n0 + nn)[:, None] * PACKED_K + packed_cols[None, :],
            qzeros_base + group * PACKED_K + packed_cols[None, :],
            packed_ok[None, :], packed_ok[None, :], BLOCK_K,
        ).to(DOT_DTYPE)
        scale = tl.load(scales_base + group * K + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += (tl.dot(act_hi, w) + tl.dot(act_lo, w)) * scale[None, :]
    tl.store(row_out_ptr + row[:, None].to(tl.int64) * K + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


ALIGN_TILE = 64


def align_rows(topk_ids, num_experts: int, block_m: int):
    """The routed rows of ``topk_ids`` [M, k] grouped by expert into blocks of ``block_m``
    (one launch): ``sorted_rows`` (padding slots hold M * k), each block's expert, and the
    live block count [1]; grids are sized by the upper bound ``block_expert.numel()``."""
    rows = topk_ids.numel()
    max_blocks = triton.cdiv(rows, block_m) + min(rows, num_experts)
    device = topk_ids.device
    e_pad = max(16, _next_pow2(num_experts))
    counts = torch.empty(e_pad, dtype=torch.int32, device=device)
    row_rank = torch.empty(rows, dtype=torch.int32, device=device)
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_blocks = torch.empty(1, dtype=torch.int32, device=device)
    _align_kernel[(1,)](
        topk_ids, rows, num_experts, max_blocks * block_m, max_blocks,
        counts, row_rank, sorted_rows, block_expert, num_blocks,
        BLOCK_M=block_m, E_PAD=e_pad, BLOCK=ALIGN_TILE, BLOCK_B=16, num_warps=4,
    )
    return sorted_rows, block_expert, num_blocks


def dense_moe(
    hidden_states, topk_weights, topk_ids,
    w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size: int,
    out, config: DenseConfig,
) -> None:
    """Launch the dense route into ``out`` [M, K]. Scratch is allocated here (no workspace)."""
    M, K = hidden_states.shape
    top_k = topk_ids.shape[1]
    N = w2_qweight.shape[1]
    rows = M * top_k
    bm = config.block_m
    sorted_rows, block_expert, num_blocks = align_rows(topk_ids, w13_qweight.shape[0], bm)
    max_blocks = block_expert.numel()
    act = torch.empty(rows, N, dtype=torch.float32, device=hidden_states.device)
    row_out = torch.empty(rows, K, dtype=torch.float32, device=hidden_states.device)
    _dense_w13_kernel[(max_blocks, triton.cdiv(N, config.w13_block_n))](
        hidden_states, hidden_states.stride(0),
        w13_qweight, w13_scales, w13_qzeros,
        sorted_rows, block_expert, num_blocks,
        act, rows,
        TOP_K=top_k, K=K, N=N, G=group_size,
        BLOCK_M=bm, BLOCK_N=config.w13_block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    _dense_w2_kernel[(max_blocks, triton.cdiv(K, config.w2_block_k))](
        act,
        w2_qweight, w2_scales, w2_qzeros,
        sorted_rows, block_expert, num_blocks,
        row_out, rows,
        K=K, N=N, G=group_size,
        BLOCK_M=bm, BLOCK_K=config.w2_block_k, BLOCK_N=config.w2_block_n,
        DOT_DTYPE=_TL_DTYPE[hidden_states.dtype],
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    combine_rows(row_out, topk_weights, out)
