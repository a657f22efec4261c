"""Install the pass into ``torch._inductor.config.post_grad_custom_post_pass`` for plain torch users.

Inductor holds one post-grad custom post pass (torch 2.13 also accepts a list;
torch 2.11 does not), so installing composes: whatever is there keeps running,
in order, followed by the grouped decode pass, inside one
:class:`ComposedGraphPass` whose uuid combines theirs. At most one
GroupedDecodePass is ever installed: installing again replaces it, which makes
repeated installs (vLLM loads plugins more than once) harmless.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional, Tuple

import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass

from .grouped_decode import GroupedDecodePass


class ComposedGraphPass(CustomGraphPass):
    """Runs several post-grad passes in order; its uuid is theirs together (None if any lacks one)."""

    def __init__(self, *passes: Any) -> None:
        self.passes: Tuple[Any, ...] = passes

    def __call__(self, graph) -> None:
        for graph_pass in self.passes:
            graph_pass(graph)

    def uuid(self) -> Optional[Tuple[Any, ...]]:
        # A pass without a uuid cannot be part of a cache key: returning None makes
        # Inductor bypass its FX graph cache rather than reuse a stale graph.
        uuids = tuple(p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.passes)
        return None if any(u is None for u in uuids) else uuids


def _flatten(installed: Any) -> Tuple[Any, ...]:
    if installed is None:
        return ()
    if isinstance(installed, (list, tuple)):
        return tuple(p for item in installed for p in _flatten(item))
    if isinstance(installed, ComposedGraphPass):
        return _flatten(installed.passes)
    return (installed,)


def composed_with_installed(grouped_pass: GroupedDecodePass, installed: Any) -> Any:
    """``installed`` (None, a pass, a list or a composition) followed by ``grouped_pass``."""
    others = tuple(p for p in _flatten(installed) if not isinstance(p, GroupedDecodePass))
    return ComposedGraphPass(*others, grouped_pass) if others else grouped_pass


def install(grouped_pass: Optional[GroupedDecodePass] = None) -> GroupedDecodePass:
    """Install (for the rest of the process) and return the pass now in Inductor's config."""
    grouped_pass = grouped_pass or GroupedDecodePass()
    inductor_config.post_grad_custom_post_pass = composed_with_installed(
        grouped_pass, inductor_config.post_grad_custom_post_pass
    )
    return grouped_pass


@contextlib.contextmanager
def grouped_decode_installed(grouped_pass: Optional[GroupedDecodePass] = None) -> Iterator[GroupedDecodePass]:
    """Install for the duration of a block; the previous setting is restored on exit."""
    grouped_pass = grouped_pass or GroupedDecodePass()
    composed = composed_with_installed(grouped_pass, inductor_config.post_grad_custom_post_pass)
    with inductor_config.patch(post_grad_custom_post_pass=composed):
        yield grouped_pass
