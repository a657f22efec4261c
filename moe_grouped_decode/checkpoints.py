"""Local, deterministic AWQ MoE checkpoints for end-to-end tests, the demo and the e2e benchmark.

A checkpoint is a directory holding ``config.json`` and ``model.safetensors``, laid
out the way a Hugging Face AutoAWQ export is, for one of two architectures:

- ``qwen3_moe`` (:class:`TinyQwen3MoeSpec`, ``Qwen3MoeForCausalLM``): every layer
  sparse, GQA attention with q/k norms;
- ``deepseek_v2`` (:class:`TinyDeepseekV2Spec`, ``DeepseekV2ForCausalLM``, shaped
  like DeepSeek-V2-Lite): MLA attention, the first ``first_k_dense_replace`` layers
  with a dense MLP, every later layer with ``n_shared_experts`` shared experts
  beside the routed ones.

In both:

- the routed MoE experts are AWQ int4 "GEMM" tensors with per-expert hub names
  (``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.{qweight,scales,qzeros}``,
  from :func:`moe_grouped_decode.awq.to_hub_expert_tensors`);
- attention, the router gate, dense and shared-expert MLPs, norms, embeddings and
  the LM head are plain fp16/bf16 tensors, listed in
  ``quantization_config.modules_to_not_convert`` (the substring rule vLLM's AWQ
  config applies), so vLLM's CPU build needs no AWQ linear kernel to run them.

No tokenizer is written: run vLLM with ``skip_tokenizer_init=True`` and give
prompts as token ids. Nothing is downloaded. The same spec and seed give the same
bytes on every machine. This module does not import vllm.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, Iterator, Optional, Tuple, Union

import torch

from .awq import synthetic_moe_weights, to_hub_expert_tensors
from .contract import QWEN38_TP4, ShapeContract

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


class _MoeShape:
    """What both specs share: the routed experts' shape (E, k, K, N, G), a dtype and a seed."""

    architecture = ""
    label = ""

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

    @property
    def moe_shape(self) -> Tuple[int, int, int, int, int]:
        """(E, k, K, N, G) of the routed experts."""
        return (self.num_experts, self.top_k, self.hidden_size, self.moe_intermediate_size, self.group_size)

    def describe(self) -> str:
        return (
            f"{self.label} AWQ, {self.num_layers} layer(s): E={self.num_experts}, k={self.top_k}, "
            f"K={self.hidden_size}, N={self.moe_intermediate_size}, G={self.group_size}{self._describe_extra()}, "
            f"{_DTYPE_NAMES[self.dtype]}, seed {self.seed}"
        )

    def _describe_extra(self) -> str:
        return ""


@dataclass(frozen=True)
class TinyQwen3MoeSpec(_MoeShape):
    """The shape of a generated Qwen3-MoE checkpoint. ``head_dim`` 64 is one vLLM's CPU attention supports."""

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

    architecture = "qwen3_moe"
    label = "Qwen3-MoE"

    @property
    def moe_layers(self) -> Tuple[int, ...]:
        return tuple(range(self.num_layers))


@dataclass(frozen=True)
class TinyDeepseekV2Spec(_MoeShape):
    """The shape of a generated DeepSeek-V2-style checkpoint (DeepSeek-V2-Lite's layout, smaller).

    MLA attention without a query LoRA (``q_lora_rank`` None, as in V2-Lite): ``kv_lora_rank``
    512 and ``qk_rope_head_dim`` 64 are what vLLM's CPU MLA decode kernel computes (a 576-wide
    latent cache) and what the GPU MLA backends expect. Layers before ``first_k_dense_replace``
    have a dense MLP; every later one routes to ``num_experts`` experts and adds
    ``n_shared_experts`` shared ones (one MLP of ``n_shared_experts * moe_intermediate_size``).
    Routing as V2-Lite's: softmax over the experts, greedy top-k, weights not renormalized, no
    routed scaling.
    """

    num_layers: int = 2
    hidden_size: int = 128  # K
    num_experts: int = 8  # E (n_routed_experts)
    top_k: int = 2  # k
    moe_intermediate_size: int = 64  # N
    group_size: int = 32  # G
    n_shared_experts: int = 2
    first_k_dense_replace: int = 1
    intermediate_size: int = 256  # the dense layers' MLP
    vocab_size: int = 512
    num_attention_heads: int = 2
    qk_nope_head_dim: int = 64
    qk_rope_head_dim: int = 64
    v_head_dim: int = 64
    kv_lora_rank: int = 512
    dtype: torch.dtype = torch.float16
    seed: int = 0

    architecture = "deepseek_v2"
    label = "DeepSeek-V2"

    def __post_init__(self) -> None:
        if not 0 <= self.first_k_dense_replace < self.num_layers:
            raise ValueError(f"first_k_dense_replace={self.first_k_dense_replace} must leave at least one MoE "
                             f"layer among num_layers={self.num_layers}")
        if self.n_shared_experts < 1:
            raise ValueError("a DeepSeek-V2 spec has at least one shared expert")

    @property
    def moe_layers(self) -> Tuple[int, ...]:
        return tuple(range(self.first_k_dense_replace, self.num_layers))

    def _describe_extra(self) -> str:
        return (f", {self.n_shared_experts} shared expert(s), first {self.first_k_dense_replace} layer(s) dense, "
                f"MLA (kv_lora_rank {self.kv_lora_rank})")


