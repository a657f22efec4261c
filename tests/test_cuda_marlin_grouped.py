"""The grouped decode over vLLM's Marlin tensors (kernels/marlin_grouped.py) on the GPU: its inline
PTX (which the interpreter does not run) against the float64 reference, at full layer shapes.

Runs on a CUDA GPU only (skipped elsewhere). The Marlin tensors come from marlin_layout.awq_to_marlin
(bit-equal to vLLM's load step: tests/test_marlin_layout.py, and on the GPU
benchmarks/marlin_grouped_check.py against vLLM's own repack). Shapes: Qwen3-30B-A3B at TP1 (N = 768),
qwen3.8-tp4 (N = 160: padded to 192, G = 32), and an N == G layer (the channelwise scale order);
fp16 and bf16; CUDA-graph replay gives the eager call's bits. The same kernels over the tensors
vLLM's Humming backend holds (humming_layout), and that reference layout against humming's own
load step where humming-kernels is importable.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.kernels.marlin_grouped import MarlinGroupedConfig, launch_marlin_grouped
from moe_grouped_decode.marlin_layout import awq_to_marlin
from moe_grouped_decode.ops import error_stats, reference_moe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # as tests/test_cuda_ops.py's
SHAPES = {  # E, k, K, N, G
    "qwen3-30b-tp1": (16, 8, 2048, 768, 128),  # E cut: the kernels do not depend on it
    "qwen3.8-tp4": (32, 10, 2560, 160, 32),
    "n-equals-g": (16, 6, 1024, 128, 128),
}


@pytest.fixture(scope="module", params=[(name, dtype) for name in SHAPES for dtype in (torch.float16, torch.bfloat16)],
                ids=lambda p: f"{p[0]}-{str(p[1]).replace('torch.', '')}")
def layer(request):
    name, dtype = request.param
    E, k, K, N, G = SHAPES[name]
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=31)
    marlin = awq_to_marlin(awq)
    return awq, [t.cuda() for t in marlin.tensors()], marlin.scales_grouped, (E, k, K, N, G), dtype


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("config", [MarlinGroupedConfig(4, 2, 1), MarlinGroupedConfig(2, 4, 4),
                                    MarlinGroupedConfig(4, 2, 2, fused_combine=False),
                                    MarlinGroupedConfig(2, 4, 2, w2_row_warps=4),
                                    MarlinGroupedConfig(4, 2, 1, w2_row_warps=2),
                                    # the shipped co-serving tables' picks
                                    MarlinGroupedConfig(1, 8, 2), MarlinGroupedConfig(1, 4, 2),
                                    # W2 in N splits, fused and as its own launch
                                    MarlinGroupedConfig(1, 8, 2, w2_n_splits=2),
                                    MarlinGroupedConfig(1, 8, 2, fused_combine=False, w2_n_splits=4),
                                    MarlinGroupedConfig(1, 8, 4, w2_n_splits=4),  # four column warps a W2 program
                                    # the activations in a launch of their own: W13 -> act -> W2 (PDL)
                                    MarlinGroupedConfig(1, 8, 2, w2_n_splits=4, act_launch=True),
                                    MarlinGroupedConfig(1, 8, 2, fused_combine=False, w2_n_splits=2,
                                                        act_launch=True),
                                    MarlinGroupedConfig(4, 2, 1, act_launch=True)], ids=str)
def test_marlin_grouped_matches_reference(layer, M, config):
    awq, tensors, grouped, (E, k, K, N, G), dtype = layer
    gen = torch.Generator().manual_seed(M + 10 * config.w13_warps + 100 * config.w2_warps + 1000 * config.w2_row_warps
                                        + 10000 * config.w2_n_splits)
    x = torch.randn(M, K, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    tw = torch.rand(M, k, generator=gen)
    out = torch.full((M, K), float("nan"), dtype=dtype, device="cuda")
    use_pdl = torch.cuda.get_device_capability()[0] >= 9
    args = (x.cuda(), tw.cuda(), ids.cuda(), *tensors, N, G, grouped, config, use_pdl)
    if N % (32 * config.w2_row_warps * config.w2_n_splits):  # qwen3.8's N = 160 is 5 chunks: row warps
        # and N splits cannot share them
        with pytest.raises(ValueError, match="does not tile N"):
            launch_marlin_grouped(*args, out=out)
        assert torch.isnan(out).all()  # refused before any launch
        return
    matches_reference_and_replays(args, x, tw, ids, awq, dtype)


def matches_reference_and_replays(args, x, tw, ids, awq, dtype) -> None:
    """``launch_marlin_grouped(*args)`` within the float64 reference's bound, and replayed in a CUDA
    graph with the same bits (x, tw, ids: its CPU inputs; awq: the layer)."""
    M, K = x.shape
    out = torch.full((M, K), float("nan"), dtype=dtype, device="cuda")
    launch_marlin_grouped(*args, out=out)
    stats = error_stats(out.cpu(), reference_moe(x, tw, ids, awq))
    assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], (M, stats)
    replayed = torch.full_like(out, float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_marlin_grouped(*args, out=replayed)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out), M


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("config", [MarlinGroupedConfig(1, 8, 2, w2_n_splits=16), MarlinGroupedConfig(1, 8, 4, w2_n_splits=8),
                                    MarlinGroupedConfig(1, 8, 2, w2_n_splits=16, act_launch=True)], ids=str)
def test_many_n_splits_match_reference(config, dtype):
    """The configs of many N splits the large-N tables pick (Mixtral's N = 7168 in 16 splits of 14
    chunks), at an N of 32 chunks: 16 splits of two, 8 of four, eager and replayed in a graph."""
    E, k, K, N, G = 8, 2, 1024, 1024, 128
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=37)
    marlin = awq_to_marlin(awq)
    tensors = [t.cuda() for t in marlin.tensors()]
    use_pdl = torch.cuda.get_device_capability()[0] >= 9
    for M in (1, 2):
        gen = torch.Generator().manual_seed(M + 100 * config.w2_n_splits)
        x = torch.randn(M, K, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
        tw = torch.rand(M, k, generator=gen)
        args = (x.cuda(), tw.cuda(), ids.cuda(), *tensors, N, G, marlin.scales_grouped, config, use_pdl)
        matches_reference_and_replays(args, x, tw, ids, awq, dtype)


@pytest.mark.parametrize("M", [1, 8])
@pytest.mark.parametrize("config", [MarlinGroupedConfig(1, 8, 2, w2_n_splits=4, act_launch=True),
                                    MarlinGroupedConfig(4, 2, 1, fused_combine=False, act_launch=True)], ids=str)
def test_the_act_launch_gives_the_bits_of_w2s_own_activations(layer, M, config):
    """The activations in a launch of their own are W2's own sums in the same order: the same
    output bits, with the PDL chain W13 -> act -> W2 where the GPU has it."""
    import dataclasses

    awq, tensors, grouped, (E, k, K, N, G), dtype = layer
    try:
        config.splits(K, N)
    except ValueError:  # qwen3.8-tp4's N = 160 in 4 N splits: no bits to compare; the refusal itself is
        # test_marlin_grouped_matches_reference's
        pytest.skip(f"{config} does not tile K = {K}, N = {N}")
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32).cuda()
    tw = torch.rand(M, k, generator=gen).cuda()
    use_pdl = torch.cuda.get_device_capability()[0] >= 9
    outs = [launch_marlin_grouped(x, tw, ids, *tensors, N, G, grouped, c, use_pdl)
            for c in (config, dataclasses.replace(config, act_launch=False))]
    assert torch.equal(*outs)


@pytest.mark.parametrize("M", [1, 5])
def test_the_co_served_op_matches_reference_and_replays_in_a_graph(layer, M):
    """The op the co-served method calls (its config from the tables), eager and inside a CUDA
    graph whose capture allocates the op's scratch, as vLLM's graphs capture the layer."""
    from moe_grouped_decode.ops import awq_marlin_grouped_decode_cuda

    awq, tensors, grouped, (E, k, K, N, G), dtype = layer
    gen = torch.Generator().manual_seed(7 + M)
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32).cuda()
    tw = torch.rand(M, k, generator=gen).cuda()
    args = (x, tw, ids, *tensors, N, G, grouped)
    out = awq_marlin_grouped_decode_cuda(*args)
    stats = error_stats(out.cpu(), reference_moe(x.cpu(), tw.cpu(), ids.cpu(), awq))
    assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], stats
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = awq_marlin_grouped_decode_cuda(*args)
    replayed.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(replayed, out)


# Humming's tensors: (E, k, K, N, G) and configs that tile them. The padded layer has every end
# padding Humming makes (W13's rows K -> 1152 and columns 2N -> 512, W2's rows N -> 256 and
# columns K -> 1280) at G = 32
HUMMING_LAYERS = {
    "qwen3-30b-tp1": ((16, 8, 2048, 768, 128), [MarlinGroupedConfig(1, 8, 2), MarlinGroupedConfig(1, 8, 2, w2_n_splits=2),
                                                MarlinGroupedConfig(1, 8, 2, w2_n_splits=4, act_launch=True)]),
    "padded": ((8, 4, 1088, 192, 32), [MarlinGroupedConfig(1, 2, 1), MarlinGroupedConfig(1, 2, 1, w2_n_splits=2),
                                       MarlinGroupedConfig(1, 2, 1, w2_n_splits=2, act_launch=True)]),
    "qwen3.8-tp4": ((32, 10, 2560, 160, 32), [MarlinGroupedConfig(1, 8, 2)]),  # N = 160: refused
}


def humming_importable() -> bool:
    """humming's Python imports (it needs cuda-bindings and a CUDA driver besides the wheel)."""
    try:
        import humming.schema  # noqa: F401
        import humming.transform  # noqa: F401
    except Exception:
        return False
    return True


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(HUMMING_LAYERS))
@pytest.mark.parametrize("M", [1, 4])
def test_the_kernels_over_hummings_tensors_match_reference(name, M, dtype):
    """The same kernels over the tensors vLLM's Humming backend holds (humming_layout), where N is a
    multiple of 64 (up on whole tiles); qwen3.8-tp4's N = 160 is refused."""
    from moe_grouped_decode.humming_layout import awq_to_humming
    from moe_grouped_decode.kernels.marlin_grouped import launch_humming_grouped

    (E, k, K, N, G), configs = HUMMING_LAYERS[name]
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=41)
    hum = [t.cuda() for t in awq_to_humming(awq).tensors()]
    for config in configs:
        gen = torch.Generator().manual_seed(M + 100 * config.w2_n_splits)
        x = torch.randn(M, K, generator=gen).to(dtype)
        ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
        tw = torch.rand(M, k, generator=gen)
        out = torch.full((M, K), float("nan"), dtype=dtype, device="cuda")
        args = (x.cuda(), tw.cuda(), ids.cuda(), *hum, N, G, config, torch.cuda.get_device_capability()[0] >= 9)
        if N % 64:
            with pytest.raises(ValueError, match="multiple of 64"):
                launch_humming_grouped(*args, out=out)
            continue
        launch_humming_grouped(*args, out=out)
        stats = error_stats(out.cpu(), reference_moe(x, tw, ids, awq))
        assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], (config, stats)


