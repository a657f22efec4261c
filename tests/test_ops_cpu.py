"""The custom ops on CPU: opcheck, numerics against the reference, compaction, clear errors."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import moe_grouped_decode  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import AwqMoeWeights, synthetic_for_contract, synthetic_moe_weights
from moe_grouped_decode.contract import QWEN38_TP4
from moe_grouped_decode.ops import (alloc_workspace, compact_rows, error_stats, reference_moe, reference_segments,
                                   workspace_views)

OPS = torch.ops.moe_grouped_decode
SCALED_MAX_ABS_BOUND = 2e-3  # fp16 evidence bound: max|out - ref| <= 2e-3 * max|ref|

# a small layer keeps opcheck fast; sizes still exercise several groups and packed words
E, K, N, G = 8, 64, 32, 32


def small_weights(dtype=torch.float16, seed=0):
    return synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=seed)


def routing(m, k, num_experts, pattern, seed, weight_dtype=torch.float32, id_dtype=torch.int32):
    gen = torch.Generator().manual_seed(seed)
    if pattern == "random":
        rows = [torch.randperm(num_experts, generator=gen)[:k] for _ in range(m)]
        ids = torch.stack(rows) if rows else torch.empty(0, k, dtype=torch.int64)
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


# --------------------------------------------------------------------------- ids outside [0, E)

OUTSIDE_IDS = [-1, E, 2**30]  # vLLM's mark for an expert on another rank; the first id past the layer; far past it


def with_ids_outside(m, bad, dtype=torch.float16, id_dtype=torch.int32, seed=0):
    """make_args with some slots routed to ``bad`` and weighted NaN: every other token loses slot 1,
    and (M > 1) the last token has no expert of this layer at all. Returns (args, outside mask)."""
    x, tw, ids, *weights = make_args(m, dtype=dtype, id_dtype=id_dtype, seed=seed)
    outside = torch.zeros(ids.shape, dtype=torch.bool)
    outside[::2, 1] = True
    if m > 1:
        outside[-1] = True
    return (x, tw.masked_fill(outside, float("nan")), ids.masked_fill(outside, bad), *weights), outside


def reference_without(args, outside):
    """The reference on the slots' own routing with the outside slots weighted 0 and their ids clamped
    into [0, E): what the CUDA tests compare with, independent of how the reference treats such ids."""
    x, tw, ids, *weights = args
    return reference_moe(x, tw.masked_fill(outside, 0.0), ids.clamp(0, E - 1), AwqMoeWeights(*weights))


@pytest.mark.parametrize("bad", OUTSIDE_IDS, ids=["minus1", "E", "huge"])
@pytest.mark.parametrize("m", [1, 4, 9])
@pytest.mark.parametrize("dtype,id_dtype", [(torch.float16, torch.int32), (torch.bfloat16, torch.int64)],
                         ids=["fp16-int32", "bf16-int64"])
def test_ids_outside_the_experts_contribute_nothing(bad, m, dtype, id_dtype):
    """Under expert parallelism vLLM gives an expert on another rank the id -1: such a slot, or any
    id outside [0, E), adds nothing to its token whatever its weight (NaN here), raises nothing,
    and leaves the other slots' bits as they were; on all three ops, the workspace poisoned."""
    args, outside = with_ids_outside(m, bad, dtype, id_dtype, seed=20 + m)
    x, tw, ids, *weights = args
    ref = reference_without(args, outside)
    assert torch.equal(reference_moe(x, tw, ids, AwqMoeWeights(*weights)), ref)  # the reference's own rule
    workspace = alloc_workspace(9, 3, K, N, "cpu")
    workspace.fill_(-1)  # poison: NaN as float32
    dense = OPS.awq_moe_dense(*args)
    grouped = OPS.awq_moe_grouped_decode(*args, workspace)
    rows = workspace_views(workspace, m * 3, K, N).row_outputs.view(m, 3, K)
    assert (rows[outside] == 0).all()  # as the CUDA kernels leave them
    routed = OPS.awq_moe_routed(*args, alloc_workspace(9, 3, K, N, "cpu"), 2, 8)
    bound = SCALED_MAX_ABS_BOUND * (8 if dtype == torch.bfloat16 else 1)
    for out in (dense, grouped):
        stats = error_stats(out, ref)
        assert not stats.nan and stats.scaled_max_abs <= bound and stats.max_ulp <= 2, stats
    if m > 1:
        assert (dense[-1] == 0).all()  # a token with no expert here: exactly nothing
    assert torch.equal(dense, grouped) and torch.equal(routed, dense)
    # the slots inside the layer give what they give without the others: the same bits as weight 0
    # on an in-range id (x + 0 is x)
    zeroed = (x, tw.masked_fill(outside, 0.0), ids.masked_fill(outside, 0), *weights)
    assert torch.equal(dense, OPS.awq_moe_dense(*zeroed))


