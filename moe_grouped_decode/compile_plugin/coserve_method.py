"""Co-serving: vLLM's own AWQ MoE method on its Marlin backend, the few-token steps by the plugin.

Where a layer's measured table does not admit the plugin whole but shows its grouped decode
over vLLM's Marlin tensors faster than vLLM at the first token counts
(``tables.coserve_verdict``), the layer keeps one copy of its weights, in vLLM's Marlin layout:
vLLM loads and repacks them, builds its Marlin kernel and runs every step, except those whose
token count lies in the window, which ``apply`` sends to the plugin's op on the same tensors
(``ops.awq_marlin_grouped_decode``).

MARLIN is forced through vLLM's own explicit path, the layer's ``moe_config.moe_backend``, so
vLLM's checks run unchanged and refuse what Marlin cannot serve (a user's ``--moe-backend`` is
respected: with another backend than Marlin the layer is not co-served). ``apply`` is reached the same way in vLLM 0.26,
0.32 and 0.34 (from ``RoutedExperts.forward_modular``; on CUDA inside the opaque
``vllm::moe_forward``, so eagerly, with the token count a host int), and bypassing vLLM's
modular kernel skips its prepare/finalize and any shared experts it would overlap, so both are
checked at load and co-serving is refused where either does work.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod

from ..contract import LayerShape
from ..marlin_layout import vllm_scales_grouped
from ..ops import awq_marlin_grouped_decode_cuda, local_expert_ids
from .moe_method import check_expert_map
from .vllm_compat import backend_name_of

logger = logging.getLogger("moe_grouped_decode")

# vLLM 0.26 / 0.32 read it to run Marlin on 8-bit activations, which AWQ's 16-bit repack does not fit
MARLIN_INPUT_DTYPE_ENV = "VLLM_MARLIN_INPUT_DTYPE"


class CoserveRefused(ValueError):
    """vLLM would not build its Marlin backend for the layer (the layer stays with vLLM's choice)."""


def refusal_before_loading(moe: FusedMoEConfig, shape: LayerShape) -> Optional[str]:
    """Why a layer must not be co-served, from what is known before vLLM loads it; or None."""
    parallel = getattr(moe, "moe_parallel_config", None)
    if parallel is not None and (int(getattr(parallel, "dp_size", 1) or 1) > 1
                                 or bool(getattr(parallel, "use_all2all_kernels", False))):
        return "data parallelism or all-to-all dispatch (vLLM's kernel moves tokens around the experts)"
    if shape.intermediate_size == shape.group_size:
        return "N == G, where vLLM's Marlin reads the scales in another order than it writes them"
    if os.environ.get(MARLIN_INPUT_DTYPE_ENV):
        return f"{MARLIN_INPUT_DTYPE_ENV} is set (Marlin on 8-bit activations)"
    return None


def no_dp_ep_prepare_finalize(moe_kernel) -> bool:
    """Whether vLLM's modular kernel does nothing around the experts (no data-parallel gather, no
    expert-parallel all-to-all), so a call that bypasses it computes the same layer."""
    from vllm.model_executor.layers.fused_moe.prepare_finalize.no_dp_ep import MoEPrepareAndFinalizeNoDPEPModular

    return isinstance(getattr(moe_kernel, "prepare_finalize", None), MoEPrepareAndFinalizeNoDPEPModular)


class AwqMarlinCoServedMethod(AutoAWQMoEMethod):
    """vLLM's ``AutoAWQMoEMethod`` on MARLIN, whose ``apply`` gives the plugin's op the token counts
    of ``window``. ``window`` becomes None at load where co-serving must be refused; the layer is
    then exactly vLLM's Marlin method."""

    def __init__(self, quant_config: AutoAWQConfig, moe: FusedMoEConfig, shape: LayerShape,
                 window: Tuple[int, int]):
        # what refuses co-serving before vLLM repacks for Marlin: the layer then keeps vLLM's own pick
        why = refusal_before_loading(moe, shape)
        if why is not None:
            raise CoserveRefused(why)
        forced = moe.moe_backend == "auto"
        if forced:
            moe.moe_backend = "marlin"
        try:
            super().__init__(quant_config, moe)
        except (ValueError, NotImplementedError) as error:
            raise CoserveRefused(f"vLLM will not run Marlin for it: {error}") from error
        finally:
            if forced:
                moe.moe_backend = "auto"
        if backend_name_of(self) != "MARLIN":
            raise CoserveRefused(f"vLLM picked {backend_name_of(self)} (a --moe-backend), not Marlin")
        self.shape = shape
        self.window: Optional[Tuple[int, int]] = tuple(window)
        self.scales_grouped = vllm_scales_grouped(shape.group_size, shape.intermediate_size)

    @property
    def method_name(self) -> str:
        if self.window is None:
            return f"{type(self).__name__}(Marlin only)"
        return f"{type(self).__name__}(plugin at {self.window[0]}..{self.window[1]} tokens, Marlin above)"

    def refusal(self, layer) -> Optional[str]:
        """Why the plugin's op must not serve this loaded layer, or None (what could be known before
        loading was asked then: ``refusal_before_loading``)."""
        if not no_dp_ep_prepare_finalize(self.moe_kernel):
            return "vLLM's kernel gathers or dispatches tokens around the experts (data parallelism or all-to-all)"
        if getattr(self, "mk_can_overlap_shared_experts", False):
            return "vLLM's kernel runs the shared experts inside it"
        if layer.w13_qweight.device.type != "cuda":
            return "the weights are not on a CUDA device"
        if layer.w13_scales.dtype != self.shape.dtype:
            return f"scales in {layer.w13_scales.dtype}, activations in {self.shape.dtype}"
        return None

    def process_weights_after_loading(self, layer) -> None:
        from .startup import layer_loaded, refuse_coserving, warm_up_coserved

        super().process_weights_after_loading(layer)  # vLLM's repack and its Marlin kernel, untouched
        name = getattr(layer, "layer_name", "an MoE layer")
        try:
            check_expert_map(layer, self.moe)
            why = self.refusal(layer)
            if why is None:
                warm_up_coserved(layer, self)
        except Exception as error:  # vLLM's Marlin serves the layer whatever the plugin's kernels do
            why = f"{type(error).__name__}: {error}"
        if why is not None:
            logger.warning("moe_grouped_decode: %s stays on vLLM's Marlin at every token count: %s", name, why)
            self.window = None
            refuse_coserving(name, self.shape, why)
        layer_loaded(name)

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the plugin's op takes this call: a plain CUDA tensor (not under a tracer) whose
        token count, a host int here, is in the window."""
        window = self.window
        return (window is not None and window[0] <= x.shape[0] <= window[1] and type(x) is torch.Tensor
                and x.is_cuda and not torch.compiler.is_compiling())

    def coserved_forward(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        if layer.expert_map is not None:
            topk_ids = local_expert_ids(topk_ids, layer.expert_map)
        return awq_marlin_grouped_decode_cuda(x, topk_weights, topk_ids, layer.w13_qweight, layer.w13_scales,
                                              layer.w13_qzeros, layer.w2_qweight, layer.w2_scales, layer.w2_qzeros,
                                              self.shape.intermediate_size, self.shape.group_size, self.scales_grouped)

    def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
        if self.serves(x):
            return self.coserved_forward(layer, x, topk_weights, topk_ids)
        return super().apply(layer, x, topk_weights, topk_ids, *args, **kwargs)
