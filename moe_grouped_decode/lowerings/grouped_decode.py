"""Rewrite ``awq_moe_dense`` into the grouped decode route where a shape contract admits it.

Where the op sits. In a post-grad graph (functional, after AOTAutograd) the
dense op is one plain node, ``call_function[torch.ops.moe_grouped_decode.
awq_moe_dense.default]`` with positional arguments and ``group_size`` as an int
literal; ``meta["val"]`` of every argument is a fake tensor whose sizes are ints
or SymInts of the graph's ShapeEnv. The pattern is that single node, traced with
Inductor's ``fwd_only`` (make_fx, the post-grad decompositions, no-op removal:
the form post-grad graphs have), with ``group_size`` captured as a keyword so
one pattern serves every group size.

Admission. For each matched call the pass reads the layer shape (E, k, K, N, G,
activation dtype) from the fake tensors and the token count M from
``hidden_states.shape[0]``: a concrete M, or a symbolic M's value range from the
ShapeEnv (``bound_sympy``), or the pass's ``token_range`` hint in its place
(vLLM's compile range; see ``token_range_of`` for why it replaces the ShapeEnv's). Which of those
counts take the grouped route is the lookup's (``kernels/lookup.py``, ``grouped_tokens``: the
rule of its per-M route, ``contract.admits``); a call none of whose counts does is left exactly
as it was.

What a call becomes:

* M's whole range admitted (a concrete M in the window, or e.g. M in 2..8 for a
  2..8 window; Dynamo's range of a backed SymInt starts at 2): ``awq_moe_grouped_decode``.
* M's range overlaps the window but is wider (e.g. 1..8, or vLLM's 1..8192):
  ``awq_moe_routed`` with the admitted sub-window, which picks the grouped route
  for M inside it and the dense route outside, from the shape at run time.
  Chosen over leaving the call dense because vLLM compiles one graph for the
  whole range [1, max_num_batched_tokens]; without a runtime choice decode would
  only benefit when compile ranges are split at the window. The choice reads
  only M, so it is graph-safe: a CUDA graph is captured at one M and replays
  the route chosen then; eager and piecewise runs choose per call.
* M's range disjoint from every window (M=1, M=9 for a 2..8 window), or the
  shape matches no contract: left dense.

Workspace. The replacement allocates it functionally, ``torch.empty`` of the
size for the largest admitted M, and calls the mutating op through
``auto_functionalized`` (post-grad graphs are functional until Inductor's
``reinplace_inplaceable_ops`` / ``decompose_auto_functionalized``, which run
after custom passes). Reinplacing sees a fresh buffer with no other users and
mutates it in place: no clone, no copy. Inductor allocates it per call from its
own allocator (inside a CUDA graph: from the graph's private pool, fixed
address across replays), so nothing persistent needs managing; the grouped op
rewrites every region it reads, so uninitialized memory is fine.
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import sympy
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor import pattern_matcher as pm
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.utils._sympy.numbers import int_oo

from .. import __version__
from .. import contract as contract_module
from ..contract import LayerShape, contracts_fingerprint
from ..kernels import lookup as lookup_module
from ..kernels.lookup import grouped_tokens
from ..ops import routed as routed_module
from ..ops.workspace import workspace_numel

LOG = logging.getLogger("moe_grouped_decode.lowerings")

DENSE = torch.ops.moe_grouped_decode.awq_moe_dense.default
GROUPED = torch.ops.moe_grouped_decode.awq_moe_grouped_decode.default
ROUTED = torch.ops.moe_grouped_decode.awq_moe_routed.default

TokenRange = Tuple[int, int]
# Stands for "no upper bound" (a SymInt Dynamo left unbounded): wider than any window.
UNBOUNDED_TOKENS = 2**62

# Tiny real CPU tensors to trace the pattern with (E=2, K=N=G=8, M=k=1); any valid call works.
_EXAMPLE_GROUP_SIZE = 8


@dataclass(frozen=True)
class Route:
    """What the pass does with one dense call: ``kind`` is "grouped", "routed" or "dense"."""

    kind: str
    reason: str
    grouped_tokens: Optional[TokenRange] = None  # the M values that take the grouped route
    workspace_rows: int = 0  # R capacity of the workspace the replacement allocates


def token_range_of(num_tokens, hint: Optional[TokenRange]) -> TokenRange:
    """M's possible values: a concrete M, else ``hint``, else a SymInt's ShapeEnv range.

    The hint replaces the ShapeEnv range rather than narrowing it: Dynamo
    specializes M=0 and M=1, so a backed SymInt's range starts at 2, yet vLLM drops
    shape guards and runs M=1 through the same graph. Only the caller knows.
    """
    if isinstance(num_tokens, int):
        return (num_tokens, num_tokens)
    if hint is not None:
        return hint
    node = num_tokens.node
    bounds = node.shape_env.bound_sympy(node.expr)
    lo = 0 if bounds.lower in (-int_oo, -sympy.oo) else int(bounds.lower)
    hi = UNBOUNDED_TOKENS if bounds.upper in (int_oo, sympy.oo) else int(bounds.upper)
    return (lo, hi)


def _describe(tokens: TokenRange) -> str:
    lo, hi = tokens
    if lo == hi:
        return f"M={lo}"
    return f"M in {lo}..{'inf' if hi == UNBOUNDED_TOKENS else hi}"


def choose_route(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size: int, hint: Optional[TokenRange]) -> Route:
    """Decide one call from its (fake) arguments; which token counts take the grouped route is
    the lookup's (``lookup.grouped_tokens``: the rule its per-M route follows)."""
    layer_dims = (hidden_states.shape[1], topk_ids.shape[1], *w13_qweight.shape[:2], w2_qweight.shape[1], group_size)
    if not all(isinstance(d, int) for d in layer_dims):
        # reading a symbolic layer size would specialize it behind Dynamo's back
        return Route("dense", f"symbolic layer sizes {layer_dims} (compile with static weight shapes)")
    shape = LayerShape.from_tensors(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size)
    tokens = token_range_of(hidden_states.shape[0], hint)
    grouped = grouped_tokens(shape.shape, shape.dtype, tokens)
    if grouped.tokens == tokens:
        return Route("grouped", f"{_describe(tokens)}: {grouped.reason}", tokens, tokens[1] * shape.top_k)
    if grouped.tokens is not None:
        sub = grouped.tokens
        reason = f"{_describe(tokens)}: grouped for {_describe(sub)} ({grouped.reason}), dense otherwise"
        return Route("routed", reason, sub, sub[1] * shape.top_k)
    return Route("dense", f"{_describe(tokens)}: {grouped.reason}")


