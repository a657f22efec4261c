"""The co-served op over vLLM's Humming tensors: the grouped decode where vLLM keeps Humming.

vLLM 0.32+ serves AutoAWQ MoE layers with its HUMMING backend on compute capability 9.0. Where a
layer's table co-serves it over Humming's tensors (``tables.coserve_verdict``), vLLM loads and
repacks the layer for Humming as usual and runs every step but the window's, for which the
plugin's method calls this op on the same tensors (``kernels/marlin_grouped.py``,
``launch_humming_grouped``; the layout is ``humming_layout``'s). ``hidden_size`` and
``intermediate_size`` are the layer's own K and N (Humming pads both at the ends).

The CPU implementation converts the tensors back to AutoAWQ's layout (``humming_layout``, exact)
and runs the dense op's: the reference the CUDA kernel is checked against.
"""

from __future__ import annotations

import torch

from ..contract import dtype_name
from ..humming_layout import HummingMoeWeights, humming_padded_sizes, humming_to_awq
from ..kernels import device_facts
from ..kernels.marlin_grouped import coserved_config, launch_humming_grouped
from ..kernels.pdl import pdl_supported
from .awq_moe import LIBRARY, awq_moe_dense
from .marlin import check_routing_args

OP = "awq_humming_grouped_decode"


def check_humming_args(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale, w2_weight,
                       intermediate_size: int) -> None:
    """Shape-only checks both implementations share (the kernel launch checks every tensor)."""
    check_routing_args(OP, hidden_states, topk_weights, topk_ids, w13_weight_scale)
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(hidden_states.shape[1], intermediate_size)
    if (tuple(w13_weight.shape[1:]) != (k_rows // 16, 2 * w13_columns)
            or tuple(w2_weight.shape) != (w13_weight.shape[0], n_rows // 16, 2 * w2_columns)):
        raise ValueError(f"{OP}: Humming weights {tuple(w13_weight.shape)}, {tuple(w2_weight.shape)} are not a layer "
                         f"of hidden size {hidden_states.shape[1]} and intermediate size {intermediate_size}")


@torch.library.custom_op(f"{LIBRARY}::{OP}", mutates_args=())
def awq_humming_grouped_decode(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_weight: torch.Tensor,
    w13_weight_scale: torch.Tensor,
    w13_zero_point: torch.Tensor,
    w2_weight: torch.Tensor,
    w2_weight_scale: torch.Tensor,
    w2_zero_point: torch.Tensor,
    intermediate_size: int,
    group_size: int,
) -> torch.Tensor:
    """The MoE layer on Humming's tensors (CPU implementation: back to AutoAWQ's layout, the dense op)."""
    check_humming_args(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale, w2_weight,
                       intermediate_size)
    awq = humming_to_awq(HummingMoeWeights(w13_weight, w13_weight_scale, w13_zero_point, w2_weight, w2_weight_scale,
                                           w2_zero_point, group_size, hidden_states.shape[1], intermediate_size))
    return awq_moe_dense(hidden_states, topk_weights, topk_ids, *awq.tensors(), group_size)


@awq_humming_grouped_decode.register_fake
def _awq_humming_grouped_decode_fake(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale,
                                     w13_zero_point, w2_weight, w2_weight_scale, w2_zero_point, intermediate_size,
                                     group_size):
    check_humming_args(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale, w2_weight,
                       intermediate_size)
    return hidden_states.new_empty(hidden_states.shape)


def awq_humming_grouped_decode_cuda(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale,
                                    w13_zero_point, w2_weight, w2_weight_scale, w2_zero_point, intermediate_size: int,
                                    group_size: int) -> torch.Tensor:
    """The CUDA implementation: the launch config the layer's Humming co-serving table names for this M."""
    check_humming_args(hidden_states, topk_weights, topk_ids, w13_weight, w13_weight_scale, w2_weight,
                       intermediate_size)
    facts = device_facts(hidden_states.device)
    M, K = hidden_states.shape
    shape = (w13_weight.shape[0], topk_ids.shape[1], K, intermediate_size, group_size)
    config = coserved_config(facts.name, shape, dtype_name(hidden_states.dtype), M, layout="humming")
    return launch_humming_grouped(hidden_states, topk_weights.contiguous(), topk_ids.contiguous(), w13_weight,
                                  w13_weight_scale, w13_zero_point, w2_weight, w2_weight_scale, w2_zero_point,
                                  intermediate_size, group_size, config, use_pdl=pdl_supported(facts.capability))


awq_humming_grouped_decode.register_kernel("cuda")(awq_humming_grouped_decode_cuda)
