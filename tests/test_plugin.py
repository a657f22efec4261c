"""The plugin's decisions without an engine: registration, switches, checkpoint claims, contracts, uuid."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from moe_grouped_decode.checkpoints import TINY, hf_config
from moe_grouped_decode.compile_plugin.contracts_env import CONTRACTS_ENV, contracts_from_json, contracts_to_json, register_env_contracts
from moe_grouped_decode.compile_plugin.startup import check_switch, kernels_unavailable_reason
from moe_grouped_decode.contract import QWEN38_TP4, contract_registered, registered_contracts, unregister_contract
from moe_grouped_decode.env import GROUPED_DECODE_ENV, LEGACY_ENV_NAMES

pytestmark = pytest.mark.vllm  # imports vllm (no engine is started)


def test_register_is_idempotent_and_adds_the_quantization_override():
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from moe_grouped_decode.compile_plugin import register
    from moe_grouped_decode.compile_plugin.quant_config import QUANTIZATION_NAME, GroupedDecodeAwqConfig

    register()
    register()  # vLLM loads plugins more than once per process
    assert QUANTIZATION_METHODS.count(QUANTIZATION_NAME) == 1
    assert get_quantization_config(QUANTIZATION_NAME) is GroupedDecodeAwqConfig
    assert hasattr(torch.ops.moe_grouped_decode, "vllm_moe_forward_grouped")
    # same schema as vLLM's op, so swapping the call target keeps the graph valid
    ours = torch.ops.moe_grouped_decode.vllm_moe_forward_grouped.default._schema
    theirs = torch.ops.vllm.moe_forward.default._schema
    def signature(schema):
        return [(a.name, str(a.type), a.alias_info and a.alias_info.is_write) for a in schema.arguments], [
            str(r.type) for r in schema.returns
        ]

    assert signature(ours) == signature(theirs)


class _Config:
    """A minimal hf_config: the override only reads the expert count."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@pytest.mark.parametrize(
    "quant_cfg,user_quant,hf,claimed",
    [
        (hf_config(TINY)["quantization_config"], None, _Config(num_experts=8), True),  # the generated checkpoint
        ({"quant_method": "awq", "bits": 4, "zero_point": True}, "awq", _Config(num_experts=512), True),  # no version: GEMM
        ({"quant_method": "awq", "bits": 4, "zero_point": True}, None, _Config(num_experts=0), False),  # dense model
        ({"quant_method": "awq", "bits": 4, "zero_point": True}, None, None, False),  # unknown model
        ({"quant_method": "awq", "bits": 4, "zero_point": True, "version": "gemv"}, None, _Config(num_experts=8), False),  # other layout
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, None, _Config(num_experts=8), False),  # symmetric
        ({"quant_method": "gptq", "bits": 4}, None, _Config(num_experts=8), False),  # not AWQ
        ({"quant_method": "awq", "bits": 4, "zero_point": True}, "gptq", _Config(num_experts=8), False),  # user asked otherwise
    ],
)
def test_which_checkpoints_are_claimed(quant_cfg, user_quant, hf, claimed):
    from moe_grouped_decode.compile_plugin.quant_config import QUANTIZATION_NAME, GroupedDecodeAwqConfig

    result = GroupedDecodeAwqConfig.override_quantization_method(quant_cfg, user_quant, hf_config=hf)
    assert result == (QUANTIZATION_NAME if claimed else None)


@pytest.mark.parametrize(
    "switch,device,enabled",
    [
        (None, "cpu", True),  # unset: on where the kernels run (the CPU implementations always do)
        ("1", "cpu", True),
        ("0", "cpu", False),  # rollback
        (None, "xpu", False),  # unset where they cannot run: silently dense
        ("0", "xpu", False),
    ],
)
def test_switch(monkeypatch, switch, device, enabled):
    if switch is None:
        monkeypatch.delenv(GROUPED_DECODE_ENV, raising=False)
    else:
        monkeypatch.setenv(GROUPED_DECODE_ENV, switch)
    assert check_switch(device) is enabled


@pytest.fixture(autouse=True)
def no_switch_set(monkeypatch):
    for name in (GROUPED_DECODE_ENV, LEGACY_ENV_NAMES[GROUPED_DECODE_ENV]):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", [GROUPED_DECODE_ENV, LEGACY_ENV_NAMES[GROUPED_DECODE_ENV]])
def test_explicit_on_fails_closed_naming_what_is_missing(monkeypatch, name):
    monkeypatch.setenv(name, "1")
    # the message names the variable the user set, old name or new
    with pytest.raises(RuntimeError, match=rf"^{name}=1 .* no implementation .* 'xpu'.* Unset {name} "):
        check_switch("xpu")
    assert kernels_unavailable_reason("cpu") is None  # the torch implementations run on any CPU


def test_pre_ampere_gpu_is_named_and_fails_closed(monkeypatch):
    # the grouped kernels use tensor-core mma.sync m16n8k16: sm_80 and newer (a T4 is 7.5)
    assert "compute capability 8.0 or newer" in kernels_unavailable_reason("cuda", (7, 5))
    assert "this one is 7.5" in kernels_unavailable_reason("cuda", (7, 5))
    monkeypatch.delenv(GROUPED_DECODE_ENV, raising=False)
    assert check_switch("cuda", (7, 0)) is False  # unset: silently dense
    monkeypatch.setenv(GROUPED_DECODE_ENV, "1")
    with pytest.raises(RuntimeError, match=r"MOE_GROUPED_DECODE=1 .* compute capability 8.0 .* 7.0"):
        check_switch("cuda", (7, 0))


