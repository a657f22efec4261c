"""The prefill route (``awq_moe_dense`` on CUDA: the on-device sort, W13 + SiLU, W2, combine)
against the float64 per-expert reference, at token counts from one token to prefill sizes.

Runs on a CUDA GPU only (skipped elsewhere). The qwen3.8-tp4 contract's shapes; bounds as
tests/test_cuda_ops.py's (fp16 2e-3 of max|ref|, bf16 8x that for its own output rounding).
Routing patterns: random distinct experts per token (a router's), single-hot (every token on
the same k experts: groups of many rows per expert) and skewed (half of each token's slots on
8 hot experts: a few experts take most rows, as under a load-imbalanced router).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.kernels.config import PrefillConfig, prefill_config
from moe_grouped_decode.ops import error_stats, launch_prefill, prefill_plan_for, reference_moe
from overflow_cases import assert_overflow_handled, overflowing

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = QWEN38_TP4.shape
BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # as tests/test_cuda_ops.py's
prefill_op = torch.ops.moe_grouped_decode.awq_moe_dense


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def layer(request):
    weights = synthetic_moe_weights(E, K, N, G, dtype=request.param, seed=13, device="cuda")
    return weights, weights.to("cpu")


def routing(pattern: str, M: int, gen: torch.Generator):
    """topk_ids [M, k] int32 and float32 softmax-like topk_weights, on the GPU."""
    if pattern == "random":
        ids = torch.rand(M, E, generator=gen).topk(TOP_K, dim=1).indices
    elif pattern == "single_hot":
        ids = torch.randperm(E, generator=gen)[:TOP_K].repeat(M, 1)
    elif pattern == "skewed":  # slots 0..4 from 8 hot experts, the rest from the other 504, all distinct
        hot = torch.randperm(E, generator=gen)[:8]
        cold = torch.tensor([e for e in range(E) if e not in set(hot.tolist())])
        ids = torch.cat([hot[torch.rand(M, 8, generator=gen).argsort(1)[:, :5]],
                         cold[torch.rand(M, cold.numel(), generator=gen).argsort(1)[:, :5]]], dim=1)
    else:
        raise ValueError(pattern)
    weights = torch.rand(M, TOP_K, generator=gen)
    return ids.to(torch.int32).cuda(), (weights / weights.sum(1, keepdim=True)).cuda()


def check(name, out, x, tw, ids, cpu_weights):
    stats = error_stats(out, reference_moe(x.cpu(), tw.cpu(), ids.cpu(), cpu_weights))
    assert not stats.nan, f"{name}: NaN in output"
    assert stats.scaled_max_abs <= BOUND[out.dtype], f"{name}: {stats}"


CASES = [(M, pattern) for M in (1, 2, 8, 16, 33, 64, 256) for pattern in ("random", "single_hot", "skewed")]
CASES += [(1000, "random"), (1000, "skewed"), (4096, "random")]


@pytest.mark.parametrize("M,pattern", CASES)
def test_prefill_matches_reference(layer, M, pattern):
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(31 * M + len(pattern))
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing(pattern, M, gen)
    torch.full((M * K,), float("nan"), dtype=weights.dtype, device="cuda")  # the freed block the output may reuse
    out = prefill_op(x, tw, ids, *weights.op_args())
    check(f"prefill {weights.dtype} M={M} {pattern}", out, x, tw, ids, cpu_weights)


@pytest.mark.parametrize("config", [
    PrefillConfig(token_blocks=2),  # 16-row groups
    PrefillConfig(token_blocks=4, w13_warps=8, w2_warps=8),  # 32-row groups, 8-warp programs
    PrefillConfig(w13_warps=1, w2_warps=1),  # one warp over all of K
    PrefillConfig(kernel="dot"),  # tl.dot over 16-row groups
    PrefillConfig(kernel="dot", block_rows=32, w13_block_n=64, w2_block_n=64, w13_stages=4),  # masked W13 tile
    PrefillConfig(kernel="dot", block_rows=64, w13_block_k=64, w13_warps=8, w2_warps=8, w2_block_n=256),
    PrefillConfig(kernel="dot", block_rows=128, w13_block_k=128, w13_warps=8, w2_warps=4, w2_stages=2),
    PrefillConfig(kernel="wgmma", block_rows=64, w13_stages=4, w2_stages=4),  # the wgmma kernels (Hopper)
    PrefillConfig(kernel="wgmma", block_rows=128, w13_stages=3, w2_stages=2),
    PrefillConfig(kernel="wgmma", block_rows=16, w13_stages=3, w2_stages=3),  # copies wider than the group
    PrefillConfig(kernel="wgmma", block_rows=32, w13_block_k=64, w13_stages=3, w2_stages=4),  # 64-row steps
    PrefillConfig(kernel="wgmma", block_rows=8, w13_block_k=64, w13_stages=3, w2_stages=4, w13_scales_ahead=True),
    PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=64, w13_stages=3, w2_stages=4, w13_scales_ahead=True),
    PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=32, w13_stages=2, w2_stages=2, w13_scales_ahead=True),
    PrefillConfig(kernel="wgmma", block_rows=8, w13_block_k=64, w13_stages=3, w2_stages=4, w13_scales_ahead=True,
                  w13_tiles="narrow"),
    PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=32, w13_stages=2, w2_stages=2, w13_tiles="narrow"),
    PrefillConfig(kernel="wgmma", block_rows=32, w13_block_k=64, w13_stages=3, w2_stages=4, w13_tiles="narrow"),
    PrefillConfig(kernel="wgmma", block_rows=8, w13_block_k=128, w13_stages=3, w2_stages=4, w13_scales_ahead=True,
                  w13_tiles="narrow"),
    PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=128, w13_stages=2, w2_stages=4, w13_tiles="wide"),
    # a W2 ring of as many stages as a tile has pieces (N / 32 = 5): one allocation per piece
    PrefillConfig(kernel="wgmma", block_rows=8, w13_block_k=128, w13_stages=2, w2_stages=5, w13_scales_ahead=True,
                  w13_tiles="narrow"),
    PrefillConfig(kernel="wgmma", block_rows=64, w13_stages=4, w2_stages=5),
], ids=["tb2", "tb4-8warps", "1warp", "dot16", "dot32-n64", "dot64-8warps", "dot128", "wgmma64", "wgmma128",
        "wgmma16", "wgmma32-k64", "wgmma8-ahead", "wgmma16-k64-ahead", "wgmma16-k32-ahead", "wgmma8-narrow",
        "wgmma16-k32-narrow", "wgmma32-narrow", "wgmma8-k128-narrow", "wgmma16-k128-wide", "wgmma8-w2-piece-rings",
        "wgmma64-w2-piece-rings"])
def test_prefill_configs_match_reference(layer, config):
    """Every launch shape the route table may pick, on routing with multi-group experts."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(7)
    for M, pattern in ((40, "single_hot"), (300, "skewed")):
        x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
        ids, tw = routing(pattern, M, gen)
        out = torch.full_like(x, float("nan"))
        launch_prefill(x, tw, ids, weights, out, config)
        check(f"prefill {config} {weights.dtype} M={M} {pattern}", out, x, tw, ids, cpu_weights)


