"""The co-served op: the grouped decode over vLLM's own Marlin tensors.

Where a layer is co-served (``tables.coserve_verdict``) vLLM loads it for its Marlin backend
and keeps every step but the few-token ones; for those the plugin's method calls this op on
the same tensors (``kernels/marlin_grouped.py``). The shapes are in the kernel module's
docstring; ``intermediate_size`` is the layer's own N (vLLM pads it to N_p, which the op reads
off ``w2_qweight``), ``scales_grouped`` the order vLLM wrote the scales in
(``marlin_layout.vllm_scales_grouped``).

The CPU implementation converts the tensors back to AutoAWQ's layout (``marlin_layout``,
exact) and runs the dense op's: the reference the CUDA kernel is checked against.
"""

from __future__ import annotations

import torch

from ..contract import dtype_name
from ..kernels import device_facts
from ..kernels.marlin_grouped import coserved_config, launch_marlin_grouped
from ..kernels.pdl import pdl_supported
from ..marlin_layout import MarlinMoeWeights, marlin_to_awq
from .awq_moe import LIBRARY, awq_moe_dense

MARLIN_ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)


def check_routing_args(op: str, hidden_states, topk_weights, topk_ids, scales) -> None:
    """The checks every co-served op makes of its activations, routing and scales' dtype; ``op``
    names it in the error."""
    if hidden_states.dim() != 2 or topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"{op}: hidden_states [M, K] and topk_weights / topk_ids [M, k] of one shape, got "
                         f"{tuple(hidden_states.shape)}, {tuple(topk_weights.shape)}, {tuple(topk_ids.shape)}")
    if topk_ids.shape[0] != hidden_states.shape[0]:
        raise ValueError(f"{op}: {topk_ids.shape[0]} rows of ids for {hidden_states.shape[0]} tokens")
    if hidden_states.dtype not in MARLIN_ACTIVATION_DTYPES or scales.dtype != hidden_states.dtype:
        raise ValueError(f"{op}: activations and scales of one dtype among {MARLIN_ACTIVATION_DTYPES}, got "
                         f"{hidden_states.dtype} and {scales.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype not in (torch.float32, hidden_states.dtype):
        raise ValueError(f"{op}: topk_weights must be float32 or {hidden_states.dtype}, got {topk_weights.dtype}")


def check_marlin_args(hidden_states, topk_weights, topk_ids, w13_qweight, w2_qweight, w13_scales) -> None:
    """Shape-only checks both implementations share (the kernel launch checks the weights)."""
    check_routing_args("awq_marlin_grouped_decode", hidden_states, topk_weights, topk_ids, w13_scales)
    if w13_qweight.shape[1] * 16 != hidden_states.shape[1] or w2_qweight.shape[0] != w13_qweight.shape[0]:
        raise ValueError(f"awq_marlin_grouped_decode: Marlin weights {tuple(w13_qweight.shape)}, "
                         f"{tuple(w2_qweight.shape)} are not a layer of hidden size {hidden_states.shape[1]}")


@torch.library.custom_op(f"{LIBRARY}::awq_marlin_grouped_decode", mutates_args=())
def awq_marlin_grouped_decode(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_qzeros: torch.Tensor,
    intermediate_size: int,
    group_size: int,
    scales_grouped: bool,
) -> torch.Tensor:
    """The MoE layer on Marlin tensors (CPU implementation: back to AutoAWQ's layout, the dense op)."""
    check_marlin_args(hidden_states, topk_weights, topk_ids, w13_qweight, w2_qweight, w13_scales)
    awq = marlin_to_awq(MarlinMoeWeights(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros,
                                         group_size, intermediate_size, scales_grouped))
    return awq_moe_dense(hidden_states, topk_weights, topk_ids, *awq.tensors(), group_size)


@awq_marlin_grouped_decode.register_fake
def _awq_marlin_grouped_decode_fake(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                                    w2_qweight, w2_scales, w2_qzeros, intermediate_size, group_size, scales_grouped):
    check_marlin_args(hidden_states, topk_weights, topk_ids, w13_qweight, w2_qweight, w13_scales)
    return hidden_states.new_empty(hidden_states.shape)


def awq_marlin_grouped_decode_cuda(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                                   w2_qweight, w2_scales, w2_qzeros, intermediate_size: int, group_size: int,
                                   scales_grouped: bool) -> torch.Tensor:
    """The CUDA implementation: the launch config the layer's measured table names for this M."""
    check_marlin_args(hidden_states, topk_weights, topk_ids, w13_qweight, w2_qweight, w13_scales)
    facts = device_facts(hidden_states.device)
    M, K = hidden_states.shape
    shape = (w13_qweight.shape[0], topk_ids.shape[1], K, intermediate_size, group_size)
    config = coserved_config(facts.name, shape, dtype_name(hidden_states.dtype), M)
    return launch_marlin_grouped(hidden_states, topk_weights.contiguous(), topk_ids.contiguous(), w13_qweight,
                                 w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, intermediate_size,
                                 group_size, scales_grouped, config, use_pdl=pdl_supported(facts.capability))


awq_marlin_grouped_decode.register_kernel("cuda")(awq_marlin_grouped_decode_cuda)
