"""The CUDA (Triton) implementations of both ops against the float64 per-expert reference.

Runs on a CUDA GPU only (skipped elsewhere). Shapes are the qwen3.8-tp4
contract's (E=512, k=10, K=2560, N=160, G=32). Bound: max|out - ref| <=
2e-3 * max|ref| for fp16; bf16's own output rounding can reach 2^-8 * max|ref|,
so its bound is 8x (as in test_ops_cpu.py). Every case's max abs diff and max
ULP are written to $MOE_GD_STATS (JSON) when set.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from moe_grouped_decode.awq import slice_tp, synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.env import GLUON_W13_ENV
from moe_grouped_decode.kernels import gluon_helpers
from moe_grouped_decode.ops import alloc_workspace, error_stats, grouped_plan_for, launch_grouped, reference_moe
from overflow_cases import assert_overflow_handled, overflowing

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = (QWEN38_TP4.num_experts, QWEN38_TP4.top_k, QWEN38_TP4.hidden_size,
                     QWEN38_TP4.intermediate_size, QWEN38_TP4.group_size)
BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}
GROUPED_MAX_TOKENS = 64  # the workspace below holds 64 * 10 routed rows
STATS: list = []

grouped_op = torch.ops.moe_grouped_decode.awq_moe_grouped_decode
dense_op = torch.ops.moe_grouped_decode.awq_moe_dense


@pytest.fixture(scope="module", autouse=True)
def _write_stats():
    yield
    path = os.environ.get("MOE_GD_STATS")
    if path:
        with open(path, "w") as f:
            json.dump(STATS, f, indent=1)


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def layer(request):
    """A synthetic contract-shaped layer on the GPU, and its CPU copy for the reference."""
    weights = synthetic_moe_weights(E, K, N, G, dtype=request.param, seed=11, device="cuda")
    return weights, weights.to("cpu")


@pytest.fixture(scope="module")
def workspace():
    return alloc_workspace(GROUPED_MAX_TOKENS, TOP_K, K, N, "cuda")


def routing(pattern: str, M: int, gen: torch.Generator, num_experts: int = E):
    """topk_ids [M, k] int32 and float32 softmax-like topk_weights, on the GPU."""
    if pattern == "random":  # distinct experts per token, as a router gives
        ids = torch.rand(M, num_experts, generator=gen).topk(TOP_K, dim=1).indices
    elif pattern == "round_robin":  # consecutive experts: neighbouring tokens share some
        ids = (torch.arange(M)[:, None] * 3 + torch.arange(TOP_K)[None, :]) % num_experts
    elif pattern == "single_hot":  # every token on the same k experts: k segments of M rows
        ids = torch.randperm(num_experts, generator=gen)[:TOP_K].repeat(M, 1)
    else:
        raise ValueError(pattern)
    weights = torch.rand(M, TOP_K, generator=gen)
    weights = weights / weights.sum(1, keepdim=True)
    return ids.to(torch.int32).cuda(), weights.cuda()


def activations(M: int, dtype, gen: torch.Generator):
    return torch.randn(M, K, generator=gen).to(dtype).cuda()


def poison_allocator(numel: int, dtype) -> None:
    """Fill a freed block of the op's output size with NaN so that an output the
    op allocates next likely starts as NaN, not as an earlier right answer."""
    torch.full((numel,), float("nan"), dtype=dtype, device="cuda")


def assert_close(name: str, out: torch.Tensor, x, tw, ids, cpu_weights) -> None:
    ref = reference_moe(x.cpu(), tw.cpu(), ids.cpu(), cpu_weights)
    stats = error_stats(out, ref)
    STATS.append({"case": name, **stats.row(), "nan": stats.nan})
    assert not stats.nan, f"{name}: NaN in output"
    assert stats.scaled_max_abs <= BOUND[out.dtype], f"{name}: {stats}"


def table_config(weights, M: int, **changes):
    """The launch config the op picks for the contract's shape at M (the table's entry, no tuning
    cache here), with ``changes``, fitted to K."""
    x = torch.empty(M, K, dtype=weights.dtype, device="cuda")
    ids = torch.empty(M, TOP_K, dtype=torch.int32, device="cuda")
    return dataclasses.replace(grouped_plan_for(x, ids, weights).config, **changes).fitted(K)


def kernel_names(launched) -> list:
    """The kernels a launch_grouped call ran, by their JIT functions' names."""
    return [kernel.name for kernel in launched]


