"""The host side of the timeline's per-program stamps (kernels/timeline.py; benchmarks/timeline.py)."""

from __future__ import annotations

from typing import Dict

import torch


def alloc_stamps(plan, device) -> Dict[str, torch.Tensor]:
    """Stamp buffers for one call of a timeline ``plan`` (``kernels.plan.GroupedPlan``), filled
    with -1: a program that never stamps leaves it (no time, and SM 0 is a real SM)."""
    return {name: torch.full(shape, -1, dtype=torch.int64, device=device)
            for name, shape in plan.timeline_shapes.items()}
