"""Programmatic dependent launch (Hopper and newer) between the grouped op's launches.

A launch made with ``launch_pdl`` may start while the previous one still runs, as
soon as every program of the previous one has called ``let_next_launch_start``;
it must call ``wait_for_previous_launch`` before it reads anything the previous
launch writes. Both are no-ops with ``USE_PDL`` false (older GPUs, the interpreter).
"""

from __future__ import annotations

from typing import Tuple

import torch
import triton
import triton.language as tl


@triton.jit
def let_next_launch_start(USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_for_previous_launch(USE_PDL: tl.constexpr):
    """Block until the previous launch has finished and its writes are visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


def pdl_supported(capability: Tuple[int, int]) -> bool:
    """Programmatic dependent launch needs Hopper or newer and compiled kernels (the
    interpreter's capability is (0, 0))."""
    return torch.version.hip is None and capability[0] >= 9  # ROCm reports major 9 for MI300


def launch_options(use_pdl: bool) -> dict:
    """Extra keyword arguments of a kernel launch that waits for the previous launch."""
    return {"launch_pdl": True} if use_pdl else {}
