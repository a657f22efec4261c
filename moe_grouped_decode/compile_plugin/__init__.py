"""vLLM general plugin. The only subpackage that imports vllm."""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_registered = False


def register() -> None:
    """``vllm.general_plugins`` entry point: idempotent and cheap in every process."""
    global _registered
    if _registered:
        return
    import moe_grouped_decode  # noqa: F401  (registers the custom ops)

    _registered = True
    logger.debug("moe_grouped_decode plugin registered")
