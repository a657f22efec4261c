"""Expert parallelism's id mapping: the router's global expert ids as one rank's local ids.

Under vLLM's expert parallelism a rank holds E / ep whole experts; ``expert_map[g]`` is global
expert g's local id there, or -1 where another rank holds it. The ops give an id outside
[0, E_local) no contribution, so a rank's op on the mapped ids computes its share of every token
and vLLM's all-reduce sums the ranks. Pure torch, on the ids' device, no host sync (CUDA-graph
safe); the vLLM method (``compile_plugin/moe_method.py``) calls it per layer.
"""

from __future__ import annotations

import torch


def local_expert_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor) -> torch.Tensor:
    """The router's global expert ids as this rank's local ids, int32, on the device.

    An id outside the map (vLLM's -1 for an unused slot, or any other) must not index it
    directly: -1 would wrap to the last global expert, which may be local here, and a large id
    would read out of bounds. Clamped to [-1, n] (n global experts), every such id reads the -1
    appended at index n (index -1 of the padded map is that entry).
    """
    num_global = expert_map.shape[0]
    padded = torch.nn.functional.pad(expert_map, (0, 1), value=-1)
    return padded[topk_ids.clamp(-1, num_global)].to(torch.int32)