def run_grouped(x, tw, ids, weights, workspace):
    workspace.fill_(-1)  # 0xFFFFFFFF: NaN as float32, -1 as ids and offsets
    poison_allocator(x.numel(), x.dtype)
    return grouped_op(x, tw, ids, *weights.op_args(), workspace)


# M = 1..9 crosses the launch table's entries and the seeds' window 2..8; 16 and 64 (R = 160 and
# 640 rows, the grouped window's top) launch W13 grids of 8k-32k programs
GROUPED_TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 64]


@pytest.mark.parametrize("pattern", ["random", "round_robin", "single_hot"])
@pytest.mark.parametrize("M", GROUPED_TOKENS)
def test_grouped_matches_reference(layer, workspace, M, pattern):
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(100 * M + len(pattern))
    x = activations(M, weights.dtype, gen)
    ids, tw = routing(pattern, M, gen)
    out = run_grouped(x, tw, ids, weights, workspace)
    assert_close(f"grouped {weights.dtype} M={M} {pattern}", out, x, tw, ids, cpu_weights)


# small M (decode sizes, C1), mid sizes, and prefill sizes where blocks fill up
DENSE_CASES = [
    *[(M, "random") for M in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 64)],
    (8, "single_hot"),  # one padded block per expert holding 8 rows
    (8, "round_robin"),
    (512, "random"),  # ~10 rows per expert
]


def check_dense(layer, M, pattern):
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(7 * M + len(pattern))
    x = activations(M, weights.dtype, gen)
    ids, tw = routing(pattern, M, gen)
    poison_allocator(x.numel(), x.dtype)
    out = dense_op(x, tw, ids, *weights.op_args())
    assert_close(f"dense {weights.dtype} M={M} {pattern}", out, x, tw, ids, cpu_weights)


@pytest.mark.parametrize("M,pattern", DENSE_CASES)
def test_dense_matches_reference(layer, M, pattern):
    check_dense(layer, M, pattern)


# ~40 rows per expert, several blocks for busy experts; bf16 only, as one 2048-token case
# keeps the float64 reference's CPU time down and bf16 is the dtype with the looser bits
@pytest.mark.parametrize("layer", [torch.bfloat16], ids=["bf16"], indirect=True)
def test_dense_2048_tokens_matches_reference(layer):
    check_dense(layer, 2048, "random")


@pytest.mark.parametrize("rank", [0, 3])  # first and last TP4 shard: gate/up and down slices at both ends
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tp4_shards(rank, dtype, workspace):
    full = synthetic_moe_weights(E, K, 4 * N, G, dtype=dtype, seed=5, device="cuda")
    shard = slice_tp(full, rank, 4)
    cpu_shard = shard.to("cpu")
    gen = torch.Generator().manual_seed(rank)
    for M in (2, 8):
        x = activations(M, dtype, gen)
        ids, tw = routing("random", M, gen)
        out = run_grouped(x, tw, ids, shard, workspace)
        assert_close(f"grouped tp4 rank{rank} {dtype} M={M}", out, x, tw, ids, cpu_shard)
        poison_allocator(x.numel(), x.dtype)
        out = dense_op(x, tw, ids, *shard.op_args())
        assert_close(f"dense tp4 rank{rank} {dtype} M={M}", out, x, tw, ids, cpu_shard)


@pytest.mark.parametrize("M", range(2, 9))
def test_grouped_cuda_graph_replay(layer, M):
    """Capture once, then replay with new routing and activations copied into the inputs."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(1000 + M)
    workspace = alloc_workspace(M, TOP_K, K, N, "cuda")
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    grouped_op(x, tw, ids, *weights.op_args(), workspace)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_op(x, tw, ids, *weights.op_args(), workspace)
    for replay, pattern in enumerate(("random", "single_hot", "round_robin", "random")):
        new_ids, new_tw = routing(pattern, M, gen)
        if pattern == "round_robin":  # shift so each replay routes differently
            new_ids = (new_ids + 37 * replay) % E
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(activations(M, weights.dtype, gen))
        out.fill_(float("nan"))
        workspace.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(f"graph {weights.dtype} M={M} replay{replay} {pattern}", out, x, tw, ids, cpu_weights)


def test_bit_identical_repeats(layer, workspace):
    weights, _ = layer
    gen = torch.Generator().manual_seed(3)
    for M in (2, 8):
        x = activations(M, weights.dtype, gen)
        ids, tw = routing("random", M, gen)
        first = run_grouped(x, tw, ids, weights, workspace).clone()
        dense_first = dense_op(x, tw, ids, *weights.op_args()).clone()
        for _ in range(3):
            assert torch.equal(run_grouped(x, tw, ids, weights, workspace).view(torch.int16), first.view(torch.int16))
            assert torch.equal(dense_op(x, tw, ids, *weights.op_args()).view(torch.int16), dense_first.view(torch.int16))


def test_position_and_neighbour_independence(layer, workspace):
    """One token's bits do not change with its batch position or the other tokens."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(4)
    M = 8
    token_x = activations(1, weights.dtype, gen)
    token_ids, token_tw = routing("random", 1, gen)
    outputs = []
    for position in (0, 5, 7):
        x = activations(M, weights.dtype, gen)
        ids, tw = routing("random", M, gen)
        # one neighbour shares all of the token's experts: its segments get two rows
        ids[(position + 1) % M] = token_ids[0]
        x[position], ids[position], tw[position] = token_x[0], token_ids[0], token_tw[0]
        outputs.append(run_grouped(x, tw, ids, weights, workspace)[position].clone())
    for other in outputs[1:]:
        assert torch.equal(other.view(torch.int16), outputs[0].view(torch.int16))


