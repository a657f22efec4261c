"""CUDA implementations of the ops, launching the Triton kernels in ``..kernels``.

Nothing here reads tensor data on the host: validation is shape-only
(``check_moe_args``), every launch grid is fixed by the static shapes (the launch plan,
``kernels/plan.py``), and the grouped op's scratch is carved from the caller's
``workspace``. ``warmup`` compiles every kernel variant (and, opt-in, autotunes) before
CUDA-graph capture.
"""

from __future__ import annotations

from typing import Callable, Dict, Iterable, Optional

import torch
import triton

from .. import env
from ..awq import AwqMoeWeights
from ..kernels import config as kernel_config
from ..kernels import plan
from ..kernels.lookup import launch_choice
from .awq_moe import awq_moe_dense, awq_moe_grouped_decode, check_moe_args
from .workspace import workspace_views


def layer_shape(hidden_states: torch.Tensor, topk_ids: torch.Tensor, weights: AwqMoeWeights) -> kernel_config.Shape:
    """(E, k, K, N, G): what the launch tables are keyed by, besides GPU, dtype and M."""
    return (int(weights.num_experts), int(topk_ids.shape[1]), int(hidden_states.shape[1]),
            int(weights.intermediate_size), int(weights.group_size))


def grouped_plan_for(hidden_states, topk_ids, weights: AwqMoeWeights, config=None, **options) -> plan.GroupedPlan:
    """The launch plan of one grouped call: ``config`` (fitted here), or the one the op runs
    (``lookup.launch_choice``: tuned, table, default); ``options``: plan.grouped_plan's lab
    switches (stages, timeline, w2_rn_scale) and check_ids."""
    choice = launch_choice(hidden_states.device, layer_shape(hidden_states, topk_ids, weights), hidden_states.dtype,
                           hidden_states.shape[0], route="grouped")
    if config is not None:
        choice = choice.with_config(config)
    return choice.plan(**options)


def launch_grouped(hidden_states, topk_weights, topk_ids, weights: AwqMoeWeights, workspace, out, config=None,
                   stamps=None, sort_scratch=None, id_flag=None, **options) -> list:
    """Launch the grouped decode into ``out`` (no checks; a config over the sort's groups
    allocates the sort's scratch unless ``sort_scratch`` is given); ``config`` overrides the
    tuned/table launch config (benchmarks and the tuner), ``options`` and ``stamps`` are the
    plan's lab switches and the timeline's buffers; ``id_flag``: the debug mode's device flag
    (``id_flag``, here when None). Returns the launches' compiled kernels."""
    grouped = grouped_plan_for(hidden_states, topk_ids, weights, config, **options)
    views = workspace_views(workspace, grouped.rows, grouped.hidden_size, grouped.intermediate_size)
    if id_flag is None and grouped.check_ids:
        id_flag = ids_flag(hidden_states.device)
    return plan.launch_plan(grouped, hidden_states, topk_weights.contiguous(), topk_ids.contiguous(), weights, views,
                            out, stamps, sort_scratch, id_flag)


# --------------------------------------------------------------------------- the ids debug mode

_ID_FLAGS: Dict[torch.device, torch.Tensor] = {}


def ids_flag(device) -> torch.Tensor:
    """The debug mode's int32 flag on ``device`` (MOE_GROUPED_DECODE_CHECK_IDS): the kernels set it
    to 1 when a routed id is outside [0, E). Allocated zeroed at its first use, which vLLM's warmup
    makes before any CUDA-graph capture (a flag first made inside a capture would be re-zeroed by
    every replay)."""
    device = _indexed(device)
    flag = _ID_FLAGS.get(device)
    if flag is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"{env.CHECK_IDS_ENV}: the ids flag is made by an eager call or warmup before any "
                               f"CUDA-graph capture (made inside one, every replay would clear it)")
        flag = _ID_FLAGS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return flag