@pytest.mark.skipif(not humming_importable(),
                    reason="humming-kernels not importable (pip install humming-kernels, or the wheel in "
                           ".vllm_moe_src/humming_whl onto PYTHONPATH, with cuda-bindings)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(HUMMING_LAYERS))
def test_the_reference_layout_is_what_hummings_own_repack_makes(name, dtype):
    """humming_layout.awq_to_humming against humming's own load step on the GPU, as vLLM 0.32-0.34
    call it for an AutoAWQ MoE layer (16-bit activations), bit for bit: unpadded, padded at every
    end, and qwen3.8-tp4's N = 160; and the configs it makes are what the co-served method accepts
    (``humming_layout.loaded_layer_refusal``: nothing refuses where N tiles by 64)."""
    from types import SimpleNamespace

    from humming.schema import BaseWeightSchema, HummingInputSchema
    from humming.transform import prepare_and_transform_humming_tensors

    from moe_grouped_decode.humming_layout import awq_to_humming, loaded_layer_refusal

    (E, k, K, N, G), _ = HUMMING_LAYERS[name]
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=43)
    ours = awq_to_humming(awq)
    schema = BaseWeightSchema.from_config({"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True})
    layer = SimpleNamespace(humming_configs={})
    for sub, n, size_k, n_stacks in (("w13", 2 * N, K, [N, N]), ("w2", K, N, [K])):
        awq_tensors = {"qweight": getattr(awq, f"{sub}_qweight").cuda(), "scales": getattr(awq, f"{sub}_scales").cuda(),
                       "qzeros": getattr(awq, f"{sub}_qzeros").cuda()}
        converted_schema, converted = schema.convert_humming(tensors=awq_tensors, shape_n_stacks=n_stacks,
                                                             shape_k_stacks=[size_k], param_dtype=dtype, num_experts=E)
        layer.humming_configs[sub], made = prepare_and_transform_humming_tensors(
            tensors=dict(converted), shape_n=n, shape_k=size_k, pad_n_to_multiple=256, pad_k_to_multiple=128,
            input_schema=HummingInputSchema(), weight_schema=converted_schema, num_experts=E, torch_dtype=dtype,
            device=converted["weight"].device)
        for key in ("weight", "weight_scale", "zero_point"):
            assert torch.equal(made[key].cpu(), getattr(ours, f"{sub}_{key}")), (sub, key)
            setattr(layer, f"{sub}_{key}", made[key])
    if N % 64 == 0:
        assert loaded_layer_refusal(layer, E, K, N, G, dtype) is None
