"""The rewrite inside vLLM's compilation, for both graph shapes vLLM produces.

* vLLM's CPU build calls the MoE runner's Python directly, so Dynamo traces
  into :class:`AwqMoeGroupedDecodeMethod.apply` and the graph holds
  ``moe_grouped_decode::awq_moe_dense``: the lowering
  (:class:`moe_grouped_decode.lowerings.GroupedDecodePass`) rewrites it.
* vLLM's CUDA build hides the layer behind the opaque
  ``vllm::moe_forward(hidden_states, router_logits, shared_experts_input,
  input_ids, layer_name, hidden_dim_unpadded)`` (or ``moe_forward_shared``);
  the weights are not graph inputs. :class:`MoeForwardGroupedPass` recognises
  that call for layers the plugin admitted and swaps the op for
  ``moe_grouped_decode::vllm_moe_forward_grouped`` (``..._shared_grouped``),
  declared with the very same schema, which runs the layer with the grouped
  op allowed (the lookup, ``kernels/lookup.py``, picks per call from M; a captured
  graph has a fixed M).

Both run inside :class:`VllmGroupedDecodePass`, one ``InductorPass`` placed in
``compilation_config.inductor_compile_config["post_grad_custom_post_pass"]``
next to whatever was there. vLLM's CUDA backend adds that entry to its
``PostGradPassManager`` (after its own passes, whose uuid then includes ours);
vLLM's CPU build hands the same dict to ``torch.compile(backend="inductor",
options=...)``, i.e. Inductor's post-grad hook.

Logging: vLLM compiles many graphs per process (one per piece between
attention splits and compile range), most with nothing for the plugin to do.
The pass logs one INFO line per process, at the first graph it changes, saying
what it changed and why; every graph's outcome is a DEBUG line, and the
process-wide counts are in :data:`REWRITES`.
"""

from __future__ import annotations

import contextlib
import logging
from collections import Counter
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from vllm.compilation.passes.inductor_pass import InductorPass
from vllm.config import CompilationMode, VllmConfig
from vllm.model_executor.layers.fused_moe.runner import moe_runner
from vllm.model_executor.layers.fused_moe.runner.moe_runner import _resolve_layer_name, get_layer_from_name
from vllm.platforms import current_platform
from vllm.utils.torch_utils import LayerName

from .. import __version__
from ..contract import ShapeContract, contracts_fingerprint
from ..kernels.lookup import grouped_tokens
from ..lowerings import GroupedDecodePass
from ..lowerings.grouped_decode import token_range_of
from .startup import LAYER_DECISIONS
from .vllm_compat import op_tags_for

logger = logging.getLogger("moe_grouped_decode")
# the lowerings' loggers (this one and any below it): quiet while the lowering runs inside vLLM
_LOWERING_LOG = logging.getLogger("moe_grouped_decode.lowerings")

PASS_KEY = "post_grad_custom_post_pass"
# Process-wide rewrite counts (what the e2e tests and the demo read back):
# "awq_moe_dense": dense-op calls rewritten by the lowering (CPU build),
# "moe_forward": opaque vLLM MoE calls swapped (CUDA build), "graphs": graphs seen.
REWRITES: Counter = Counter()

# --------------------------------------------------------------------------- the replacement ops

_LIBRARY = torch.library.Library("moe_grouped_decode", "FRAGMENT")
# vLLM op -> (the plugin's op with the same schema, vLLM's Python signature and fake)
_GROUPED_FORWARD_OPS = {
    "moe_forward": ("vllm_moe_forward_grouped", moe_runner._moe_forward, moe_runner._moe_forward_fake),
    "moe_forward_shared": (
        "vllm_moe_forward_shared_grouped",
        moe_runner._moe_forward_shared,
        moe_runner._moe_forward_shared_fake,
    ),
}


def _forward_grouped(hidden_states, router_logits, shared_experts_input, input_ids, layer_name, hidden_dim_unpadded):
    """vLLM's ``_moe_forward`` body, with the layer's method allowed to take the grouped op."""
    layer = get_layer_from_name(_resolve_layer_name(layer_name))
    grouped_route = getattr(layer.routed_experts.quant_method, "grouped_route", None)
    if grouped_route is None:
        # A layer with vLLM's own method can run a graph compiled for an admitted
        # one: isomorphic graphs share compiled artifacts, the layer name being an input.
        return layer._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)
    with grouped_route():
        return layer._forward_impl(hidden_states, router_logits, shared_experts_input, input_ids)


