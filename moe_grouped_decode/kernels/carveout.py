"""The shared-memory carveout of the grouped op's launches: how much of an SM's unified L1 and
shared memory is shared memory (on Hopper one of 0, 8, 16, 32, 64, 100, 132, 164, 196, 228 KB
of 256).

An SM runs programs of two kernels side by side only while its current carveout serves both.
Without a preference the driver picks one per kernel from its resources, so whether the W2
programs launched early (PDL) start beside W13's, and load their first weights during W13,
hinges on both kernels' register counts: at M = 2 a W2 of 56 registers instead of 72, or a W13
with a 2-stage ring, keeps W2 off until W13's programs leave (~5 us; explorations runs 73-75,
docs/PERF.md). A config's ``max_shared_carveout`` gives both launches the largest carveout, so
neither can ask for one the other's SMs lack. Preferences between the smallest and the largest
are no cure: most of them bring the same ~4 us cliff (run 74).
"""

from __future__ import annotations

import ctypes
from typing import Dict, Optional

_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_MAX_SHARED = 100  # percent: CU_SHAREDMEM_CARVEOUT_MAX_SHARED
_NO_PREFERENCE = -1  # CU_SHAREDMEM_CARVEOUT_DEFAULT
_libcuda: Optional[ctypes.CDLL] = None
_preferences: Dict[int, int] = {}  # CUfunction -> the preference it was last given here


def prefer_max_shared_carveout(kernel, prefer: bool) -> None:
    """Give the compiled ``kernel`` (what a Triton launch returns) the largest carveout as its
    preference, or (``prefer`` False) none. A function attribute: it holds from the kernel's next
    launch on, and every caller launches eagerly before a CUDA-graph capture. Set only when it
    changes (a kernel binary can serve configs with either)."""
    want = _MAX_SHARED if prefer else _NO_PREFERENCE
    if _preferences.get(kernel.function, _NO_PREFERENCE) == want:
        return
    global _libcuda
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    result = _libcuda.cuFuncSetAttribute(ctypes.c_void_p(kernel.function), _PREFERRED_SHARED_MEMORY_CARVEOUT,
                                         ctypes.c_int(want))
    if result != 0:
        raise RuntimeError(f"cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT, {want}) on {kernel.name} "
                           f"failed: CUresult {result}")
    _preferences[kernel.function] = want
