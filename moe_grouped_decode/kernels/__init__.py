"""Triton kernels and their launch plans and configurations. No torch.library here. This module:
what the plans and tables need to know of a device (``DeviceFacts``), asked once per device.

    plan.py          both routes' launch plans: which kernels, grids and constexprs; the loop that runs them
    launcher.py      one launch: Triton's dispatch the first time, its compiled binary directly after
    w13_gluon.py     W13 (split-K partials), loads staged in shared memory (Gluon)
    w13_tl.py        the same W13 in Triton tl (the interpreter, no Gluon, the switch off)
    w2_gluon.py      W2 + SiLU + fused combine, weights staged in shared memory (Gluon)
    w2_tl.py         the same W2 in Triton tl
    expert_sort.py   the prefill route's on-device sort of the routed rows into per-expert groups
    prefill_wgmma.py the prefill route's W13 + SiLU and W2 over those groups on wgmma, the weights its
                     register operand (Gluon, Hopper: what the H200's table names)
    prefill.py       the same on mma.sync over groups of 8-32 rows (elsewhere, up to 32-row groups)
    prefill_dot.py   the same on tl.dot over groups of 16-256 rows (elsewhere, larger groups)
    combine.py       the weighted combine over a token's k rows (both routes)
    overflow.py      the combine launches' float64 recompute of a token whose sums overflowed
    awq_mma.py       AutoAWQ nibbles dequantized into mma.sync fragments (inline PTX; interpreter emulation)
    awq_tiles.py     AutoAWQ's column order; silu_mul
    marlin_grouped.py the grouped decode over vLLM's Marlin tensors (one weight copy with vLLM's
                     MARLIN backend; not yet wired into the ops)
    marlin_mma.py    Marlin words as mma.sync fragments (inline PTX; interpreter emulation)
    gluon_helpers.py what the Gluon kernels share (availability, clock, PDL)
    pdl.py           programmatic dependent launch for the tl kernels
    carveout.py      the shared-memory carveout preference of a compiled kernel
    timeline.py      the in-kernel timestamps (compiled out unless a plan asks for them)
    config.py        launch configs, the measured tables (configs/*.json), the autotune cache
    lookup.py        the one lookup: (device, layer shape, dtype, M) -> the route and its launch config
"""

import os
from dataclasses import dataclass
from typing import Dict, Tuple

import torch

# The grouped kernels multiply on tensor cores with mma.sync m16n8k16 (awq_mma.py): Ampere and newer.
MIN_CUDA_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class DeviceFacts:
    """What the launch tables and plans need to know of a device."""

    name: str  # the GPU's name as the measured tables key it; the device type off CUDA
    capability: Tuple[int, int]  # what the kernels compile for; (0, 0) off CUDA and under the interpreter


_FACTS: Dict[torch.device, DeviceFacts] = {}


def query_device_name(device: torch.device) -> str:
    """The GPU's name as the launch tables key it (``torch.cuda.get_device_name``); the device
    type elsewhere."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def query_capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability the kernels are compiled for on ``device``; (0, 0) off CUDA and under
    the interpreter (no PTX runs)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return (0, 0)
    return tuple(torch.cuda.get_device_capability(device))


def device_facts(device) -> DeviceFacts:
    """``device``'s name and capability, asked once per device (every call of the ops reads them:
    the question must not reach the driver each time)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # "cuda" means the current device, which a later set_device may change: keyed by its index
        device = torch.device("cuda", torch.cuda.current_device())
    facts = _FACTS.get(device)
    if facts is None:
        facts = _FACTS[device] = DeviceFacts(query_device_name(device), query_capability(device))
    return facts


def forget_device_facts() -> None:
    """Ask every device again at its next use (tests that fake a device)."""
    _FACTS.clear()


def device_name(device) -> str:
    """``device_facts(device).name``."""
    return device_facts(device).name


def cuda_capability(device) -> Tuple[int, int]:
    """``device_facts(device).capability``."""
    return device_facts(device).capability