def _define_grouped_forward_ops() -> None:
    """Declare each op exactly as vLLM declares its own (schema from vLLM's signature, same mutations)."""
    for vllm_name, (name, vllm_function, vllm_fake) in _GROUPED_FORWARD_OPS.items():
        if hasattr(torch.ops.moe_grouped_decode, name):
            continue
        vllm_op = getattr(torch.ops.vllm, vllm_name)
        vllm_schema = vllm_op.default._schema
        mutated = [a.name for a in vllm_schema.arguments if a.alias_info is not None and a.alias_info.is_write]
        schema = torch.library.infer_schema(vllm_function, mutates_args=mutated)
        # the same stride contract as vLLM's op (its tag changed between vLLM versions)
        _LIBRARY.define(name + schema, tags=op_tags_for(vllm_op))
        _LIBRARY.impl(name, _forward_grouped, dispatch_key=current_platform.dispatch_key)
        _LIBRARY._register_fake(name, vllm_fake)


_define_grouped_forward_ops()
_SWAPS = {
    getattr(torch.ops.vllm, vllm_name).default: getattr(torch.ops.moe_grouped_decode, name).default
    for vllm_name, (name, _, _) in _GROUPED_FORWARD_OPS.items()
}

# --------------------------------------------------------------------------- the moe_forward pass

TokenRange = Tuple[int, int]


def _layer_name_of(value: Any) -> Optional[str]:
    """The layer name a ``moe_forward`` call carries: a str, a LayerName, or a hoisted placeholder."""
    if isinstance(value, torch.fx.Node):
        value = value.meta.get("val")
    value = getattr(value, "real_obj", value)  # a FakeScriptObject wraps the real LayerName
    if isinstance(value, LayerName):
        return value.value
    return value if isinstance(value, str) else None


def _call_parts(node: torch.fx.Node):
    """(vLLM op, its arguments by name) of a direct or auto-functionalized moe_forward call."""
    if node.target in (auto_functionalized, auto_functionalized_v2) and node.args and node.args[0] in _SWAPS:
        return node.args[0], dict(node.kwargs)
    if node.target in _SWAPS:
        schema = node.target._schema
        return node.target, {
            arg.name: node.args[i] if i < len(node.args) else node.kwargs.get(arg.name) for i, arg in enumerate(schema.arguments)
        }
    return None, None


class MoeForwardGroupedPass:
    """Swap ``vllm::moe_forward[_shared]`` for the plugin's same-schema op on admitted layers.

    A call is swapped when its layer's method is the plugin's with a contract
    match, and some token count in the graph's range (``token_range`` narrows a
    symbolic M, as vLLM's compile range does) takes the grouped route (``lookup.grouped_tokens``).
    The swapped op asks the lookup again with the concrete M on every call.
    """

    def __init__(self, token_range: Optional[TokenRange] = None) -> None:
        self.token_range = token_range
        self.last_swapped: List[str] = []  # layer names of the calls swapped in the last graph
        self.last_kept: List[str] = []  # "layer: reason" for the calls left as they were

    @property
    def last_rewrites(self) -> int:
        return len(self.last_swapped)

    def __call__(self, graph: torch.fx.Graph) -> None:
        swapped, kept = [], []
        for node in list(graph.nodes):
            op, args = _call_parts(node)
            if op is None:
                continue
            layer_name = _layer_name_of(args.get("layer_name"))
            reason = self._reason_to_keep(layer_name, args["hidden_states"])
            if reason is not None:
                kept.append(f"{layer_name}: {reason}")
                continue
            if node.target in (auto_functionalized, auto_functionalized_v2):
                node.args = (_SWAPS[op], *node.args[1:])
            else:
                node.target = _SWAPS[op]
            swapped.append(str(layer_name))
        self.last_swapped, self.last_kept = swapped, kept

    def summary(self) -> str:
        line = f"swapped {len(self.last_swapped)} vllm::moe_forward call(s)"
        return line + ("; kept: " + " | ".join(self.last_kept) if self.last_kept else "")

    def _reason_to_keep(self, layer_name: Optional[str], hidden_states) -> Optional[str]:
        decision = LAYER_DECISIONS.get(layer_name)
        if decision is None or not decision.admission:
            return "layer not admitted by a contract" if decision else "not a layer the plugin serves"
        num_tokens = hidden_states.meta["val"].shape[0]
        tokens = token_range_of(num_tokens, self.token_range)
        if tokens is None or grouped_tokens(decision.shape.shape, decision.shape.dtype, tokens).tokens is None:
            return f"no admitted token count in {tokens or self.token_range}"
        return None


# --------------------------------------------------------------------------- the pass vLLM runs


def _compile_range() -> Optional[TokenRange]:
    """vLLM's compile range for the graph being compiled, when its backend set one."""
    from vllm.compilation.passes import inductor_pass

    context = inductor_pass._pass_context
    if context is None:
        return None
    return (int(context.compile_range.start), int(context.compile_range.end))


