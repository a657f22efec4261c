"""The custom ops on CPU: opcheck, numerics against the reference, compaction, clear errors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_grouped_decode  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import AwqMoeWeights, synthetic_for_contract, synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.ops import alloc_workspace, compact_rows, error_stats, reference_moe, reference_segments

OPS = torch.ops.moe_grouped_decode
SCALED_MAX_ABS_BOUND = 2e-3  # fp16 evidence bound: max|out - ref| <= 2e-3 * max|ref|

# a small layer keeps opcheck fast; sizes still exercise several groups and packed words
E, K, N, G = 8, 64, 32, 32


def small_weights(dtype=torch.float16, seed=0):
    return synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=seed)


def routing(m, k, num_experts, pattern, seed, weight_dtype=torch.float32, id_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    if pattern == "random":
        ids = torch.stack([torch.randperm(num_experts, generator=gen)[:k] for _ in range(m)])
    elif pattern == "round_robin":
        ids = (torch.arange(m * k) % num_experts).view(m, k)
    elif pattern == "single_hot":  # every token on the same k experts: multi-row segments
        ids = torch.randperm(num_experts, generator=gen)[:k].expand(m, k).clone()
    else:
        raise ValueError(pattern)
    weights = torch.rand(m, k, generator=gen) + 0.1
    return (weights / weights.sum(-1, keepdim=True)).to(weight_dtype), ids.to(id_dtype)


def make_args(m, dtype=torch.float16, id_dtype=torch.int32, weight_dtype=torch.float32, pattern="random", k=3, seed=0):
    w = small_weights(dtype, seed)
    gen = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(m, K, generator=gen).to(dtype)
    topk_weights, topk_ids = routing(m, k, E, pattern, seed, weight_dtype, id_dtype)
    return (x, topk_weights, topk_ids, *w.op_args())


# --------------------------------------------------------------------------- opcheck

OPCHECK_CASES = [
    # (id, kwargs): each case exists for the reason in its id
    ("fp16-int32ids-f32weights-M1", dict(m=1)),  # C1: a single token
    ("bf16-int64ids-M2", dict(m=2, dtype=torch.bfloat16, id_dtype=torch.int64)),  # other activation + id dtypes
    ("fp16-actdtype-weights-M8", dict(m=8, weight_dtype=torch.float16)),  # topk weights in the activation dtype
    ("bf16-actdtype-weights-M8", dict(m=8, dtype=torch.bfloat16, weight_dtype=torch.bfloat16)),
    ("single-hot-repeated-experts-M5", dict(m=5, pattern="single_hot")),  # multi-row segments
    ("round-robin-M4", dict(m=4, pattern="round_robin", k=4)),
]


@pytest.mark.parametrize("name,kwargs", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_dense(name, kwargs):
    torch.library.opcheck(OPS.awq_moe_dense.default, make_args(**kwargs))


@pytest.mark.parametrize("name,kwargs", OPCHECK_CASES, ids=[c[0] for c in OPCHECK_CASES])
def test_opcheck_grouped(name, kwargs):
    args = make_args(**kwargs)
    workspace = alloc_workspace(8, args[2].shape[1], K, N, "cpu")
    # test_aot_dispatch_dynamic included: M is traced symbolically
    torch.library.opcheck(OPS.awq_moe_grouped_decode.default, (*args, workspace))


def test_fake_kernels_are_shape_functions():
    args = make_args(4, dtype=torch.bfloat16)
    workspace = alloc_workspace(4, 3, K, N, "cpu")
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in (*args, workspace)]
        dense = OPS.awq_moe_dense(*fake_args[:-1])
        grouped = OPS.awq_moe_grouped_decode(*fake_args)
    for out in (dense, grouped):
        assert out.shape == (4, K) and out.dtype == torch.bfloat16 and out.stride() == (K, 1)


# --------------------------------------------------------------------------- numerics


@pytest.mark.parametrize(
    "pattern,m,k",
    [
        ("random", 1, 3),  # C1
        ("random", 7, 3),  # a mid-window odd count
        ("round_robin", 6, 4),  # every expert used, mostly several times
        ("single_hot", 8, 3),  # all rows in k multi-row segments
    ],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_small_layer_matches_reference(pattern, m, k, dtype):
    x, tw, ids, *weights = make_args(m, dtype=dtype, pattern=pattern, k=k, seed=m)
    ref = reference_moe(x, tw, ids, AwqMoeWeights(*weights))
    workspace = alloc_workspace(8, k, K, N, "cpu")
    dense = OPS.awq_moe_dense(x, tw, ids, *weights)
    grouped = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, workspace)
    # bf16 has 3 fewer mantissa bits than fp16: its rounding of the output is 8x coarser
    bound = SCALED_MAX_ABS_BOUND * (8 if dtype == torch.bfloat16 else 1)
    for out in (dense, grouped):
        stats = error_stats(out, ref)
        assert not stats.nan and stats.scaled_max_abs <= bound, stats
        assert stats.max_ulp <= 2, stats  # fp32 accumulation, one final rounding
    # same math and summation order on CPU: the routes agree bit for bit
    assert torch.equal(dense, grouped)


@pytest.fixture(scope="module")
def qwen_layer():
    return synthetic_for_contract(QWEN38_TP4, dtype=torch.float16, seed=0)


@pytest.mark.parametrize("m", range(1, 10))  # every count across both window edges (1|2, 8|9)
def test_qwen38_shapes_match_reference(qwen_layer, m):
    gen = torch.Generator().manual_seed(1000 + m)
    x = torch.randn(m, 2560, generator=gen).to(torch.float16)
    tw, ids = routing(m, 10, 512, "random", seed=m)
    ref = reference_moe(x, tw, ids, qwen_layer)
    workspace = alloc_workspace(9, 10, 2560, 160, "cpu")
    workspace.fill_(-1)  # poison: the op must write what it reads
    grouped = OPS.awq_moe_grouped_decode(x, tw, ids, *qwen_layer.op_args(), workspace)
    dense = OPS.awq_moe_dense(x, tw, ids, *qwen_layer.op_args())
    for out in (grouped, dense):
        stats = error_stats(out, ref)
        assert not stats.nan and stats.scaled_max_abs <= SCALED_MAX_ABS_BOUND, stats
    assert torch.equal(grouped, dense)


def test_repeat_runs_and_batch_position_are_bit_identical():
    x, tw, ids, *weights = make_args(6, pattern="random", seed=3)
    workspace = alloc_workspace(8, 3, K, N, "cpu")
    first = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, workspace)
    again = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, workspace)
    assert torch.equal(first, again)
    perm = torch.tensor([5, 2, 0, 4, 1, 3])
    shuffled = OPS.awq_moe_grouped_decode(x[perm], tw[perm], ids[perm], *weights, workspace)
    assert torch.equal(shuffled, first[perm])
    alone = OPS.awq_moe_grouped_decode(x[2:3], tw[2:3], ids[2:3], *weights, workspace)
    assert torch.equal(alone[0], first[2])


# --------------------------------------------------------------------------- compaction


@pytest.mark.parametrize(
    "pattern,m,k",
    [
        ("random", 5, 3),  # mostly single-row segments
        ("single_hot", 4, 3),  # k segments of m rows
        ("round_robin", 6, 4),  # 24 rows over 8 experts: 3-row segments
    ],
)
def test_reference_segments_invariants(pattern, m, k):
    _, ids = routing(m, k, E, pattern, seed=11)
    seg = reference_segments(ids)
    flat = ids.flatten().tolist()
    A = len(seg.active_experts)
    assert seg.active_experts == sorted(set(flat))  # one segment per distinct expert, ascending
    assert len(seg.segment_offsets) == A + 1 and seg.segment_offsets[0] == 0 and seg.segment_offsets[-1] == m * k
    assert sorted(seg.sorted_rows) == list(range(m * k))  # every routed row exactly once
    for a, expert in enumerate(seg.active_experts):
        rows = seg.sorted_rows[seg.segment_offsets[a] : seg.segment_offsets[a + 1]]
        assert rows and rows == sorted(rows)  # contiguous, non-empty, rows ascending
        assert all(flat[r] == expert for r in rows)
    if pattern != "random":
        assert max(b - a for a, b in zip(seg.segment_offsets, seg.segment_offsets[1:])) > 1


@pytest.mark.parametrize("pattern", ["random", "single_hot", "round_robin"])
def test_cpu_compaction_is_the_reference_walk(pattern):
    """The CPU op's compaction (a stable torch sort) gives the reference's plain Python walk."""
    _, ids = routing(6, 3, E, pattern, seed=4)
    assert compact_rows(ids) == reference_segments(ids)


# --------------------------------------------------------------------------- errors


def _replace(args, index, value):
    args = list(args)
    args[index] = value
    return args


BAD_INPUTS = [
    # (case, index of the argument to replace, function producing the bad value, expected message)
    ("activation-float32", 0, lambda a: a[0].float(), "hidden_states must be float16 or bfloat16"),
    ("hidden-3d", 0, lambda a: a[0].unsqueeze(0), "hidden_states must be 2-D"),
    ("ids-float", 2, lambda a: a[2].float(), "topk_ids must be int32 or int64"),
    ("ids-wrong-M", 2, lambda a: a[2][:-1], "topk_ids must be"),
    ("weights-shape", 1, lambda a: a[1][:, :-1], "topk_weights must be"),
    ("weights-dtype", 1, lambda a: a[1].double(), "topk_weights must be float32 or"),
    ("qweight-dtype", 3, lambda a: a[3].to(torch.int64), "w13_qweight must be int32"),
    ("scales-dtype", 4, lambda a: a[4].to(torch.bfloat16), "w13_scales must have the activation dtype"),
    ("w13-scales-shape", 4, lambda a: a[4][:, :1], "w13_scales must have shape"),
    ("w2-qzeros-shape", 8, lambda a: a[8][:, :, :-1], "w2_qzeros must have shape"),
    ("hidden-size-mismatch", 0, lambda a: a[0][:, :32], "w13_qweight must be"),
    ("group-not-dividing", 9, lambda a: 24, "group_size=24 must divide"),
    ("group-nonpositive", 9, lambda a: 0, "group_size must be a positive int"),
    ("ids-out-of-range-high", 2, lambda a: torch.full_like(a[2], E), "topk_ids must lie in \\[0, E=8\\)"),
    ("ids-negative", 2, lambda a: torch.full_like(a[2], -1), "topk_ids must lie in"),
    ("device-mismatch", 1, lambda a: a[1].to("meta"), "topk_weights is on meta"),
]


@pytest.mark.parametrize("case,index,bad,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_bad_inputs_raise_clear_errors(case, index, bad, match, op):
    args = make_args(4)
    args = _replace(args, index, bad(args))
    with pytest.raises(ValueError, match=match):
        if op == "dense":
            OPS.awq_moe_dense(*args)
        else:
            OPS.awq_moe_grouped_decode(*args, alloc_workspace(4, 3, K, N, "cpu"))


def test_tokens_beyond_workspace_raise():
    args = make_args(5)
    small = alloc_workspace(4, 3, K, N, "cpu")
    with pytest.raises(ValueError, match=r"workspace holds fewer than M\*k = 5\*3 = 15 routed rows"):
        OPS.awq_moe_grouped_decode(*args, small)


@pytest.mark.parametrize(
    "bad,match",
    [
        (lambda ws: ws.float(), "workspace must be a 1-D int32 tensor"),
        (lambda ws: ws.view(2, -1), "workspace must be a 1-D int32 tensor"),
    ],
)
def test_bad_workspace_raise(bad, match):
    args = make_args(2)
    with pytest.raises(ValueError, match=match):
        OPS.awq_moe_grouped_decode(*args, bad(alloc_workspace(4, 3, K, N, "cpu")))


def test_alloc_workspace_validates():
    with pytest.raises(ValueError, match="max_tokens must be a positive int"):
        alloc_workspace(0, 10, 2560, 160, "cpu")
    ws = alloc_workspace(8, 10, 2560, 160, "cpu")
    assert ws.dtype == torch.int32 and ws.dim() == 1