@pytest.mark.parametrize("bad", [-1, 2**30], ids=["minus1", "huge"])
def test_a_rank_holding_none_of_the_routed_experts_gives_zeros(bad):
    args = make_args(5, seed=6)
    x, tw, ids, *weights = args
    ids = torch.full_like(ids, bad)
    for out in (OPS.awq_moe_dense(x, tw, ids, *weights),
                OPS.awq_moe_grouped_decode(x, tw, ids, *weights, alloc_workspace(5, 3, K, N, "cpu"))):
        assert out.dtype == x.dtype and torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_opcheck_ids_outside_the_experts(op):
    args, _ = with_ids_outside(4, -1, seed=8)
    if op == "dense":
        torch.library.opcheck(OPS.awq_moe_dense.default, args)
    else:
        torch.library.opcheck(OPS.awq_moe_grouped_decode.default, (*args, alloc_workspace(4, 3, K, N, "cpu")))


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
    ("ids-wrong-M", 2, lambda a: a[2][:-1], "topk_ids must have shape \\(4, 3\\)"),
    ("weights-shape", 1, lambda a: a[1][:, :-1], "topk_ids \\(4, 3\\) and topk_weights \\(4, 2\\) must have the same"),
    ("weights-dtype", 1, lambda a: a[1].double(), "topk_weights must be float32 or"),
    ("qweight-dtype", 3, lambda a: a[3].to(torch.int64), "w13_qweight must be int32"),
    ("scales-dtype", 4, lambda a: a[4].to(torch.bfloat16), "w13_scales must have the activation dtype"),
    ("w13-scales-shape", 4, lambda a: a[4][:, :1], "w13_scales must have shape"),
    ("w2-qzeros-shape", 8, lambda a: a[8][:, :, :-1], "w2_qzeros must have shape"),
    ("hidden-size-mismatch", 0, lambda a: a[0][:, :32], "hidden_states must have shape \\(4, 64\\)"),
    ("group-not-dividing", 9, lambda a: 24, "group_size=24 must divide"),
    ("group-nonpositive", 9, lambda a: 0, "group_size must be a positive int"),
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


def test_group_size_must_not_be_a_bool():
    """The dispatcher turns True into 1 before any of our code runs, so the op rejects the 1 it
    receives (the weights' scales hold another group size); the Python side, AwqMoeWeights and
    so synthetic_moe_weights, rejects the bool itself."""
    x, tw, ids, *weights = make_args(4)
    with pytest.raises(ValueError, match="awq_moe_dense: group_size=1 does not match the weights: .* i.e. G=32"):
        OPS.awq_moe_dense(x, tw, ids, *weights[:-1], True)
    with pytest.raises(ValueError, match="group_size must be an int .* got True"):
        AwqMoeWeights(*weights[:-1], True)
    with pytest.raises(ValueError, match="group_size must be an int .* got True"):
        synthetic_moe_weights(E, K, N, True)


# --------------------------------------------------------------------------- every shape error names its tensor

