"""@triton.jit kernels and their launch configurations. No torch.library here."""

import functools
import os
from typing import Tuple

import torch

# The grouped kernels multiply on tensor cores with mma.sync m16n8k16 (awq_mma.py): Ampere and newer.
MIN_CUDA_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=None)
def cuda_capability(device: torch.device) -> Tuple[int, int]:
    """Compute capability the kernels are compiled for on ``device``, asked once per device
    (every grouped call asks); (0, 0) off CUDA and under the interpreter (no PTX runs)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET", "0") == "1":
        return (0, 0)
    return torch.cuda.get_device_capability(device)
