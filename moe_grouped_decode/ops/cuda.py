"""CUDA implementations of the ops, launching the Triton kernels in ``..kernels``.

Nothing here reads tensor data on the host: validation is shape-only
(``check_moe_args``), every launch grid is fixed by the static shapes, and the
grouped op's scratch is carved from the caller's ``workspace``. ``warmup``
compiles every kernel variant (and, opt-in, autotunes) before CUDA-graph capture.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional, Sequence

import torch

from .. import env
from .awq_moe import awq_moe_dense, awq_moe_grouped_decode, check_moe_args
from .workspace import workspace_views

log = logging.getLogger(__name__)

_DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


def _shape(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size):
    return (int(w13_qweight.shape[0]), int(topk_ids.shape[1]), int(hidden_states.shape[1]), int(w2_qweight.shape[1]), int(group_size))


def _ensure_tuned_cache_loaded() -> None:
    from ..kernels import configs
    import triton

    configs.load_tuned(configs.cache_path(torch.cuda.get_device_name(), triton.__version__))


def launch_grouped(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                    w2_qweight, w2_scales, w2_qzeros, group_size, workspace, out, config=None):
    """Launch the grouped decode into ``out`` (no checks, no allocation); ``config`` overrides
    the table/tuned launch config (benchmarks and the tuner use this)."""
    from ..kernels import configs, cuda_capability, grouped

    M, K = hidden_states.shape
    shape = _shape(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size)
    if config is None:
        ring = grouped.ring_available(cuda_capability(hidden_states.device))
        config = configs.grouped_config(shape, _DTYPE_NAMES[hidden_states.dtype], M, ring)
    views = workspace_views(workspace, M * shape[1], K, shape[3])
    grouped.grouped_decode(
        hidden_states, topk_weights.contiguous(), topk_ids.contiguous(),
        w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size,
        views, out, config,
    )


@awq_moe_grouped_decode.register_kernel("cuda")
def _awq_moe_grouped_decode_cuda(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                                 w2_qweight, w2_scales, w2_qzeros, group_size, workspace):
    check_moe_args("awq_moe_grouped_decode", hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales,
                   w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size, workspace)
    out = torch.empty_like(hidden_states)
    if hidden_states.shape[0] == 0:
        return out
    launch_grouped(hidden_states.contiguous(), topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                    w2_qweight, w2_scales, w2_qzeros, group_size, workspace, out)
    return out


@awq_moe_dense.register_kernel("cuda")
def _awq_moe_dense_cuda(hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales, w13_qzeros,
                        w2_qweight, w2_scales, w2_qzeros, group_size):
    from ..kernels import configs, dense

    check_moe_args("awq_moe_dense", hidden_states, topk_weights, topk_ids, w13_qweight, w13_scales,
                   w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size)
    out = torch.empty_like(hidden_states)
    M = hidden_states.shape[0]
    if M == 0:
        return out
    config = configs.dense_config(_shape(hidden_states, topk_ids, w13_qweight, w2_qweight, group_size), M)
    dense.dense_moe(
        hidden_states.contiguous(), topk_weights.contiguous(), topk_ids.contiguous(),
        w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros, group_size, out, config,
    )
    return out


def _random_routing(num_tokens: int, top_k: int, num_experts: int, device, generator) -> torch.Tensor:
    scores = torch.rand(num_tokens, num_experts, device=device, generator=generator)
    return scores.topk(top_k, dim=1).indices.to(torch.int32)


def graph_replay_us(step: Callable[[int], None], calls: int, replays: int = 30) -> float:
    """Median microseconds per call of one CUDA graph that runs ``step(i)`` for i < ``calls``.

    Every call runs once before the capture (Triton compiles, the allocator
    settles); the benchmark, the TP4 check and the autotune all time this way.
    """
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            step(i)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(calls):
                step(i)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000.0 / calls)
    del graph
    return sorted(times)[len(times) // 2]


def _time_grouped(args, workspace, config, routings, replays: int = 20) -> float:
    """Median microseconds of one grouped call under CUDA-graph replay, cycling routings
    over all E experts so that the active experts' weights mostly miss L2."""
    hidden_states, topk_weights, _, *weights = args
    out = torch.empty_like(hidden_states)

    def step(i: int) -> None:
        launch_grouped(hidden_states, topk_weights, routings[i], *weights, workspace, out, config)

    return graph_replay_us(step, len(routings), replays)