CheckpointSpec = Union[TinyQwen3MoeSpec, TinyDeepseekV2Spec]
ARCHITECTURES = {"qwen3_moe": TinyQwen3MoeSpec, "deepseek_v2": TinyDeepseekV2Spec}

# The e2e tests' and the demo's small model: seconds to build and to load.
TINY = TinyQwen3MoeSpec()
# The same family with one knob off the tiny contract (G=64), for "matches no contract".
TINY_UNMATCHED = replace(TINY, group_size=64, seed=1)
# The tiny model's routed experts behind MLA attention, a dense first layer and shared experts.
TINY_DEEPSEEK_V2 = TinyDeepseekV2Spec()
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


def _awq_quantization_config(spec: CheckpointSpec, not_converted) -> dict:
    return {
        "quant_method": "awq",
        "bits": 4,
        "group_size": spec.group_size,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": list(not_converted),
    }


def hf_config(spec: CheckpointSpec) -> dict:
    """``config.json`` content: the architecture's config with an AutoAWQ quantization_config."""
    if isinstance(spec, TinyDeepseekV2Spec):
        return _deepseek_v2_config(spec)
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
        "quantization_config": _awq_quantization_config(spec, ["self_attn", "mlp.gate"]),
    }


# Substrings of every module kept in fp16/bf16 in a DeepSeek-V2 checkpoint: attention, the router
# ("mlp.gate", which also covers the dense layers' gate_proj/gate_up_proj), the dense layers' other
# projections and the shared experts. The routed experts ("mlp.experts") match none of them.
DEEPSEEK_V2_NOT_CONVERTED = ("self_attn", "mlp.gate", "mlp.up_proj", "mlp.down_proj", "mlp.shared_experts")


def _deepseek_v2_config(spec: TinyDeepseekV2Spec) -> dict:
    dtype = _DTYPE_NAMES[spec.dtype]
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_attention_heads,  # MLA: one latent per token, heads unshared
        "hidden_act": "silu",
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "q_lora_rank": None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.qk_nope_head_dim,
        "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "n_routed_experts": spec.num_experts,
        "n_shared_experts": spec.n_shared_experts,
        "num_experts_per_tok": spec.top_k,
        "moe_intermediate_size": spec.moe_intermediate_size,
        "first_k_dense_replace": spec.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "greedy",
        "scoring_func": "softmax",
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "torch_dtype": dtype,
        "dtype": dtype,
        "quantization_config": _awq_quantization_config(spec, DEEPSEEK_V2_NOT_CONVERTED),
    }


def _dense(generator: torch.Generator, shape, fan_in: int, dtype: torch.dtype) -> torch.Tensor:
    # 1/sqrt(fan_in) keeps activations near unit scale through the random layers
    return (torch.randn(shape, generator=generator, device=generator.device) / fan_in**0.5).to(dtype).cpu()