# E, K, N, G, M, k with every dim of a tensor unlike its others, so that each swap of two dims changes a shape
BE, BK, BN, BG, BM, Bk = 5, 96, 64, 32, 7, 3
ROUTING_NAMES = ("hidden_states", "topk_weights", "topk_ids")
WEIGHT_NAMES = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")
# the layout written out from the AWQ format (awq.py's docstring), not from the checker
RIGHT_SHAPES = {
    "hidden_states": (BM, BK), "topk_weights": (BM, Bk), "topk_ids": (BM, Bk),
    "w13_qweight": (BE, BK, 2 * BN // 8), "w13_scales": (BE, BK // BG, 2 * BN), "w13_qzeros": (BE, BK // BG, 2 * BN // 8),
    "w2_qweight": (BE, BN, BK // 8), "w2_scales": (BE, BN // BG, BK), "w2_qzeros": (BE, BN // BG, BK // 8),
}


def _wrong_shapes():
    """(case id, tensor name, wrong shape): every dim of each of the 9 tensors +-1, and every swap of two dims."""
    for name, shape in RIGHT_SHAPES.items():
        for d in range(len(shape)):
            for delta in (-1, 1):
                yield f"{name}-dim{d}{delta:+d}", name, shape[:d] + (shape[d] + delta,) + shape[d + 1:]
        for a in range(len(shape)):
            for b in range(a + 1, len(shape)):
                swapped = list(shape)
                swapped[a], swapped[b] = swapped[b], swapped[a]
                yield f"{name}-swap{a}{b}", name, tuple(swapped)


WRONG_SHAPES = list(_wrong_shapes())


@pytest.fixture(scope="module")
def blame_args():
    w = synthetic_moe_weights(BE, BK, BN, BG, seed=5)
    gen = torch.Generator().manual_seed(5)
    tw, ids = routing(BM, Bk, BE, "random", seed=5)
    args = dict(hidden_states=torch.randn(BM, BK, generator=gen).half(), topk_weights=tw, topk_ids=ids,
                **dict(zip(WEIGHT_NAMES, w.tensors())))
    assert {n: tuple(t.shape) for n, t in args.items()} == RIGHT_SHAPES
    return args


def _call(op, args, group_size=BG, workspace=None):
    ordered = [args[n] for n in (*ROUTING_NAMES, *WEIGHT_NAMES)]
    if op == "dense":
        return OPS.awq_moe_dense(*ordered, group_size)
    ws = alloc_workspace(BM, Bk, BK, BN, "cpu") if workspace is None else workspace
    return OPS.awq_moe_grouped_decode(*ordered, group_size, ws)


@pytest.mark.parametrize("case,name,shape", WRONG_SHAPES, ids=[c[0] for c in WRONG_SHAPES])
@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_shape_errors_name_the_wrong_tensor(blame_args, op, case, name, shape):
    args = dict(blame_args, **{name: torch.zeros(shape, dtype=blame_args[name].dtype)})
    with pytest.raises(ValueError) as info:
        _call(op, args)
    message = str(info.value)
    prefix = f"awq_moe_{'dense' if op == 'dense' else 'grouped_decode'}: "
    if name in ("topk_ids", "topk_weights") and shape[0] == BM and shape[1] != Bk:
        # k has only these two witnesses: no majority says which is wrong, so both are named
        assert message.startswith(f"{prefix}topk_ids {tuple(args['topk_ids'].shape)} and topk_weights "
                                  f"{tuple(args['topk_weights'].shape)} must have the same shape [M={BM}, k]"), message
    else:
        assert message.startswith(f"{prefix}{name} must have shape {RIGHT_SHAPES[name]}"), message
        assert message.endswith(f"got {shape}"), message


MORE_BAD_ARGUMENTS = [
    ("k-zero", dict(topk_ids=torch.zeros(BM, 0, dtype=torch.int32), topk_weights=torch.zeros(BM, 0)),
     r"topk_ids must route each token to k >= 1 experts: shape \[M=7, k >= 1\], got \(7, 0\)"),
    ("group-size-smaller", dict(group_size=16), r"group_size=16 does not match the weights: .* i\.e\. G=32"),
    ("group-size-larger", dict(group_size=64), r"group_size=64 must divide hidden size K=96 and intermediate size N=64"),
    ("group-size-bool", dict(group_size=True), r"group_size=1 does not match the weights"),
    ("hidden-K-off-by-4", dict(hidden_states=torch.zeros(BM, 100, dtype=torch.float16)),
     r"hidden_states must have shape \(7, 96\)"),
]


@pytest.mark.parametrize("case,change,match", MORE_BAD_ARGUMENTS, ids=[c[0] for c in MORE_BAD_ARGUMENTS])
@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_more_bad_arguments_are_named(blame_args, op, case, change, match):
    change = dict(change)
    group_size = change.pop("group_size", BG)
    with pytest.raises(ValueError, match=match):
        _call(op, dict(blame_args, **change), group_size)


def test_short_workspace_is_named(blame_args):
    from moe_grouped_decode.ops import workspace_numel

    need = workspace_numel(BM * Bk, BK, BN)
    _call("grouped", blame_args, workspace=torch.empty(need, dtype=torch.int32))  # exactly enough is fine
    with pytest.raises(ValueError, match=rf"workspace holds fewer .*\(needs {need} int32 elements .* has {need - 1}\)"):
        _call("grouped", blame_args, workspace=torch.empty(need - 1, dtype=torch.int32))


# --------------------------------------------------------------------------- workspace memory

INPUT_NAMES = (*ROUTING_NAMES, *WEIGHT_NAMES)


def _inside(workspace: torch.Tensor, t: torch.Tensor, byte_offset: int) -> torch.Tensor:
    """A copy of ``t`` living in ``workspace``'s memory from ``byte_offset`` on."""
    view = workspace.view(torch.uint8)[byte_offset : byte_offset + t.numel() * t.element_size()]
    return view.view(t.dtype).view(t.shape).copy_(t)


@pytest.mark.parametrize("name", INPUT_NAMES)
def test_workspace_overlapping_an_input_is_rejected(name):
    """Before the check, an input inside the workspace was overwritten while read (a wrong result)."""
    x, tw, ids, *weights = make_args(4)
    args = dict(zip(INPUT_NAMES, (x, tw, ids, *weights[:-1])))
    workspace = alloc_workspace(4, 3, K, N, "cpu")
    region = workspace.numel() * 4 // 2  # the middle: the scratch regions reach it
    args[name] = _inside(workspace, args[name], region - region % 64)
    with pytest.raises(ValueError, match=f"awq_moe_grouped_decode: workspace overlaps {name} in memory"):
        OPS.awq_moe_grouped_decode(*args.values(), G, workspace)


def test_workspace_and_inputs_carved_from_one_buffer_without_overlap_are_fine():
    """The check compares the bytes the tensors reach, not their storages: disjoint views of one
    buffer give the same result as separate allocations."""
    x, tw, ids, *weights = make_args(4)
    workspace = alloc_workspace(4, 3, K, N, "cpu")
    expected = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, workspace)
    buffer = torch.empty(workspace.numel() + x.numel() // 2, dtype=torch.int32)
    shared_ws = buffer[: workspace.numel()]
    shared_x = _inside(buffer, x, workspace.numel() * 4)  # starts at the workspace's last byte + 1
    assert shared_ws.untyped_storage().data_ptr() == shared_x.untyped_storage().data_ptr()
    assert torch.equal(OPS.awq_moe_grouped_decode(shared_x, tw, ids, *weights, shared_ws), expected)
    # one element further down and they share 2 bytes
    with pytest.raises(ValueError, match="workspace overlaps hidden_states"):
        OPS.awq_moe_grouped_decode(shared_x, tw, ids, *weights, buffer[: workspace.numel() + 1])


def test_meta_tensors_skip_the_memory_check():
    """Meta tensors have no memory (every data_ptr() is 0): the ops still run their fake kernels."""
    args = [a.to("meta") if isinstance(a, torch.Tensor) else a for a in make_args(4)]
    out = OPS.awq_moe_grouped_decode(*args, alloc_workspace(4, 3, K, N, "meta"))
    assert out.device.type == "meta" and out.shape == (4, K)


def test_workspace_check_covers_strided_views_and_out():
    """A transposed view reaches from its first to its last element; ``out`` (a caller's output
    buffer, e.g. for the CUDA launcher) is checked like any input."""
    from moe_grouped_decode.ops.awq_moe import check_workspace_disjoint

    buffer = torch.zeros(64, dtype=torch.int32)
    workspace = buffer[:32]
    strided = buffer[28:].view(6, 6).t()  # first element 28, reaches [28, 64)
    with pytest.raises(ValueError, match="workspace overlaps out"):
        check_workspace_disjoint("op", workspace, {"out": strided})
    check_workspace_disjoint("op", workspace, {"out": buffer[32:].view(8, 4).t()})  # [32, 64): disjoint


# --------------------------------------------------------------------------- M = 0, symbolic sizes


def _three_ops(x, tw, ids, w13q, w13s, w13z, w2q, w2s, w2z, group_size, workspace):
    weight_args = (w13q, w13s, w13z, w2q, w2s, w2z, group_size)
    return (
        OPS.awq_moe_dense(x, tw, ids, *weight_args),
        OPS.awq_moe_grouped_decode(x, tw, ids, *weight_args, workspace),
        OPS.awq_moe_routed(x, tw, ids, *weight_args, workspace, 2, 8),
    )


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_zero_tokens_give_an_empty_result(mode):
    x, tw, ids, *weights = make_args(4, dtype=torch.bfloat16)
    args = (x[:0], tw[:0], ids[:0], *weights, alloc_workspace(8, 3, K, N, "cpu"))  # the routed op's window: 2..8
    fn = _three_ops if mode == "eager" else torch.compile(_three_ops, fullgraph=True)
    for out in fn(*args):
        assert out.shape == (0, K) and out.dtype == torch.bfloat16


@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_opcheck_zero_tokens(op):
    args = make_args(0)
    if op == "dense":
        torch.library.opcheck(OPS.awq_moe_dense.default, args)
    else:
        torch.library.opcheck(OPS.awq_moe_grouped_decode.default, (*args, alloc_workspace(1, 3, K, N, "cpu")))


def test_dynamic_compile_with_group_size_an_argument():
    """torch.compile(dynamic=True) makes every size and the int group_size symbolic: the fake
    kernels must neither force them to ints nor reject them; the compiled graph serves other M."""
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(_three_ops, dynamic=True, fullgraph=True, backend=counter)
    workspace = alloc_workspace(8, 3, K, N, "cpu")
    for m in (4, 6):  # no other size is 4 or 6: duck sizing would tie M to it
        args = (*make_args(m, seed=m), workspace)
        for got, want in zip(compiled(*args), _three_ops(*args)):
            assert torch.equal(got, want)
    assert counter.frame_count == 1  # M stayed symbolic: no recompile for the second M
    inputs = {n.name: n.meta["example_value"] for n in counter.graphs[0].graph.find_nodes(op="placeholder")}
    assert isinstance(inputs["l_group_size_"], torch.SymInt)  # the case under test, not a specialized 32


# --------------------------------------------------------------------------- float32 overflow


@pytest.mark.parametrize("scale", [1e20, 1e30, 1e37])  # past float32 in silu(gate) * up; 1e37: in gate itself
@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_overflow_gives_the_references_inf(op, scale):
    """bf16 inputs whose float32 intermediates overflow: the result is the float64 reference's,
    rounded (+-Inf where it overflows bf16), never NaN."""
    x, tw, ids, *weights = make_args(4, dtype=torch.bfloat16, seed=7)
    x = (x.float() * scale).to(torch.bfloat16)
    assert torch.isfinite(x).all()
    ref = reference_moe(x, tw, ids, AwqMoeWeights(*weights)).to(torch.bfloat16)
    assert not ref.isnan().any() and ref.isinf().any()
    if op == "dense":
        out = OPS.awq_moe_dense(x, tw, ids, *weights)
    else:
        out = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, alloc_workspace(4, 3, K, N, "cpu"))
    assert not out.isnan().any()
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[ref.isinf()], ref[ref.isinf()])
    finite = ~ref.isinf()
    if finite.any():  # 1e20: some outputs stay within bf16
        assert error_stats(out[finite], ref[finite].double()).max_ulp <= 1


