"""``awq_moe_routed``: pick the dense or the grouped route from the token count at run time.

The Inductor rewrite (``moe_grouped_decode.lowerings``) emits this op where a
graph's symbolic token count M ranges wider than a contract's window (vLLM
compiles one graph for M in 1..max_num_batched_tokens): the grouped route runs
for ``grouped_min_tokens <= M <= grouped_max_tokens`` (the window the lookup,
``kernels/lookup.grouped_tokens``, gave the rewrite), the dense route otherwise.
The choice reads only M, a shape, never tensor data: it is made once per call
on the host, and a CUDA graph captured at a fixed M replays the route
chosen at capture. ``workspace`` is mutated only on the grouped route, but the
schema declares it mutated on both (a schema cannot depend on M).

The implementation dispatches to the two existing ops, so it runs on every
device they are registered for.
"""

from __future__ import annotations

import torch

from ..awq import AwqMoeWeights
from ..env import batch_invariant
from .awq_moe import LIBRARY, _fail, check_moe_args
from .workspace import workspace_numel

OP = "awq_moe_routed"


def check_routed_args(hidden_states, topk_weights, topk_ids, weights: AwqMoeWeights, workspace: torch.Tensor,
                      grouped_min_tokens: int, grouped_max_tokens: int) -> None:
    """The dense op's checks, plus: the workspace holds the window's largest grouped call."""
    check_moe_args(OP, hidden_states, topk_weights, topk_ids, weights)
    if not 1 <= grouped_min_tokens <= grouped_max_tokens:
        _fail(OP, f"grouped token window must satisfy 1 <= min <= max, got {grouped_min_tokens}..{grouped_max_tokens}")
    if workspace.dtype != torch.int32 or workspace.dim() != 1:
        _fail(OP, f"workspace must be a 1-D int32 tensor from alloc_workspace(), got {workspace.dtype} {tuple(workspace.shape)}")
    if workspace.device != hidden_states.device:
        _fail(OP, f"workspace is on {workspace.device}, but hidden_states is on {hidden_states.device}")
    K, k, N = hidden_states.shape[1], topk_ids.shape[1], weights.intermediate_size
    need = workspace_numel(grouped_max_tokens * k, K, N)
    if need > workspace.numel():
        _fail(
            OP,
            f"workspace holds fewer than grouped_max_tokens*k = {grouped_max_tokens}*{k} routed rows "
            f"(needs {need} int32 elements, has {workspace.numel()})",
        )


@torch.library.custom_op(f"{LIBRARY}::{OP}", mutates_args=("workspace",))
def awq_moe_routed(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_qweight: torch.Tensor,
    w13_scales: torch.Tensor,
    w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor,
    w2_scales: torch.Tensor,
    w2_qzeros: torch.Tensor,
    group_size: int,
    workspace: torch.Tensor,
    grouped_min_tokens: int,
    grouped_max_tokens: int,
) -> torch.Tensor:
    """Grouped route when M lies in [grouped_min_tokens, grouped_max_tokens], dense otherwise."""
    weights = AwqMoeWeights(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size)
    check_routed_args(hidden_states, topk_weights, topk_ids, weights, workspace, grouped_min_tokens, grouped_max_tokens)
    # the mode is asked here too: a graph may carry this op from before the mode was switched on
    if grouped_min_tokens <= hidden_states.shape[0] <= grouped_max_tokens and not batch_invariant():
        return torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
            hidden_states, topk_weights, topk_ids, *weights.op_args(), workspace)
    return torch.ops.moe_grouped_decode.awq_moe_dense(hidden_states, topk_weights, topk_ids, *weights.op_args())


@awq_moe_routed.register_fake
def _awq_moe_routed_fake(hidden_states, topk_weights, topk_ids, *rest):
    # No branch on M here: with a symbolic M that would add a guard and split the graph.
    *weight_args, workspace, grouped_min_tokens, grouped_max_tokens = rest
    check_routed_args(hidden_states, topk_weights, topk_ids, AwqMoeWeights(*weight_args), workspace,
                      grouped_min_tokens, grouped_max_tokens)
    return hidden_states.new_empty(hidden_states.shape)