def checkpoint_tensors(spec: CheckpointSpec, device="cpu") -> Iterator[Tuple[Optional[int], Dict[str, torch.Tensor]]]:
    """Every tensor of the checkpoint by hub name, on the CPU: ``(None, embeddings, final norm and
    head)``, then ``(i, layer i's tensors)`` for each layer. Deterministic in ``spec``; ``device``
    draws the values there (the same bits on every machine on the CPU; fast for large shapes on a
    GPU)."""
    gen = torch.Generator(device=device).manual_seed(spec.seed)
    K, dt = spec.hidden_size, spec.dtype

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dt)

    yield None, {
        "model.embed_tokens.weight": torch.randn(spec.vocab_size, K, generator=gen, device=device).to(dt).cpu(),
        "model.norm.weight": ones(K),
        "lm_head.weight": _dense(gen, (spec.vocab_size, K), K, dt),
    }
    for i in range(spec.num_layers):
        layer = f"model.layers.{i}"
        tensors = {f"{layer}.input_layernorm.weight": ones(K), f"{layer}.post_attention_layernorm.weight": ones(K)}
        if isinstance(spec, TinyDeepseekV2Spec):
            tensors.update(_deepseek_v2_layer(spec, i, gen))
        else:
            q_out, kv_out = spec.num_attention_heads * spec.head_dim, spec.num_key_value_heads * spec.head_dim
            tensors.update({
                f"{layer}.self_attn.q_proj.weight": _dense(gen, (q_out, K), K, dt),
                f"{layer}.self_attn.k_proj.weight": _dense(gen, (kv_out, K), K, dt),
                f"{layer}.self_attn.v_proj.weight": _dense(gen, (kv_out, K), K, dt),
                f"{layer}.self_attn.o_proj.weight": _dense(gen, (K, q_out), q_out, dt),
                f"{layer}.self_attn.q_norm.weight": ones(spec.head_dim),
                f"{layer}.self_attn.k_norm.weight": ones(spec.head_dim),
                f"{layer}.mlp.gate.weight": _dense(gen, (spec.num_experts, K), K, dt),
            })
        if i in spec.moe_layers:
            experts = synthetic_moe_weights(
                spec.num_experts, K, spec.moe_intermediate_size, spec.group_size, dtype=dt,
                seed=spec.seed * 1000 + i + 1, device=device,
            ).to("cpu")
            tensors.update(to_hub_expert_tensors(experts, f"{layer}.mlp"))
        yield i, tensors


def _deepseek_v2_layer(spec: TinyDeepseekV2Spec, i: int, gen: torch.Generator) -> Dict[str, torch.Tensor]:
    """Layer ``i``'s MLA attention and its dense MLP, or its router and shared experts (the routed
    experts are added by the caller)."""
    K, dt, H = spec.hidden_size, spec.dtype, spec.num_attention_heads
    attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
    tensors = {
        f"{attn}.q_proj.weight": _dense(gen, (H * (spec.qk_nope_head_dim + spec.qk_rope_head_dim), K), K, dt),
        f"{attn}.kv_a_proj_with_mqa.weight": _dense(gen, (spec.kv_lora_rank + spec.qk_rope_head_dim, K), K, dt),
        f"{attn}.kv_a_layernorm.weight": torch.ones(spec.kv_lora_rank, dtype=dt),
        f"{attn}.kv_b_proj.weight": _dense(gen, (H * (spec.qk_nope_head_dim + spec.v_head_dim), spec.kv_lora_rank),
                                           spec.kv_lora_rank, dt),
        f"{attn}.o_proj.weight": _dense(gen, (K, H * spec.v_head_dim), H * spec.v_head_dim, dt),
    }
    if i in spec.moe_layers:
        width, prefix = spec.n_shared_experts * spec.moe_intermediate_size, f"{mlp}.shared_experts"
        tensors[f"{mlp}.gate.weight"] = _dense(gen, (spec.num_experts, K), K, dt)
    else:
        width, prefix = spec.intermediate_size, mlp
    tensors.update({
        f"{prefix}.gate_proj.weight": _dense(gen, (width, K), K, dt),
        f"{prefix}.up_proj.weight": _dense(gen, (width, K), K, dt),
        f"{prefix}.down_proj.weight": _dense(gen, (K, width), width, dt),
    })
    return tensors


def state_dict(spec: CheckpointSpec) -> Dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, by hub name (deterministic in ``spec``)."""
    tensors: Dict[str, torch.Tensor] = {}
    for _, part in checkpoint_tensors(spec):
        tensors.update(part)
    return tensors


def spec_stamp(spec: CheckpointSpec) -> dict:
    """What identifies a built checkpoint (``spec.json``): every field, the dtype by name, the architecture."""
    return {**asdict(spec), "dtype": _DTYPE_NAMES[spec.dtype], "architecture": spec.architecture}


def build_checkpoint(directory, spec: CheckpointSpec = TINY) -> Path:
    """Write ``spec``'s checkpoint into ``directory`` (created if needed); return its path.

    A directory already holding this spec's checkpoint is reused as is (the
    ``spec.json`` stamp records what was built), so repeated runs cost nothing.
    """
    from safetensors.torch import save_file

    path = Path(directory)
    stamp = path / "spec.json"
    wanted = json.dumps(spec_stamp(spec), sort_keys=True)
    if stamp.is_file() and stamp.read_text() == wanted and (path / "model.safetensors").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config(spec), indent=2))
    save_file(state_dict(spec), str(path / "model.safetensors"), metadata={"format": "pt"})
    stamp.write_text(wanted)
    return path
