"""Inductor pattern passes: rewrite dense MoE calls into the grouped decode op.

``GroupedDecodePass`` is a post-grad ``CustomGraphPass``; ``install`` and
``grouped_decode_installed`` put it into ``torch._inductor.config`` next to any
custom post-grad pass already there.
"""

from .grouped_decode import GroupedDecodePass, RewriteReport, Route, choose_route
from .install import ComposedGraphPass, composed_with_installed, grouped_decode_installed, install

__all__ = [
    "GroupedDecodePass",
    "RewriteReport",
    "Route",
    "choose_route",
    "ComposedGraphPass",
    "composed_with_installed",
    "grouped_decode_installed",
    "install",
]