def _indexed(device) -> torch.device:
    """``device`` with its index ("cuda" is the current CUDA device), as tensors name theirs."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def raise_on_flagged_ids(device=None) -> None:
    """Raise (and clear the flag) if a kernel has seen a routed id outside [0, E) on ``device`` (every
    device with a flag when None) since the last check. Reads the flag on the host: a sync."""
    for flag_device, flag in list(_ID_FLAGS.items()):
        if device is not None and flag_device != _indexed(device):
            continue
        if int(flag.item()):
            flag.zero_()
            raise ValueError(f"moe_grouped_decode: a routed id outside [0, num_experts) reached the kernels on "
                             f"{flag_device} (its slot contributed nothing to its token); check the router's topk_ids "
                             f"or the layer's expert map ({env.CHECK_IDS_ENV} is on)")


def aligned_rows(hidden_states: torch.Tensor) -> torch.Tensor:
    """``hidden_states`` [M, K] row-major with rows K apart, starting on a 16-byte boundary; copied
    where it is not (a view into a larger tensor may start anywhere, and a one-row view counts as
    contiguous whatever its row stride): the Gluon kernels copy its rows in 16-byte pieces, and
    Triton cannot lower them for an address it does not know to be aligned. With K a multiple of
    32, every row then starts aligned too."""
    x = hidden_states.contiguous()
    if x.data_ptr() % 16 == 0 and x.stride(0) == x.shape[1]:
        return x
    return torch.empty(x.shape, dtype=x.dtype, device=x.device).copy_(x)


def _checked_call(op_name: str, device, launch) -> None:
    """Run ``launch(check_ids)`` with the debug mode's switch read once for the call; in the debug
    mode check the flag before and after it, outside a capture."""
    check_ids = env.check_ids()
    if not check_ids or torch.cuda.is_current_stream_capturing():
        launch(check_ids)
        return
    raise_on_flagged_ids(device)
    launch(check_ids)
    try:
        raise_on_flagged_ids(device)
    except ValueError as error:
        raise ValueError(f"{op_name}: {error}") from None


@awq_moe_grouped_decode.register_kernel("cuda")
def awq_moe_grouped_decode_cuda(hidden_states, topk_weights, topk_ids, *weight_args_and_workspace):
    """``awq_moe_grouped_decode``'s CUDA implementation; an eager caller outside tracing may call
    it directly (as the vLLM method's apply does), sparing the dispatcher's host time per call."""
    *weight_args, workspace = weight_args_and_workspace
    weights = AwqMoeWeights(*weight_args)
    check_moe_args("awq_moe_grouped_decode", hidden_states, topk_weights, topk_ids, weights, workspace)
    out = hidden_states.new_empty(hidden_states.shape)  # row-major whatever the input's layout
    if hidden_states.shape[0] == 0:
        return out
    _checked_call("awq_moe_grouped_decode", hidden_states.device, lambda check_ids: launch_grouped(
        aligned_rows(hidden_states), topk_weights, topk_ids, weights, workspace, out, check_ids=check_ids))
    return out


def prefill_plan_for(hidden_states, topk_ids, weights: AwqMoeWeights, config=None,
                     check_ids: Optional[bool] = None) -> plan.PrefillPlan:
    """The launch plan of one prefill-route call: ``config``, or the one the op runs
    (``lookup.launch_choice``: the table's, or in batch-invariant mode one config at every M)."""
    choice = launch_choice(hidden_states.device, layer_shape(hidden_states, topk_ids, weights), hidden_states.dtype,
                           hidden_states.shape[0], route="prefill")
    if config is not None:
        choice = choice.with_config(config)
    return choice.plan(check_ids)


def launch_prefill(hidden_states, topk_weights, topk_ids, weights: AwqMoeWeights, out, config=None,
                   scratch: Optional[torch.Tensor] = None, id_flag: Optional[torch.Tensor] = None,
                   check_ids: Optional[bool] = None) -> list:
    """Launch the prefill route into ``out``: the routed rows sorted by expert on the device, each
    expert's weights read once per group of rows (kernels/prefill.py). ``scratch`` (int32, at
    least the plan's ``scratch_numel``) is allocated here when not given."""
    prefill = prefill_plan_for(hidden_states, topk_ids, weights, config, check_ids)
    if scratch is None:
        scratch = torch.empty(prefill.scratch_numel, dtype=torch.int32, device=hidden_states.device)
    if id_flag is None and prefill.check_ids:
        id_flag = ids_flag(hidden_states.device)
    return plan.launch_prefill(prefill, hidden_states, topk_weights.contiguous(), topk_ids.contiguous(), weights,
                               scratch, out, id_flag)


# The argument metadata of dense calls that passed check_moe_args. Outside vLLM's CUDA graphs a step
# runs one call per layer from Python, and the check costs several times what its key does; it
# reads nothing but what the key holds (without a workspace, no address either).
_PASSED_DENSE_CHECKS: set = set()
MAX_PASSED_CHECKS = 4096  # the set is emptied when full


def _check_dense_args(hidden_states, topk_weights, topk_ids, weights: AwqMoeWeights) -> None:
    key = (hidden_states.shape, hidden_states.dtype, hidden_states.device, topk_weights.shape, topk_weights.dtype,
           topk_weights.device, topk_ids.shape, topk_ids.dtype, topk_ids.device, weights.group_size,
           *[(t.shape, t.dtype, t.device) for t in weights.tensors()])
    if key in _PASSED_DENSE_CHECKS:
        return
    check_moe_args("awq_moe_dense", hidden_states, topk_weights, topk_ids, weights)
    if len(_PASSED_DENSE_CHECKS) >= MAX_PASSED_CHECKS:
        _PASSED_DENSE_CHECKS.clear()
    _PASSED_DENSE_CHECKS.add(key)


@awq_moe_dense.register_kernel("cuda")
def awq_moe_dense_cuda(hidden_states, topk_weights, topk_ids, *weight_args):
    """``awq_moe_dense``'s CUDA implementation; callable directly as ``awq_moe_grouped_decode_cuda``."""
    weights = AwqMoeWeights(*weight_args)
    _check_dense_args(hidden_states, topk_weights, topk_ids, weights)
    out = hidden_states.new_empty(hidden_states.shape)  # row-major whatever the input's layout
    if hidden_states.shape[0] == 0:
        return out
    _checked_call("awq_moe_dense", hidden_states.device, lambda check_ids: launch_prefill(
        aligned_rows(hidden_states), topk_weights, topk_ids, weights, out, check_ids=check_ids))
    return out


# the opt-in autotune searches the grouped route's launch configs at these token counts only (each
# takes ~1 s per candidate at warmup; above them the table's or the default config runs)
TUNE_MAX_TOKENS = 8


def random_routing(num_tokens: int, top_k: int, num_experts: int, device, generator) -> torch.Tensor:
    """Distinct random experts per token, as a router gives, int32 [M, k]."""
    scores = torch.rand(num_tokens, num_experts, device=device, dtype=torch.float32, generator=generator)
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


def prefill_warmup_counts(max_tokens: int) -> list:
    """Token counts whose prefill-route calls compile every binary that any M up to
    ``max_tokens`` launches: what a call compiles changes only past a power of two (the plan's
    buckets) or past a launch table's entry (its config), so the powers of two below it, the
    tables' entries below it and itself (each the top of a stretch of equal binaries)."""
    counts, m = [], 1
    while m < max_tokens:
        counts.append(m)
        m *= 2
    bounds = [m for m in kernel_config.prefill_table_token_counts() if m < max_tokens]
    return sorted(set(counts + bounds)) + [max_tokens]


# --------------------------------------------------------------------------- compiles after warmup

_warming = 0  # warmup calls in progress
_compile_watch: dict = {}  # "log": the callable compiles after warmup are reported to; "seen": reported keys


def watch_compiles_after_warmup(log: Callable[[str], None]) -> bool:
    """Report to ``log``, once per kernel and specialization, every Triton compile of one of this
    package's kernels outside ``warmup``: a binary the warmup did not cover, compiled during
    CUDA-graph capture or while serving (Triton's post-compile hook, chained to any hook already
    set, e.g. vLLM's JIT monitor). Returns whether this Triton has the hook; installs it once."""
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    _compile_watch["log"] = log
    if _compile_watch.get("installed"):
        return True
    existing = runtime.jit_post_compile_hook

    def on_compile(**kwargs):
        _report_compile(kwargs)
        return existing(**kwargs) if existing is not None else None

    runtime.jit_post_compile_hook = on_compile
    _compile_watch.update(installed=True, seen=set())
    return True


def _report_compile(kwargs: dict) -> None:
    fn = kwargs.get("fn")
    module = getattr(fn, "module", "") or ""
    if _warming or not module.startswith(__name__.split(".")[0] + ".") or "log" not in _compile_watch:
        return
    name = getattr(fn, "name", "<kernel>")
    seen = _compile_watch.setdefault("seen", set())
    key = (module, name, str(kwargs.get("key")))
    if key in seen:
        return
    seen.add(key)
    options = str(kwargs.get("repr", "")).split("](")[0] + "]"
    _compile_watch["log"](f"moe_grouped_decode: Triton compiled {name} ({module}) after the plugin's warmup: a binary "
                          f"its warmup did not cover, compiled during CUDA-graph capture or serving: "
                          f"{options[:200]}({compiled_arguments(kwargs)[:1200]})")


def compiled_arguments(kwargs: dict) -> str:
    """The runtime arguments of one compile as Triton keyed its binary, from the compile hook's
    ``compile`` record: ``name type`` (``/16`` where Triton specialized a pointer or int on being a
    multiple of 16) or ``name=value`` where it made the argument a constant (an int 1, None).
    Parameters declared constexpr are left out. Empty where the record is not in this form."""
    record = kwargs.get("compile") or {}
    signature = record.get("signature")
    params = getattr(getattr(kwargs.get("fn"), "jit_function", None), "params", None)
    if not isinstance(signature, dict) or params is None:
        return ""
    constants = record.get("constants") or {}
    attrs = (record.get("configs") or [{}])[0] or {}
    parts = []
    for index, (param, (name, kind)) in enumerate(zip(params, signature.items())):
        if getattr(param, "is_constexpr", False):
            continue
        if kind == "constexpr":
            parts.append(f"{name}={constants.get((index,))!r}")
        else:
            aligned = any(attr[0] == "tt.divisibility" for attr in attrs.get((index,), ()))
            parts.append(f"{name} {kind}{'/16' if aligned else ''}")
    return ", ".join(parts)


# The router weights' dtype the warmup compiles for: vLLM's routers give float32 whatever the model's
# dtype. Triton keys a binary by every pointer's dtype, so the kernels that read topk_weights (W2 with
# the fused combine, the combines) compile once per dtype they are called with.
ROUTER_WEIGHTS_DTYPE = torch.float32


def warmup(weights: AwqMoeWeights, top_k: int, grouped_token_counts: Iterable[int],
           dense_token_counts: Iterable[int] = (), workspace: Optional[torch.Tensor] = None,
           dtype: Optional[torch.dtype] = None, weights_dtype: torch.dtype = ROUTER_WEIGHTS_DTYPE) -> None:
    """Compile (and, with MOE_GROUPED_DECODE_TUNE=1, tune) every kernel variant.

    Call once per layer shape before CUDA-graph capture, with the token counts the grouped
    route will run (each has a plan of its own) and the prefill route's (``awq_moe_dense``:
    ``prefill_warmup_counts`` covers every binary up to a token count). Runs each op once on random activations and routing; the tune, if
    enabled, runs here and never during capture, and is cached on disk per GPU, shape and
    Triton version. ``workspace`` must hold max(grouped_token_counts) * top_k rows (a
    temporary one is allocated if omitted). ``dtype``: the activations' (default: the scales');
    ``weights_dtype``: topk_weights' as the caller's router gives them (float32 for vLLM's). Every
    tensor is made with an explicit dtype: vLLM runs this while its default dtype is the model's.
    """
    global _warming
    _warming += 1
    try:
        _warmup(weights, top_k, grouped_token_counts, dense_token_counts, workspace, dtype, weights_dtype)
    finally:
        _warming -= 1


def _warmup(weights, top_k, grouped_token_counts, dense_token_counts, workspace, dtype, weights_dtype) -> None:
    from .autotune import load_tuned_cache, tune_grouped
    from .workspace import alloc_workspace

    device = weights.w13_qweight.device
    dtype = dtype or weights.dtype
    grouped_counts = sorted(set(int(m) for m in grouped_token_counts))
    dense_counts = sorted(set(int(m) for m in dense_token_counts))
    E, K, N = weights.num_experts, weights.hidden_size, weights.intermediate_size
    max_tokens = max(grouped_counts + dense_counts + [1])
    gen = torch.Generator(device=device).manual_seed(0)
    hidden_states = torch.randn(max_tokens, K, device=device, dtype=dtype, generator=gen)
    topk_weights = torch.rand(max_tokens, top_k, device=device, dtype=weights_dtype, generator=gen)
    load_tuned_cache(device)
    if env.check_ids():
        ids_flag(device)  # before any capture
    if grouped_counts:
        if workspace is None:
            workspace = alloc_workspace(max(grouped_counts), top_k, K, N, device)
        if env.tune_enabled():
            for m in (m for m in grouped_counts if m <= TUNE_MAX_TOKENS):
                tune_grouped(hidden_states[:m], topk_weights[:m], weights, workspace)
        for m in grouped_counts:
            ids = random_routing(m, top_k, E, device, gen)
            torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                hidden_states[:m], topk_weights[:m], ids, *weights.op_args(), workspace)
    for m in dense_counts:
        ids = random_routing(m, top_k, E, device, gen)
        torch.ops.moe_grouped_decode.awq_moe_dense(hidden_states[:m], topk_weights[:m], ids, *weights.op_args())
    torch.cuda.synchronize(device)
