"""vLLM 0.32's HUMMING MoE backend (HummingIndexedExperts) for an AWQ layer of any shape.

The calls vLLM makes into the humming package (humming-kernels 0.1.17, JIT through NVRTC), in
its order and with its arguments (the shared Humming anchor's port, every shape-dependent
argument taken from ``shape``):
  * weights: convert_to_humming_moe_kernel_format(layer, quant_config={awq, 4 bits, G, zero
    point}): per sublayer AWQWeightSchema.convert_humming (gate|up as two N stacks),
    HummingInputSchema().convert_humming, check_and_fallback_input_schema (16-bit activations),
    prepare_and_transform_humming_tensors with pad_n_to_multiple=256, pad_k_to_multiple=128;
  * experts: init_humming_moe (indexed GEMM, no batch invariance, no f16 accumulation):
    get_heuristics_config of each sublayer = intervals of valid_shape_m -> kernel config;
  * forward (apply, no expert parallelism): the W13 interval holding M*k gives the moe block
    size, moe_align_block_size (again for W2 when its interval's block differs),
    humming_forward W13 (top_k = k), may_process_input with SiLU(gate)*up, humming_forward W2
    (top_k = 1), vLLM's Triton moe_fused_mul_sum (router weights, sum over top-k).
Humming's JIT runs at the first forward of each kernel config (outside the timings).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import types
from typing import Dict, Optional, Sequence

import torch

from .ops import VllmMoeOps, align_block_size
from .shape import (HUMMING_LOCKS_PER_SM, HUMMING_PAD_K_TO_MULTIPLE, HUMMING_PAD_N_TO_MULTIPLE, MoeShape,
                    humming_block_size, humming_buffer_shapes, humming_sublayers, humming_valid_shape_m,
                    humming_workspace_layout)

HUMMING_VERSION = "0.1.17"  # vLLM 0.32.0's pin
# quantization/utils/humming/activation.py: MoEActivation.SILU without a clamp limit
SILU_ACTIVATION = {"activation_type": "binary_split", "activation_impl": "(a / (1.f + expf(-a))) * b"}


def humming_unavailable() -> Optional[str]:
    """Why Humming cannot be timed here, or None."""
    if importlib.util.find_spec("humming") is None:
        return ("the humming package is not importable: pip install --target DIR the wheel that "
                "`python -m moe_grouped_decode vllm-moe-fetch` put in .vllm_moe_src/humming_whl, then put DIR "
                "on PYTHONPATH")
    from importlib import metadata
    try:
        version = metadata.version("humming-kernels")
    except metadata.PackageNotFoundError:
        import humming
        version = getattr(humming, "__version__", "?")
    if version != HUMMING_VERSION:
        return f"humming {version} is installed; vLLM 0.32.0 runs {HUMMING_VERSION}"
    return None


_SETUP: Dict[str, object] = {}


def setup_humming() -> Dict[str, object]:
    """Once per process: NVRTC's folder on LD_LIBRARY_PATH for Humming's nvrtc_compile children
    (NVRTC loads libnvrtc-builtins from the loader path; nothing in Humming changes), a JIT
    cache folder if none is set, and vllm/utils/humming.py _patch_humming() (one cached
    DeviceInfo per device, as vLLM applies on first use of humming)."""
    if _SETUP:
        return _SETUP
    os.environ.setdefault("HUMMING_CACHE_DIR", os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm032_humming_cache"))
    from humming.utils.nvrtc import get_nvrtc_library_path
    try:
        folder = os.path.dirname(os.path.realpath(get_nvrtc_library_path()))
        paths = os.environ.get("LD_LIBRARY_PATH", "")
        if folder not in paths.split(":"):
            os.environ["LD_LIBRARY_PATH"] = folder + (":" + paths if paths else "")
        _SETUP["nvrtc_folder"] = folder
    except Exception as exc:  # Humming then finds NVRTC its own way, or says why it cannot
        _SETUP["nvrtc_error"] = repr(exc)
    _patch_device_info()
    import humming
    _SETUP.update(humming_version=humming.__version__, cache_dir=os.environ["HUMMING_CACHE_DIR"])
    return _SETUP


def _patch_device_info() -> None:
    import humming.config.config
    import humming.transform
    import humming.tune
    import humming.tune.process_input
    import humming.utils.smem
    from humming.device import DeviceInfo, get_device_index

    modules = (humming.config.config, humming.transform, humming.tune, humming.tune.process_input,
               humming.utils.smem)
    if not any(getattr(m, "DeviceInfo", None) is DeviceInfo for m in modules):
        return  # patched already (by vLLM itself, or the shared anchor, in this process)

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._get_value(), name)

    DeviceInfo.__getattr__ = __getattr__
    device_infos = {}

    def cached_device_info(index=None):
        if isinstance(index, torch.device) and index.type != "cuda":
            return DeviceInfo(index)
        device_index = get_device_index(index)
        if device_index not in device_infos:
            device_infos[device_index] = DeviceInfo(device_index)
        return device_infos[device_index]

    for m in modules:
        if getattr(m, "DeviceInfo", None) is DeviceInfo:
            m.DeviceInfo = cached_device_info


def humming_api() -> types.SimpleNamespace:
    """The humming entry points vLLM's conversion calls (vllm/utils/humming.py's facade), plus
    this port of vLLM's check_and_fallback_input_schema. Tests pass stand-ins instead."""
    from humming.config import GemmType
    from humming.schema import BaseWeightSchema, HummingInputSchema, HummingWeightSchema
    from humming.transform import prepare_and_transform_humming_tensors
    from humming.tune import get_heuristics_config

    return types.SimpleNamespace(
        BaseWeightSchema=BaseWeightSchema, HummingInputSchema=HummingInputSchema,
        HummingWeightSchema=HummingWeightSchema, GemmType=GemmType,
        prepare_and_transform_humming_tensors=prepare_and_transform_humming_tensors,
        get_heuristics_config=get_heuristics_config, check_and_fallback_input_schema=check_and_fallback_input_schema)