# (fused_combine, pdl): why
LAUNCH_VARIANTS = [
    (False, False),  # three plain launches (W13, W2, combine)
    (False, True),  # three launches chained by programmatic dependent launch
    (True, False),  # the combine inside W2 (arrival counters), plain launches
]


@pytest.mark.parametrize("fused_combine,pdl", LAUNCH_VARIANTS)
def test_launch_variants_give_the_default_bits(layer, workspace, fused_combine, pdl):
    """Fusing the combine and PDL change launches, not arithmetic: the same bits as the
    default launches (fused + PDL) at M = 8's table config with the tl W2 (the Gluon W2 runs only
    with the combine fused; test_gluon_w2_gives_the_tl_kernels_bits covers it), on routing where
    tokens share experts."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(5)
    M = 8
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("round_robin", M, gen)
    default = table_config(weights, M, w2_kernel="tl")
    outs = []
    for config in (default, dataclasses.replace(default, fused_combine=fused_combine, pdl=pdl)):
        out = torch.full_like(x, float("nan"))
        workspace.fill_(-1)
        launched = launch_grouped(x, tw, ids, weights, workspace, out, config)
        assert len(launched) == (2 if config.fused_combine else 3)
        outs.append(out)
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16))


# (M, W13 split rows): why
GLUON_W13_CASES = [
    (2, 256),  # M = 2's table split: 10 splits that tile K, 8 chunks each
    (8, 512),  # M = 8's: 16 chunks per split, deeper than any ring
    (5, 384),  # a split that does not tile K = 2560: the last split's chunks past K are masked and zeroed
]


def _gluon_vs_tl_case(layer, M, seed, monkeypatch, **changes):
    """The inputs of a Gluon-against-tl bits test: the Gluon switch at its default (on; off, every
    run would be the tl one), activations and round-robin routing (tokens share experts) drawn
    from ``seed``, and the table's config at M with ``changes``, fitted to K."""
    monkeypatch.delenv(GLUON_W13_ENV, raising=False)
    gen = torch.Generator().manual_seed(seed)
    x = activations(M, layer[0].dtype, gen)
    ids, tw = routing("round_robin", M, gen)
    return x, tw, ids, table_config(layer[0], M, **changes)


@pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="needs Triton's Gluon")
@pytest.mark.parametrize("M,split", GLUON_W13_CASES)
def test_gluon_w13_gives_the_tl_kernels_bits(layer, workspace, M, split, monkeypatch):
    """The Gluon W13 (kernels/w13_gluon.py: loads staged in shared memory) runs the tl W13's
    fragments and sums: the same bits at the same split, for rings shallower and deeper than
    the table's, on routing where tokens share experts."""
    weights, _ = layer
    x, tw, ids, base = _gluon_vs_tl_case(layer, M, 7 + M, monkeypatch, w13_block_k=split)
    outs = {}
    for stages in (0, 2, 3, 4):
        config = dataclasses.replace(base, w13_kernel="gluon" if stages else "tl", w13_ring_stages=max(stages, 1))
        out = torch.full_like(x, float("nan"))
        workspace.fill_(-1)
        launched = launch_grouped(x, tw, ids, weights, workspace, out, config)
        assert kernel_names(launched)[0] == ("_w13_gluon" if stages else "_w13_tl")
        outs[stages] = out
    assert not torch.isnan(outs[0]).any()
    for stages in (2, 3, 4):
        assert torch.equal(outs[stages].view(torch.int16), outs[0].view(torch.int16)), f"ring {stages}"


