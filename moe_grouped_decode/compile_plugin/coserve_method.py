"""Co-serving: vLLM's own AWQ MoE method on its backend, the few-token steps by the plugin.

Where a layer's measured table does not admit the plugin whole but shows its grouped decode
over vLLM's own tensors faster than vLLM at the first token counts (``tables.coserve_verdict``),
the layer keeps one copy of its weights, in vLLM's layout: vLLM loads and repacks them, builds
its kernel and runs every step, except those whose token count lies in the window, which
``apply`` sends to the plugin's op on the same tensors. Two backends' tensors are read:

* Marlin's (``AwqMarlinCoServedMethod``, ``ops.awq_marlin_grouped_decode``): MARLIN is forced
  through vLLM's own explicit path, the layer's ``moe_config.moe_backend``, so vLLM's checks run
  unchanged and refuse what Marlin cannot serve (a user's ``--moe-backend`` is respected: with
  another backend than Marlin the layer is not co-served);
* Humming's (``AwqHummingCoServedMethod``, ``ops.awq_humming_grouped_decode``), where vLLM 0.32+
  picks HUMMING itself (compute capability 9.0): nothing is forced, and the layer is co-served
  only where its loaded tensors are exactly the layout the kernel reads (``humming_refusal``).

``apply`` is reached the same way in vLLM 0.26, 0.32 and 0.34 (from
``RoutedExperts.forward_modular``; on CUDA inside the opaque ``vllm::moe_forward``, so eagerly,
with the token count a host int), and bypassing vLLM's modular kernel skips its prepare/finalize
and any shared experts it would overlap, so both are checked at load and co-serving is refused
where either does work.
"""

from __future__ import annotations

import logging
import os
from typing import Optional, Tuple

import torch
from vllm.model_executor.layers.fused_moe import FusedMoEConfig
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig, AutoAWQMoEMethod

from ..contract import LayerShape
from ..humming_layout import loaded_layer_refusal
from ..marlin_layout import vllm_scales_grouped
from ..ops import awq_humming_grouped_decode_cuda, awq_marlin_grouped_decode_cuda, local_expert_ids
from .moe_method import check_expert_map
from .vllm_compat import backend_name_of

logger = logging.getLogger("moe_grouped_decode")

# vLLM 0.26 / 0.32 read it to run Marlin on 8-bit activations, which AWQ's 16-bit repack does not fit
MARLIN_INPUT_DTYPE_ENV = "VLLM_MARLIN_INPUT_DTYPE"
# vLLM 0.32+ reads it to quantize Humming's activations, whose tensors are then laid out otherwise
HUMMING_INPUT_QUANT_ENV = "VLLM_HUMMING_INPUT_QUANT_CONFIG"
# the humming-kernels releases whose repack of AutoAWQ layers is the layout the kernel reads (the
# GPU tests compare ``humming_layout`` with 0.1.17's own repack; 0.1.19's repack sources are the same)
HUMMING_TESTED_VERSIONS = ("0.1.17", "0.1.19")
# the kernel over Humming's tensors takes gate and up each on whole 64-column tiles
HUMMING_N_MULTIPLE = 64


class CoserveRefused(ValueError):
    """vLLM would not build the backend co-serving reads for the layer (the layer stays with vLLM's choice)."""


def _parallel_refusal(moe: FusedMoEConfig) -> Optional[str]:
    parallel = getattr(moe, "moe_parallel_config", None)
    if parallel is not None and (int(getattr(parallel, "dp_size", 1) or 1) > 1
                                 or bool(getattr(parallel, "use_all2all_kernels", False))):
        return "data parallelism or all-to-all dispatch (vLLM's kernel moves tokens around the experts)"
    return None


def refusal_before_loading(moe: FusedMoEConfig, shape: LayerShape) -> Optional[str]:
    """Why a layer must not be co-served over Marlin's tensors, from what is known before vLLM loads
    it; or None."""
    why = _parallel_refusal(moe)
    if why is not None:
        return why
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


def humming_refusal_before_loading(moe: FusedMoEConfig, shape: LayerShape) -> Optional[str]:
    """Why a layer must not be co-served over Humming's tensors, from what is known before vLLM
    loads it; or None."""
    why = _parallel_refusal(moe)
    if why is not None:
        return why
    if shape.intermediate_size % HUMMING_N_MULTIPLE:
        return (f"N = {shape.intermediate_size} is not a multiple of {HUMMING_N_MULTIPLE} (up's columns would start "
                "inside one of the kernel's tiles of Humming's W13)")
    if os.environ.get(HUMMING_INPUT_QUANT_ENV):
        return f"{HUMMING_INPUT_QUANT_ENV} is set (Humming on quantized activations)"
    try:
        import humming
    except Exception as error:  # vLLM picked Humming, so it imports; anything else is not what was tested
        return f"humming does not import here ({type(error).__name__})"
    version = str(getattr(humming, "__version__", "unknown"))
    if version not in HUMMING_TESTED_VERSIONS:
        return (f"humming-kernels {version}: its repack is checked against the kernel's layout only for "
                f"{', '.join(HUMMING_TESTED_VERSIONS)}")
    return None


def humming_refusal(layer, shape: LayerShape) -> Optional[str]:
    """Why this loaded layer's Humming tensors are not the layout the kernel reads, or None
    (``humming_layout.loaded_layer_refusal``)."""
    return loaded_layer_refusal(layer, shape.num_experts, shape.hidden_size, shape.intermediate_size,
                                shape.group_size, shape.dtype)