def check_and_fallback_input_schema(weight_schema, input_schema, param_dtype, allow_fallback=True):
    """quantization/utils/humming/schema.py check_and_fallback_input_schema for the 16-bit
    activations AWQ layers get (HummingInputSchema() without an activation dtype)."""
    from humming import dtypes
    from humming.config import InputQuantizationMode
    from humming.schema import HummingInputSchema

    weight = weight_schema.to_humming_schema(param_dtype)
    schema = input_schema.to_humming_schema(param_dtype)
    if schema.is_compatible_with(weight, param_dtype):
        if schema.a_dtype is None or schema.a_dtype.num_bits == 16:
            return schema
        raise NotImplementedError("quantized activations are outside the vLLM MoE timers")
    if allow_fallback:  # the fallback list of a 16-bit activation ends at the params dtype
        candidate = HummingInputSchema(a_dtype=dtypes.DataType.from_any(param_dtype), input_scale_group_size=0,
                                       input_scale_dtype=None, input_quant_mode=InputQuantizationMode.Disabled)
        if candidate.is_compatible_with(weight, param_dtype):
            return candidate
    raise ValueError(f"no compatible Humming input schema for {schema} / {weight}")


def prepare_humming_layer(awq: dict, shape: MoeShape, dtype: torch.dtype, api=None) -> dict:
    """convert_to_humming_moe_kernel_format for one AutoAWQ layer (scales in the params dtype,
    as vLLM loads them); returns {"w13": (LayerConfig, tensors, hadamard_block_size), "w2": (...)}."""
    api = api or humming_api()
    quant_config = {"quant_method": "awq", "bits": 4, "group_size": shape.group_size, "zero_point": True}
    weight_schema = api.BaseWeightSchema.from_config(quant_config)
    input_schema = api.HummingInputSchema()  # VLLM_HUMMING_INPUT_QUANT_CONFIG unset: every layer skipped
    out = {}
    for name, sub in humming_sublayers(shape).items():
        tensors = {"qweight": awq[f"{name}_qweight"], "scales": awq[f"{name}_scales"].to(dtype),
                   "qzeros": awq[f"{name}_qzeros"]}
        stacks = {"shape_n_stacks": sub["shape_n_stacks"], "shape_k_stacks": sub["shape_k_stacks"]}
        converted_weight_schema, converted = weight_schema.convert_humming(
            tensors=tensors, param_dtype=dtype, num_experts=shape.num_experts, **stacks)
        converted_input_schema, input_tensors = input_schema.convert_humming(
            tensors=tensors, param_dtype=dtype, num_experts=shape.num_experts, **stacks)
        converted.update(input_tensors)
        assert isinstance(converted_weight_schema, api.HummingWeightSchema)
        converted_input_schema = api.check_and_fallback_input_schema(
            weight_schema=converted_weight_schema, input_schema=converted_input_schema, param_dtype=dtype,
            allow_fallback=True)
        source = dict(converted)
        for scale_name in ("input_scale", "input_scale_2"):
            if scale_name != converted_input_schema.static_tensor_scale_name:
                source.pop(scale_name, None)
        config, transformed = api.prepare_and_transform_humming_tensors(
            tensors=source, shape_n=sub["shape_n"], shape_k=sub["shape_k"], pad_n_to_multiple=HUMMING_PAD_N_TO_MULTIPLE,
            pad_k_to_multiple=HUMMING_PAD_K_TO_MULTIPLE, input_schema=converted_input_schema,
            weight_schema=converted_weight_schema, has_bias=False, num_experts=shape.num_experts, torch_dtype=dtype,
            device=converted["weight"].device)
        for scale_name in ("input_scale", "input_scale_2"):
            if scale_name in source:
                transformed[scale_name] = source[scale_name]
        out[name] = (config, transformed, converted_weight_schema.hadamard_block_size)
    return out


