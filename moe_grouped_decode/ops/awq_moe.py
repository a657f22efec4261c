"""The two custom ops: ``awq_moe_dense`` and ``awq_moe_grouped_decode``.

Both compute, for M tokens routed to k of E AWQ int4 experts::

    out[t] = sum_j topk_weights[t, j] * W2_e( silu(x_t W13_e[:, :N]) * (x_t W13_e[:, N:]) ),  e = topk_ids[t, j]

A routed slot whose id lies outside [0, E) (vLLM's -1 for an expert on another
rank under expert parallelism, or any other id) contributes nothing to its token and
raises nothing (vLLM passes such ids on purpose; on CUDA a check would be a host
sync). Its row output is zero; the CPU implementation, like the CUDA prefill route,
never reads its weight (the CUDA grouped route multiplies it by that zero row).

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
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..awq import PACK_FACTOR, AwqMoeWeights
from ..env import batch_invariant
from .reference import Segments
from .workspace import workspace_numel, workspace_views

LIBRARY = "moe_grouped_decode"
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
ID_DTYPES = (torch.int32, torch.int64)

# each weight's shape from (E, K, N, G) (awq.py's layout), and as the error messages write it
EXPECTED_WEIGHT_SHAPES = {
    "w13_qweight": lambda E, K, N, G: (E, K, 2 * N // PACK_FACTOR),
    "w13_scales": lambda E, K, N, G: (E, K // G, 2 * N),
    "w13_qzeros": lambda E, K, N, G: (E, K // G, 2 * N // PACK_FACTOR),
    "w2_qweight": lambda E, K, N, G: (E, N, K // PACK_FACTOR),
    "w2_scales": lambda E, K, N, G: (E, N // G, K),
    "w2_qzeros": lambda E, K, N, G: (E, N // G, K // PACK_FACTOR),
}
GROUP_DIM_WEIGHTS = ("w13_scales", "w13_qzeros", "w2_scales", "w2_qzeros")
EXPECTED_WEIGHT_SHAPES_TEXT = {
    "w13_qweight": "[E, K, 2N/8]",
    "w13_scales": "[E, K/G, 2N]",
    "w13_qzeros": "[E, K/G, 2N/8]",
    "w2_qweight": "[E, N, K/8]",
    "w2_scales": "[E, N/G, K]",
    "w2_qzeros": "[E, N/G, K/8]",
}


def _fail(op: str, message: str):
    raise ValueError(f"{op}: {message}")


def _differs(a, b) -> bool:
    """a != b for sizes. A symbolic size (a fake kernel under ``torch.compile(dynamic=True)``)
    is compared by its hint and guarded, never forced to an int: the equalities the op needs
    (hidden_states and topk_ids share M, ...) then hold in the graph too."""
    return bool(a != b)


def _known(condition) -> bool:
    """``condition`` where it is known without a guard (always, for concrete sizes); a symbolic
    bound that would need one is left to the real implementation, which sees concrete sizes."""
    return statically_known_true(condition)


def _consensus(candidates: dict):
    """The value most ``candidates`` (name -> size) agree on, the first listed winning a tie.

    Each size is read from several tensors: taking the majority blames the one tensor
    that disagrees, whichever it is, instead of the others."""
    values = list(candidates.values())
    if not any(_differs(v, values[0]) for v in values[1:]):
        return values[0]  # the usual case, in n - 1 comparisons
    best, best_votes = None, -1
    for value in values:
        votes = sum(not _differs(other, value) for other in values)
        if votes > best_votes:
            best, best_votes = value, votes
    return best


def _shape(t: torch.Tensor) -> tuple:
    return tuple(t.shape)


def _is_int(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def check_moe_args(
    op: str,
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    weights: AwqMoeWeights,
    workspace: Optional[torch.Tensor] = None,
) -> None:
    """Validate dtypes, shapes, devices, sizes and the workspace's memory; every message
    names the tensor (or group_size) that is wrong and what it should be.

    Runs in the fake kernels too, so a bad call fails at trace time; symbolic sizes and a
    symbolic group_size are compared through guards, except the workspace's capacity (a
    bound on M), which the real implementation checks at run time. Reads no tensor data (no
    device sync).
    """
    group_size = weights.group_size  # an int or a SymInt: AwqMoeWeights checked its type
    if group_size <= 0:
        _fail(op, f"group_size must be a positive int, got {group_size!r}")

    if hidden_states.dim() != 2:
        _fail(op, f"hidden_states must be 2-D [M, K], got shape {_shape(hidden_states)}")
    if hidden_states.dtype not in ACTIVATION_DTYPES:
        _fail(op, f"hidden_states must be float16 or bfloat16, got {hidden_states.dtype}")
    for name, t in (("topk_ids", topk_ids), ("topk_weights", topk_weights)):
        if t.dim() != 2:
            _fail(op, f"{name} must be 2-D [M, k], got shape {_shape(t)}")
    if topk_ids.dtype not in ID_DTYPES:
        _fail(op, f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if topk_weights.dtype not in (torch.float32, hidden_states.dtype):
        _fail(op, f"topk_weights must be float32 or {hidden_states.dtype} (the activation dtype), got {topk_weights.dtype}")
    for name in ("w13_qweight", "w13_qzeros", "w2_qweight", "w2_qzeros"):
        t = getattr(weights, name)
        if t.dtype != torch.int32:
            _fail(op, f"{name} must be int32 (8 packed int4 per element), got {t.dtype}")
        if t.dim() != 3:
            _fail(op, f"{name} must be 3-D, got shape {_shape(t)}")
    for name in ("w13_scales", "w2_scales"):
        t = getattr(weights, name)
        if t.dtype != hidden_states.dtype:
            _fail(op, f"{name} must have the activation dtype {hidden_states.dtype}, got {t.dtype}")
        if t.dim() != 3:
            _fail(op, f"{name} must be 3-D, got shape {_shape(t)}")

    # M tokens, k experts per token, E experts, hidden size K, intermediate size N: each read from
    # every tensor that holds it
    w = weights
    M = _consensus({"hidden_states": hidden_states.shape[0], "topk_ids": topk_ids.shape[0],
                    "topk_weights": topk_weights.shape[0]})
    E = _consensus({name: getattr(w, name).shape[0] for name in EXPECTED_WEIGHT_SHAPES})
    K = _consensus({"hidden_states": hidden_states.shape[1], "w13_qweight": w.w13_qweight.shape[1],
                    "w2_scales": w.w2_scales.shape[2], "w2_qweight": w.w2_qweight.shape[2] * PACK_FACTOR,
                    "w2_qzeros": w.w2_qzeros.shape[2] * PACK_FACTOR})
    two_n = _consensus({"w2_qweight": 2 * w.w2_qweight.shape[1], "w13_scales": w.w13_scales.shape[2],
                        "w13_qweight": w.w13_qweight.shape[2] * PACK_FACTOR,
                        "w13_qzeros": w.w13_qzeros.shape[2] * PACK_FACTOR})
    N = two_n // 2  # two_n is even: an odd one (w13_scales alone) cannot outvote the first candidate

    if _differs(hidden_states.shape[0], M) or _differs(hidden_states.shape[1], K):
        _fail(op, f"hidden_states must have shape {(M, K)} ([M, K]: M as topk_ids and topk_weights, K as the "
                  f"weights), got {_shape(hidden_states)}")
    for name, t, other in (("topk_ids", topk_ids, topk_weights), ("topk_weights", topk_weights, topk_ids)):
        if _differs(t.shape[0], M):
            _fail(op, f"{name} must have shape {(M, other.shape[1])} ([M, k]: M as hidden_states, k as the "
                      f"other routing tensor), got {_shape(t)}")
    k = topk_ids.shape[1]
    if _differs(topk_weights.shape[1], k):
        # two witnesses of k: no majority, so both are named
        _fail(op, f"topk_ids {_shape(topk_ids)} and topk_weights {_shape(topk_weights)} must have the same "
                  f"shape [M={M}, k]; one of them has the wrong k")
    if k == 0:
        _fail(op, f"topk_ids must route each token to k >= 1 experts: shape [M={M}, k >= 1], got {_shape(topk_ids)}")

    if K % PACK_FACTOR or N % PACK_FACTOR:
        _fail(op, f"hidden size K={K} (hidden_states.shape[1]) and intermediate size N={N} (w2_qweight.shape[1]) "
                  "must be multiples of 8 (int4 packing)")
    if K % group_size or N % group_size:
        _fail(op, f"group_size={group_size} must divide hidden size K={K} and intermediate size N={N}")
    expected = {name: tuple(dims(E, K, N, group_size)) for name, dims in EXPECTED_WEIGHT_SHAPES.items()}

    # tuples of sizes compare element by element, through _differs's semantics for SymInts
    wrong = [name for name in expected if _shape(getattr(w, name)) != expected[name]]

    def differs(name, dims):
        return any(_differs(getattr(w, name).shape[d], expected[name][d]) for d in dims)

    groups = w.w13_scales.shape[1]
    if wrong and all(differs(name, (1,)) and not differs(name, (0, 2)) for name in GROUP_DIM_WEIGHTS):
        # every scale and zero tensor disagrees in its group count alone: group_size is what is wrong
        their_g = f"G={K // groups}" if _is_int(K, groups) and groups and not K % groups else "another group size"
        _fail(op, f"group_size={group_size} does not match the weights: w13_scales {_shape(w.w13_scales)} holds "
                  f"K/G={groups} groups of rows for K={K}, i.e. {their_g}")
    if wrong:
        name = wrong[0]
        _fail(op, f"{name} must have shape {expected[name]} ({EXPECTED_WEIGHT_SHAPES_TEXT[name]} for E={E}, K={K}, "
                  f"N={N}, G={group_size}), got {_shape(getattr(w, name))}")

    device = hidden_states.device
    inputs = {"hidden_states": hidden_states, "topk_weights": topk_weights, "topk_ids": topk_ids,
              **{name: getattr(w, name) for name in expected}}
    for name, t in {**inputs, **({} if workspace is None else {"workspace": workspace})}.items():
        if t.device != device:
            _fail(op, f"{name} is on {t.device}, but hidden_states is on {device}; all arguments must share a device")

    if workspace is not None:
        if workspace.dtype != torch.int32 or workspace.dim() != 1:
            _fail(op, f"workspace must be a 1-D int32 tensor from alloc_workspace(), got {workspace.dtype} {_shape(workspace)}")
        need = workspace_numel(M * k, K, N)
        if _known(need > workspace.numel()):
            _fail(
                op,
                f"workspace holds fewer than M*k = {M}*{k} = {M * k} routed rows "
                f"(needs {need} int32 elements for K={K}, N={N}, has {workspace.numel()}); "
                "allocate it with alloc_workspace(max_tokens >= M, ...)",
            )
        check_workspace_disjoint(op, workspace, inputs)


def _byte_range(t: torch.Tensor):
    """[first, last + 1) bytes of memory that ``t``'s elements can touch; None when empty."""
    numel = t.numel()
    if numel == 0:
        return None
    start = t.data_ptr()  # includes the storage offset
    if t.is_contiguous():
        return start, start + numel * t.element_size()
    span = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + (span + 1) * t.element_size()