@pytest.mark.parametrize("op", ["dense", "grouped"])
def test_overflow_recompute_skips_ids_outside_the_experts(op):
    """The float64 recompute of a non-finite token walks its slots again: one outside the experts
    (NaN-weighted) must add nothing there either, not index past the weights."""
    args, outside = with_ids_outside(4, -1, dtype=torch.bfloat16, seed=7)
    x, tw, ids, *weights = args
    x = (x.float() * 1e30).to(torch.bfloat16)
    ref = reference_without((x, tw, ids, *weights), outside).to(torch.bfloat16)
    assert ref.isinf().any()
    if op == "dense":
        out = OPS.awq_moe_dense(x, tw, ids, *weights)
    else:
        out = OPS.awq_moe_grouped_decode(x, tw, ids, *weights, alloc_workspace(4, 3, K, N, "cpu"))
    assert not out.isnan().any()
    assert torch.equal(out.isinf(), ref.isinf()) and torch.equal(out[ref.isinf()], ref[ref.isinf()])
    assert (out[-1] == 0).all()


def test_rows_not_on_a_16_byte_boundary_are_copied_to_one():
    """The CUDA ops hand their kernels ``hidden_states`` starting on a 16-byte boundary: a view one
    element into a larger tensor is copied (same values), an aligned one or a strided one made
    contiguous is not copied again."""
    from moe_grouped_decode.ops.cuda import aligned_rows

    gen = torch.Generator().manual_seed(5)
    for dtype in (torch.float16, torch.bfloat16):
        flat = torch.randn(4 * 64 + 8, generator=gen).to(dtype)
        aligned = flat[:4 * 64].view(4, 64)
        assert aligned.data_ptr() % 16 == 0 and aligned_rows(aligned) is aligned
        off = flat[1:4 * 64 + 1].view(4, 64)
        assert off.data_ptr() % 16 != 0
        fixed = aligned_rows(off)
        assert fixed.data_ptr() % 16 == 0 and fixed.is_contiguous() and torch.equal(fixed, off)
        strided = flat[:4 * 64 * 1].view(64, 4).t()
        made = aligned_rows(strided)
        assert made.is_contiguous() and made.data_ptr() % 16 == 0 and torch.equal(made, strided)
        wide = flat[:2 * 100].view(2, 100)[:1, 8:72]  # one row: "contiguous", its row stride 100
        assert wide.is_contiguous() and wide.stride(0) == 100
        one = aligned_rows(wide)
        assert one.stride(0) == 64 and one.data_ptr() % 16 == 0 and torch.equal(one, wide)


