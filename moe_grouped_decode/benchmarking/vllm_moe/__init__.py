"""Timers for vLLM 0.32's own AWQ MoE backends, MARLIN and HUMMING, at any MoE layer shape.

``shape``: what vLLM 0.32 decides from a layer's shape; ``sources``: the fetch step
(``python -m moe_grouped_decode vllm-moe-fetch``).
"""

from .shape import MoeShape

__all__ = ["MoeShape"]