# (M, W2 warps, W13 ring stages (0: the tl W13), chunks copied ahead or None for the table's,
# activations as a hi + lo pair): why
GLUON_W2_CASES = [
    (8, 8, 3, None, False),  # M = 8's table config, after the Gluon W13
    (8, 8, 2, 1, False),  # the weight copies one chunk ahead of the mma (one copy group in flight)
    (8, 8, 2, 8, False),  # more chunks ahead than there are (5): the plan clamps, all copies before the wait
    (2, 4, 4, 3, False),  # 4-warp programs, 20 rows, three chunks ahead
    (5, 8, 0, 4, False),  # after the tl W13
    (8, 8, 2, None, True),  # the activations as a hi + lo pair: two mma per chunk
    (3, 4, 4, 2, True),  # the same with 4-warp programs, 30 rows
]


@pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="needs Triton's Gluon")
@pytest.mark.parametrize("M,warps,stages,ahead,act_split", GLUON_W2_CASES)
@pytest.mark.parametrize("pdl", [True, False])  # without PDL the launches are plain (pre-Hopper, the pdl switch)
def test_gluon_w2_gives_the_tl_kernels_bits(layer, workspace, M, warps, stages, ahead, act_split, pdl, monkeypatch):
    """The Gluon W2 (kernels/w2_gluon.py: weights staged in shared memory) runs the tl W2's
    fragments, sums and combine: the same bits as the tl W2 built with RN_SCALE (the plan's
    ``w2_rn_scale``), on routing where tokens share experts."""
    weights, cpu_weights = layer
    ahead = {} if ahead is None else {"w2_copy_ahead": ahead}
    x, tw, ids, base = _gluon_vs_tl_case(layer, M, 17 + M, monkeypatch, w2_warps=warps, w2_max_registers=0,
                                         w13_kernel="gluon" if stages else "tl", w13_ring_stages=max(stages, 1),
                                         w2_act_split=act_split, pdl=pdl, **ahead)
    outs = {}
    for kernel in ("tl", "gluon"):
        config = dataclasses.replace(base, w2_kernel=kernel)
        out = torch.full_like(x, float("nan"))
        workspace.fill_(-1)
        launched = launch_grouped(x, tw, ids, weights, workspace, out, config, w2_rn_scale=kernel == "tl")
        assert kernel_names(launched)[1] == f"_w2_{kernel}"
        outs[kernel] = out
    assert not torch.isnan(outs["tl"]).any()
    assert torch.equal(outs["gluon"].view(torch.int16), outs["tl"].view(torch.int16))
    assert_close(f"grouped {weights.dtype} M={M} Gluon W2 ({warps} warps)", outs["gluon"], x, tw, ids, cpu_weights)


