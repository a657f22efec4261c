"""The Inductor rewrite on CPU: snapshots of post-grad graphs, rewrite counts, numerics vs eager.

Most cases compile with plain ``torch.compile`` (Inductor, FX graph cache off so
every compile runs the pass) at a small test contract, so each compile takes
seconds; one case runs at the real qwen3.8-tp4 shapes. Cases that no real graph
can hold (float32 activations, shapes the op's own checks refuse) run the pass on
a hand-built post-grad graph of fake tensors. The CPU implementations of the
dense and grouped ops are bit-identical for the same routing, so compiled and
eager outputs are compared exactly. Regenerate snapshots with EXPECTTEST_ACCEPT=1.
"""

from __future__ import annotations

import contextlib
import re
import types
from collections import Counter

import pytest
import torch
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.utils import run_and_get_code
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_grouped_decode  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import synthetic_for_contract, synthetic_moe_weights
from moe_grouped_decode.contract import (
    QWEN38_TP4,
    ShapeContract,
    contract_registered,
    contracts_fingerprint,
    register_contract,
    registered_contracts,
    unregister_contract,
)
from moe_grouped_decode.lowerings import (
    ComposedGraphPass,
    GroupedDecodePass,
    composed_with_installed,
    grouped_decode_installed,
    install,
)
from moe_grouped_decode.lowerings import grouped_decode as grouped_decode_module
from moe_grouped_decode.ops import workspace_numel, workspace_views
from moe_grouped_decode.ops.routed import awq_moe_routed

OPS = torch.ops.moe_grouped_decode

# Small enough that an Inductor compile takes seconds; several groups and packed words per dim.
SMALL = ShapeContract(
    name="test-small", num_experts=16, top_k=4, hidden_size=128, intermediate_size=64, group_size=32,
    min_tokens=2, max_tokens=8, dtypes=(torch.float16,),
)


@contextlib.contextmanager
def only_contracts(*contracts):
    """Exactly ``contracts`` registered for a block, so rejection reasons name no other contract."""
    saved = registered_contracts()
    for contract in saved:
        unregister_contract(contract.name)
    try:
        with contextlib.ExitStack() as stack:
            for contract in contracts:
                stack.enter_context(contract_registered(contract))
            yield
    finally:
        for contract in saved:
            register_contract(contract)


@pytest.fixture(autouse=True)
def small_contract(request):
    contracts = (QWEN38_TP4,) if "qwen" in request.node.name else (SMALL,)
    with only_contracts(*contracts):
        yield


def layer(num_experts=16, hidden_size=128, intermediate_size=64, group_size=32, dtype=torch.float16, seed=0):
    return synthetic_moe_weights(num_experts, hidden_size, intermediate_size, group_size, dtype, seed)