def _has_memory(t: torch.Tensor) -> bool:
    if type(t) in (torch.Tensor, torch.nn.Parameter):  # the usual case, without is_fake's walk
        return not t.is_meta
    return not t.is_meta and not is_fake(t)


def check_workspace_disjoint(op: str, workspace: torch.Tensor, tensors: dict) -> None:
    """Reject a workspace whose memory overlaps any of ``tensors`` (name -> tensor).

    The op writes its scratch there, so an input inside it would be overwritten while it
    is read. Compares host-side pointer ranges (``data_ptr`` and strides: views of one
    buffer that do not overlap are fine); no sync, no data read. FakeTensors and meta
    tensors have no memory and are skipped.
    """
    if not _has_memory(workspace):
        return
    ws = _byte_range(workspace)
    if ws is None:
        return
    for name, t in tensors.items():
        if not _has_memory(t):
            continue
        r = _byte_range(t)
        if r is not None and r[0] < ws[1] and ws[0] < r[1]:
            _fail(op, f"workspace overlaps {name} in memory (workspace bytes [{ws[0]:#x}, {ws[1]:#x}), {name} "
                      f"[{r[0]:#x}, {r[1]:#x})); the op writes its scratch there: give it a buffer of its own "
                      "(alloc_workspace)")


def routed_slots(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[M, k] bool: the slots whose id names one of the layer's E experts; every other slot
    contributes nothing to its token (the CUDA kernels' rule)."""
    return (topk_ids >= 0) & (topk_ids < num_experts)


def _expert_rows_forward(x_rows: torch.Tensor, expert: int, weights: AwqMoeWeights):
    """Rows [r, K] through one expert -> (activations [r, N], outputs [r, K]), in x_rows' dtype
    (float32; float64 for the overflow recompute)."""
    w13, w2 = (w.to(x_rows.dtype) for w in weights.dequantized_expert(expert))
    return _rows_through(x_rows, w13, w2)


def _rows_through(x_rows: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    n = w2.shape[0]
    gate_up = x_rows @ w13
    act = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    return act, act @ w2


INVARIANT_BLOCK_ROWS = 8


def _expert_rows_in_blocks(x_rows: torch.Tensor, expert: int, weights: AwqMoeWeights):
    """``_expert_rows_forward`` in zero-padded blocks of INVARIANT_BLOCK_ROWS rows: every matmul
    has one shape, so a row's bits do not depend on how many rows share its expert (the CPU
    GEMM picks its kernel, and so its summation order, by shape)."""
    rows = x_rows.shape[0]
    padded = -(-rows // INVARIANT_BLOCK_ROWS) * INVARIANT_BLOCK_ROWS
    block = x_rows.new_zeros(padded, x_rows.shape[1])
    block[:rows] = x_rows
    w13, w2 = (w.to(x_rows.dtype) for w in weights.dequantized_expert(expert))
    parts = [_rows_through(block[i:i + INVARIANT_BLOCK_ROWS], w13, w2) for i in range(0, padded, INVARIANT_BLOCK_ROWS)]
    return tuple(torch.cat(p)[:rows] for p in zip(*parts))


def _combine(row_outputs: torch.Tensor, topk_weights: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """out[t] = sum_j w[t, j] * row_out[t*k + j] over the routed slots, summed in j order in
    row_outputs' dtype. A slot outside the experts adds an exact 0 whatever its weight (a NaN
    weight there must not reach the token)."""
    M, k = topk_weights.shape
    weights = torch.where(routed, topk_weights, 0).to(row_outputs.dtype)
    # K spelled out: with M = 0 a -1 could be any size
    weighted = row_outputs.view(M, k, row_outputs.shape[1]) * weights.unsqueeze(-1)
    out = weighted[:, 0]
    for j in range(1, k):
        out = out + weighted[:, j]
    return out


def _finish(out: torch.Tensor, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            routed: torch.Tensor, weights: AwqMoeWeights) -> torch.Tensor:
    """The float32 result in the activation dtype, tokens whose result is not finite recomputed in float64.

    A float32 intermediate can overflow where float64 does not (bf16 inputs of 1e20 and more
    on a unit-scale layer: silu(gate) * up passes 3.4e38, and W2 then sums +inf and -inf into
    NaN) while the exact result rounds to +-Inf or to a finite value. An overflow always
    leaves the token's float32 result non-finite, so recomputing exactly those tokens in
    float64 rounds them as the float64 reference does; every other token keeps its float32 bits.
    """
    result = out.to(hidden_states.dtype)
    bad = (~torch.isfinite(out)).any(dim=1).nonzero(as_tuple=True)[0]
    if bad.numel():
        k = topk_ids.shape[1]
        x = hidden_states[bad].to(torch.float64)
        ids = topk_ids[bad].tolist()
        row_outputs = torch.zeros(bad.numel() * k, out.shape[1], dtype=torch.float64)
        for i, token_ids in enumerate(ids):
            for j, expert in enumerate(token_ids):
                if 0 <= expert < weights.num_experts:
                    row_outputs[i * k + j] = _expert_rows_forward(x[i : i + 1], expert, weights)[1][0]
        result[bad] = _combine(row_outputs, topk_weights[bad], routed[bad]).to(hidden_states.dtype)
    return result


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
    M, K = hidden_states.shape
    k = topk_ids.shape[1]
    x = hidden_states.to(torch.float32)
    routed = routed_slots(topk_ids, weights.num_experts)
    flat_ids = topk_ids.flatten().to(torch.int64)
    row_outputs = torch.zeros(M * k, K, dtype=torch.float32)  # a slot outside the experts keeps its 0
    # dense metadata: a row count for every one of the E experts, walked in order
    counts = torch.bincount(flat_ids[routed.flatten()], minlength=weights.num_experts).tolist()
    invariant = batch_invariant()
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = (flat_ids == expert).nonzero(as_tuple=True)[0]
        if invariant:
            _, row_outputs[rows] = _expert_rows_in_blocks(x[rows // k], expert, weights)
        else:
            _, row_outputs[rows] = _expert_rows_forward(x[rows // k], expert, weights)
    return _finish(_combine(row_outputs, topk_weights, routed), hidden_states, topk_weights, topk_ids, routed,
                   weights)


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
    M, K = hidden_states.shape
    k = topk_ids.shape[1]
    views = workspace_views(workspace, M * k, K, weights.intermediate_size)
    segments = compact_rows(topk_ids)
    routed = routed_slots(topk_ids, weights.num_experts)
    x = hidden_states.to(torch.float32)
    offsets = segments.segment_offsets
    for a, expert in enumerate(segments.active_experts):
        rows = torch.tensor(segments.sorted_rows[offsets[a]: offsets[a + 1]], dtype=torch.int64)
        if not 0 <= expert < weights.num_experts:
            # no expert of this layer: the rows read no weights and their outputs are 0, as on CUDA
            views.activations[rows] = 0.0
            views.row_outputs[rows] = 0.0
            continue
        act, out = _expert_rows_forward(x[rows // k], expert, weights)
        views.activations[rows] = act
        views.row_outputs[rows] = out
    return _finish(_combine(views.row_outputs, topk_weights, routed), hidden_states, topk_weights, topk_ids, routed,
                   weights)


@awq_moe_grouped_decode.register_fake
def _awq_moe_grouped_decode_fake(hidden_states, topk_weights, topk_ids, *weight_args_and_workspace):
    *weight_args, workspace = weight_args_and_workspace
    check_moe_args("awq_moe_grouped_decode", hidden_states, topk_weights, topk_ids, AwqMoeWeights(*weight_args),
                   workspace)
    return hidden_states.new_empty(hidden_states.shape)
