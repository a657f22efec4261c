"""Expert parallelism: a layer with an expert map (vLLM's EP: a rank holds E / ep experts, the
router's ids are global) served by the plugin's method.

In this process, on a layer-shaped stand-in and vLLM's own ``determine_expert_map``: the id
mapping, ``apply`` against the ops on local ids, the ranks' outputs summed against the global
layer, and which layers are servable. In a fresh process (``tests/vllm_expert_parallel_job.py``):
two real EP ranks over gloo, each a real vLLM MoE layer loaded by vLLM's weight loader.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from moe_grouped_decode.awq import AwqMoeWeights, slice_ep, synthetic_moe_weights
from moe_grouped_decode.contract import Admission, LayerShape, ShapeContract, admits, contract_registered
from moe_grouped_decode.ops import alloc_workspace, error_stats, reference_moe

pytestmark = pytest.mark.vllm  # imports vllm (the job starts no engine either)

OPS = torch.ops.moe_grouped_decode
SCALED_MAX_ABS_BOUND = 2e-3  # fp16 evidence bound: max|out - ref| <= 2e-3 * max|ref|
E, TOP_K, K, N, G = 16, 4, 64, 32, 32  # the global layer
WEIGHT_NAMES = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")


@pytest.fixture(scope="module")
def global_layer() -> AwqMoeWeights:
    return synthetic_moe_weights(E, K, N, G, torch.float16, seed=9)


def vllm_expert_map(ep_size: int, ep_rank: int, placement: str) -> torch.Tensor:
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    local, expert_map, _ = determine_expert_map(ep_size, ep_rank, E, placement)
    assert expert_map is not None and local == E // ep_size
    return expert_map


def lookup(ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """Global -> local ids one by one in Python (-1: another rank's expert, or no expert at all)."""
    table = expert_map.tolist()
    return torch.tensor([[table[g] if 0 <= g < len(table) else -1 for g in row] for row in ids.tolist()],
                        dtype=torch.int32).view(ids.shape)


def fake_layer(weights: AwqMoeWeights, expert_map, name="model.layers.0.mlp.experts"):
    """What ``apply`` and ``process_weights_after_loading`` read of vLLM's RoutedExperts."""
    tensors = dict(zip(WEIGHT_NAMES, weights.tensors())) if weights is not None else {}
    return types.SimpleNamespace(layer_name=name, expert_map=expert_map, **tensors)


def fake_moe(num_local_experts, **changes):
    """The FusedMoEConfig fields the method reads (vLLM's names)."""
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    fields = dict(num_experts=E, num_local_experts=num_local_experts, experts_per_token=TOP_K, hidden_dim=K,
                  intermediate_size_per_partition=N, in_dtype=torch.float16, activation=MoEActivation.SILU,
                  has_bias=False, is_lora_enabled=False, rocm_aiter_fmoe_enabled=False, max_num_tokens=64)
    return types.SimpleNamespace(**{**fields, **changes})


def quant_config():
    from moe_grouped_decode.compile_plugin.quant_config import GroupedDecodeAwqConfig

    return GroupedDecodeAwqConfig.from_config({"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True,
                                               "version": "gemm"})


def method_for(num_local_experts, contract=None):
    from moe_grouped_decode.compile_plugin.moe_method import AwqMoeGroupedDecodeMethod, layer_shape

    moe = fake_moe(num_local_experts)
    shape = layer_shape(moe, G)
    admission = Admission(contract, "test") if contract is not None else Admission(None, "dense only")
    method = AwqMoeGroupedDecodeMethod(quant_config(), moe, shape, admission)
    if contract is not None:
        method.workspace_tokens = contract.max_tokens
        method.workspace = alloc_workspace(contract.max_tokens, TOP_K, K, N, "cpu")
    return method


def global_routing(m, seed, outside=True):
    """Router output over the E global experts (distinct per token), fixed seed; with ``outside``
    some slots carry ids no map may be indexed by: vLLM's -1 for an unused slot, E, 2^30."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=gen)[:TOP_K] for _ in range(m)]).to(torch.int32)
    tw = torch.rand(m, TOP_K, generator=gen) + 0.1
    if outside:
        ids[::3, 0] = -1
        ids[1::3, 1] = E
        ids[2::3, 2] = 2**30
    x = torch.randn(m, K, generator=gen).to(torch.float16)
    return x, tw, ids


# --------------------------------------------------------------------------- the id mapping


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_size,ep_rank", [(2, 0), (2, 1), (4, 3)])
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_local_expert_ids_is_the_lookup(placement, ep_size, ep_rank, id_dtype):
    """Every global id, and every id outside the map: -1 must not wrap to the last global expert
    (local on the last rank), a large one must not read past the map."""
    from moe_grouped_decode.ops import local_expert_ids

    expert_map = vllm_expert_map(ep_size, ep_rank, placement)
    ids = torch.tensor([list(range(E)), [-1, -2, -(2**30), E, E + 1, 2**30, E - 1, 0] * 2], dtype=id_dtype)
    got = local_expert_ids(ids, expert_map)
    assert got.dtype == torch.int32 and torch.equal(got, lookup(ids, expert_map))
    assert got[1, 0] == -1 and (ep_rank != ep_size - 1 or placement != "linear" or got[1, 6] >= 0)


def test_local_expert_ids_compiles_without_a_graph_break():
    from moe_grouped_decode.ops import local_expert_ids

    expert_map = vllm_expert_map(2, 1, "linear")
    ids = torch.tensor([[-1, 3, 15], [16, 8, 2**30]], dtype=torch.int32)
    compiled = torch.compile(local_expert_ids, fullgraph=True, dynamic=True)
    assert torch.equal(compiled(ids, expert_map), lookup(ids, expert_map))


# --------------------------------------------------------------------------- apply with an expert map


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
@pytest.mark.parametrize("ep_rank", [0, 1])
@pytest.mark.parametrize("m", [1, 5, 12])
def test_apply_with_an_expert_map_is_the_ops_on_local_ids(global_layer, placement, ep_rank, m):
    """``apply`` on global ids gives the bits of the ops on the local ids looked up by hand, on the
    dense route and (inside the window) the grouped one; a slot whose expert is on the other rank,
    or that names no expert, adds nothing (checked against the reference with those slots' weights
    zeroed), and a token none of whose experts is here gets exactly 0."""
    expert_map = vllm_expert_map(2, ep_rank, placement)
    local = slice_ep(global_layer, expert_map)
    layer = fake_layer(local, expert_map)
    contract = ShapeContract("ep-apply-test", E // 2, TOP_K, K, N, G, min_tokens=2, max_tokens=8, dtypes=(torch.float16,))
    method = method_for(E // 2, contract)
    x, tw, ids = global_routing(m, seed=30 + m)
    local_ids = lookup(ids, expert_map)
    nowhere = local_ids < 0
    tw = tw.masked_fill(nowhere, float("nan"))  # never read
    expected = OPS.awq_moe_dense(x, tw, local_ids, *local.op_args())
    assert torch.equal(method.apply(layer, x, tw, ids, None, None), expected)
    with method.grouped_route():
        assert torch.equal(method.apply(layer, x, tw, ids, None, None), expected)
    ref = reference_moe(x, tw.masked_fill(nowhere, 0.0), local_ids.clamp(min=0), local)
    stats = error_stats(expected, ref)
    assert not stats.nan and stats.scaled_max_abs <= SCALED_MAX_ABS_BOUND, stats
    for t in nowhere.all(dim=1).nonzero().flatten().tolist():
        assert torch.equal(expected[t], torch.zeros(K, dtype=x.dtype))


def test_apply_takes_the_grouped_op_only_within_the_window_and_the_workspace():
    """The route is the same admission as without a map; above what the workspace holds (data-parallel
    EP gathers every DP rank's tokens before apply) the dense route serves."""
    weights = synthetic_moe_weights(E // 2, K, N, G, torch.float16, seed=2)
    expert_map = vllm_expert_map(2, 0, "linear")
    contract = ShapeContract("ep-window-test", E // 2, TOP_K, K, N, G, min_tokens=2, max_tokens=8,
                             dtypes=(torch.float16,))
    method = method_for(E // 2, contract)
    method.workspace_tokens = 6
    seen = []
    originals = {name: getattr(OPS, name) for name in ("awq_moe_dense", "awq_moe_grouped_decode")}

    def recorder(name):
        def call(*args):
            seen.append(name)
            return originals[name](*args)
        return call

    try:
        for name in originals:
            setattr(OPS, name, recorder(name))
        with contract_registered(contract), method.grouped_route():
            for m in (1, 2, 6, 7, 9):
                x, tw, ids = global_routing(m, seed=m, outside=False)
                method.apply(fake_layer(weights, expert_map), x, tw, ids, None, None)
    finally:
        for name, packet in originals.items():
            setattr(OPS, name, packet)
    assert seen == ["awq_moe_dense", "awq_moe_grouped_decode", "awq_moe_grouped_decode", "awq_moe_dense",
                    "awq_moe_dense"]


# --------------------------------------------------------------------------- ranks summed = the global layer


@pytest.mark.parametrize("ep_size,placement", [(2, "linear"), (2, "round_robin"), (4, "linear")])
def test_ep_ranks_summed_are_the_global_layer(global_layer, ep_size, placement):
    """How vLLM combines EP ranks: an all-reduce of each rank's partial output. The sum over the
    ranks' shards of one global layer is the single-rank layer's output (to fp16 rounding: each
    partial is rounded once) and the float64 reference's."""
    x, tw, ids = global_routing(9, seed=ep_size)
    outside = (ids < 0) | (ids >= E)
    single_rank = OPS.awq_moe_dense(x, tw, ids, *global_layer.op_args())
    reference = reference_moe(x, tw.masked_fill(outside, 0.0), ids.clamp(0, E - 1), global_layer)
    method = method_for(E // ep_size)
    partials = []
    for rank in range(ep_size):
        expert_map = vllm_expert_map(ep_size, rank, placement)
        partials.append(method.apply(fake_layer(slice_ep(global_layer, expert_map), expert_map), x, tw, ids, None, None))
    total = sum(p.double() for p in partials)
    scale = reference.abs().max()
    assert ((total - reference).abs().max() / scale) <= SCALED_MAX_ABS_BOUND
    assert ((total - single_rank.double()).abs().max() / scale) <= SCALED_MAX_ABS_BOUND
    assert error_stats(single_rank, reference).scaled_max_abs <= SCALED_MAX_ABS_BOUND


# --------------------------------------------------------------------------- which layers are served


def fake_routed_experts(moe, **changes):
    fields = dict(moe_config=moe, apply_router_weight_on_input=False, swiglu_limit=None, swiglu_alpha=None)
    return types.SimpleNamespace(**{**fields, **changes})


def test_expert_parallel_layers_are_servable():
    from moe_grouped_decode.compile_plugin.moe_method import unservable_reason

    config = quant_config()
    assert unservable_reason(fake_routed_experts(fake_moe(E)), config) is None
    assert unservable_reason(fake_routed_experts(fake_moe(E // 4)), config) is None  # EP: E / 4 experts here
    # vLLM 0.26 hands ROCm AITER's 0/1 mask as layer.expert_map: not ids the ops could use
    assert unservable_reason(fake_routed_experts(fake_moe(E // 4, rocm_aiter_fmoe_enabled=True)), config) == \
        "expert parallelism under ROCm AITER (an expert mask)"
    assert unservable_reason(fake_routed_experts(fake_moe(E, rocm_aiter_fmoe_enabled=True)), config) is None
    # the other reasons still stand beside it
    assert unservable_reason(fake_routed_experts(fake_moe(E // 4, has_bias=True)), config) == "expert biases"


def test_admission_reads_the_local_shape():
    """An EP rank's layer is E / ep experts at the full intermediate size: a contract for the TP
    shape does not admit it, one for the local shape does."""
    from moe_grouped_decode.compile_plugin.moe_method import layer_shape

    shape = layer_shape(fake_moe(E // 4), G)
    assert shape == LayerShape(E // 4, TOP_K, K, N, G, torch.float16)
    with contract_registered(ShapeContract("ep-global-test", E, TOP_K, K, N, G, 2, 8)):
        assert not admits(shape)
    with contract_registered(ShapeContract("ep-local-test", E // 4, TOP_K, K, N, G, 2, 8)) as local:
        assert admits(shape).contract == local


@pytest.mark.parametrize("case,expert_map,num_local,match", [
    ("no-map", None, E // 2, r"holds 8 of 16 experts but has no expert map"),
    ("short", torch.arange(8, dtype=torch.int32), 8, r"must give each of the 16 global experts .* got shape \(8,\)"),
    ("a-local-id-twice", torch.tensor([0, 1, 1, 2] + [-1] * 12, dtype=torch.int32), 4, r"local ids \[0, 1, 1, 2\]"),
    ("a-local-id-missing", torch.tensor([0, 1, 3] + [-1] * 13, dtype=torch.int32), 3, r"local ids \[0, 1, 3\]"),
    ("a-mask", torch.tensor([1] * 8 + [0] * 8, dtype=torch.int32), 8, r"in 0\.\.7 or -1"),
])
def test_a_map_the_ops_would_misread_fails_at_load(case, expert_map, num_local, match):
    method = method_for(num_local)
    weights = synthetic_moe_weights(num_local, K, N, G, torch.float16, seed=1)
    with pytest.raises(ValueError, match=rf"model\.layers\.7\.mlp\.experts: .*{match}"):
        method.process_weights_after_loading(fake_layer(weights, expert_map, name="model.layers.7.mlp.experts"))


def test_vllms_maps_pass_the_load_check():
    from moe_grouped_decode.compile_plugin.moe_method import check_expert_map

    for placement in ("linear", "round_robin"):
        for rank in range(4):
            check_expert_map(fake_layer(None, vllm_expert_map(4, rank, placement)), fake_moe(E // 4))
    check_expert_map(fake_layer(None, None), fake_moe(E))  # no EP, no map


# --------------------------------------------------------------------------- the EP form of qwen3.8-tp4

# qwen3.8 under --enable-expert-parallel at tensor_parallel_size=4: each rank holds 512 / 4 = 128
# experts at the full intermediate size 640 (= 4 x 160). Not shipped (no measured route table
# entry); this is the MOE_GROUPED_DECODE_CONTRACTS value the documentation gives, decode window.
QWEN38_EP4_JSON = ('[{"name": "qwen3.8-ep4", "num_experts": 128, "top_k": 10, "hidden_size": 2560, '
                   '"intermediate_size": 640, "group_size": 32, "min_tokens": 1, "max_tokens": 8, '
                   '"dtypes": ["float16", "bfloat16"]}]')


@pytest.fixture
def qwen38_ep4(monkeypatch):
    from moe_grouped_decode.compile_plugin.contracts_env import CONTRACTS_ENV, register_env_contracts
    from moe_grouped_decode.contract import unregister_contract

    monkeypatch.setenv(CONTRACTS_ENV, QWEN38_EP4_JSON)
    (contract,) = register_env_contracts()
    try:
        yield contract
    finally:
        unregister_contract(contract.name)


def test_the_documented_qwen38_ep_contract_admits_an_ep_rank_only(qwen38_ep4):
    from moe_grouped_decode.compile_plugin.moe_method import layer_shape
    from moe_grouped_decode.contract import QWEN38_TP4

    ep_rank = layer_shape(fake_moe(128, num_experts=512, experts_per_token=10, hidden_dim=2560,
                                   intermediate_size_per_partition=640, in_dtype=torch.bfloat16), 32)
    assert admits(ep_rank).contract == qwen38_ep4
    assert admits(ep_rank, 8) and not admits(ep_rank, 9)  # the prefill route above the window
    tp4_rank = LayerShape(512, 10, 2560, 160, 32, torch.float16)
    assert admits(tp4_rank).contract == QWEN38_TP4  # the shipped contract is unchanged, and the only match


def test_qwen38_ep4_rank_apply_matches_the_reference(qwen38_ep4):
    """The real EP shape on the last of 4 ranks, global ids over all 512 experts: only the slots
    on this rank's 128 experts count, on the dense and the grouped route."""
    from moe_grouped_decode.awq import synthetic_for_contract
    from moe_grouped_decode.compile_plugin.moe_method import AwqMoeGroupedDecodeMethod, layer_shape
    from vllm.model_executor.layers.fused_moe.expert_map_manager import determine_expert_map

    _, expert_map, _ = determine_expert_map(4, 3, 512)
    local = synthetic_for_contract(qwen38_ep4, dtype=torch.float16, seed=4)
    moe = fake_moe(128, num_experts=512, experts_per_token=10, hidden_dim=2560, intermediate_size_per_partition=640)
    method = AwqMoeGroupedDecodeMethod(quant_config(), moe, layer_shape(moe, 32), admits(layer_shape(moe, 32)))
    method.workspace_tokens = 8
    method.workspace = alloc_workspace(8, 10, 2560, 640, "cpu")
    gen = torch.Generator().manual_seed(41)
    ids = torch.stack([torch.randperm(512, generator=gen)[:10] for _ in range(3)]).to(torch.int32)
    ids[0, :4] = torch.tensor([384, 400, 511, 450], dtype=torch.int32)  # a few certainly on rank 3
    tw = torch.rand(3, 10, generator=gen)
    x = torch.randn(3, 2560, generator=gen).to(torch.float16)
    layer = fake_layer(local, expert_map)
    on_rank = ids >= 384
    ref = reference_moe(x, tw.masked_fill(~on_rank, 0.0), (ids - 384).clamp(min=0), local)
    dense = method.apply(layer, x, tw, ids, None, None)
    with method.grouped_route():
        grouped = method.apply(layer, x, tw, ids, None, None)
    stats = error_stats(dense, ref)
    assert not stats.nan and stats.scaled_max_abs <= SCALED_MAX_ABS_BOUND, stats
    assert torch.equal(grouped, dense)


# --------------------------------------------------------------------------- two real EP ranks


JOB = Path(__file__).with_name("vllm_expert_parallel_job.py")


@pytest.fixture(scope="module")
def job():
    proc = subprocess.run([sys.executable, str(JOB)], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("EP_JOB ")]
    assert proc.returncode == 0 and lines, f"job failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("EP_JOB ") :])


def test_vllm_builds_an_expert_parallel_layer_the_plugin_serves(job):
    for rank, r in enumerate(job["ranks"]):
        assert (r["use_ep"], r["ep_size"], r["ep_rank"]) == (True, 2, rank)
        # the local shape: half the experts, the whole intermediate size (no TP split under EP)
        assert (r["num_experts"], r["num_local_experts"], r["intermediate_size_per_partition"]) == (8, 4, 64)
        assert r["expert_map"] == ([0, 1, 2, 3] + [-1] * 4 if rank == 0 else [-1] * 4 + [0, 1, 2, 3])
        assert r["unservable"] is None
        assert r["served_by_plugin"] and r["admitted"] == "ep-test" and r["shape"] == [4, 3, 128, 64, 32]
        assert r["method_name"] == "AwqMoeGroupedDecodeMethod(grouped under ep-test)"
        assert r["held_weights_match_the_map"]  # vLLM's loader kept this rank's experts, at their local ids


def test_each_rank_applies_its_experts_to_the_global_ids(job):
    for r in job["ranks"]:
        assert r["apply_equals_ops_on_local_ids"] and r["grouped_equals_dense"] and not r["nan"]
        assert r["grouped_ops"] == ["awq_moe_grouped_decode"]
        # the mapping traces into the graph: no break, the dense call rewritten
        assert r["compiled_equals_eager"] and r["graph_rewrites"] == 1
    # rank 0 holds 0..3: token 1 (4, 5, 7) and token 3 (E, 2^30, 6) bring it nothing; rank 1: token 0
    assert [r["zero_tokens"] for r in job["ranks"]] == [[1, 3], [0]]


def test_the_ranks_outputs_summed_are_the_global_layer(job):
    assert job["partial_sum_vs_reference"] <= SCALED_MAX_ABS_BOUND
    assert job["partial_sum_vs_single_rank"] <= SCALED_MAX_ABS_BOUND
    assert job["single_rank_vs_reference"] <= SCALED_MAX_ABS_BOUND
    # the whole vLLM layer: its router, the method on each rank, its all-reduce
    assert job["layer_out_same_on_every_rank"]
    assert all(r["layer_out_vs_reference"] <= SCALED_MAX_ABS_BOUND for r in job["ranks"])


def test_apply_calls_the_implementations_directly_outside_tracing(global_layer, monkeypatch):
    """Outside tracing ``apply`` calls the ops' implementations for the input's device type
    directly (on a GPU: the dispatcher's way costs more host time than the launches), the
    grouped one inside the window and the dense one outside; while tracing, the ops themselves.
    The CPU stands in for the GPU here: its entry is the ops' own CPU implementations, recorded."""
    from moe_grouped_decode.compile_plugin import moe_method

    calls = []

    def recorded(name, op):
        return lambda *args: calls.append(name) or op(*args)

    monkeypatch.setitem(moe_method.EAGER_IMPLEMENTATIONS, "cpu", (
        recorded("grouped", OPS.awq_moe_grouped_decode), recorded("dense", OPS.awq_moe_dense)))
    layer = fake_layer(global_layer, None)
    contract = ShapeContract("direct-apply-test", E, TOP_K, K, N, G, min_tokens=1, max_tokens=8,
                             dtypes=(torch.float16,))
    method = method_for(E, contract)
    with contract_registered(contract):
        for m, route in ((3, "grouped"), (12, "dense")):
            x, tw, ids = global_routing(m, seed=60 + m, outside=False)
            expected = OPS.awq_moe_dense(x, tw, ids, *global_layer.op_args())
            with method.grouped_route():
                assert torch.equal(method.apply(layer, x, tw, ids, None, None), expected)
            assert calls == [route]
            calls.clear()
            with monkeypatch.context() as tracing, method.grouped_route():
                tracing.setattr(torch.compiler, "is_compiling", lambda: True)
                assert torch.equal(method.apply(layer, x, tw, ids, None, None), expected)
            assert calls == []