def decode_inputs(m, top_k=4, num_experts=16, hidden_size=128, dtype=torch.float16, seed=0):
    """Activations and softmax-style routing: k distinct experts per token, fp32 weights summing to 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, hidden_size, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(m)])
    weights = torch.softmax(torch.randn(m, top_k, generator=gen), dim=-1)
    return x, weights, ids


def dense(x, weights, ids, w):
    return OPS.awq_moe_dense(x, weights, ids, *w.op_args())


# --------------------------------------------------------------------------- graph text


_DTYPES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32", torch.int32: "i32", torch.int64: "i64"}


def _workspace_labels(graph: torch.fx.Graph) -> dict:
    """Workspace allocation node -> "workspace_numel(rows=R)", so snapshots survive layout changes."""
    labels = {}
    for node in graph.find_nodes(op="call_function", target=auto_functionalized):
        workspace = node.kwargs["workspace"]
        K = node.kwargs["hidden_states"].meta["val"].shape[1]
        N = node.kwargs["w2_qweight"].meta["val"].shape[1]
        numel = workspace.args[0][0]
        rows = next(r for r in range(1, 1 << 16) if workspace_numel(r, K, N) >= numel)
        assert workspace_numel(rows, K, N) == numel, "the workspace is sized for a whole number of rows"
        labels[workspace] = f"[workspace_numel(rows={rows})]"
    return labels


def normalized_graph(graph: torch.fx.Graph) -> str:
    """Stable text of a post-grad graph: inputs with dtype/shape, then one line per call.

    Names come from targets with per-target counters and symbols are renumbered in
    order of appearance, so the text does not depend on torch's node or symbol naming.
    """
    names, per_target, symbols, lines = {}, Counter(), {}, []
    workspace_labels = _workspace_labels(graph)

    def sym(text: str) -> str:
        return re.sub(r"\bs\d+\b", lambda m: symbols.setdefault(m.group(0), f"s{len(symbols)}"), text)

    def describe(value) -> str:
        if isinstance(value, torch.Tensor):
            return f"{_DTYPES.get(value.dtype, value.dtype)}[{sym(', '.join(str(d) for d in value.shape))}]"
        return sym(f"{type(value).__name__} {value}")

    def fmt(arg) -> str:
        if isinstance(arg, torch.fx.Node):
            return names[arg]
        if isinstance(arg, (list, tuple)):
            return "[" + ", ".join(fmt(a) for a in arg) + "]"
        return str(arg)

    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = f"in{len(names)}"
            lines.append(f"{names[node]}: {describe(node.meta['val'])}")
        elif node.op == "call_function":
            target = node.target
            text = str(target) if isinstance(target, torch._ops.OpOverload) else target.__name__
            base = getattr(target, "_opname", None) or target.__name__
            names[node] = base if not per_target[base] else f"{base}_{per_target[base]}"
            per_target[base] += 1
            args = [workspace_labels[node]] + [fmt(a) for a in node.args[1:]] if node in workspace_labels else [fmt(a) for a in node.args]
            args += [f"{k}={fmt(v)}" for k, v in node.kwargs.items()]
            lines.append(f"{names[node]} = {text}({', '.join(args)})")
        elif node.op == "output":
            lines.append(f"return {fmt(node.args[0])}")
    return "\n".join(lines)


class GraphRecorder(CustomGraphPass):
    """Test-only post-grad pass keeping the normalized text of every graph it sees."""

    def __init__(self):
        self.texts = []

    def __call__(self, graph):
        self.texts.append(normalized_graph(graph))

    def uuid(self):
        return "graph-recorder"


@contextlib.contextmanager
def compiled_with_pass(fn, token_range=None):
    """``fn`` compiled by Inductor with [before-recorder, GroupedDecodePass, after-recorder].

    The recorders also check composition: ``grouped_decode_installed`` keeps the
    pass already configured (the before-recorder) and the after-recorder is
    composed behind it.
    """
    torch._dynamo.reset()
    before, after = GraphRecorder(), GraphRecorder()
    grouped = GroupedDecodePass(token_range)
    with inductor_config.patch(post_grad_custom_post_pass=before, fx_graph_cache=False):
        with grouped_decode_installed(grouped):
            composed = ComposedGraphPass(inductor_config.post_grad_custom_post_pass, after)
            with inductor_config.patch(post_grad_custom_post_pass=composed):
                yield types.SimpleNamespace(fn=torch.compile(fn, fullgraph=True), grouped=grouped, before=before, after=after)
    torch._dynamo.reset()


def mark_tokens_dynamic(tensors, **bounds):
    for t in tensors:
        torch._dynamo.mark_dynamic(t, 0, **bounds)


def assert_same_as_eager(compiled, fn, *args):
    expected = fn(*args)
    actual = compiled(*args)
    assert torch.equal(actual, expected), f"max abs diff {(actual.float() - expected.float()).abs().max()}"


# --------------------------------------------------------------------------- compiled cases


def test_static_contract_shape_is_rewritten_in_place():
    """M=4 at the contract shape: one grouped call, the workspace reinplaced (no copy), repeat calls exact."""
    w = layer()

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    with compiled_with_pass(moe) as c:
        out, (code,) = run_and_get_code(c.fn, *decode_inputs(4, seed=1))
        for seed in (2, 3):  # fresh routing and activations through the same compiled graph
            assert_same_as_eager(c.fn, moe, *decode_inputs(4, seed=seed))
    assert torch.equal(out, moe(*decode_inputs(4, seed=1)))
    assert c.grouped.last_report.summary() == "rewrote 1 of 1 awq_moe_dense calls (grouped 1, routed 0)"
    assert (c.grouped.last_rewrites, c.grouped.total_rewrites) == (1, 1)
    # the workspace is Inductor's own fresh buffer handed straight to the op: reinplaced, never cloned
    assert code.count("torch.ops.moe_grouped_decode.awq_moe_grouped_decode.default(") == 1
    assert "awq_moe_dense.default(" not in code
    assert "clone" not in code and "copy_" not in code
    assert_expected_inline(c.before.texts[0], """\
in0: f16[4, 128]
in1: f32[4, 4]
in2: i64[4, 4]
in3: i32[16, 128, 16]
in4: f16[16, 4, 128]
in5: i32[16, 4, 16]
in6: i32[16, 64, 16]
in7: f16[16, 2, 128]
in8: i32[16, 2, 16]
awq_moe_dense = moe_grouped_decode.awq_moe_dense.default(in0, in1, in2, in3, in4, in5, in6, in7, in8, 32)
return [awq_moe_dense]""")
    assert_expected_inline(c.after.texts[0], """\
