"""Startup decisions: can the grouped route run here, which layers took it, warmup.

Every layer's decision is :func:`moe_grouped_decode.contract.choose_method`'s and every
token count's route is the lookup's (``kernels/lookup.py``); this module only records the
answers and reports them once.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

from ..contract import Admission, LayerChoice, LayerShape
from ..env import (FORCE_ENV, GROUPED_DECODE_ENV, GroupedDecodeMode, batch_invariant, coserve_enabled, direct_launch,
                   force_plugin, gluon_w13_enabled, grouped_decode_mode, switch_setting)
from ..kernels import MIN_CUDA_CAPABILITY

logger = logging.getLogger("moe_grouped_decode")


def kernels_unavailable_reason(device_type: str, capability: Optional[Tuple[int, int]] = None) -> Optional[str]:
    """What is missing for the grouped op to run on ``device_type``, or None.

    CPU: nothing (the ops' torch implementations run anywhere). CUDA: compute
    capability ``MIN_CUDA_CAPABILITY`` or newer (when ``capability`` is known), Triton,
    and CUDA implementations registered for both ops (``moe_grouped_decode.ops.cuda``).
    Any other device: the ops have no implementation there.
    """
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return f"no implementation of the moe_grouped_decode ops for device type {device_type!r}"
    if capability is not None and tuple(capability) < MIN_CUDA_CAPABILITY:
        return (f"the grouped kernels need a GPU of compute capability {MIN_CUDA_CAPABILITY[0]}."
                f"{MIN_CUDA_CAPABILITY[1]} or newer (tensor-core mma.sync), this one is {capability[0]}.{capability[1]}")
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed (pip install triton)"
    missing = [
        op
        for op in ("awq_moe_dense", "awq_moe_grouped_decode")
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"moe_grouped_decode::{op}", "CUDA")
    ]
    if missing:
        return f"no CUDA kernel registered for {', '.join(missing)} (moe_grouped_decode.ops.cuda)"
    return None


def device_capability(platform) -> Optional[Tuple[int, int]]:
    """(major, minor) of vLLM's current platform's device, or None (CPU, unknown). vLLM's
    CUDA platform asks NVML, so this does not initialize CUDA in the calling process."""
    capability = platform.get_device_capability()
    return None if capability is None else (capability.major, capability.minor)


def device_name(platform) -> Optional[str]:
    """The GPU's name as the measured tables key it (vLLM's CUDA platform asks NVML, so this does not
    initialize CUDA in the calling process); None off CUDA or where the platform cannot say."""
    if platform.device_type != "cuda":
        return None
    try:
        return platform.get_device_name()
    except Exception:  # a platform without NVML: no table is this GPU's (vLLM keeps the layers)
        return None


def check_switch(device_type: str, capability: Optional[Tuple[int, int]] = None) -> bool:
    """Whether the grouped route is on for this process; fail closed on an explicit 1.

    ``MOE_GROUPED_DECODE=0`` (or its old name ``VLLM_AWQ_MOE_GROUPED_DECODE``): off. Unset: on where the kernels can run,
    silently off elsewhere. ``=1`` where they cannot run: RuntimeError naming
    what is missing. ``capability``: the GPU's (major, minor), as vLLM's platform
    reports it without initializing CUDA (None where unknown).
    """
    mode = grouped_decode_mode()
    gluon_w13_enabled()  # parsed now: a bad value fails at startup, not at the first decode step
    direct_launch()
    coserve_enabled()
    force = force_plugin()  # and a force that contradicts the rollback
    if mode is GroupedDecodeMode.OFF:
        return False
    missing = kernels_unavailable_reason(device_type, capability)
    if missing is None:
        return True
    if mode is GroupedDecodeMode.REQUIRED or force:
        name = switch_setting(GROUPED_DECODE_ENV)[0] if mode is GroupedDecodeMode.REQUIRED else FORCE_ENV
        raise RuntimeError(
            f"{name}=1 requires the grouped decode kernels, which cannot run on "
            f"this {device_type} platform: {missing}. Unset {name} to fall back "
            "to the dense route silently, or set it to 0 to roll back."
        )
    return False


@dataclass(frozen=True)
class LayerDecision:
    shape: LayerShape
    choice: LayerChoice
    vllm_backend: Optional[str]  # what vLLM's own selection answered for the layer (None: no backend here)

    @property
    def admission(self) -> Admission:  # falsy: the plugin's dense route, or vLLM's method
        return self.choice.admission

    @property
    def served_by_plugin(self) -> bool:
        return self.choice.served_by_plugin


# layer name -> what was decided when the model was built (this process)
LAYER_DECISIONS: Dict[str, LayerDecision] = {}
_loaded_layers: set = set()
_reported = False


_left_to_vllm_logged: set = set()


def record_layer(layer_name: str, decision: LayerDecision) -> None:
    """Remember a layer's decision (made while vLLM builds the model). A layer left to vLLM is
    said at once, once per shape and reason: vLLM's own method loads it, so the summary that the
    plugin's layers log once loaded may never come."""
    LAYER_DECISIONS[layer_name] = decision
    logger.debug("%s: %s (%s)", layer_name, decision.choice.route, decision.choice.reason)
    key = (decision.shape, decision.vllm_backend, decision.choice.reason)
    if decision.choice.route == "vllm" and key not in _left_to_vllm_logged:
        _left_to_vllm_logged.add(key)
        s = decision.shape
        logger.info("moe_grouped_decode: MoE layers of shape E=%d k=%d K=%d N=%d G=%d %s (first: %s) left to "
                    "vLLM's own %s backend: %s. %s=1 serves them with the plugin anyway, unmeasured",
                    s.num_experts, s.top_k, s.hidden_size, s.intermediate_size, s.group_size,
                    str(s.dtype).removeprefix("torch."), layer_name, decision.vllm_backend, decision.choice.reason,
                    FORCE_ENV)


