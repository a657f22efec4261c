"""Local, deterministic AWQ Qwen3-MoE checkpoints for end-to-end tests and the demo.

A checkpoint is a directory holding ``config.json`` and ``model.safetensors``, laid
out the way a Hugging Face AutoAWQ export of ``Qwen3MoeForCausalLM`` is:

- MoE experts are AWQ int4 "GEMM" tensors with per-expert hub names
  (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.{qweight,scales,qzeros}``,
  from :func:`moe_grouped_decode.awq.to_hub_expert_tensors`);
- attention, the router gate, norms, embeddings and the LM head are plain
  fp16/bf16 tensors, listed in ``quantization_config.modules_to_not_convert``
  (the substring rule vLLM's AWQ config applies), so vLLM's CPU build needs no
  AWQ linear kernel to run them.

No tokenizer is written: run vLLM with ``skip_tokenizer_init=True`` and give
prompts as token ids. Nothing is downloaded. The same spec and seed give the same
bytes on every machine. This module does not import vllm.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict

import torch

from .awq import synthetic_moe_weights, to_hub_expert_tensors
from .contract import QWEN38_TP4, ShapeContract

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


@dataclass(frozen=True)
class TinyQwen3MoeSpec:
    """The shape of a generated checkpoint. ``head_dim`` 64 is one vLLM's CPU attention supports."""

    num_layers: int = 2
    hidden_size: int = 128  # K
    num_experts: int = 8  # E
    top_k: int = 2  # k
    moe_intermediate_size: int = 64  # N (the full checkpoint's; TP1 runs it whole)
    group_size: int = 32  # G
    vocab_size: int = 512
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 64
    dtype: torch.dtype = torch.float16
    seed: int = 0

    def contract(self, name: str, min_tokens: int = 2, max_tokens: int = 8) -> ShapeContract:
        """A contract whose layer family is exactly this checkpoint's MoE layers."""
        return ShapeContract(
            name=name,
            num_experts=self.num_experts,
            top_k=self.top_k,
            hidden_size=self.hidden_size,
            intermediate_size=self.moe_intermediate_size,
            group_size=self.group_size,
            min_tokens=min_tokens,
            max_tokens=max_tokens,
            dtypes=(self.dtype,),
        )

    def describe(self) -> str:
        return (
            f"Qwen3-MoE AWQ, {self.num_layers} layer(s): E={self.num_experts}, k={self.top_k}, "
            f"K={self.hidden_size}, N={self.moe_intermediate_size}, G={self.group_size}, "
            f"{_DTYPE_NAMES[self.dtype]}, seed {self.seed}"
        )


# The e2e tests' and the demo's small model: seconds to build and to load.
TINY = TinyQwen3MoeSpec()
# The same family with one knob off the tiny contract (G=64), for "matches no contract".
TINY_UNMATCHED = replace(TINY, group_size=64, seed=1)
# One layer with the real qwen3.8-tp4 MoE shapes (E=512, k=10, K=2560, N=160, G=32).
QWEN38_TP4_ONE_LAYER = TinyQwen3MoeSpec(
    num_layers=1,
    hidden_size=QWEN38_TP4.hidden_size,
    num_experts=QWEN38_TP4.num_experts,
    top_k=QWEN38_TP4.top_k,
    moe_intermediate_size=QWEN38_TP4.intermediate_size,
    group_size=QWEN38_TP4.group_size,
    vocab_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def hf_config(spec: TinyQwen3MoeSpec) -> dict:
    """``config.json`` content: a Qwen3-MoE config with an AutoAWQ quantization_config."""
    dtype = _DTYPE_NAMES[spec.dtype]
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": 4 * spec.hidden_size,  # unused: every layer is sparse
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": spec.moe_intermediate_size,
        "num_experts": spec.num_experts,
        "num_experts_per_tok": spec.top_k,
        "norm_topk_prob": True,
        "torch_dtype": dtype,
        "dtype": dtype,
        "quantization_config": {
            "quant_method": "awq",
            "bits": 4,
            "group_size": spec.group_size,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": ["self_attn", "mlp.gate"],
        },
    }


def _dense(generator: torch.Generator, shape, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    # 1/sqrt(fan_in) keeps activations near unit scale through the random layers
    return (torch.randn(shape, generator=generator) / fan_in**0.5).to(dtype)


def state_dict(spec: TinyQwen3MoeSpec) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by hub name (deterministic in ``spec``)."""
    gen = torch.Generator().manual_seed(spec.seed)
    K, dt = spec.hidden_size, spec.dtype
    q_out = spec.num_attention_heads * spec.head_dim
    kv_out = spec.num_key_value_heads * spec.head_dim
    tensors: Dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(spec.vocab_size, K, generator=gen).to(dt),
        "model.norm.weight": torch.ones(K, dtype=dt),
        "lm_head.weight": _dense(gen, (spec.vocab_size, K), K, dt),
    }
    for i in range(spec.num_layers):
        layer = f"model.layers.{i}"
        tensors.update(
            {
                f"{layer}.input_layernorm.weight": torch.ones(K, dtype=dt),
                f"{layer}.post_attention_layernorm.weight": torch.ones(K, dtype=dt),
                f"{layer}.self_attn.q_proj.weight": _dense(gen, (q_out, K), K, dt),
                f"{layer}.self_attn.k_proj.weight": _dense(gen, (kv_out, K), K, dt),
                f"{layer}.self_attn.v_proj.weight": _dense(gen, (kv_out, K), K, dt),
                f"{layer}.self_attn.o_proj.weight": _dense(gen, (K, q_out), q_out, dt),
                f"{layer}.self_attn.q_norm.weight": torch.ones(spec.head_dim, dtype=dt),
                f"{layer}.self_attn.k_norm.weight": torch.ones(spec.head_dim, dtype=dt),
                f"{layer}.mlp.gate.weight": _dense(gen, (spec.num_experts, K), K, dt),
            }
        )
        experts = synthetic_moe_weights(
            spec.num_experts,
            K,
            spec.moe_intermediate_size,
            spec.group_size,
            dtype=dt,
            seed=spec.seed * 1000 + i + 1,
        )
        tensors.update(to_hub_expert_tensors(experts, f"{layer}.mlp"))
    return tensors


def build_checkpoint(directory, spec: TinyQwen3MoeSpec = TINY) -> Path:
    """Write ``spec``'s checkpoint into ``directory`` (created if needed); return its path.

    A directory already holding this spec's checkpoint is reused as is (the
    ``spec.json`` stamp records what was built), so repeated runs cost nothing.
    """
    from safetensors.torch import save_file

    path = Path(directory)
    stamp = path / "spec.json"
    wanted = json.dumps({**asdict(spec), "dtype": _DTYPE_NAMES[spec.dtype]}, sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted and (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    save_file(state_dict(spec), str(path / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(wanted)
    return path