def _call_arguments(node: torch.fx.Node) -> dict:
    """Argument name -> value of an op-overload call node, positional or keyword."""
    schema = node.target._schema
    return {
        arg.name: node.args[i] if i < len(node.args) else node.kwargs.get(arg.name, arg.default_value)
        for i, arg in enumerate(schema.arguments)
    }


def _fake(value):
    return value.meta["val"] if isinstance(value, torch.fx.Node) else value


def _example_inputs() -> List[torch.Tensor]:
    E, K, N, G, M, k = 2, 8, 8, _EXAMPLE_GROUP_SIZE, 1, 1
    i32 = dict(dtype=torch.int32)
    return [
        torch.ones(M, K, dtype=torch.float16),  # hidden_states
        torch.ones(M, k, dtype=torch.float32),  # topk_weights
        torch.zeros(M, k, dtype=torch.int64),  # topk_ids
        torch.zeros(E, K, 2 * N // 8, **i32),  # w13_qweight
        torch.ones(E, K // G, 2 * N, dtype=torch.float16),  # w13_scales
        torch.zeros(E, K // G, 2 * N // 8, **i32),  # w13_qzeros
        torch.zeros(E, N, K // 8, **i32),  # w2_qweight
        torch.ones(E, N // G, K, dtype=torch.float16),  # w2_scales
        torch.zeros(E, N // G, K // 8, **i32),  # w2_qzeros
    ]


def _dense_call(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size):
    return DENSE(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size)


def _source_digest() -> str:
    """Digest of the source that decides what the pass emits (this module, admission, the lookup,
    the routed op)."""
    hasher = hashlib.sha256()
    for module in (sys.modules[__name__], contract_module, lookup_module, routed_module):
        hasher.update(inspect.getsource(module).encode())
    return hasher.hexdigest()[:16]


@dataclass(frozen=True)
class RewriteReport:
    """One graph's outcome: calls rewritten per route, and why the others stayed dense."""

    grouped: int
    routed: int
    kept_dense: Tuple[str, ...]  # one reason per untouched awq_moe_dense call

    @property
    def rewrites(self) -> int:
        return self.grouped + self.routed

    def summary(self) -> str:
        total = self.rewrites + len(self.kept_dense)
        line = f"rewrote {self.rewrites} of {total} awq_moe_dense calls (grouped {self.grouped}, routed {self.routed})"
        if self.kept_dense:
            line += "; kept dense: " + " | ".join(self.kept_dense)
        return line


class GroupedDecodePass(CustomGraphPass):
    """Inductor post-grad pass: ``awq_moe_dense`` -> grouped decode where a contract admits it.

    ``token_range``: optional inclusive (lo, hi) that a symbolic M takes at run time
    (vLLM's compile range); it replaces the ShapeEnv's range (see ``token_range_of``).

    After each graph: ``last_report`` (a :class:`RewriteReport`), ``last_rewrites``;
    ``total_rewrites`` accumulates over the pass's life.
    """

    def __init__(self, token_range: Optional[TokenRange] = None) -> None:
        if token_range is not None:
            lo, hi = (int(v) for v in token_range)
            if not 1 <= lo <= hi:
                raise ValueError(f"token_range must be (lo, hi) with 1 <= lo <= hi, got {token_range}")
            token_range = (lo, hi)
        self.token_range = token_range
        self.last_report = RewriteReport(0, 0, ())
        self.total_rewrites = 0
        self._patterns = pm.PatternMatcherPass(pass_name="moe_grouped_decode")
        self._register_patterns()

    @property
    def last_rewrites(self) -> int:
        return self.last_report.rewrites

    def _route_of_node(self, node: torch.fx.Node) -> Route:
        args = {name: _fake(value) for name, value in _call_arguments(node).items()}
        return choose_route(
            args["hidden_states"], args["topk_ids"], args["w13_qweight"], args["w2_qweight"], args["group_size"], self.token_range
        )

    def _register_patterns(self) -> None:
        def admitted(match: pm.Match) -> bool:
            return self._route_of_node(match.output_node()).kind != "dense"

        def replacement(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size):
            # Traced with the matched call's fake arguments, so this is the route `admitted` chose.
            route = choose_route(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size, self.token_range)
            workspace = torch.empty(
                workspace_numel(route.workspace_rows, hidden_states.shape[1], w2_qweight.shape[1]),
                dtype=torch.int32,
                device=hidden_states.device,
            )
            args = dict(
                hidden_states=hidden_states, topk_weights=topk_weights, topk_ids=topk_ids,
                w13_qweight=w13_qweight, w13_scales=w13_scales, w13_qzeros=w13_qzeros,
                w2_qweight=w2_qweight, w2_scales=w2_scales, w2_qzeros=w2_qzeros,
                group_size=group_size, workspace=workspace,
            )
            if route.kind == "grouped":
                return auto_functionalized(GROUPED, **args)[0]
            lo, hi = route.grouped_tokens
            return auto_functionalized(ROUTED, **args, grouped_min_tokens=lo, grouped_max_tokens=hi)[0]

        example_inputs = _example_inputs()
        scalars = {"group_size": _EXAMPLE_GROUP_SIZE}
        # Pre-traced pattern: the single node needs no per-match retrace (a retrace would
        # run the fake kernel on calls the extra check is about to reject).
        pattern = pm.gen_pattern(_dense_call, example_inputs, pm.fwd_only, scalars)
        pm.register_replacement(
            _dense_call,
            replacement,
            example_inputs,
            pm.fwd_only,
            self._patterns,
            extra_check=admitted,
            scalar_workaround=scalars,
            search_fn_pattern=pattern,
        )

    def __call__(self, graph: torch.fx.Graph) -> None:
        # Counted as differences: a graph may already hold grouped calls of its own.
        grouped_before, routed_before = _count_auto_functionalized(graph, GROUPED), _count_auto_functionalized(graph, ROUTED)
        self._patterns.apply(graph)
        report = RewriteReport(
            grouped=_count_auto_functionalized(graph, GROUPED) - grouped_before,
            routed=_count_auto_functionalized(graph, ROUTED) - routed_before,
            kept_dense=tuple(
                self._route_of_node(node).reason for node in graph.find_nodes(op="call_function", target=DENSE)
            ),
        )
        self.last_report = report
        self.total_rewrites += report.rewrites
        LOG.info("GroupedDecodePass: %s", report.summary())

    def uuid(self) -> str:
        return f"GroupedDecodePass-{__version__}-{_source_digest()}-{contracts_fingerprint()}-{self.token_range}"


def _count_auto_functionalized(graph: torch.fx.Graph, op) -> int:
    return sum(
        1
        for node in graph.find_nodes(op="call_function", target=auto_functionalized)
        if node.args and node.args[0] is op
    )