def _tune_grouped(hidden_states, topk_weights, weights: Sequence[torch.Tensor], group_size, workspace, num_tokens) -> None:
    """Search the small config space for one token count; cache the winner on disk."""
    from ..kernels import configs, cuda_capability, grouped
    import triton

    E, top_k = weights[0].shape[0], topk_weights.shape[1]
    shape = _shape(hidden_states, topk_weights, weights[0], weights[3], group_size)
    dtype_name = _DTYPE_NAMES[hidden_states.dtype]
    path = configs.cache_path(torch.cuda.get_device_name(), triton.__version__)
    capability = cuda_capability(hidden_states.device)
    ring = grouped.ring_available(capability)
    if configs.tuned_config(shape, dtype_name, num_tokens, ring) is not None:
        return
    gen = torch.Generator(device=hidden_states.device).manual_seed(1234)
    routings = [_random_routing(num_tokens, top_k, E, hidden_states.device, gen) for _ in range(16)]
    args = (hidden_states[:num_tokens], topk_weights[:num_tokens], None, *weights, group_size)
    best, best_us = None, float("inf")
    for candidate in configs.grouped_candidates(capability, ring):
        us = _time_grouped(args, workspace, candidate.fitted(shape[2]), routings)
        if us < best_us:
            best, best_us = candidate, us
    log.info("moe_grouped_decode: tuned %s M=%d -> %s (%.2f us)", shape, num_tokens, best, best_us)
    configs.store_tuned(path, configs.shape_key(shape, dtype_name, num_tokens, ring), best)


def warmup(
    w13_qweight: torch.Tensor, w13_scales: torch.Tensor, w13_qzeros: torch.Tensor,
    w2_qweight: torch.Tensor, w2_scales: torch.Tensor, w2_qzeros: torch.Tensor,
    group_size: int, top_k: int, grouped_token_counts: Iterable[int],
    dense_token_counts: Iterable[int] = (), workspace: Optional[torch.Tensor] = None,
    dtype: Optional[torch.dtype] = None,
) -> None:
    """Compile (and, with VLLM_AWQ_MOE_GROUPED_DECODE_TUNE=1, tune) every kernel variant.

    Call once per layer shape before CUDA-graph capture, with the token counts
    the grouped route will run (e.g. 2..8) and the dense ones worth compiling
    ahead (e.g. 1 and the capture sizes). Runs each op once on random
    activations and routing; the tune, if enabled, runs here and never during
    capture, and is cached on disk per GPU, shape and Triton version.
    ``workspace`` must hold max(grouped_token_counts) * top_k rows (a
    temporary one is allocated if omitted).
    """
    from .workspace import alloc_workspace

    device = w13_qweight.device
    dtype = dtype or w13_scales.dtype
    grouped_counts = sorted(set(int(m) for m in grouped_token_counts))
    dense_counts = sorted(set(int(m) for m in dense_token_counts))
    E, K = w13_qweight.shape[0], w13_qweight.shape[1]
    N = w2_qweight.shape[1]
    weights = (w13_qweight, w13_scales, w13_qzeros, w2_qweight, w2_scales, w2_qzeros)
    max_tokens = max(grouped_counts + dense_counts + [1])
    gen = torch.Generator(device=device).manual_seed(0)
    hidden_states = torch.randn(max_tokens, K, device=device, dtype=dtype, generator=gen)
    topk_weights = torch.rand(max_tokens, top_k, device=device, generator=gen)
    _ensure_tuned_cache_loaded()
    if grouped_counts:
        if workspace is None:
            workspace = alloc_workspace(max(grouped_counts), top_k, K, N, device)
        if env.tune_enabled():
            for m in grouped_counts:
                _tune_grouped(hidden_states, topk_weights, weights, group_size, workspace, m)
        for m in grouped_counts:
            ids = _random_routing(m, top_k, E, device, gen)
            torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                hidden_states[:m], topk_weights[:m], ids, *weights, group_size, workspace)
    for m in dense_counts:
        ids = _random_routing(m, top_k, E, device, gen)
        torch.ops.moe_grouped_decode.awq_moe_dense(hidden_states[:m], topk_weights[:m], ids, *weights, group_size)
    torch.cuda.synchronize(device)
