"""The two custom ops: ``awq_moe_dense`` and ``awq_moe_grouped_decode``.

Both compute, for M tokens routed to k of E AWQ int4 experts::

    out[t] = sum_j topk_weights[t, j] * W2_e( silu(x_t W13_e[:, :N]) * (x_t W13_e[:, N:]) ),  e = topk_ids[t, j]

The dense op works from metadata over all E experts (the route for C1 and
prefill). The grouped op touches only the routed experts' weights; its scratch
lives in ``workspace`` (declared mutated). Each op has a fake kernel beside it
(a pure shape function), a CPU implementation in torch here, and a CUDA
implementation in Triton registered from ``cuda.py``. The schemas keep the ten
tensors vLLM holds; below them the six weight tensors and the group size travel
as one ``AwqMoeWeights``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..awq import PACK_FACTOR, AwqMoeWeights
from .reference import Segments
from .workspace import workspace_numel, workspace_views

LIBRARY = "moe_grouped_decode"
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)


def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _is_concrete(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def check_moe_args(
    op: str,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: AwqMoeWeights,
    workspace: Optional[torch.Tensor] = None,
) -> None:
    """Validate dtypes, shapes, devices and sizes; every message names the argument.

    Runs in the fake kernels too, so a bad call fails at trace time. Reads no
    tensor data (no device sync).
    """
    group_size = weights.group_size
    if hidden_states.dim() != 2:
        _fail(op, f"hidden_states must be 2-D [M, K], got shape {tuple(hidden_states.shape)}")
    if hidden_states.dtype not in ACTIVATION_DTYPES:
        _fail(op, f"hidden_states must be float16 or bfloat16, got {hidden_states.dtype}")
    M, K = hidden_states.shape
    if topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        _fail(op, f"topk_ids must be [M={M}, k], got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in ID_DTYPES:
        _fail(op, f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    k = topk_ids.shape[1]
    if tuple(topk_weights.shape) != (M, k):
        _fail(op, f"topk_weights must be [M={M}, k={k}] like topk_ids, got shape {tuple(topk_weights.shape)}")
    if topk_weights.dtype not in (torch.float32, hidden_states.dtype):
        _fail(op, f"topk_weights must be float32 or {hidden_states.dtype} (the activation dtype), got {topk_weights.dtype}")
    if not isinstance(group_size, int) or group_size <= 0:
        _fail(op, f"group_size must be a positive int, got {group_size!r}")

    for name in ("w13_qweight", "w13_qzeros", "w2_qweight", "w2_qzeros"):
        t = getattr(weights, name)
        if t.dtype != torch.int32:
            _fail(op, f"{name} must be int32 (8 packed int4 per element), got {t.dtype}")
        if t.dim() != 3:
            _fail(op, f"{name} must be 3-D, got shape {tuple(t.shape)}")
    for name in ("w13_scales", "w2_scales"):
        t = getattr(weights, name)
        if t.dtype != hidden_states.dtype:
            _fail(op, f"{name} must have the activation dtype {hidden_states.dtype}, got {t.dtype}")
        if t.dim() != 3:
            _fail(op, f"{name} must be 3-D, got shape {tuple(t.shape)}")

    E = weights.num_experts
    N = weights.intermediate_size
    if weights.w13_qweight.shape[1] != K:
        _fail(op, f"w13_qweight must be [E, K={K}, 2N/8] (K = hidden_states.shape[1]), got shape "
                  f"{tuple(weights.w13_qweight.shape)}")
    if _is_concrete(K, N) and (K % group_size or N % group_size):
        _fail(op, f"group_size={group_size} must divide hidden size K={K} and intermediate size N={N}")
    if _is_concrete(K, N) and (K % PACK_FACTOR or N % PACK_FACTOR):
        _fail(op, f"K={K} and N={N} must be multiples of 8 (int4 packing)")
    expected = {
        "w13_qweight": (E, K, 2 * N // PACK_FACTOR),
        "w13_scales": (E, K // group_size, 2 * N),
        "w13_qzeros": (E, K // group_size, 2 * N // PACK_FACTOR),
        "w2_qweight": (E, N, K // PACK_FACTOR),
        "w2_scales": (E, N // group_size, K),
        "w2_qzeros": (E, N // group_size, K // PACK_FACTOR),
    }
    for name, shape in expected.items():
        t = getattr(weights, name)
        if tuple(t.shape) != shape:
            _fail(op, f"{name} must have shape {shape} for E={E}, K={K}, N={N}, G={group_size}, got {tuple(t.shape)}")

    device = hidden_states.device
    tensors = {"topk_weights": topk_weights, "topk_ids": topk_ids, **{name: getattr(weights, name) for name in expected}}
    if workspace is not None:
        tensors["workspace"] = workspace
    for name, t in tensors.items():
        if t.device != device:
            _fail(op, f"{name} is on {t.device}, but hidden_states is on {device}; all arguments must share a device")

    if workspace is not None:
        if workspace.dtype != torch.int32 or workspace.dim() != 1:
            _fail(op, f"workspace must be a 1-D int32 tensor from alloc_workspace(), got {workspace.dtype} {tuple(workspace.shape)}")
        if _is_concrete(M, k, workspace.numel()):
            need = workspace_numel(M * k, K, N)
            if need > workspace.numel():
                _fail(
                    op,
                    f"workspace holds fewer than M*k = {M}*{k} = {M * k} routed rows "
                    f"(needs {need} int32 elements for K={K}, N={N}, has {workspace.numel()}); "
                    "allocate it with alloc_workspace(max_tokens >= M, ...)",
                )


def check_topk_ids_range(op: str, topk_ids: torch.Tensor, num_experts: int) -> None:
    """Value check of the routing (reads the data: CPU implementations only)."""
    if topk_ids.numel():
        lo, hi = int(topk_ids.min()), int(topk_ids.max())
        if lo < 0 or hi >= num_experts:
            _fail(op, f"topk_ids must lie in [0, E={num_experts}), got values in [{lo}, {hi}]")


def _expert_rows_forward(x_rows: torch.Tensor, expert: int, weights: AwqMoeWeights):
    """float32 rows [r, K] through one expert -> (activations [r, N], outputs [r, K])."""
    w13, w2 = weights.dequantized_expert(expert)
    n = w2.shape[0]
    gate_up = x_rows @ w13
    act = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    return act, act @ w2


def _combine(row_outputs: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * row_out[t*k + j], summed in j order in float32."""
    M, k = topk_weights.shape
    weighted = row_outputs.view(M, k, -1) * topk_weights.to(torch.float32).unsqueeze(-1)
    out = weighted[:, 0]
    for j in range(1, k):
        out = out + weighted[:, j]
    return out.to(dtype)