def test_wgmma_group_rows_and_scales_ahead_keep_the_bits(layer):
    """A row's output from the wgmma kernels does not depend on how many rows share its group (8,
    16 or 32: each is its own column of wgmma's N, reduced in the same order), on when W13's
    scales are requested, on how W13's programs split a group's columns, nor on how many 32-row
    pieces share a step (each column's sum is the same wgmma chain): bit-identical outputs, on
    routing whose experts span several groups."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(11)
    M = 300
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing("skewed", M, gen)
    outs = []
    for rows, ahead, tiles in ((16, False, "wide"), (16, True, "wide"), (8, True, "wide"), (8, False, "wide"),
                               (32, False, "wide"), (16, True, "narrow"), (8, False, "narrow"), (32, False, "narrow"),
                               (8, True, "narrow-k128"), (16, False, "wide-k128")):
        config = PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=128 if tiles.endswith("k128") else 64,
                               w13_stages=3, w2_stages=4, w13_scales_ahead=ahead, w13_tiles=tiles.split("-")[0])
        out = torch.full_like(x, float("nan"))
        launch_prefill(x, tw, ids, weights, out, config)
        outs.append((rows, ahead, tiles, out))
    for rows, ahead, tiles, out in outs[1:]:
        assert torch.equal(out, outs[0][3]), (f"{rows}-row groups, scales ahead {ahead}, {tiles} W13 programs: "
                                              "bits differ from 16-row wide")


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the wgmma kernels run on a Hopper")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_wgmma_w2_tiles_and_unrolled_pieces_keep_the_bits(dtype):
    """W2's pieces unrolled or looped, over one ring or a ring stage a piece, and one, two or four
    128-column tiles a program, reduce each output in the same order: bit-identical outputs,
    within the float64 reference's bound, at N = 384 (12 pieces a tile) and K = 1152 (9 tiles:
    the last program of two or four tiles runs past K)."""
    E2, k2, K2, N2, G2 = 16, 4, 1152, 384, 128
    weights = synthetic_moe_weights(E2, K2, N2, G2, dtype=dtype, seed=17, device="cuda")
    gen = torch.Generator().manual_seed(19)
    M = 96
    x = torch.randn(M, K2, generator=gen).to(dtype).cuda()
    ids = torch.rand(M, E2, generator=gen).topk(k2, dim=1).indices.to(torch.int32).cuda()
    tw = torch.rand(M, k2, generator=gen)
    tw = (tw / tw.sum(1, keepdim=True)).cuda()
    outs = []
    for tiles, unrolled, stages in ((4, 8, 4), (4, 16, 12), (2, 8, 4), (1, 8, 4), (2, 16, 12), (1, 16, 12),
                                   (1, 16, 4), (2, 16, 4)):
        config = PrefillConfig(kernel="wgmma", block_rows=16, w13_block_k=64, w13_stages=3, w2_stages=stages,
                               w2_tiles_per_program=tiles, w2_unrolled_pieces=unrolled)
        out = torch.full_like(x, float("nan"))
        launch_prefill(x, tw, ids, weights, out, config)
        outs.append(((tiles, unrolled), out))
    stats = error_stats(outs[0][1], reference_moe(x.cpu(), tw.cpu(), ids.cpu(), weights.to("cpu")))
    assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], stats
    for (tiles, unrolled), out in outs[1:]:
        assert torch.equal(out, outs[0][1]), f"{tiles} tiles a program, {unrolled} pieces unrolled: bits differ"


def test_prefill_sort_groups_every_row_once(layer):
    """The on-device sort's groups hold every routed row exactly once, each in a group of its own
    expert of at most 8 * token_blocks rows, in expert order."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(8)
    M, config = 700, PrefillConfig(token_blocks=2)
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing("skewed", M, gen)
    plan = prefill_plan_for(x, ids, weights, config)
    scratch = torch.full((plan.scratch_numel,), -7, dtype=torch.int32, device="cuda")
    launch_prefill(x, tw, ids, weights, torch.empty_like(x), config, scratch=scratch)
    views = {name: view.cpu() for name, view in plan.scratch_views(scratch).items() if name not in ("act16", "row_out16")}
    flat = ids.flatten().cpu()
    live = int(views["num_groups"][0])
    experts = views["group_expert"][:live]
    assert (experts.diff() >= 0).all()
    placed = []
    for g in range(live):
        start, count = int(views["group_start"][g]), int(views["group_count"][g])
        assert 1 <= count <= config.group_rows
        rows = views["sorted_rows"][start: start + count]
        assert (flat[rows.long()] == experts[g]).all()
        placed += rows.tolist()
    assert sorted(placed) == list(range(M * TOP_K))