def test_rn_scale_changes_only_the_tl_w2s_rounding(layer, workspace):
    """w2_rn_scale (a lab switch of the plan) gives the tl W2 the Gluon W2's scale rounding: it
    moves an output by at most the rounding of its last bits (the float32 scale multiply rounded
    on its own instead of fused into the accumulate), and it is off by default."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(31)
    x = activations(4, weights.dtype, gen)
    ids, tw = routing("random", 4, gen)
    config = table_config(weights, 4, w2_kernel="tl")
    outs = []
    for rn_scale in (False, True):
        out = torch.full_like(x, float("nan"))
        launch_grouped(x, tw, ids, weights, workspace, out, config, w2_rn_scale=rn_scale)
        outs.append(out)
    assert not torch.isnan(outs[1]).any()
    assert error_stats(outs[1], outs[0].double()).max_ulp <= 2
    assert dict(grouped_plan_for(x, ids, weights, config).launch_for("w2").constexprs)["RN_SCALE"] is False


@pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="needs Triton's Gluon")
def test_gluon_switch_off_runs_the_tl_kernels(layer, workspace, monkeypatch):
    """MOE_GROUPED_DECODE_GLUON=0 (the rollback): the op launches neither Gluon kernel
    and still matches the reference, also when launched with the Gluon table's M = 8 config
    (a Gluon W13 ring and the Gluon W2), which the switch overrides."""
    monkeypatch.setenv(GLUON_W13_ENV, "0")
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(11)
    x = activations(8, weights.dtype, gen)
    ids, tw = routing("random", 8, gen)
    out = run_grouped(x, tw, ids, weights, workspace)
    assert_close(f"grouped {weights.dtype} M=8 tl W13 (switch off)", out, x, tw, ids, cpu_weights)
    assert [launch.name for launch in grouped_plan_for(x, ids, weights).launches] == ["w13_tl", "w2_tl"]
    monkeypatch.delenv(GLUON_W13_ENV)
    gluon_config = table_config(weights, 8)
    assert gluon_config.w2_kernel == "gluon" and gluon_config.w13_kernel == "gluon"
    monkeypatch.setenv(GLUON_W13_ENV, "0")
    out = torch.full_like(x, float("nan"))
    workspace.fill_(-1)
    launched = launch_grouped(x, tw, ids, weights, workspace, out, gluon_config)
    assert kernel_names(launched) == ["_w13_tl", "_w2_tl"]
    assert_close(f"grouped {weights.dtype} M=8 Gluon table config (switch off)", out, x, tw, ids, cpu_weights)


@pytest.mark.parametrize("stages", [
    0,  # the tl W13 (what runs without Gluon)
    # the Gluon W13 at M = 8's table ring depth
    pytest.param(3, marks=pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="needs Triton's Gluon")),
])
def test_timeline_stamps_are_causal_and_change_no_bits(layer, workspace, stages, monkeypatch):
    """benchmarks/timeline.py's stamps (kernels/timeline.py): the op gives the same bits with them,
    every program stamps every point, in order, and the SM it ran on; no W2 program gets past the
    PDL wait before the last W13 program has stamped its end. A wrongly sized timeline is refused."""
    from moe_grouped_decode.benchmarking.stamps import alloc_stamps
    from moe_grouped_decode.kernels.timeline import W2_STAMPS, W13_STAMPS

    monkeypatch.delenv(GLUON_W13_ENV, raising=False)
    weights, _ = layer
    M = 8
    gen = torch.Generator().manual_seed(23)
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    config = table_config(weights, M, w13_kernel="gluon" if stages else "tl", w13_ring_stages=max(stages, 1))
    plan = grouped_plan_for(x, ids, weights, config, timeline=True)
    assert plan.launches[0].name == ("w13_gluon" if stages else "w13_tl")
    stamps = alloc_stamps(plan, x.device)
    outs = []
    for options in ({}, {"timeline": True, "stamps": stamps}):
        out = torch.full_like(x, float("nan"))
        workspace.fill_(-1)
        launch_grouped(x, tw, ids, weights, workspace, out, config, **options)
        outs.append(out)
    torch.cuda.synchronize()
    assert not torch.isnan(outs[0]).any()
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    w13_sm, w2_sm = W13_STAMPS.index("sm"), W2_STAMPS.index("sm")
    w13, w2 = stamps["w13_stamps"][:, :w13_sm].cpu(), stamps["w2_stamps"][..., :w2_sm].cpu()
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    for sm in (stamps["w13_stamps"][:, w13_sm], stamps["w2_stamps"][..., w2_sm]):  # -1 where no program stamped
        assert ((sm >= 0) & (sm < sms)).all()
    # a grid this size (2,000 W13 programs, 400 W2) lands on more than one SM
    assert len(stamps["w13_stamps"][:, w13_sm].unique()) > 1 and len(stamps["w2_stamps"][..., w2_sm].unique()) > 1
    assert (w13 > 0).all() and (w13[:, 1] >= w13[:, 0]).all()
    assert w2.shape[0] == M * TOP_K  # one grid row per routed row
    assert (w2 > 0).all() and (w2.diff(dim=-1) >= 0).all()
    assert w2[..., 1].min() >= w13[:, 1].max(), "a W2 program passed the wait before W13 ended"
    with pytest.raises(ValueError, match="not sized"):
        launch_grouped(x, tw, ids, weights, workspace, outs[0], config, timeline=True,
                       stamps=dict(stamps, w13_stamps=stamps["w13_stamps"][1:]))
    with pytest.raises(ValueError, match="int64"):
        launch_grouped(x, tw, ids, weights, workspace, outs[0], config, timeline=True,
                       stamps=dict(stamps, w2_stamps=stamps["w2_stamps"].to(torch.int32)))
    with pytest.raises(ValueError, match="built without the timeline"):
        launch_grouped(x, tw, ids, weights, workspace, outs[0], config, stamps=stamps)


@pytest.mark.skipif(not gluon_helpers.AVAILABLE, reason="needs Triton's Gluon")
def test_largest_carveout_has_binaries_of_its_own_and_changes_no_bits(layer, workspace, monkeypatch):
    """M = 2's table entry asks both launches for the largest shared-memory carveout
    (kernels/carveout.py): its W13 and W2 binaries carry the preference (read back from the
    driver); the same config without it launches other binaries, which do not, so neither config
    runs under the other's preference whatever their order; and the bits are the same."""
    import ctypes

    monkeypatch.delenv(GLUON_W13_ENV, raising=False)
    libcuda = ctypes.CDLL("libcuda.so.1")

    def preference(kernel):
        value = ctypes.c_int()
        assert libcuda.cuFuncGetAttribute(ctypes.byref(value), 9, ctypes.c_void_p(kernel.function)) == 0
        return value.value

    weights, cpu_weights = layer
    M = 2
    gen = torch.Generator().manual_seed(29)
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    table = table_config(weights, M)
    assert table.max_shared_carveout
    functions, bits = {True: set(), False: set()}, {}
    for call, config in enumerate((table, dataclasses.replace(table, max_shared_carveout=False), table)):
        out = torch.full_like(x, float("nan"))
        workspace.fill_(-1)
        kernels = launch_grouped(x, tw, ids, weights, workspace, out, config)
        assert [preference(kernel) == 100 for kernel in kernels] == [config.max_shared_carveout] * 2
        functions[config.max_shared_carveout].update(kernel.function for kernel in kernels)
        bits[config.max_shared_carveout] = out.view(torch.int16).clone()
        assert_close(f"grouped {weights.dtype} M=2 largest carveout {config.max_shared_carveout} (call {call})", out,
                     x, tw, ids, cpu_weights)
    assert len(functions[True]) == len(functions[False]) == 2 and functions[True].isdisjoint(functions[False])
    assert torch.equal(bits[True], bits[False])


