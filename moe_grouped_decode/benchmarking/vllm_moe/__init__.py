"""Timers for vLLM 0.32's own AWQ MoE backends, MARLIN and HUMMING, at any MoE layer shape.

They time what vLLM runs for a layer (E experts, top-k k, hidden K, intermediate N per rank, AWQ
group G in 32/64/128, fp16 or bf16) the way the shared anchors (../shared/anchors) time their one
shape: vLLM's own kernels driven by a port of vLLM's Python (weight conversion untimed), a CUDA
graph replaying the given layers in turn so L2 stays cold, median of the replays per layer, of
align + W13 + SiLU-and-mul + W2 + sum over top-k. Every shape-dependent choice follows vLLM 0.32's
code for that shape (``shape.py``; checked by tests/test_vllm_moe_timers.py).

    python -m moe_grouped_decode vllm-moe-fetch            # once, on a machine with network
    # on the GPU (humming-kernels installed from .vllm_moe_src/humming_whl for the Humming column)
    from moe_grouped_decode.benchmarking.vllm_moe import time_vllm_backends
    times = time_vllm_backends(layers, group_size=128, Ms=[1, 8, 64], dtype=torch.float16, reps=30,
                               top_k=8)   # or xs={M: x}, plans={M: [(ids, weights) per layer]}
    # {"marlin": {1: 21.3, 8: ...}, "humming": {...} or "not measured: <why>"}

Where vLLM 0.32 is installed with its CUDA ops, those run; else ``marlin_build`` builds them from
the fetched sources on first use (the common ops plus 30 Marlin instantiations per group size,
about a minute on 16 cores). Modules: ``shape`` (vLLM's shape rules), ``sources`` (fetch step),
``marlin_build``, ``ops``, ``marlin``, ``humming``, ``timing``, ``timers``. The device check
against the anchors: ``benchmarks/vllm_moe_check.py``.
"""

from .marlin import MarlinRunner, make_locks, prepare_marlin_layer
from .ops import load_ops
from .shape import MoeShape, awq_tensors
from .timers import BACKENDS, time_vllm_backend_rows, time_vllm_backends

__all__ = ["BACKENDS", "MarlinRunner", "MoeShape", "awq_tensors", "load_ops", "make_locks", "prepare_marlin_layer",
           "time_vllm_backend_rows", "time_vllm_backends"]