class HummingLayer:
    """One layer's parameters after the conversion, and its experts' locks (create_humming_locks)."""

    def __init__(self, prepared: dict):
        (self.config13, t13, self.hadamard13), (self.config2, t2, self.hadamard2) = prepared["w13"], prepared["w2"]
        self.w13_weight, self.w13_scale, self.w13_zero_point = t13["weight"], t13["weight_scale"], t13.get("zero_point")
        self.w2_weight, self.w2_scale, self.w2_zero_point = t2["weight"], t2["weight_scale"], t2.get("zero_point")
        self.w13_scale_2, self.w2_scale_2 = t13.get("weight_scale_2"), t2.get("weight_scale_2")
        device = self.w13_weight.device
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        self.locks = torch.zeros(sms * HUMMING_LOCKS_PER_SM, dtype=torch.int32, device=device)


def heuristics_configs(config13, config2, api=None):
    """HummingExpertsBase.init_humming_moe with vLLM's defaults (VLLM_BATCH_INVARIANT=0,
    VLLM_HUMMING_USE_F16_ACCUM=0, indexed GEMM): (compute_config, W13 tuning, W2 tuning)."""
    api = api or humming_api()
    indexed = api.GemmType.INDEXED
    compute_config = {"use_batch_invariant": False, "use_f16_accum": False, "gemm_type": indexed.value}
    tuning = [api.get_heuristics_config(layer_config=c, use_f16_accum=False, use_batch_invariant=False,
                                        gemm_type=indexed) for c in (config13, config2)]
    return compute_config, tuning[0], tuning[1]


def moe_blocks(tuning13: Sequence, tuning2: Sequence, M: int, shape: MoeShape) -> dict:
    """prepare_humming_moe_kwargs' choices at M tokens: valid_shape_m, the W13 and W2 block
    sizes (and kernel configs) and how many alignments run (2 when the blocks differ)."""
    valid_shape_m = humming_valid_shape_m(M, shape.top_k, shape.num_experts)
    block13, config13 = humming_block_size(tuning13, valid_shape_m)
    block2, config2 = humming_block_size(tuning2, valid_shape_m)
    return {"valid_shape_m": valid_shape_m, "block_m13": block13, "block_m2": block2,
            "aligns_per_layer": 1 if block13 == block2 else 2, "kernel13": config13, "kernel2": config2}


class HummingExperts:
    """What one HummingIndexedExperts holds that does not depend on the layer's tensors (every
    layer of a shape has the same LayerConfigs, hence the same tuning)."""

    def __init__(self, shape: MoeShape, layer: HummingLayer):
        self.shape, self.config13, self.config2 = shape, layer.config13, layer.config2
        self.hadamard13, self.hadamard2 = layer.hadamard13, layer.hadamard2
        # get_buffer_metas / moe_problem_size read the unpadded sizes back from the configs
        unpadded = (self.config13.shape_n - self.config13.pad_shape_n, self.config2.shape_k - self.config2.pad_shape_k,
                    self.config13.shape_k - self.config13.pad_shape_k)
        if unpadded != (2 * shape.intermediate_size, shape.intermediate_size, shape.hidden_size):
            raise ValueError(f"Humming LayerConfigs give (2N, N, K) = {unpadded} for {shape}")
        self.compute_config, self.tuning13, self.tuning2 = heuristics_configs(self.config13, self.config2)
        self.compute_config_str = json.dumps(self.compute_config)
        self.tuning13_str, self.tuning2_str = json.dumps(self.tuning13), json.dumps(self.tuning2)