@pytest.mark.parametrize("bad", [-1, E, 2**30], ids=["minus1", "E", "huge"])
def test_ids_outside_the_experts_contribute_nothing(layer, bad):
    """vLLM marks an expert not on this rank with -1 (expert parallelism): such a slot, or any id
    outside [0, E), adds nothing to its token and reads nothing out of bounds."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(9)
    M = 24
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing("random", M, gen)
    ids[::3, 2] = bad
    out = prefill_op(x, tw, ids, *weights.op_args())
    torch.cuda.synchronize()
    ref_tw = tw.clone()
    ref_tw[::3, 2] = 0.0
    check(f"prefill {weights.dtype} ids {bad}", out, x, ref_tw, ids.clamp(0, E - 1), cpu_weights)


@pytest.mark.parametrize("M", [1, 40, 256])
def test_overflow_gives_the_rounded_reference(layer, M):
    """Inputs whose intermediates overflow (tests/overflow_cases.py; for fp16 the route's 16-bit
    activations and row outputs): the combine's float64 recompute gives the reference rounded
    (+-Inf or finite, never NaN); the other tokens keep their results."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(41 + M)
    ids, tw = routing("random", M, gen)
    x, tw = overflowing(torch.randn(M, K, generator=gen).to(weights.dtype).cuda(), tw)
    torch.full((M * K,), float("nan"), dtype=weights.dtype, device="cuda")  # the freed block the output may reuse
    out = prefill_op(x, tw, ids, *weights.op_args())
    assert_overflow_handled(f"prefill {weights.dtype} M={M}", out, x, tw, ids, cpu_weights, BOUND[weights.dtype])