class _CoServedMethod(AutoAWQMoEMethod):
    """vLLM's ``AutoAWQMoEMethod`` on ``BACKEND``, whose ``apply`` gives the plugin's op the token
    counts of ``window``. ``window`` becomes None at load where co-serving must be refused; the
    layer is then exactly vLLM's method on that backend."""

    BACKEND = ""  # vLLM's backend as its selection names it
    FORCE = False  # whether the backend is forced through the layer's moe_config.moe_backend
    # the six tensors the op reads as vLLM's load step names them: W13's weights, scales, zeros, W2's
    TENSOR_NAMES: Tuple[str, ...] = ()

    def __init__(self, quant_config: AutoAWQConfig, moe: FusedMoEConfig, shape: LayerShape,
                 window: Tuple[int, int]):
        # what refuses co-serving before vLLM repacks: the layer then keeps vLLM's own pick
        why = self.refusal_before_loading(moe, shape)
        if why is not None:
            raise CoserveRefused(why)
        forced = self.FORCE and moe.moe_backend == "auto"
        if forced:
            moe.moe_backend = self.BACKEND.lower()
        try:
            super().__init__(quant_config, moe)
        except (ValueError, NotImplementedError) as error:
            raise CoserveRefused(f"vLLM will not run {self.BACKEND.title()} for it: {error}") from error
        finally:
            if forced:
                moe.moe_backend = "auto"
        if backend_name_of(self) != self.BACKEND:
            raise CoserveRefused(f"vLLM picked {backend_name_of(self)}{' (a --moe-backend)' if self.FORCE else ''}, "
                                 f"not {self.BACKEND.title()}")
        self.shape = shape
        self.window: Optional[Tuple[int, int]] = tuple(window)

    @staticmethod
    def refusal_before_loading(moe: FusedMoEConfig, shape: LayerShape) -> Optional[str]:
        raise NotImplementedError

    @property
    def method_name(self) -> str:
        backend = self.BACKEND.title()
        if self.window is None:
            return f"{type(self).__name__}({backend} only)"
        return f"{type(self).__name__}(plugin at {self.window[0]}..{self.window[1]} tokens, {backend} above)"

    def refusal(self, layer) -> Optional[str]:
        """Why the plugin's op must not serve this loaded layer, or None (what could be known before
        loading was asked then: ``refusal_before_loading``)."""
        if not no_dp_ep_prepare_finalize(self.moe_kernel):
            return "vLLM's kernel gathers or dispatches tokens around the experts (data parallelism or all-to-all)"
        if getattr(self, "mk_can_overlap_shared_experts", False):
            return "vLLM's kernel runs the shared experts inside it"
        weights, scales = (getattr(layer, name) for name in self.TENSOR_NAMES[:2])
        if weights.device.type != "cuda":
            return "the weights are not on a CUDA device"
        if scales.dtype != self.shape.dtype:
            return f"scales in {scales.dtype}, activations in {self.shape.dtype}"
        return None

    def layer_tensors(self, layer) -> tuple:
        """The six tensors the op reads, as vLLM's load step left them."""
        return tuple(getattr(layer, name) for name in self.TENSOR_NAMES)

    def kernel(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """The plugin's op on the layer's tensors (ids local to this rank)."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer) -> None:
        from .startup import layer_loaded, refuse_coserving, warm_up_coserved

        super().process_weights_after_loading(layer)  # vLLM's repack and its kernel, untouched
        name = getattr(layer, "layer_name", "an MoE layer")
        try:
            check_expert_map(layer, self.moe)
            why = self.refusal(layer)
            if why is None:
                warm_up_coserved(layer, self)
        except Exception as error:  # vLLM's backend serves the layer whatever the plugin's kernels do
            why = f"{type(error).__name__}: {error}"
        if why is not None:
            logger.warning("moe_grouped_decode: %s stays on vLLM's %s at every token count: %s", name,
                           self.BACKEND.title(), why)
            self.window = None
            refuse_coserving(name, self.shape, why, self.BACKEND)
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
        return self.kernel(layer, x, topk_weights, topk_ids)

    def apply(self, layer, x, topk_weights, topk_ids, *args, **kwargs):
        if self.serves(x):
            return self.coserved_forward(layer, x, topk_weights, topk_ids)
        return super().apply(layer, x, topk_weights, topk_ids, *args, **kwargs)


class AwqMarlinCoServedMethod(_CoServedMethod):
    """Co-served over vLLM's Marlin tensors, MARLIN forced."""

    BACKEND = "MARLIN"
    FORCE = True
    TENSOR_NAMES = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")
    refusal_before_loading = staticmethod(refusal_before_loading)

    def __init__(self, quant_config: AutoAWQConfig, moe: FusedMoEConfig, shape: LayerShape,
                 window: Tuple[int, int]):
        super().__init__(quant_config, moe, shape, window)
        self.scales_grouped = vllm_scales_grouped(shape.group_size, shape.intermediate_size)


    def kernel(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return awq_marlin_grouped_decode_cuda(x, topk_weights, topk_ids, *self.layer_tensors(layer),
                                              self.shape.intermediate_size, self.shape.group_size, self.scales_grouped)


class AwqHummingCoServedMethod(_CoServedMethod):
    """Co-served over vLLM's Humming tensors, where vLLM picks HUMMING itself."""

    BACKEND = "HUMMING"
    TENSOR_NAMES = ("w13_weight", "w13_weight_scale", "w13_zero_point", "w2_weight", "w2_weight_scale",
                    "w2_zero_point")
    refusal_before_loading = staticmethod(humming_refusal_before_loading)

    def refusal(self, layer) -> Optional[str]:
        return humming_refusal(layer, self.shape) or super().refusal(layer)


    def kernel(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        return awq_humming_grouped_decode_cuda(x, topk_weights, topk_ids, *self.layer_tensors(layer),
                                               self.shape.intermediate_size, self.shape.group_size)
