"""The plugin's MoE method: vLLM's AWQ tensors as loaded, computed by the plugin's ops.

It reuses ``AutoAWQMoEMethod.create_weights`` (same parameter names, shapes and
weight loaders, so checkpoints load exactly as vLLM loads them) and skips
everything after: no Marlin repack, no second copy. ``apply`` calls the dense
op (eagerly on a GPU, its implementation directly); the compile-time rewrite
(``passes.py``) turns it into the grouped op where the layer's contract admits
the step's token count.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod
from vllm.scalar_type import scalar_types

from ..contract import ACTIVATION_DTYPES, Admission, LayerShape
from ..env import batch_invariant
from ..kernels.lookup import launch_choice
from ..ops import alloc_workspace, awq_moe_dense_cuda, awq_moe_grouped_decode_cuda, local_expert_ids

# One workspace per (device, rows, K, N): MoE layers run one after another, so
# every layer of a model shares it; allocated once, before any graph capture.
_WORKSPACES: dict = {}

# the ops' implementations (grouped, dense) that ``apply`` calls directly per device type, on a
# plain tensor outside tracing: a GPU step outside vLLM's CUDA graphs is bound by the host's time,
# and the dispatcher's way to an implementation adds to it on every layer
EAGER_IMPLEMENTATIONS = {"cuda": (awq_moe_grouped_decode_cuda, awq_moe_dense_cuda)}


def shared_workspace(max_tokens: int, top_k: int, hidden_size: int, intermediate_size: int, device) -> torch.Tensor:
    key = (str(torch.device(device)), max_tokens * top_k, hidden_size, intermediate_size)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = alloc_workspace(max_tokens, top_k, hidden_size, intermediate_size, device)
        _WORKSPACES[key] = workspace
    return workspace


def layer_shape(moe: FusedMoEConfig, group_size: int) -> LayerShape:
    """The admission function's view of a vLLM MoE layer: what this rank holds. Under expert
    parallelism that is E / ep experts (``num_local_experts``, the weights' first dim) at the
    full intermediate size (vLLM's MoE TP size is 1 there), so a contract names the local shape."""
    return LayerShape(
        num_experts=moe.num_local_experts,
        top_k=moe.experts_per_token,
        hidden_size=moe.hidden_dim,
        intermediate_size=moe.intermediate_size_per_partition,
        group_size=group_size,
        dtype=moe.in_dtype,
    )


def unservable_reason(layer, quant_config: AutoAWQConfig) -> Optional[str]:
    """Why the plugin's ops cannot compute this layer exactly, or None when they can.

    The ops implement gated SiLU experts over the E experts this rank holds, weights
    applied after the experts, AWQ 4-bit with zero points; anything else stays
    with vLLM. Under expert parallelism ``apply`` maps the router's global ids
    through the layer's expert map, except where vLLM's ROCm AITER path makes
    ``layer.expert_map`` a 0/1 mask (vLLM 0.26) instead of global -> local ids.
    """
    moe: FusedMoEConfig = layer.moe_config
    expert_parallel = moe.num_local_experts != moe.num_experts
    checks = (
        (quant_config.weight_bits == 4, f"{quant_config.weight_bits}-bit weights"),
        (quant_config.zero_point, "no zero points"),
        (moe.in_dtype in ACTIVATION_DTYPES, f"activation dtype {moe.in_dtype}"),
        (moe.activation == MoEActivation.SILU, f"activation {moe.activation}"),
        (not moe.has_bias, "expert biases"),
        (not (expert_parallel and moe.rocm_aiter_fmoe_enabled), "expert parallelism under ROCm AITER (an expert mask)"),
        (not layer.apply_router_weight_on_input, "router weights applied on the input"),
        (layer.swiglu_limit is None and layer.swiglu_alpha is None, "a clamped/scaled SwiGLU"),
        (not moe.is_lora_enabled, "LoRA on experts"),
    )
    reasons = [what for ok, what in checks if not ok]
    return ", ".join(reasons) if reasons else None


def check_expert_map(layer, moe: FusedMoEConfig) -> None:
    """Refuse a layer whose expert map the ops would misread: once, at load (a host read of a
    small map, before any graph capture). Every global id must have an entry, and the map's
    non-negative entries must be the local ids 0..E_local-1, each once."""
    expert_map = layer.expert_map
    name = getattr(layer, "layer_name", "an MoE layer")
    if expert_map is None:
        if moe.num_local_experts != moe.num_experts:
            raise ValueError(f"{name}: holds {moe.num_local_experts} of {moe.num_experts} experts but has no "
                             "expert map to turn the router's global ids into local ones")
        return
    entries = expert_map.flatten().tolist()
    local = sorted(e for e in entries if e != -1)
    if expert_map.dim() != 1 or len(entries) < moe.num_experts or local != list(range(moe.num_local_experts)):
        raise ValueError(f"{name}: the expert map must give each of the {moe.num_experts} global experts its local "
                         f"id in 0..{moe.num_local_experts - 1} or -1 (another rank), each local id once; got shape "
                         f"{tuple(expert_map.shape)} with local ids {local[:8]}{' ...' if len(local) > 8 else ''}")


class AwqMoeGroupedDecodeMethod(AutoAWQMoEMethod):
    """AWQ MoE through ``torch.ops.moe_grouped_decode``.

    ``admission`` is the layer's contract match (``admits(shape, None)``), or a
    falsy one when the layer is served dense only (no contract, or the switch
    is off) because vLLM has no backend for it on this platform.

    Two graph shapes reach the grouped op. Where vLLM traces into ``apply``
    (its CPU build), the graph holds the dense op and the lowering pass
    rewrites it. Where vLLM hides the layer behind the opaque
    ``vllm::moe_forward`` (its CUDA build), the pass swaps that call for
    ``moe_grouped_decode::vllm_moe_forward_grouped``, which runs the layer
    inside :meth:`grouped_route`, and ``apply`` then takes the grouped op
    for every token count the lookup (``kernels/lookup.py``) routes grouped.
    """

    def __init__(self, quant_config: AutoAWQConfig, moe: FusedMoEConfig, shape: LayerShape, admission: Admission):
        # AutoAWQMoEMethod.__init__ picks a WNA16 kernel backend (and raises
        # where there is none); this method needs none, only its create_weights.
        FusedMoEMethodBase.__init__(self, moe)
        self.quant_config = quant_config
        self.quant_type = scalar_types.uint4
        self.input_dtype = None
        self.use_marlin = False
        self.shape = shape
        self.admission = admission
        self._grouped_route = False
        self.workspace: Optional[torch.Tensor] = None
        self.workspace_tokens = 0  # the most tokens the workspace holds

    @property
    def method_name(self) -> str:
        if not self.admission:
            route = "dense"
        elif batch_invariant():
            route = f"batch-invariant prefill under {self.admission.contract.name}"
        else:
            route = f"grouped under {self.admission.contract.name}"
        return f"{type(self).__name__}({route})"

    def process_weights_after_loading(self, layer) -> None:
        # The tensors stay exactly as loaded; only the grouped route's scratch
        # is added, sized once from the contract window capped by the engine's
        # max_num_batched_tokens (no step holds more tokens than that).
        from .startup import layer_loaded, warm_up_kernels

        check_expert_map(layer, self.moe)
        if self.admission:
            contract = self.admission.contract
            self.workspace_tokens = min(contract.max_tokens, self.moe.max_num_tokens)
            self.workspace = shared_workspace(
                self.workspace_tokens,
                contract.top_k,
                contract.hidden_size,
                contract.intermediate_size,
                layer.w13_qweight.device,
            )
            warm_up_kernels(layer, self)
        layer_loaded(layer.layer_name)

    def get_fused_moe_quant_config(self, layer) -> None:
        return None  # no vLLM modular kernel is involved

    @contextlib.contextmanager
    def grouped_route(self) -> Iterator[None]:
        """Inside this block (eager code only: the opaque op's body), ``apply`` may go grouped."""
        previous, self._grouped_route = self._grouped_route, True
        try:
            yield
        finally:
            self._grouped_route = previous

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        expert_map = layer.expert_map
        if expert_map is not None:
            # expert parallelism: the router's ids are global, the weights hold this rank's experts
            topk_ids = local_expert_ids(topk_ids, expert_map)
        weights = (
            layer.w13_qweight,
            layer.w13_scales,
            layer.w13_qzeros,
            layer.w2_qweight,
            layer.w2_scales,
            layer.w2_qzeros,
            self.quant_config.group_size,
        )
        # x.shape[0] is a host int here (this branch never runs under tracing),
        # so the choice costs no device sync and is fixed inside a captured graph.
        # Data-parallel EP gathers every DP rank's tokens before apply, which can
        # pass what the workspace was sized for (one engine's max_num_batched_tokens).
        num_tokens = x.shape[0]
        # outside tracing, on a GPU, straight to the op's implementation (EAGER_IMPLEMENTATIONS);
        # a tensor subclass (a fake tensor of some other tracer) keeps the ops and their fake kernels
        eager = type(x) is torch.Tensor and not torch.compiler.is_compiling()
        direct = EAGER_IMPLEMENTATIONS.get(x.device.type) if eager else None
        grouped, dense = direct or (torch.ops.moe_grouped_decode.awq_moe_grouped_decode,
                                    torch.ops.moe_grouped_decode.awq_moe_dense)
        if (self._grouped_route and num_tokens <= self.workspace_tokens
                and launch_choice(x.device, self.shape.shape, self.shape.dtype, num_tokens).route == "grouped"):
            return grouped(x, topk_weights, topk_ids, *weights, self.workspace)
        return dense(x, topk_weights, topk_ids, *weights)