def test_bit_identical_reruns(layer):
    weights, _ = layer
    gen = torch.Generator().manual_seed(10)
    for M in (8, 333):
        x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
        ids, tw = routing("skewed", M, gen)
        first = prefill_op(x, tw, ids, *weights.op_args()).clone()
        for _ in range(3):
            assert torch.equal(prefill_op(x, tw, ids, *weights.op_args()).view(torch.int16), first.view(torch.int16))


@pytest.mark.parametrize("M", [40, 160, 256, 1000])
def test_early_launches_keep_the_bits(layer, M):
    """The table's config with its launches starting early (PDL: each waits for the one before
    only before it reads its output; W13 and W2 request their first weights before that) gives
    the bits of the same launches each started after the last finished: calls back to back on
    one scratch, fresh routing each, no synchronization between them (a launch that read a
    predecessor's output, or overwrote what it still read, before it finished would differ),
    one of them with no valid id (no groups: the call's output is zero)."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(31 + M)
    dtype_name = "bf16" if weights.dtype == torch.bfloat16 else "fp16"
    config = prefill_config(QWEN38_TP4.shape, torch.cuda.get_device_name(), dtype_name, M)
    calls = []
    for pattern in ("random", "skewed", "none", "single_hot", "random"):
        ids, tw = routing("random" if pattern == "none" else pattern, M, gen)
        if pattern == "none":  # no groups at all (every id -1, as expert parallelism's other ranks)
            ids.fill_(-1)
        calls.append((torch.randn(M, K, generator=gen).to(weights.dtype).cuda(), ids, tw))
    outs = {}
    for pdl in (True, False):
        run = dataclasses.replace(config, pdl=pdl)
        scratch = torch.empty(prefill_plan_for(calls[0][0], calls[0][1], weights, run).scratch_numel,
                              dtype=torch.int32, device="cuda")
        outs[pdl] = [torch.full_like(x, float("nan")) for x, _, _ in calls]
        for (x, ids, tw), out in zip(calls, outs[pdl]):
            launch_prefill(x, tw, ids, weights, out, run, scratch=scratch)
        torch.cuda.synchronize()
    for i, (early, waiting) in enumerate(zip(outs[True], outs[False])):
        assert torch.equal(early, waiting), f"call {i}: early launches changed the bits ({config})"
    x, ids, tw = calls[1]
    check(f"prefill early launches {weights.dtype} M={M}", outs[True][1], x, tw, ids, cpu_weights)
    assert not outs[True][2].any(), "a call whose ids are all -1 must give zeros"


# vLLM's default CUDA-graph capture sizes (1, 2, 4, then multiples of 8) up to 512
CAPTURE_SIZES = [1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512]


@pytest.mark.parametrize("M", CAPTURE_SIZES)
def test_prefill_cuda_graph_replay(layer, M):
    """Capture once at a capture size, then replay with new routing and activations each time."""
    weights, cpu_weights = layer
    gen = torch.Generator().manual_seed(2000 + M)
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing("random", M, gen)
    prefill_op(x, tw, ids, *weights.op_args())  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefill_op(x, tw, ids, *weights.op_args())
    for replay, pattern in enumerate(("random", "single_hot", "skewed")):
        new_ids, new_tw = routing(pattern, M, gen)
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        x.copy_(torch.randn(M, K, generator=gen).to(weights.dtype))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check(f"prefill graph {weights.dtype} M={M} replay{replay} {pattern}", out, x, tw, ids, cpu_weights)


@pytest.mark.parametrize("M", [16384, 32768])
def test_prefill_sort_at_engine_token_limits(M):
    """The sort's one-program stages at vLLM's larger max_num_batched_tokens (warmup compiles
    them there): every routed row placed once, in a group of its own expert, and the route's
    output finite (the float64 reference at this size would take minutes on the CPU)."""
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=14, device="cuda")
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(torch.float16).cuda()
    ids, tw = routing("skewed", M, gen)
    plan = prefill_plan_for(x, ids, weights)
    scratch = torch.full((plan.scratch_numel,), -7, dtype=torch.int32, device="cuda")
    out = torch.full_like(x, float("nan"))
    launch_prefill(x, tw, ids, weights, out, scratch=scratch)
    views = plan.scratch_views(scratch)
    live = int(views["num_groups"][0])
    counts = views["group_count"][:live]
    assert int(counts.sum()) == M * TOP_K and int(counts.max()) <= plan.config.group_rows
    rows = views["sorted_rows"].long()
    assert torch.equal(rows.sort().values, torch.arange(M * TOP_K, device="cuda"))
    experts = torch.repeat_interleave(views["group_expert"][:live].long(), counts.long())
    assert torch.equal(ids.flatten().long()[rows], experts)
    assert torch.isfinite(out).all()


def test_batch_invariant_mode_gives_each_token_the_same_bits(layer, monkeypatch):
    """MOE_GROUPED_DECODE_BATCH_INVARIANT=1: a token's output bits do not depend on M or on the
    tokens beside it, across the prefill table's whole range (its mma and dot entries) and in
    any order. Without the mode the table changes kernels at 1025 tokens (and so the bits)."""
    weights, _ = layer
    gen = torch.Generator().manual_seed(41)
    M = 2048
    x = torch.randn(M, K, generator=gen).to(weights.dtype).cuda()
    ids, tw = routing("skewed", M, gen)
    monkeypatch.setenv("MOE_GROUPED_DECODE_BATCH_INVARIANT", "1")
    full = prefill_op(x, tw, ids, *weights.op_args()).view(torch.int16)
    for m in (1, 2, 8, 33, 300, 1025):
        part = prefill_op(x[:m], tw[:m], ids[:m], *weights.op_args()).view(torch.int16)
        assert torch.equal(part, full[:m]), f"M={m}: {int((part != full[:m]).sum())} elements differ from M={M}'s"
    perm = torch.randperm(M, generator=gen).cuda()
    shuffled = prefill_op(x[perm], tw[perm], ids[perm], *weights.op_args()).view(torch.int16)
    assert torch.equal(shuffled, full[perm])