def test_the_dense_ops_check_is_skipped_only_for_metadata_it_passed(monkeypatch):
    """The CUDA dense op remembers the argument metadata (shapes, dtypes, devices, group size) of
    the calls its check passed and skips the check for those alone: a call that differs in any
    of them is checked again, and a call that failed is never remembered."""
    from moe_grouped_decode.ops import cuda

    monkeypatch.setattr(cuda, "_PASSED_DENSE_CHECKS", set())
    checked = []
    real_check = cuda.check_moe_args
    monkeypatch.setattr(cuda, "check_moe_args", lambda *args: checked.append(args[0]) or real_check(*args))
    E, k, K, N, G = 8, 2, 64, 32, 32
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=3)
    gen = torch.Generator().manual_seed(4)

    def call(M=5, x_dtype=torch.float16, tw_dtype=torch.float32, ids_dtype=torch.int32, w=weights, top_k=k):
        x = torch.randn(M, K, generator=gen).to(x_dtype)
        ids = torch.randint(0, E, (M, top_k), generator=gen).to(ids_dtype)
        cuda._check_dense_args(x, torch.rand(M, top_k, generator=gen).to(tw_dtype), ids, w)

    call()
    call()  # the same metadata, fresh tensors: not checked again
    assert len(checked) == 1
    call(M=6)  # another M: checked (and passes)
    call(ids_dtype=torch.int64)
    assert len(checked) == 3
    bad_scales = AwqMoeWeights(*weights.tensors()[:4], weights.w2_scales.to(torch.bfloat16), weights.w2_qzeros, G)
    wrong_shape = AwqMoeWeights(weights.w13_qweight[:, :, :-1], *weights.tensors()[1:], G)
    failing = [dict(x_dtype=torch.float32), dict(tw_dtype=torch.float64), dict(w=bad_scales), dict(w=wrong_shape),
               dict(w=AwqMoeWeights(*weights.tensors(), 16)), dict(top_k=0)]
    for case in failing:
        for _ in range(2):  # a failed check is not remembered
            with pytest.raises(ValueError, match="awq_moe_dense"):
                call(**case)
    assert len(checked) == 3 + 2 * len(failing)
    call()
    assert len(checked) == 3 + 2 * len(failing)