class VllmGroupedDecodePass(InductorPass):
    """The plugin's post-grad pass for vLLM: ``previous`` (if any), then both rewrites."""

    def __init__(self, previous: Any = None) -> None:
        self.previous = previous
        self._lowerings: dict = {}  # compile range -> GroupedDecodePass

    def __deepcopy__(self, memo):
        # vLLM deep-copies inductor_compile_config; the pass and its counters stay shared.
        return self

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.previous is not None:
            self.previous(graph)
        token_range = _compile_range()
        lowering = self._lowerings.get(token_range)
        if lowering is None:
            lowering = self._lowerings[token_range] = GroupedDecodePass(token_range=token_range)
        with _level_at_least(_LOWERING_LOG, logging.WARNING):  # it logs every graph; reported below
            lowering(graph)
        forward_pass = MoeForwardGroupedPass(token_range)
        forward_pass(graph)
        REWRITES["awq_moe_dense"] += lowering.last_rewrites
        REWRITES["moe_forward"] += forward_pass.last_rewrites
        REWRITES["graphs"] += 1
        _report(token_range, lowering, forward_pass)

    def uuid(self) -> str:
        previous = self.previous.uuid() if hasattr(self.previous, "uuid") else repr(self.previous)
        return InductorPass.hash_dict(
            {
                "plugin": __version__,
                "source": InductorPass.hash_source(self, MoeForwardGroupedPass, _forward_grouped),
                "lowering": GroupedDecodePass().uuid(),
                "contracts": contracts_fingerprint(),
                "previous": previous,
            }
        )


@contextlib.contextmanager
def _level_at_least(target: logging.Logger, level: int) -> Iterator[None]:
    previous = target.level
    target.setLevel(max(level, previous))
    try:
        yield
    finally:
        target.setLevel(previous)


_announced = False  # the one INFO line of this process has been logged


def _report(token_range: Optional[TokenRange], lowering: GroupedDecodePass, forward_pass: MoeForwardGroupedPass) -> None:
    """A DEBUG line per graph; one INFO line per process, at the first graph the pass changed."""
    global _announced
    where = "the graph" if token_range is None else f"a graph for {token_range[0]}..{token_range[1]} tokens"
    logger.debug(
        "moe_grouped_decode: %s (graph %d of this process): lowering %s; %s",
        where, REWRITES["graphs"], lowering.last_report.summary(), forward_pass.summary(),
    )
    if _announced or not (lowering.last_rewrites or forward_pass.last_rewrites):
        return
    _announced = True
    why = _admitted_contracts()
    if forward_pass.last_rewrites:
        what = (f"swapped {forward_pass.last_rewrites} vllm::moe_forward call(s) for the grouped route in {where} "
                f"({_names(forward_pass.last_swapped)}): layers admitted under {why}; graphs for other token "
                "counts keep vLLM's op")
    else:
        report = lowering.last_report
        what = f"{report.summary()} in {where}: layers admitted under {why}"
        if report.routed:
            what += "; the routed op picks the grouped or the dense op from the token count at run time"
    logger.info("moe_grouped_decode: compile pass %s. Later graphs are logged at DEBUG.", what)


def _admitted_contracts() -> str:
    contracts = {d.admission.contract for d in LAYER_DECISIONS.values() if d.admission}
    return ", ".join(
        f"contract {c.name!r} (grouped route for {c.min_tokens}..{c.max_tokens} tokens)"
        for c in sorted(contracts, key=lambda c: c.name)
    ) or "no contract"


def _names(names: List[str]) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}, {len(names)} layers"


def install_passes(vllm_config: VllmConfig, contract: ShapeContract) -> VllmGroupedDecodePass:
    """Put the plugin's pass into ``vllm_config``'s post-grad hook (once) and split compile ranges.

    Called while vLLM builds the model, when the first admitted MoE layer is
    seen: before the compile wrapper reads ``inductor_compile_config`` and
    before vLLM's backend reads the compile ranges. Idempotent.
    """
    compilation = vllm_config.compilation_config
    installed = compilation.inductor_compile_config.get(PASS_KEY)
    if not isinstance(installed, VllmGroupedDecodePass):
        installed = VllmGroupedDecodePass(previous=installed)
        compilation.inductor_compile_config[PASS_KEY] = installed
    if compilation.mode == CompilationMode.VLLM_COMPILE:
        _split_compile_ranges(vllm_config, contract)
    return installed


def _split_compile_ranges(vllm_config: VllmConfig, contract: ShapeContract) -> None:
    """Endpoints at the window's edges, so the admitted decode sizes get a graph of their own."""
    compilation = vllm_config.compilation_config
    top = vllm_config.scheduler_config.max_num_batched_tokens
    endpoints = set(compilation.compile_ranges_endpoints or [])
    endpoints.update(e for e in (contract.min_tokens - 1, contract.max_tokens) if 1 <= e < top)
    compilation.compile_ranges_endpoints = sorted(endpoints)