in0: f16[4, 128]
in1: f32[4, 4]
in2: i64[4, 4]
in3: i32[16, 128, 16]
in4: f16[16, 4, 128]
in5: i32[16, 4, 16]
in6: i32[16, 64, 16]
in7: f16[16, 2, 128]
in8: i32[16, 2, 16]
empty = aten.empty.memory_format([workspace_numel(rows=16)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in0, topk_weights=in1, topk_ids=in2, w13_qweight=in3, w13_scales=in4, w13_qzeros=in5, w2_qweight=in6, w2_scales=in7, w2_qzeros=in8, group_size=32, workspace=empty)
getitem = getitem(auto_functionalized, 0)
return [getitem]""")


def test_dynamic_tokens_inside_window_take_grouped_route():
    """M marked dynamic 2..8: the whole range is admitted, so the call becomes the grouped op; one compile serves 2..8."""
    w = layer()

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    inputs = decode_inputs(5, seed=1)
    mark_tokens_dynamic(inputs, min=2, max=8)
    with compiled_with_pass(moe) as c:
        c.fn(*inputs)
        for m in range(2, 9):
            assert_same_as_eager(c.fn, moe, *decode_inputs(m, seed=m))
    assert (c.grouped.last_report.grouped, c.grouped.total_rewrites, len(c.after.texts)) == (1, 1, 1)
    assert_expected_inline(c.after.texts[0], """\
in0: SymInt s0
in1: f16[s0, 128]
in2: f32[s0, 4]
in3: i64[s0, 4]
in4: i32[16, 128, 16]
in5: f16[16, 4, 128]
in6: i32[16, 4, 16]
in7: i32[16, 64, 16]
in8: f16[16, 2, 128]
in9: i32[16, 2, 16]
empty = aten.empty.memory_format([workspace_numel(rows=32)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in1, topk_weights=in2, topk_ids=in3, w13_qweight=in4, w13_scales=in5, w13_qzeros=in6, w2_qweight=in7, w2_scales=in8, w2_qzeros=in9, group_size=32, workspace=empty)
getitem = getitem(auto_functionalized, 0)
return [getitem]""")


def test_wide_dynamic_range_picks_route_at_run_time():
    """M marked dynamic 1..8192 (vLLM's one big range): routed op, grouped for 2..8 at run time, dense beyond."""
    w = layer()

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    inputs = decode_inputs(4, seed=1)
    mark_tokens_dynamic(inputs, min=1, max=8192)
    with compiled_with_pass(moe) as c:
        c.fn(*inputs)
        for m in (2, 8, 9, 33):  # both edges of the window, and both sides of its top
            assert_same_as_eager(c.fn, moe, *decode_inputs(m, seed=m))
    assert (c.grouped.last_report.routed, len(c.after.texts)) == (1, 1)
    assert_expected_inline(c.after.texts[0], """\
in0: SymInt s0
in1: f16[s0, 128]
in2: f32[s0, 4]
in3: i64[s0, 4]
in4: i32[16, 128, 16]
in5: f16[16, 4, 128]
in6: i32[16, 4, 16]
in7: i32[16, 64, 16]
in8: f16[16, 2, 128]
in9: i32[16, 2, 16]
empty = aten.empty.memory_format([workspace_numel(rows=32)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_routed.default, hidden_states=in1, topk_weights=in2, topk_ids=in3, w13_qweight=in4, w13_scales=in5, w13_qzeros=in6, w2_qweight=in7, w2_scales=in8, w2_qzeros=in9, group_size=32, workspace=empty, grouped_min_tokens=2, grouped_max_tokens=8)
getitem = getitem(auto_functionalized, 0)
return [getitem]""")


def test_token_range_hint_replaces_dynamo_range():
    """Dynamo's range of a backed M starts at 2; vLLM also runs M=1 through the graph, so its hint (1, 8) wins."""
    w = layer()

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    inputs = decode_inputs(4, seed=1)
    mark_tokens_dynamic(inputs, min=2, max=8)  # on its own this would be the grouped route (test above)
    with compiled_with_pass(moe, token_range=(1, 8)) as c:
        assert_same_as_eager(c.fn, moe, *inputs)
    report = c.grouped.last_report
    assert (report.grouped, report.routed) == (0, 1)
    assert "grouped_min_tokens=2, grouped_max_tokens=8" in c.after.texts[0]


def test_tokens_outside_window_are_untouched():
    """M=1 (C1 keeps dense) and M=9 (above the window) in one graph: both calls stay dense."""
    w = layer()

    def two_batches(x1, weights1, ids1, x9, weights9, ids9):
        return dense(x1, weights1, ids1, w), dense(x9, weights9, ids9, w)

    inputs = (*decode_inputs(1, seed=1), *decode_inputs(9, seed=9))
    with compiled_with_pass(two_batches) as c:
        expected, actual = two_batches(*inputs), c.fn(*inputs)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert c.grouped.last_report.rewrites == 0
    assert c.before.texts == c.after.texts
    assert_expected_inline("\n".join(c.grouped.last_report.kept_dense), """\
M=1: test-small: M=1 outside window 2..8
M=9: test-small: M=9 outside window 2..8""")
    assert_expected_inline(c.after.texts[0], """\
in0: f16[1, 128]
in1: f32[1, 4]
in2: i64[1, 4]
in3: i32[16, 128, 16]
in4: f16[16, 4, 128]
in5: i32[16, 4, 16]
in6: i32[16, 64, 16]
in7: f16[16, 2, 128]
in8: i32[16, 2, 16]
in9: f16[9, 128]
in10: f32[9, 4]
in11: i64[9, 4]
awq_moe_dense = moe_grouped_decode.awq_moe_dense.default(in0, in1, in2, in3, in4, in5, in6, in7, in8, 32)
awq_moe_dense_1 = moe_grouped_decode.awq_moe_dense.default(in9, in10, in11, in3, in4, in5, in6, in7, in8, 32)
return [awq_moe_dense, awq_moe_dense_1]""")


# one layer per way of missing the test contract (E=16, k=4, K=128, N=64, G=32, fp16), plus one that matches
MISMATCHED_LAYERS = [
    # (name, layer kwargs, decode_inputs kwargs)
    ("match", {}, {}),  # control: the same graph still rewrites what it should
    ("E=32", dict(num_experts=32), dict(num_experts=32)),
    ("k=2", {}, dict(top_k=2)),
    ("K=160", dict(hidden_size=160), dict(hidden_size=160)),
    ("N=96", dict(intermediate_size=96), {}),
    ("G=64", dict(group_size=64), {}),
    ("bf16", dict(dtype=torch.bfloat16), dict(dtype=torch.bfloat16)),  # the contract admits fp16 only
]


def test_each_contract_mismatch_is_untouched():
    """Seven layers in one graph: only the matching one is rewritten; each mismatch says why it stayed dense."""
    layers = [layer(seed=i, **kw) for i, (_, kw, _) in enumerate(MISMATCHED_LAYERS)]
    inputs = [decode_inputs(4, seed=i, **kw) for i, (_, _, kw) in enumerate(MISMATCHED_LAYERS)]

    def many_layers(*flat):
        return tuple(dense(*flat[3 * i : 3 * i + 3], w) for i, w in enumerate(layers))

    flat = [t for triple in inputs for t in triple]
    with compiled_with_pass(many_layers) as c:
        expected, actual = many_layers(*flat), c.fn(*flat)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    report = c.grouped.last_report
    assert (report.grouped, report.routed, len(report.kept_dense)) == (1, 0, 6)
    assert_expected_inline("\n".join(report.kept_dense), """\
M=4: test-small: E=32 (contract 16)
M=4: test-small: k=2 (contract 4)
M=4: test-small: K=160 (contract 128)
M=4: test-small: N=96 (contract 64)
M=4: test-small: G=64 (contract 32)
M=4: test-small: dtype=torch.bfloat16 (contract torch.float16)""")
    assert_expected_inline(c.after.texts[0], """\
in0: f16[4, 128]
in1: f32[4, 4]
in2: i64[4, 4]
in3: i32[16, 128, 16]
in4: f16[16, 4, 128]
in5: i32[16, 4, 16]
in6: i32[16, 64, 16]
in7: f16[16, 2, 128]
in8: i32[16, 2, 16]
in9: f16[4, 128]
in10: f32[4, 4]
in11: i64[4, 4]
in12: i32[32, 128, 16]
in13: f16[32, 4, 128]
in14: i32[32, 4, 16]
in15: i32[32, 64, 16]
in16: f16[32, 2, 128]
in17: i32[32, 2, 16]
in18: f16[4, 128]
in19: f32[4, 2]
in20: i64[4, 2]
in21: i32[16, 128, 16]
in22: f16[16, 4, 128]
in23: i32[16, 4, 16]
in24: i32[16, 64, 16]
in25: f16[16, 2, 128]
in26: i32[16, 2, 16]
in27: f16[4, 160]
in28: f32[4, 4]
in29: i64[4, 4]
in30: i32[16, 160, 16]
in31: f16[16, 5, 128]
in32: i32[16, 5, 16]
in33: i32[16, 64, 20]
in34: f16[16, 2, 160]
in35: i32[16, 2, 20]
in36: f16[4, 128]
in37: f32[4, 4]
in38: i64[4, 4]
in39: i32[16, 128, 24]
in40: f16[16, 4, 192]
in41: i32[16, 4, 24]
in42: i32[16, 96, 16]
in43: f16[16, 3, 128]
in44: i32[16, 3, 16]
in45: f16[4, 128]
in46: f32[4, 4]
in47: i64[4, 4]
in48: i32[16, 128, 16]
in49: f16[16, 2, 128]
in50: i32[16, 2, 16]
in51: i32[16, 64, 16]
in52: f16[16, 1, 128]
in53: i32[16, 1, 16]
in54: bf16[4, 128]
in55: f32[4, 4]
in56: i64[4, 4]
in57: i32[16, 128, 16]
in58: bf16[16, 4, 128]
in59: i32[16, 4, 16]
in60: i32[16, 64, 16]
in61: bf16[16, 2, 128]
in62: i32[16, 2, 16]
empty = aten.empty.memory_format([workspace_numel(rows=16)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in0, topk_weights=in1, topk_ids=in2, w13_qweight=in3, w13_scales=in4, w13_qzeros=in5, w2_qweight=in6, w2_scales=in7, w2_qzeros=in8, group_size=32, workspace=empty)
getitem = getitem(auto_functionalized, 0)
awq_moe_dense = moe_grouped_decode.awq_moe_dense.default(in9, in10, in11, in12, in13, in14, in15, in16, in17, 32)
awq_moe_dense_1 = moe_grouped_decode.awq_moe_dense.default(in18, in19, in20, in21, in22, in23, in24, in25, in26, 32)
awq_moe_dense_2 = moe_grouped_decode.awq_moe_dense.default(in27, in28, in29, in30, in31, in32, in33, in34, in35, 32)
awq_moe_dense_3 = moe_grouped_decode.awq_moe_dense.default(in36, in37, in38, in39, in40, in41, in42, in43, in44, 32)
awq_moe_dense_4 = moe_grouped_decode.awq_moe_dense.default(in45, in46, in47, in48, in49, in50, in51, in52, in53, 64)
awq_moe_dense_5 = moe_grouped_decode.awq_moe_dense.default(in54, in55, in56, in57, in58, in59, in60, in61, in62, 32)
return [getitem, awq_moe_dense, awq_moe_dense_1, awq_moe_dense_2, awq_moe_dense_3, awq_moe_dense_4, awq_moe_dense_5]""")


def test_two_moe_layers_are_both_rewritten():
    """Two MoE layers chained through a residual: both calls become grouped calls, each with its own workspace."""
    w0, w1 = layer(seed=0), layer(seed=1)

    def two_layers(x, weights0, ids0, weights1, ids1):
        h = x + dense(x, weights0, ids0, w0)
        return h + dense(h, weights1, ids1, w1)

    x, weights0, ids0 = decode_inputs(4, seed=1)
    _, weights1, ids1 = decode_inputs(4, seed=2)
    with compiled_with_pass(two_layers) as c:
        assert_same_as_eager(c.fn, two_layers, x, weights0, ids0, weights1, ids1)
    assert (c.grouped.last_report.grouped, c.grouped.last_rewrites) == (2, 2)
    assert_expected_inline(c.after.texts[0], """\
in0: f16[4, 128]
in1: f32[4, 4]
in2: i64[4, 4]
in3: i32[16, 128, 16]
in4: f16[16, 4, 128]
in5: i32[16, 4, 16]
in6: i32[16, 64, 16]
in7: f16[16, 2, 128]
in8: i32[16, 2, 16]
in9: f32[4, 4]
in10: i64[4, 4]
in11: i32[16, 128, 16]
in12: f16[16, 4, 128]
in13: i32[16, 4, 16]
in14: i32[16, 64, 16]
in15: f16[16, 2, 128]
in16: i32[16, 2, 16]
empty = aten.empty.memory_format([workspace_numel(rows=16)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in0, topk_weights=in1, topk_ids=in2, w13_qweight=in3, w13_scales=in4, w13_qzeros=in5, w2_qweight=in6, w2_scales=in7, w2_qzeros=in8, group_size=32, workspace=empty)
getitem = getitem(auto_functionalized, 0)
add = aten.add.Tensor(in0, getitem)
empty_1 = aten.empty.memory_format([workspace_numel(rows=16)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized_1 = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=add, topk_weights=in9, topk_ids=in10, w13_qweight=in11, w13_scales=in12, w13_qzeros=in13, w2_qweight=in14, w2_scales=in15, w2_qzeros=in16, group_size=32, workspace=empty_1)
getitem_1 = getitem(auto_functionalized_1, 0)
add_1 = aten.add.Tensor(add, getitem_1)
return [add_1]""")


def test_surrounding_ops_are_kept():
    """Router (linear, softmax, top-k), the MoE call and a residual: only the MoE node changes."""
    w = layer()
    router = torch.randn(16, 128, generator=torch.Generator().manual_seed(7)).to(torch.float16)

    def decode_block(x):
        logits = (x @ router.t()).float()
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), 4, dim=-1)
        return x + dense(x, weights, ids, w)

    x = decode_inputs(4, seed=1)[0]
    with compiled_with_pass(decode_block) as c:
        assert_same_as_eager(c.fn, decode_block, x)
    before, after = c.before.texts[0], c.after.texts[0]
    assert c.grouped.last_rewrites == 1
    # every line but the MoE call is unchanged: drop the dense call from `before`; drop the
    # replacement from `after` and call its result by the dense call's name
    replacement = ("empty = ", "auto_functionalized = ", "getitem_2 = getitem(auto_functionalized, 0)")
    assert [l for l in before.splitlines() if not l.startswith("awq_moe_dense = ")] == [
        re.sub(r"\bgetitem_2\b", "awq_moe_dense", l) for l in after.splitlines() if not l.startswith(replacement)
    ]
    assert_expected_inline(after, """\
in0: f16[16, 128]
in1: f16[4, 128]
in2: i32[16, 128, 16]
in3: f16[16, 4, 128]
in4: i32[16, 4, 16]
in5: i32[16, 64, 16]
in6: f16[16, 2, 128]
in7: i32[16, 2, 16]
permute = aten.permute.default(in0, [1, 0])
mm = aten.mm.default(in1, permute)
convert_element_type = prims.convert_element_type.default(mm, torch.float32)
amax = aten.amax.default(convert_element_type, [-1], True)
sub = aten.sub.Tensor(convert_element_type, amax)
exp = aten.exp.default(sub)
sum = aten.sum.dim_IntList(exp, [-1], True)
div = aten.div.Tensor(exp, sum)
topk = aten.topk.default(div, 4)
getitem = getitem(topk, 0)
getitem_1 = getitem(topk, 1)
empty = aten.empty.memory_format([workspace_numel(rows=16)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in1, topk_weights=getitem, topk_ids=getitem_1, w13_qweight=in2, w13_scales=in3, w13_qzeros=in4, w2_qweight=in5, w2_scales=in6, w2_qzeros=in7, group_size=32, workspace=empty)
getitem_2 = getitem(auto_functionalized, 0)
add = aten.add.Tensor(in1, getitem_2)
return [add]""")


def test_qwen38_tp4_shapes_are_rewritten():
    """The real contract (E=512, k=10, K=2560, N=160, G=32) at M=4."""
    w = synthetic_for_contract(QWEN38_TP4, seed=3)

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    inputs = decode_inputs(4, top_k=10, num_experts=512, hidden_size=2560, seed=4)
    with compiled_with_pass(moe) as c:
        assert_same_as_eager(c.fn, moe, *inputs)
    assert c.grouped.last_report.summary() == "rewrote 1 of 1 awq_moe_dense calls (grouped 1, routed 0)"
    assert_expected_inline(c.after.texts[0], """\
in0: f16[4, 2560]
in1: f32[4, 10]
in2: i64[4, 10]
in3: i32[512, 2560, 40]
in4: f16[512, 80, 320]
in5: i32[512, 80, 40]
in6: i32[512, 160, 320]
in7: f16[512, 5, 2560]
in8: i32[512, 5, 320]
empty = aten.empty.memory_format([workspace_numel(rows=40)], dtype=torch.int32, device=cpu, pin_memory=False)
auto_functionalized = auto_functionalized(moe_grouped_decode.awq_moe_grouped_decode.default, hidden_states=in0, topk_weights=in1, topk_ids=in2, w13_qweight=in3, w13_scales=in4, w13_qzeros=in5, w2_qweight=in6, w2_scales=in7, w2_qzeros=in8, group_size=32, workspace=empty)
getitem = getitem(auto_functionalized, 0)
return [getitem]""")


def test_symbolic_weight_shapes_stay_dense():
    """dynamic=True makes the weight sizes symbolic too: reading them would specialize behind Dynamo's back."""
    w = layer()

    def moe(x, weights, ids, *tensors):
        return OPS.awq_moe_dense(x, weights, ids, *tensors, 32)  # a literal: Dynamo would make an int attribute symbolic too

    inputs = (*decode_inputs(4, seed=1), *w.tensors())
    torch._dynamo.reset()
    grouped = GroupedDecodePass()
    with grouped_decode_installed(grouped), inductor_config.patch(fx_graph_cache=False):
        assert_same_as_eager(torch.compile(moe, dynamic=True), moe, *inputs)
    torch._dynamo.reset()
    assert grouped.last_report.rewrites == 0
    assert grouped.last_report.kept_dense[0].startswith("symbolic layer sizes")


# --------------------------------------------------------------------------- hand-built graphs


def hand_built_dense_graph(layers):
    """A post-grad-shaped graph of dense calls over fake tensors; no fake kernel runs, so any shape fits."""
    graph = torch.fx.Graph()
    outputs = []
    for args, group_size in layers:
        placeholders = []
        for i, value in enumerate(args):
            node = graph.placeholder(f"arg{len(outputs)}_{i}")
            node.meta["val"] = value
            placeholders.append(node)
        call = graph.call_function(OPS.awq_moe_dense.default, (*placeholders, group_size))
        call.meta["val"] = args[0].new_empty(args[0].shape)
        outputs.append(call)
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph).graph


