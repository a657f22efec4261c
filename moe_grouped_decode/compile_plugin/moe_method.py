"""The plugin's MoE method: vLLM's AWQ tensors as loaded, computed by the plugin's ops.

It reuses ``AutoAWQMoEMethod.create_weights`` (same parameter names, shapes and
weight loaders, so checkpoints load exactly as vLLM loads them) and skips
everything after: no Marlin repack, no second copy. ``apply`` calls the dense
op; the compile-time rewrite (``passes.py``) turns it into the grouped op where
the layer's contract admits the step's token count.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.activation import MoEActivation
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod
from vllm.scalar_type import scalar_types

from ..contract import ACTIVATION_DTYPES, Admission, LayerShape, admits
from ..env import batch_invariant
from ..ops import alloc_workspace

# One workspace per (device, rows, K, N): MoE layers run one after another, so
# every layer of a model shares it; allocated once, before any graph capture.
_WORKSPACES: dict = {}


def shared_workspace(max_tokens: int, top_k: int, hidden_size: int, intermediate_size: int, device) -> torch.Tensor:
    key = (str(torch.device(device)), max_tokens * top_k, hidden_size, intermediate_size)
    workspace = _WORKSPACES.get(key)
    if workspace is None:
        workspace = alloc_workspace(max_tokens, top_k, hidden_size, intermediate_size, device)
        _WORKSPACES[key] = workspace
    return workspace


def layer_shape(moe: FusedMoEConfig, group_size: int) -> LayerShape:
    """The admission function's view of a vLLM MoE layer (per-rank sizes)."""
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

    The ops implement gated SiLU experts over all E local experts, weights
    applied after the experts, AWQ 4-bit with zero points; anything else stays
    with vLLM.
    """
    moe: FusedMoEConfig = layer.moe_config
    checks = (
        (quant_config.weight_bits == 4, f"{quant_config.weight_bits}-bit weights"),
        (quant_config.zero_point, "no zero points"),
        (moe.in_dtype in ACTIVATION_DTYPES, f"activation dtype {moe.in_dtype}"),
        (moe.activation == MoEActivation.SILU, f"activation {moe.activation}"),
        (not moe.has_bias, "expert biases"),
        (moe.num_local_experts == moe.num_experts, "expert parallelism (an expert map)"),
        (not layer.apply_router_weight_on_input, "router weights applied on the input"),
        (layer.swiglu_limit is None and layer.swiglu_alpha is None, "a clamped/scaled SwiGLU"),
        (not moe.is_lora_enabled, "LoRA on experts"),
    )
    reasons = [what for ok, what in checks if not ok]
    return ", ".join(reasons) if reasons else None


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
    for every token count ``admits`` accepts.
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

        if self.admission:
            contract = self.admission.contract
            self.workspace = shared_workspace(
                min(contract.max_tokens, self.moe.max_num_tokens),
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
        if self._grouped_route and admits(self.shape, x.shape[0]):
            return torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                x, topk_weights, topk_ids, *weights, self.workspace
            )
        return torch.ops.moe_grouped_decode.awq_moe_dense(x, topk_weights, topk_ids, *weights)