class HummingRunner:
    """HummingIndexedExperts.apply for M tokens (modular kernel, no expert parallelism): the
    workspaces of _workspace_shapes / prepare_buffers, the output a buffer of its own (as the
    modular kernel's output), TopKWeightAndReduceNoOP (nothing after the sum)."""

    def __init__(self, experts: HummingExperts, M: int, dtype: torch.dtype, ops: VllmMoeOps, device):
        from humming.forward import humming_forward, may_process_input

        shape = experts.shape
        self.experts, self.shape, self.M, self.ops = experts, shape, M, ops
        self.humming_forward, self.may_process_input = humming_forward, may_process_input
        self.blocks = moe_blocks(experts.tuning13, experts.tuning2, M, shape)
        numel1, numel2, which = humming_workspace_layout(M, shape)
        self.workspace1 = torch.empty(max(numel1, M * shape.hidden_size), device=device, dtype=dtype)
        self.workspace2 = torch.empty(numel2, device=device, dtype=dtype)
        shapes = humming_buffer_shapes(M, shape)
        self.buffers = {name: (self.workspace1 if which[name] == 1 else self.workspace2).flatten()[
            : math.prod(shapes[name])].view(*shapes[name]) for name in shapes}
        self.out = torch.empty(M, shape.hidden_size, device=device, dtype=dtype)
        self.buffers["output"] = self.out
        self.workspaces = (self.workspace1, self.workspace2, self.out)

    def align(self, topk_ids: torch.Tensor):
        E = self.shape.num_experts
        align13 = align_block_size(self.ops, topk_ids, self.blocks["block_m13"], E)
        align2 = align13 if self.blocks["aligns_per_layer"] == 1 else align_block_size(
            self.ops, topk_ids, self.blocks["block_m2"], E)
        return align13, align2

    def step_w13(self, x, layer: HummingLayer, align13):
        ex = self.experts
        sorted_ids, expert_ids, num_tokens_padded = align13
        inputs, _, _ = self.may_process_input(ex.config13, inputs=x, outputs=None, token_scales=None,
                                              hadamard_block_size=ex.hadamard13, layout="normal", expert_tokens=None,
                                              scatter_idx=None, num_valid_tokens=None)
        self.humming_forward(ex.config13, inputs=inputs, weight=layer.w13_weight, weight_scale=layer.w13_scale,
                             zero_point=layer.w13_zero_point, bias=None, weight_scale_2=layer.w13_scale_2,
                             input_scale=None, input_scale_2=None, outputs=self.buffers["gate_up_output"],
                             locks=layer.locks, sorted_ids=sorted_ids, expert_ids=expert_ids,
                             num_tokens_padded=num_tokens_padded, compute_config=ex.compute_config_str,
                             valid_shape_m=self.blocks["valid_shape_m"], top_k=self.shape.top_k,
                             tuning_config=ex.tuning13_str)

    def step_activation(self):
        ex = self.experts
        inputs, _, _ = self.may_process_input(ex.config2, inputs=self.buffers["gate_up_output"],
                                              outputs=self.buffers["quanted_down_input"], token_scales=None,
                                              hadamard_block_size=ex.hadamard2, layout="normal", expert_tokens=None,
                                              scatter_idx=None, num_valid_tokens=None, **SILU_ACTIVATION)
        return inputs

    def step_w2(self, inputs, layer: HummingLayer, align2):
        ex = self.experts
        sorted_ids, expert_ids, num_tokens_padded = align2
        self.humming_forward(ex.config2, inputs=inputs, weight=layer.w2_weight, weight_scale=layer.w2_scale,
                             zero_point=layer.w2_zero_point, bias=None, weight_scale_2=layer.w2_scale_2,
                             input_scale=None, input_scale_2=None,
                             outputs=self.buffers["down_output"].view(-1, self.shape.hidden_size), locks=layer.locks,
                             sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=num_tokens_padded,
                             compute_config=ex.compute_config_str, valid_shape_m=self.blocks["valid_shape_m"],
                             top_k=1, tuning_config=ex.tuning2_str)

    def step_sum(self, topk_weights, topk_ids):
        self.ops.moe_fused_mul_sum(inputs=self.buffers["down_output"].view(self.M, self.shape.top_k, -1),
                                   topk_weights=topk_weights, topk_ids=topk_ids, expert_map=None, outputs=self.out,
                                   num_valid_tokens=None)

    def __call__(self, x, layer: HummingLayer, topk_weights, topk_ids, align=None):
        align13, align2 = align if align is not None else self.align(topk_ids)
        self.step_w13(x, layer, align13)
        inputs = self.step_activation()
        self.step_w2(inputs, layer, align2)
        self.step_sum(topk_weights, topk_ids)
        return self.out

    def describe(self) -> dict:
        return {k: v for k, v in self.blocks.items() if not k.startswith("kernel")}


def cubin_count() -> int:
    """Kernels in Humming's JIT cache (how many the first forwards compiled)."""
    return len(glob.glob(os.path.join(os.environ.get("HUMMING_CACHE_DIR", ""), "**", "kernel.cubin"), recursive=True))