def fake_layer_args(M=4, E=512, k=10, K=2560, N=160, G=32, dtype=torch.float16, scale_dtype=torch.float16):
    i32 = torch.int32
    return (
        (
            torch.empty(M, K, dtype=dtype),
            torch.empty(M, k, dtype=torch.float32),
            torch.empty(M, k, dtype=torch.int32),
            torch.empty(E, K, 2 * N // 8, dtype=i32),
            torch.empty(E, K // G, 2 * N, dtype=scale_dtype),
            torch.empty(E, K // G, 2 * N // 8, dtype=i32),
            torch.empty(E, N, K // 8, dtype=i32),
            torch.empty(E, N // G, K, dtype=scale_dtype),
            torch.empty(E, N // G, K // 8, dtype=i32),
        ),
        G,
    )


# the mismatches against qwen3.8-tp4, each alone; G=128 with N=160 and float32 activations
# are shapes the op itself refuses at trace time, so no compiled graph can carry them: only here
QWEN_MISMATCHES = [
    ("match", {}),
    ("E=256", dict(E=256)),
    ("k=8", dict(k=8)),
    ("G=128", dict(G=128)),
    ("K=2592", dict(K=2592)),
    ("N=384", dict(N=384)),
    ("float32 activations", dict(dtype=torch.float32)),
]


def test_qwen_relative_mismatches_are_untouched_in_hand_built_graph():
    with FakeTensorMode():
        layers = [fake_layer_args(**kw) for _, kw in QWEN_MISMATCHES]
    graph = hand_built_dense_graph(layers)
    dense_op = OPS.awq_moe_dense.default
    mismatched = [(node, node.args) for node in graph.find_nodes(op="call_function", target=dense_op)[1:]]
    grouped = GroupedDecodePass()
    grouped(graph)
    report = grouped.last_report
    assert (report.grouped, len(report.kept_dense)) == (1, 6)
    # the six untouched calls are the very nodes they were, with the same arguments
    assert [(node, node.args) for node in graph.find_nodes(op="call_function", target=dense_op)] == mismatched
    assert_expected_inline("\n".join(report.kept_dense), """\
M=4: qwen3.8-tp4: E=256 (contract 512)
M=4: qwen3.8-tp4: k=8 (contract 10)
M=4: qwen3.8-tp4: G=128 (contract 32)
M=4: qwen3.8-tp4: K=2592 (contract 2560)
M=4: qwen3.8-tp4: N=384 (contract 160)
M=4: qwen3.8-tp4: dtype=torch.float32 (contract torch.float16, torch.bfloat16)""")


def test_float32_activations_never_reach_a_graph():
    """Why the float32 case lives in a hand-built graph: the op refuses it eagerly and at trace time."""
    w = layer()
    x, weights, ids = decode_inputs(4)
    with pytest.raises(ValueError, match="hidden_states must be float16 or bfloat16"):
        dense(x.float(), weights, ids, w)
    with FakeTensorMode(), pytest.raises(ValueError, match="hidden_states must be float16 or bfloat16"):
        args, group_size = fake_layer_args(dtype=torch.float32)
        OPS.awq_moe_dense(*args, group_size)


# --------------------------------------------------------------------------- routed op


def routed_args(m, seed=0):
    w = layer()
    x, weights, ids = decode_inputs(m, seed=seed)
    workspace = torch.full((workspace_numel(8 * 4, 128, 64),), -7, dtype=torch.int32)
    return (x, weights, ids, *w.op_args(), workspace, 2, 8)


# M=1 and M=9 sit just outside the 2..8 window (dense), M=2 and M=8 on its edges (grouped)
@pytest.mark.parametrize("m, grouped", [(1, False), (2, True), (8, True), (9, False)])
def test_routed_op_picks_route_by_token_count(m, grouped):
    args = routed_args(m, seed=m)
    workspace = args[10]
    out = awq_moe_routed(*args)
    assert torch.equal(out, dense(*args[:3], layer()))
    # the grouped route writes every routed row's output into the workspace (-7 poison reads as
    # NaN there); the dense route never touches it
    row_outputs = workspace_views(workspace, m * 4, 128, 64).row_outputs
    if grouped:
        assert not torch.isnan(row_outputs).any()
    else:
        assert (workspace == -7).all()


def test_routed_op_opcheck_and_checks():
    torch.library.opcheck(OPS.awq_moe_routed.default, routed_args(4, seed=1))
    torch.library.opcheck(OPS.awq_moe_routed.default, routed_args(12, seed=2))
    small = list(routed_args(4))
    small[10] = small[10][:100]
    with pytest.raises(ValueError, match="workspace holds fewer than grouped_max_tokens"):
        awq_moe_routed(*small)


# --------------------------------------------------------------------------- uuid and installer


def test_uuid_tracks_version_source_contracts_and_hint(monkeypatch):
    base = GroupedDecodePass().uuid()
    assert GroupedDecodePass().uuid() == base  # stable: same inputs, same key
    assert GroupedDecodePass(token_range=(1, 8)).uuid() != base
    with contract_registered(ShapeContract("test-other", 8, 2, 64, 32, 32, 2, 4)):
        assert contracts_fingerprint() in GroupedDecodePass().uuid()
        assert GroupedDecodePass().uuid() != base
    monkeypatch.setattr(grouped_decode_module, "__version__", "9.9.9")
    assert GroupedDecodePass().uuid() != base
    monkeypatch.undo()
    real_getsource = grouped_decode_module.inspect.getsource
    monkeypatch.setattr(grouped_decode_module.inspect, "getsource", lambda m: real_getsource(m) + "# edited\n")
    assert GroupedDecodePass().uuid() != base


def test_installer_composes_and_never_duplicates():
    other = GraphRecorder()
    first, second = GroupedDecodePass(), GroupedDecodePass(token_range=(1, 8))
    with inductor_config.patch(post_grad_custom_post_pass=other):
        assert install(first) is first
        composed = inductor_config.post_grad_custom_post_pass
        assert isinstance(composed, ComposedGraphPass) and composed.passes == (other, first)
        assert composed.uuid() == ("graph-recorder", first.uuid())
        install(second)  # installing again replaces the grouped pass, keeps the other
        assert inductor_config.post_grad_custom_post_pass.passes == (other, second)
        with grouped_decode_installed(first):
            assert inductor_config.post_grad_custom_post_pass.passes == (other, first)
        assert inductor_config.post_grad_custom_post_pass.passes == (other, second)
    assert inductor_config.post_grad_custom_post_pass is None
    # alone it installs itself bare; a list (torch 2.13 accepts one) is flattened in order
    assert composed_with_installed(first, None) is first
    assert composed_with_installed(first, [other, second]).passes == (other, first)
    # a pass without uuid makes the composition uncacheable instead of silently cached
    assert ComposedGraphPass(lambda graph: None, first).uuid() is None


def test_fx_graph_cache_key_follows_contract_set(tmp_path, monkeypatch):
    """A cached graph is reused only while the contract set is the same: the pass uuid is part of the key."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    w = layer()

    def moe(x, weights, ids):
        return dense(x, weights, ids, w)

    inputs = decode_inputs(4, seed=1)
    grouped = GroupedDecodePass()

    def compile_once():
        torch._dynamo.reset()
        with inductor_config.patch(post_grad_custom_post_pass=grouped, fx_graph_cache=True):
            assert_same_as_eager(torch.compile(moe), moe, *inputs)

    compile_once()  # miss: the pass rewrites
    compile_once()  # hit: the pass does not run again
    assert grouped.total_rewrites == 1
    with contract_registered(ShapeContract("test-other", 8, 2, 64, 32, 32, 2, 4)):
        compile_once()  # new contract set -> new key -> the pass runs again
    assert grouped.total_rewrites == 2
    torch._dynamo.reset()
