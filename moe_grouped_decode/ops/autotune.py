"""The opt-in autotune (``MOE_GROUPED_DECODE_TUNE=1``): search the small config space of
one shape and token count at warmup, keep the fastest, cache it on disk.

It times each candidate as the benchmark does (CUDA-graph replay, routings over all E experts
so the weights mostly miss L2) and writes the launch tables' entry format
(``kernels.config``), keyed by shape, GPU, kernel family, dtype and M.
"""

from __future__ import annotations

import logging

import torch

from ..awq import AwqMoeWeights
from ..benchmarking.replay import graph_replay_us
from ..kernels import config as kernel_config
from ..kernels import device_facts, plan
from .cuda import launch_grouped, layer_shape, random_routing

log = logging.getLogger(__name__)


def load_tuned_cache(device: torch.device) -> None:
    """Read this GPU's tuning cache (once per process)."""
    import triton

    if device.type == "cuda":
        kernel_config.load_tuned(kernel_config.cache_path(device_facts(device).name, triton.__version__))


def tune_grouped(hidden_states, topk_weights, weights: AwqMoeWeights, workspace, routings: int = 16,
                 replays: int = 20) -> kernel_config.GroupedConfig:
    """The fastest candidate for the shape and token count of ``hidden_states`` [M, K]; cached
    on disk (a cached answer is returned without timing)."""
    import triton

    device = hidden_states.device
    M, K = hidden_states.shape
    top_k = topk_weights.shape[1]
    gen = torch.Generator(device=device).manual_seed(1234)
    ids = [random_routing(M, top_k, weights.num_experts, device, gen) for _ in range(routings)]
    shape = layer_shape(hidden_states, ids[0], weights)
    facts = device_facts(device)
    kernels = plan.kernel_family(facts)
    key = (shape, facts.name, kernels, plan.DTYPE_NAMES[hidden_states.dtype], M)
    cached = kernel_config.tuned_config(key)
    if cached is not None:
        return cached
    out = torch.empty_like(hidden_states)
    best, best_us = None, float("inf")
    for candidate in kernel_config.grouped_candidates(facts.capability, kernels):
        config = candidate.fitted(K)

        def step(i: int, config=config) -> None:
            launch_grouped(hidden_states, topk_weights, ids[i], weights, workspace, out, config)

        us = graph_replay_us(step, routings, replays)
        if us < best_us:
            best, best_us = candidate, us
    log.info("moe_grouped_decode: tuned %s M=%d -> %s (%.2f us)", shape, M, best, best_us)
    kernel_config.store_tuned(kernel_config.cache_path(facts.name, triton.__version__), key, best)
    return best