@pytest.mark.parametrize("bad", [-1, E, 2**30], ids=["minus1", "E", "huge"])
@pytest.mark.parametrize("gluon", ["1", "0"], ids=["gluon", "tl"])
@pytest.mark.parametrize("M", [1, 8, 64])
def test_grouped_ids_outside_the_experts_contribute_nothing(layer, workspace, monkeypatch, bad, gluon, M):
    """vLLM marks an expert not on this rank with -1 (expert parallelism): such a slot, or any id
    outside [0, E), adds nothing to its token, whatever its weight (NaN here), and reads nothing
    out of bounds (the context survives: the synchronize below would raise), on both kernel
    families, eager and replayed."""
    monkeypatch.setenv(GLUON_W13_ENV, gluon)
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(19 + M)
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    ids[::2, 3] = bad
    tw[::4, 3] = float("nan")
    out = run_grouped(x, tw, ids, weights, workspace)
    torch.cuda.synchronize()
    ref_tw = tw.clone()
    ref_tw[::2, 3] = 0.0
    assert_close(f"grouped {weights.dtype} M={M} ids {bad} gluon={gluon}", out, x, ref_tw, ids.clamp(0, E - 1),
                 cpu_weights)
    graph_out = torch.empty_like(out)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_op(x, tw, ids, *weights.op_args(), workspace)  # warm the allocator on this stream
        with torch.cuda.graph(graph, stream=stream):
            graph_out.copy_(grouped_op(x, tw, ids, *weights.op_args(), workspace))
    torch.cuda.current_stream().wait_stream(stream)
    ids[1::2, 0] = bad  # new routing, replayed: more slots outside
    tw[1::2, 0] = float("inf")
    ref_tw[1::2, 0] = 0.0
    graph.replay()
    torch.cuda.synchronize()
    assert_close(f"grouped replay {weights.dtype} M={M} ids {bad} gluon={gluon}", graph_out, x, ref_tw,
                 ids.clamp(0, E - 1), cpu_weights)


@pytest.mark.parametrize("M,combine", [
    (1, "fused"), (2, "fused"), (3, "fused"), (8, "fused"), (16, "fused"),  # the table's W2 kernels, tl and Gluon
    (8, "launch"),  # the per-row combine as a launch of its own
    (64, "over_groups"),
])
def test_grouped_overflow_gives_the_rounded_reference(layer, workspace, M, combine):
    """Inputs whose intermediates overflow (tests/overflow_cases.py): every combine's float64
    recompute gives the reference rounded (+-Inf or finite, never NaN): the per-row W2's fused
    combine at the table's configs (the tl W2 at 1, 3 and 16 tokens, the Gluon W2 at 2 and 8),
    the combine as a launch, and over the sort's groups; the other tokens keep their results."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(23 + M)
    ids, tw = routing("random", M, gen)
    x, tw = overflowing(activations(M, weights.dtype, gen), tw)
    changes = {"fused": {}, "launch": {"fused_combine": False, "w2_kernel": "tl"},  # Gluon's W2 always fuses it
               "over_groups": {"w13_over_groups": True}}[combine]
    config = table_config(weights, M, **changes)
    workspace.fill_(-1)
    out = torch.full_like(x, float("nan"))
    launch_grouped(x, tw, ids, weights, workspace, out, config)
    assert_overflow_handled(f"grouped {weights.dtype} M={M} {config}", out, x, tw, ids, cpu_weights,
                            BOUND[weights.dtype])


OVER_GROUPS_TOKENS = [16, 64, 512]  # 512: ~10 rows per expert, several groups per expert


def skewed_routing(M: int, gen: torch.Generator):
    """A few experts take most rows: each token's first 6 slots on 8 hot experts, the rest random."""
    ids, tw = routing("random", M, gen)
    hot = torch.randperm(E, generator=gen)[:8]
    ids = ids.cpu()
    for token in range(M):
        picks = hot[torch.randperm(8, generator=gen)[:6]]
        rest = [int(i) for i in ids[token] if int(i) not in set(picks.tolist())][: TOP_K - 6]
        ids[token] = torch.tensor(picks.tolist() + rest, dtype=torch.int32)
    return ids.cuda(), tw


