"""vLLM 0.32's MARLIN MoE backend for an AWQ layer of any shape: its weight conversion and forward.

A line-by-line port of the Python vLLM runs (the shared Marlin anchor's port, with every
shape-dependent choice taken from ``shape``):
  * weights: AutoAWQMoEMethod.process_weights_after_loading -> oracle/int_wna16.py
    _process_awq_weights_marlin (16-bit activations, no bias): N padded to
    marlin_moe_padded_intermediate, awq_marlin_moe_repack, marlin_moe_permute_scales,
    moe_awq_to_marlin_zero_points (the last two batched over experts here; the tests check
    them bit-equal to vLLM's per-expert loops);
  * forward: MarlinExperts.apply -> fused_marlin_moe: block_size_m heuristic,
    moe_align_block_size, moe_wna16_marlin_gemm (W13), silu_and_mul, moe_wna16_marlin_gemm (W2,
    router weights applied), moe_sum over top-k, in the workspaces MarlinExperts asks for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F

from .ops import VllmMoeOps, align_block_size
from .shape import (PACK_FACTOR, MoeShape, marlin_block_size_m, marlin_group_blocks, marlin_locks_numel,
                    marlin_padded_intermediate, marlin_uses_group_scale_perm, marlin_workspace_numel)

AWQ_INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # marlin_zero_points' and AutoAWQ's int4 order


def scalar_type_id(exponent: int, mantissa: int, signed: bool, bias: int, finite_values_only: bool = False,
                   nan_repr: int = 1) -> int:
    """vllm/scalar_type.py ScalarType.id: the fields packed into one integer."""
    value, offset = 0, 0
    for member, width in ((exponent, 8), (mantissa, 8), (int(signed), 1), (bias, 32), (int(finite_values_only), 1),
                          (nan_repr, 8)):
        value |= (int(member) & ((1 << width) - 1)) << offset
        offset += width
    return value


UINT4_ID = scalar_type_id(0, 4, False, 0)  # scalar_types.uint4: AWQ's int4 with zero points


def scale_perms() -> Tuple[list, list]:
    """marlin_utils.get_scale_perms: (grouped 64-wide, per-channel 32-wide) permutations."""
    scale_perm = [i + 8 * j for i in range(8) for j in range(8)]
    scale_perm_single = [2 * i + j for i in range(4) for j in (0, 1, 8, 9, 16, 17, 24, 25)]
    return scale_perm, scale_perm_single


def pad_w13_shard_cols(x: torch.Tensor, unit: int, padded_unit: int) -> torch.Tensor:
    """int_wna16._pad_w13_shard_cols: zero-pad each of the gate/up column halves."""
    if padded_unit == unit:
        return x
    e, rows, _ = x.shape
    x = F.pad(x.view(e, rows, 2, unit), (0, padded_unit - unit))
    return x.reshape(e, rows, 2 * padded_unit).contiguous()


def pad_rows(x: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """int_wna16._pad_rows."""
    if padded_rows == x.size(1):
        return x
    return F.pad(x, (0, 0, 0, padded_rows - x.size(1)))


def awq_marlin_moe_repack(ops: VllmMoeOps, b_q_weight: torch.Tensor, size_k: int, size_n: int,
                          num_bits: int = 4) -> torch.Tensor:
    """vllm/_custom_ops.py awq_marlin_moe_repack: the repack op once per expert."""
    assert size_k % 16 == 0
    output = torch.empty((b_q_weight.shape[0], size_k // 16, size_n * (num_bits // 2)), device=b_q_weight.device,
                         dtype=b_q_weight.dtype)
    for e in range(b_q_weight.shape[0]):
        output[e] = ops.awq_marlin_repack(b_q_weight[e], size_k, size_n, num_bits, False)
    return output


def marlin_moe_permute_scales(s: torch.Tensor, size_n: int, grouped: bool) -> torch.Tensor:
    """marlin_moe_permute_scales (per-expert marlin_permute_scales), all experts at once;
    ``grouped``: the 64-wide permutation (marlin_uses_group_scale_perm)."""
    scale_perm, scale_perm_single = scale_perms()
    perm = scale_perm if grouped else scale_perm_single
    e = s.shape[0]
    return s.reshape(e, -1, len(perm))[:, :, perm].reshape(e, s.shape[1], size_n).contiguous()


def moe_awq_to_marlin_zero_points(q_zp_packed: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
    """moe_awq_to_marlin_zero_points for 4 bits, all experts at once: unpack_cols, undo AWQ's
    interleave, the grouped scale permutation, marlin's interleave, pack_cols."""
    e = q_zp_packed.shape[0]
    shifts = torch.arange(0, 32, 4, device=q_zp_packed.device, dtype=torch.int32)
    q = ((q_zp_packed.unsqueeze(-1) >> shifts) & 0xF).reshape(e, size_k, size_n)
    undo = sorted(range(8), key=lambda i: AWQ_INTERLEAVE[i])  # argsort
    q = q.reshape(e, -1, 8)[:, :, undo].reshape(e, size_k, size_n)
    q = q.reshape(e, -1, 64)[:, :, scale_perms()[0]]
    q = q.reshape(e, -1, 8)[:, :, list(AWQ_INTERLEAVE)].reshape(e, size_k, size_n // 8, 8).to(torch.int64)
    packed = (q << shifts.to(torch.int64)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32).contiguous()


@dataclass
class MarlinLayer:
    """One layer's weights as MarlinExperts holds them."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scales: torch.Tensor
    w2_scales: torch.Tensor
    w13_zeros: torch.Tensor
    w2_zeros: torch.Tensor


def prepare_marlin_layer(awq: dict, shape: MoeShape, dtype: torch.dtype, ops: VllmMoeOps) -> MarlinLayer:
    """_process_awq_weights_marlin(layer, weight_bits=4, pack_factor=8, group_size=G,
    input_dtype=None, ...) on the six AWQ tensors, scales in the params dtype first."""
    N, G = shape.intermediate_size, shape.group_size
    w13_qweight, w2_qweight = awq["w13_qweight"], awq["w2_qweight"]
    w13_scales, w2_scales = awq["w13_scales"].to(dtype), awq["w2_scales"].to(dtype)
    w13_qzeros, w2_qzeros = awq["w13_qzeros"], awq["w2_qzeros"]
    padded_n = marlin_padded_intermediate(N, G)
    if padded_n != N:
        w13_qweight = pad_w13_shard_cols(w13_qweight, N // PACK_FACTOR, padded_n // PACK_FACTOR)
        w2_qweight = pad_rows(w2_qweight, padded_n)
        w13_scales = pad_w13_shard_cols(w13_scales, N, padded_n)
        w13_qzeros = pad_w13_shard_cols(w13_qzeros, N // PACK_FACTOR, padded_n // PACK_FACTOR)
        w2_scales = pad_rows(w2_scales, padded_n // G)
        w2_qzeros = pad_rows(w2_qzeros, padded_n // G)
    grouped = marlin_uses_group_scale_perm(shape)
    return MarlinLayer(
        w13=awq_marlin_moe_repack(ops, w13_qweight, w13_qweight.shape[1], w13_qweight.shape[2] * PACK_FACTOR),
        w2=awq_marlin_moe_repack(ops, w2_qweight, w2_qweight.shape[1], w2_qweight.shape[2] * PACK_FACTOR),
        w13_scales=marlin_moe_permute_scales(w13_scales, w13_scales.shape[2], grouped),
        w2_scales=marlin_moe_permute_scales(w2_scales, w2_scales.shape[2], grouped),
        w13_zeros=moe_awq_to_marlin_zero_points(w13_qzeros, w13_qzeros.shape[1], w13_qzeros.shape[2] * PACK_FACTOR),
        w2_zeros=moe_awq_to_marlin_zero_points(w2_qzeros, w2_qzeros.shape[1], w2_qzeros.shape[2] * PACK_FACTOR),
    )


def make_locks(device) -> torch.Tensor:
    """get_marlin_workspace outside vLLM's workspace manager: zeros(SMs * 4) int32."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return torch.zeros(marlin_locks_numel(sms), dtype=torch.int, device=device)


class MarlinRunner:
    """MarlinExperts.apply -> fused_marlin_moe for M tokens of a ``shape`` layer, with the
    workspaces the modular kernel hands it allocated once (as vLLM's workspace manager does)."""

    def __init__(self, shape: MoeShape, M: int, dtype: torch.dtype, ops: VllmMoeOps, locks: torch.Tensor):
        self.shape, self.M, self.ops, self.locks = shape, M, ops, locks
        device = locks.device
        numel13, numel2 = marlin_workspace_numel(M, shape)
        self.cache13 = torch.empty(numel13, device=device, dtype=dtype)  # workspace2
        self.cache2 = torch.empty(numel2, device=device, dtype=dtype)  # workspace1
        self.out = torch.empty(M, shape.hidden_size, device=device, dtype=dtype)
        self.block_size_m = marlin_block_size_m(M, shape.top_k, shape.num_experts)
        gb13, gb2 = marlin_group_blocks(shape)
        self.gemm13, self.gemm2 = ops.marlin_gemm(gb13), ops.marlin_gemm(gb2)
        self.workspaces = (self.cache13, self.cache2, self.out)

    def align(self, topk_ids: torch.Tensor):
        return align_block_size(self.ops, topk_ids, self.block_size_m, self.shape.num_experts)

    def __call__(self, x: torch.Tensor, layer: MarlinLayer, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 align=None) -> torch.Tensor:
        M, K = x.shape
        n = layer.w2.size(1) * 16  # marlin_moe_intermediate_size
        topk = topk_ids.size(1)
        assert layer.w13.size(1) * 16 == K and layer.w2.size(2) // 2 == K
        assert topk_weights.dtype == torch.float32
        sorted_ids, expert_ids, num_tokens_post_pad = align if align is not None else self.align(topk_ids)
        cache1 = self.cache13[: M * topk * 2 * n].view(M * topk, 2 * n)
        cache3 = self.cache13[: M * topk * K].view(M * topk, K)
        cache2 = self.cache2[: M * topk * n].view(M * topk, n)
        cache1 = self.gemm13(x, cache1, layer.w13, None, layer.w13_scales, None, None, layer.w13_zeros, self.locks,
                             sorted_ids, expert_ids, num_tokens_post_pad, topk_weights, self.block_size_m, topk,
                             False, UINT4_ID, M, 2 * n, K, False, True, False, -1, -1, -1)
        self.ops.silu_and_mul(cache2, cache1.view(-1, 2 * n))
        cache3 = self.gemm2(cache2, cache3, layer.w2, None, layer.w2_scales, None, None, layer.w2_zeros, self.locks,
                            sorted_ids, expert_ids, num_tokens_post_pad, topk_weights, self.block_size_m, 1, True,
                            UINT4_ID, M * topk, K, n, False, True, False, -1, -1, -1)
        self.ops.moe_sum(cache3.view(-1, topk, K), self.out)  # MarlinExperts.moe_sum
        return self.out

    def describe(self) -> dict:
        return {"block_size_m": self.block_size_m}