def test_contracts_travel_through_the_environment(monkeypatch):
    contract = TINY.contract("env-test", min_tokens=2, max_tokens=6)
    text = contracts_to_json([contract, QWEN38_TP4])
    # through the environment a contract is one written by hand: where it was measured does not travel
    assert contracts_from_json(text) == [contract, dataclasses.replace(QWEN38_TP4, measured=False)]
    with pytest.raises(ValueError, match="'measured' is not set by hand"):
        contracts_from_json(text.replace('"min_tokens"', '"measured": true, "min_tokens"', 1))
    monkeypatch.setenv(CONTRACTS_ENV, contracts_to_json([contract]))
    try:
        assert register_env_contracts() == [contract]
        assert contract in registered_contracts()
    finally:
        unregister_contract(contract.name)
    monkeypatch.setenv(CONTRACTS_ENV, '[{"name": "broken"}]')
    with pytest.raises(ValueError, match=CONTRACTS_ENV):
        register_env_contracts()


def test_pass_uuid_follows_the_contract_set():
    from moe_grouped_decode.compile_plugin.passes import VllmGroupedDecodePass

    graph_pass = VllmGroupedDecodePass()
    before = graph_pass.uuid()
    assert graph_pass.uuid() == before  # stable
    with contract_registered(TINY.contract("uuid-test")):
        assert graph_pass.uuid() != before  # a new contract changes what compiled graphs hold
    assert graph_pass.uuid() == before


def test_force_fails_closed_where_the_kernels_cannot_run(monkeypatch):
    monkeypatch.setenv("MOE_GROUPED_DECODE_FORCE", "1")
    with pytest.raises(RuntimeError, match=r"^MOE_GROUPED_DECODE_FORCE=1 .* 'xpu'"):
        check_switch("xpu")
    assert check_switch("cpu")
    monkeypatch.setenv(GROUPED_DECODE_ENV, "0")
    with pytest.raises(ValueError, match="contradict"):
        check_switch("cpu")


def _fake_moe_layer(shape):
    """What the quantization config reads of a vLLM MoE layer when it picks the layer's method."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.activation import MoEActivation

    moe = SimpleNamespace(num_local_experts=shape.num_experts, num_experts=shape.num_experts,
                          experts_per_token=shape.top_k, hidden_dim=shape.hidden_size,
                          intermediate_size_per_partition=shape.intermediate_size, in_dtype=shape.dtype,
                          activation=MoEActivation.SILU, has_bias=False, rocm_aiter_fmoe_enabled=False,
                          is_lora_enabled=False, max_num_tokens=64)
    return SimpleNamespace(moe_config=moe, apply_router_weight_on_input=False, swiglu_limit=None, swiglu_alpha=None)


@pytest.mark.parametrize("vllm_backend", ["CPU", None], ids=["vllm-has-a-backend", "vllm-has-none"])
@pytest.mark.parametrize("force", [False, True], ids=["default", "forced"])
def test_the_layer_goes_where_vllms_own_selection_and_the_switches_say(monkeypatch, vllm_backend, force):
    """The quantization config asks vLLM's own backend selection (vllm_compat.vllm_own_moe_method,
    replaced here by each of its answers) and returns vLLM's own method or the plugin's: on a CPU
    no table is measured for the CPU, so vLLM keeps any layer it has a backend for unless forced."""
    from vllm.config import VllmConfig, set_current_vllm_config

    from moe_grouped_decode.compile_plugin import quant_config, register, startup
    from moe_grouped_decode.compile_plugin.moe_method import AwqMoeGroupedDecodeMethod
    from moe_grouped_decode.contract import LayerShape

    register()
    if force:
        monkeypatch.setenv("MOE_GROUPED_DECODE_FORCE", "1")
    vllm_method = object()
    asked = []

    def selection(config, layer, prefix):
        asked.append(prefix)
        return (vllm_method, vllm_backend) if vllm_backend else (None, None)

    monkeypatch.setattr(quant_config, "vllm_own_moe_method", selection)
    config = quant_config.GroupedDecodeAwqConfig.from_config(hf_config(TINY)["quantization_config"] | {"group_size": 32})
    shape = LayerShape(*QWEN38_TP4.shape, torch.float16)
    prefix = f"model.layers.{int(force)}{vllm_backend}.mlp.experts"
    with set_current_vllm_config(VllmConfig()):
        method = config._moe_method(_fake_moe_layer(shape), prefix)
    decision = startup.LAYER_DECISIONS.pop(prefix)
    assert asked == [prefix] and decision.vllm_backend == vllm_backend
    if vllm_backend and not force:
        assert method is vllm_method and decision.choice.route == "vllm"
        assert "no table measured on cpu" in decision.choice.reason
    else:
        assert isinstance(method, AwqMoeGroupedDecodeMethod) and method.admission.contract.name == QWEN38_TP4.name
        assert decision.choice.route == "grouped"