@pytest.fixture(scope="module")
def large_workspace():
    return alloc_workspace(max(OVER_GROUPS_TOKENS), TOP_K, K, N, "cuda")


@pytest.mark.parametrize("changes", [{}, {"w13_block_k": 768}, {"group_blocks": 2}],
                         ids=["table", "uneven-split", "16-row-groups"])  # 768: the last split runs past K
@pytest.mark.parametrize("pattern", ["random", "single_hot", "skewed"])
@pytest.mark.parametrize("M", OVER_GROUPS_TOKENS)
def test_grouped_over_the_sorts_groups_matches_reference(layer, large_workspace, M, pattern, changes):
    """Both GEMMs over the on-device sort's groups (w13_over_groups): against float64, bit-identical
    on a rerun; and replayed from a CUDA graph with new routing and ids outside [0, E)."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(7 * M + len(pattern))
    x = activations(M, weights.dtype, gen)
    ids, tw = skewed_routing(M, gen) if pattern == "skewed" else routing(pattern, M, gen)
    config = table_config(weights, M, w13_over_groups=True, **changes)
    outs = []
    for _ in range(2):
        large_workspace.fill_(-1)
        out = torch.full_like(x, float("nan"))
        launched = launch_grouped(x, tw, ids, weights, large_workspace, out, config)
        outs.append(out)
    assert "ranks_kernel" in kernel_names(launched) and "w2_prefill_kernel" in kernel_names(launched)
    if gluon_helpers.AVAILABLE:  # the Gluon W13 over groups ran, not the tl one
        assert "_w13_gluon" in kernel_names(launched)
    assert torch.equal(outs[0], outs[1]), "a rerun changed the bits"
    assert_close(f"over groups {weights.dtype} M={M} {pattern} {changes}", outs[0], x, tw, ids, cpu_weights)
    if pattern != "random" or changes:
        return
    graph_out = torch.full_like(x, float("nan"))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        launch_grouped(x, tw, ids, weights, large_workspace, graph_out, config)  # warm the allocator here
        with torch.cuda.graph(graph, stream=stream):
            launch_grouped(x, tw, ids, weights, large_workspace, graph_out, config)
    torch.cuda.current_stream().wait_stream(stream)
    for replay, bad in enumerate((None, -1, E, 2**30)):
        new_ids, new_tw = skewed_routing(M, gen) if replay % 2 else routing("random", M, gen)
        ref_tw = new_tw.clone()
        if bad is not None:
            new_ids[::3, 2] = bad
            ref_tw[::3, 2] = 0.0
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        graph_out.fill_(float("nan"))
        large_workspace.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(f"over groups replay {weights.dtype} M={M} ids {bad}", graph_out, x, ref_tw,
                     ids.clamp(0, E - 1), cpu_weights)


@pytest.mark.parametrize("M", [4, 64, 1025])  # per row, over the sort's groups, the prefill route
def test_ids_debug_mode_raises_on_ids_outside_the_experts(layer, large_workspace, monkeypatch, M):
    """MOE_GROUPED_DECODE_CHECK_IDS=1: an eager call with an id outside [0, E) raises, naming the
    op; good ids do not; a CUDA graph's replays set the flag for the next check to raise."""
    from moe_grouped_decode.ops import raise_on_flagged_ids

    monkeypatch.setenv("MOE_GROUPED_DECODE_CHECK_IDS", "1")
    weights, _ = layer
    gen = torch.Generator().manual_seed(5 + M)
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    if M > 512:
        def call(i):
            return dense_op(x, tw, i, *weights.op_args())
    else:
        def call(i):
            return grouped_op(x, tw, i, *weights.op_args(), large_workspace)
    raise_on_flagged_ids("cuda")  # "cuda" names the flag of the current device ("cuda:0")
    call(ids)  # good ids: no error
    bad = ids.clone()
    bad[M // 2, 1] = -1
    with pytest.raises(ValueError, match="awq_moe_(grouped_decode|dense): .*routed id outside"):
        call(bad)
    call(ids)  # the error cleared the flag
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call(ids)
        with torch.cuda.graph(graph, stream=stream):
            call(ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    raise_on_flagged_ids()  # good ids replayed: clear
    ids.copy_(bad)
    graph.replay()
    with pytest.raises(ValueError, match="routed id outside"):
        raise_on_flagged_ids("cuda")


@pytest.mark.parametrize("M", [4, 64, 600])  # the grouped op per row, over groups; the prefill route
@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_expert_parallel_shards_sum_to_the_full_layer(M, placement):
    """Expert parallelism on one GPU, the ranks in turn: qwen3.8 at EP 4 holds 128 of 512 experts
    per rank at the full intermediate size (N = 640); each rank maps the router's global ids
    through its expert map (-1 for another rank's expert, as the vLLM method does) and the ranks'
    outputs summed (vLLM's all-reduce) match the whole layer's float64 reference."""
    E_GLOBAL, EP, N_EP = E, 4, 4 * N
    weights = synthetic_moe_weights(E_GLOBAL, K, N_EP, G, dtype=torch.float16, seed=23, device="cuda")
    gen = torch.Generator().manual_seed(29 + M)
    x = activations(M, weights.dtype, gen)
    ids, tw = routing("random", M, gen)
    experts = torch.arange(E_GLOBAL)
    total = torch.zeros(M, K, dtype=torch.float32, device="cuda")
    for rank in range(EP):
        mine = experts[rank::EP] if placement == "round_robin" else experts[rank * E_GLOBAL // EP:(rank + 1) * E_GLOBAL // EP]
        expert_map = torch.full((E_GLOBAL + 1,), -1, dtype=torch.int32)  # + the -1 an unknown id reads
        expert_map[mine] = torch.arange(len(mine), dtype=torch.int32)
        local_ids = expert_map.cuda()[ids.long().clamp(-1, E_GLOBAL)].to(torch.int32)
        shard = dataclasses.replace(weights, **{name: getattr(weights, name)[mine.cuda()] for name in (
            "w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")})
        if M > 512:
            out = dense_op(x, tw, local_ids, *shard.op_args())
        else:
            workspace = alloc_workspace(M, TOP_K, K, N_EP, "cuda")
            out = grouped_op(x, tw, local_ids, *shard.op_args(), workspace)
        total += out.float()
    assert_close(f"EP {EP} {placement} M={M}", total.to(x.dtype), x, tw, ids, weights.to("cpu"))


def test_hidden_states_of_any_layout_give_the_contiguous_inputs_bits(layer, workspace):
    """Both ops on hidden states laid out as vLLM may hand them (one element off a 16-byte
    boundary, a transposed view, one row of a wider buffer): the bits of the same values in a
    fresh contiguous tensor, and a row-major output."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(23)
    ops = torch.ops.moe_grouped_decode
    for M in (1, 8, 300):
        x = torch.randn(M, K, generator=gen).to(weights.w13_scales.dtype).cuda()
        ids = torch.rand(M, E, generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32).cuda()
        tw = torch.rand(M, TOP_K, generator=gen).cuda()
        tw = tw / tw.sum(1, keepdim=True)
        flat = torch.empty(M * K + 8, dtype=x.dtype, device="cuda")
        off = flat[1:M * K + 1].view(M, K)
        off.copy_(x)
        transposed = x.t().contiguous().t()
        wide = torch.zeros(M, K + 32, dtype=x.dtype, device="cuda")[:, 16:K + 16]
        wide.copy_(x)
        layouts = {"misaligned": off, "transposed": transposed}
        if M == 1:
            layouts["one row of a wider buffer"] = wide
        runs = [("dense", lambda h: ops.awq_moe_dense(h, tw, ids, *weights.op_args()))]
        if M <= 8:
            runs.append(("grouped", lambda h: ops.awq_moe_grouped_decode(h, tw, ids, *weights.op_args(), workspace)))
        for op_name, run in runs:
            want = run(x)
            for name, h in layouts.items():
                got = run(h)
                assert got.is_contiguous(), (op_name, name, M)
                assert torch.equal(got, want), f"{op_name} M={M}, {name} hidden states: bits differ"