# --------------------------------------------------------------------------- dense


@torch.library.custom_op(f"{LIBRARY}::awq_moe_dense", mutates_args=())
def awq_moe_dense(
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
) -> torch.Tensor:
    """Dense-route AWQ MoE (CPU implementation; CUDA is registered by ops.cuda)."""
    weights = AwqMoeWeights(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size)
    check_moe_args("awq_moe_dense", hidden_states, topk_weights, topk_ids, weights)
    check_topk_ids_range("awq_moe_dense", topk_ids, weights.num_experts)
    M, K = hidden_states.shape
    k = topk_ids.shape[1]
    x = hidden_states.to(torch.float32)
    flat_ids = topk_ids.flatten().to(torch.int64)
    row_outputs = torch.zeros(M * k, K, dtype=torch.float32)
    # dense metadata: a row count for every one of the E experts, walked in order
    counts = torch.bincount(flat_ids, minlength=weights.num_experts).tolist()
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = (flat_ids == expert).nonzero(as_tuple=True)[0]
        _, row_outputs[rows] = _expert_rows_forward(x[rows // k], expert, weights)
    return _combine(row_outputs, topk_weights, hidden_states.dtype)


@awq_moe_dense.register_fake
def _awq_moe_dense_fake(hidden_states, topk_weights, topk_ids, *weight_args):
    check_moe_args("awq_moe_dense", hidden_states, topk_weights, topk_ids, AwqMoeWeights(*weight_args))
    return hidden_states.new_empty(hidden_states.shape)


# --------------------------------------------------------------------------- grouped


def compact_rows(topk_ids: torch.Tensor) -> Segments:
    """The routed rows grouped by expert (CPU, torch): experts ascending, rows ascending within
    each segment (a stable sort)."""
    flat = topk_ids.flatten().to(torch.int64)
    sorted_ids, sorted_rows = torch.sort(flat, stable=True)
    active, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    offsets = [0] + torch.cumsum(counts, 0).tolist()
    return Segments(active.tolist(), offsets, sorted_rows.tolist())


@torch.library.custom_op(f"{LIBRARY}::awq_moe_grouped_decode", mutates_args=("workspace",))
def awq_moe_grouped_decode(
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
) -> torch.Tensor:
    """Compact active-expert AWQ MoE (CPU implementation; CUDA is registered by ops.cuda)."""
    weights = AwqMoeWeights(w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size)
    check_moe_args("awq_moe_grouped_decode", hidden_states, topk_weights, topk_ids, weights, workspace)
    check_topk_ids_range("awq_moe_grouped_decode", topk_ids, weights.num_experts)
    M, K = hidden_states.shape
    k = topk_ids.shape[1]
    views = workspace_views(workspace, M * k, K, weights.intermediate_size)
    segments = compact_rows(topk_ids)
    x = hidden_states.to(torch.float32)
    offsets = segments.segment_offsets
    for a, expert in enumerate(segments.active_experts):
        rows = torch.tensor(segments.sorted_rows[offsets[a]: offsets[a + 1]], dtype=torch.int64)
        act, out = _expert_rows_forward(x[rows // k], expert, weights)
        views.activations[rows] = act
        views.row_outputs[rows] = out
    return _combine(views.row_outputs, topk_weights, hidden_states.dtype)


@awq_moe_grouped_decode.register_fake
def _awq_moe_grouped_decode_fake(hidden_states, topk_weights, topk_ids, *weight_args_and_workspace):
    *weight_args, workspace = weight_args_and_workspace
    check_moe_args("awq_moe_grouped_decode", hidden_states, topk_weights, topk_ids, AwqMoeWeights(*weight_args),
                   workspace)
    return hidden_states.new_empty(hidden_states.shape)