def layer_loaded(layer_name: str) -> None:
    """Called once the plugin's method has a layer's weights; logs the summary once.

    Weights are processed after the whole model is built, so when every layer
    the plugin serves has reported, every decision is known.
    """
    global _reported
    _loaded_layers.add(layer_name)
    served = {name for name, d in LAYER_DECISIONS.items() if d.choice.route != "vllm"}
    if not _reported and served <= _loaded_layers:
        _reported = True
        logger.info("moe_grouped_decode: %s", summary())


def summary() -> str:
    """One line: which layers the plugin serves (under which contract, or dense) and which it
    leaves to vLLM's own backend, with the reasons."""
    by_contract: Dict[str, list] = {}
    dense: Dict[str, list] = {}
    coserved: Dict[str, list] = {}
    vllm_own: Dict[str, list] = {}
    for name, decision in LAYER_DECISIONS.items():
        if decision.choice.coserve_window is not None:
            coserved.setdefault(decision.choice.reason, []).append(name)
        elif decision.admission:
            by_contract.setdefault(decision.admission.contract.name, []).append(name)
        elif decision.served_by_plugin:
            dense.setdefault(decision.choice.reason, []).append(name)
        else:
            vllm_own.setdefault(f"{decision.vllm_backend}: {decision.choice.reason}", []).append(name)

    def routes(names) -> str:
        if batch_invariant():
            return "batch-invariant mode: the prefill route at every token count"
        d = LAYER_DECISIONS[names[0]]
        c = d.admission.contract
        return f"grouped route for {c.min_tokens}..{c.max_tokens} tokens; {d.choice.reason}"

    parts = [f"{len(names)} MoE layer(s) admitted under contract {contract!r} ({routes(names)}): {_names(names)}"
             for contract, names in by_contract.items()]
    parts += [f"{len(names)} served by the plugin's dense route ({why}): {_names(names)}"
              for why, names in dense.items()]
    parts += [f"{len(names)} {why}: {_names(names)}" for why, names in coserved.items()]
    parts += [f"{len(names)} left to vLLM's own backend {why}: {_names(names)}" for why, names in vllm_own.items()]
    return "; ".join(parts) if parts else "no MoE layers seen"


def _names(names) -> str:
    return ", ".join(names) if len(names) <= 3 else f"{names[0]} ... {names[-1]}"


_warmed_up: set = set()  # (layer shape, device) already compiled in this process


def warm_up_kernels(layer, method) -> None:
    """Compile every kernel variant any token count will launch, before graph capture: the grouped
    op at every count the method's workspace holds that the lookup routes grouped (the lookup
    ``apply`` asks), the prefill route at the counts that cover all of its binaries up to the
    engine's limit. Triton compiles a variant the first time a launch needs it; doing it here,
    at weight-loading time, keeps compilation out of CUDA-graph capture and out of serving. Once
    per layer shape and device; the CPU implementation has nothing to compile.
    """
    if layer.w13_qweight.device.type != "cuda":
        return
    from ..awq import AwqMoeWeights
    from ..kernels.lookup import grouped_token_counts
    from ..ops import cuda

    shape = method.shape
    key = (shape, str(layer.w13_qweight.device))
    if key in _warmed_up:
        return
    _warmed_up.add(key)
    weights = AwqMoeWeights(layer.w13_qweight, layer.w13_scales, layer.w13_qzeros, layer.w2_qweight, layer.w2_scales,
                            layer.w2_qzeros, shape.group_size)
    cuda.watch_compiles_after_warmup(logger.warning)  # a binary missed here would compile in capture or serving
    grouped = grouped_token_counts(layer.w13_qweight.device, shape.shape, shape.dtype, method.workspace_tokens)
    cuda.warmup(weights, shape.top_k, grouped, dense_token_counts=cuda.prefill_warmup_counts(method.moe.max_num_tokens),
                workspace=method.workspace)


def refuse_coserving(layer_name: str, shape: LayerShape, why: str, vllm_backend: str = "MARLIN") -> None:
    """A co-served layer refused at load: it runs vLLM's ``vllm_backend`` at every token count, and
    its recorded decision (the summary, the e2e reports) says so."""
    reason = f"not co-served: {why}"
    record_layer(layer_name, LayerDecision(shape, LayerChoice(False, Admission(None, reason), reason), vllm_backend))


def warm_up_coserved(layer, method) -> None:
    """Compile the co-served kernels (one launch per token count of the window: each count's launch
    config is the table's) on the layer's own tensors, before graph capture; once per layer shape,
    backend and device."""
    shape = method.shape
    device = method.layer_tensors(layer)[0].device
    key = ("coserved", method.BACKEND, shape, str(device))
    if key in _warmed_up:
        return
    _warmed_up.add(key)
    lo, hi = method.window
    for M in range(lo, hi + 1):
        x = torch.zeros(M, shape.hidden_size, dtype=shape.dtype, device=device)
        ids = (torch.arange(M * shape.top_k, device=device, dtype=torch.int32) % shape.num_experts).view(M, -1)
        weights = torch.full((M, shape.top_k), 1.0 / shape.top_k, dtype=torch.float32, device=device)
        method.kernel(layer, x, weights, ids)
    torch.cuda.synchronize(device)
