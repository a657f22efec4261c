"""The shared-memory carveout of the grouped op's launches: how much of an SM's unified L1 and
shared memory is shared memory (on Hopper one of 0, 8, 16, 32, 64, 100, 132, 164, 196, 228 KB
of 256).

An SM runs programs of two kernels side by side only while its current carveout serves both.
Without a preference the driver picks one per kernel from its resources, so whether the W2
programs launched early (PDL) start beside W13's, and load their first weights during W13,
hinges on both kernels' register counts: at M = 2 a W2 of 56 registers instead of 72, or a W13
with a 2-stage ring, keeps W2 off until W13's programs leave (~5 us; docs/PERF.md). A config's
``max_shared_carveout`` gives both launches the largest carveout, so neither can ask for one
the other's SMs lack. Preferences between the smallest and the largest are no cure: most of
them bring a cliff of 3-5 us.

The preference is an attribute of a compiled kernel (a CUfunction), not of a launch, so every
grouped kernel is defined twice over one source (``*_kernel`` and ``*_kernel_max_carveout``):
two JIT functions keep two sets of binaries, and no launch runs under another config's
preference.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Set

_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_MAX_SHARED = 100  # percent: CU_SHAREDMEM_CARVEOUT_MAX_SHARED
_libcuda: Optional[ctypes.CDLL] = None
_preferred: Set[int] = set()  # the CUfunctions given the preference


def prefer_max_shared_carveout(kernel) -> None:
    """Give the compiled ``kernel`` (what a Triton launch of a ``*_max_carveout`` JIT function
    returns) the largest carveout as its preference, once. It holds from the
    kernel's next launch on: the first launch of each binary runs under the driver's choice
    (only slower; callers launch eagerly before they capture a CUDA graph)."""
    if kernel.function in _preferred:
        return
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    result = _libcuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), _PREFERRED_SHARED_MEMORY_CARVEOUT,
                                         ctypes.c_int(_MAX_SHARED))
    if result != 0:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, {_MAX_SHARED}) on {kernel.name} "
                           f"failed: CUresult {result}")
    _preferred.add(kernel.function)
