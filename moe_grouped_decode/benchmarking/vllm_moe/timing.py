"""The shared anchors' clock, and the inputs they draw when none are given.

``replay_median_us`` is the anchors' time_graph: the body once eagerly, one CUDA graph of it on
the current stream, 3 warm replays, then ``reps`` replays each between two events; the median
(and min, max) over the layer count. ``time_runner`` times one backend's runner over rotated
layers the way the anchors' time_rows do.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .shape import MoeShape

VARIANTS = ("full", "no_align", "full_repeat")


def replay_median_us(body: Callable[[], None], reps: int, n_layers: int) -> Dict[str, float]:
    """Median over ``reps`` CUDA-graph replays of ``body`` (n_layers layers), us per layer."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    per_layer = sorted(start.elapsed_time(end) * 1e3 / n_layers for start, end in events)
    del graph
    return {"us": round(statistics.median(per_layer), 2), "us_min": round(per_layer[0], 2),
            "us_max": round(per_layer[-1], 2), "reps": reps}


def time_runner(runner, x: torch.Tensor, layers: Sequence, plans: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                reps: int, variants: Sequence[str] = ("full",)) -> Dict:
    """One row for ``runner`` (a MarlinRunner or HummingRunner for x.shape[0] tokens): an eager
    pass over every layer first (Humming's JIT, Triton's compile happen there, timed apart),
    then per variant one CUDA graph over all layers: ``full`` = align + W13 + SiLU-and-mul + W2
    + sum over top-k, ``no_align`` = the same with the alignment done beforehand,
    ``full_repeat`` = ``full`` again. layers[i] / plans[i] = (topk_ids, topk_weights): layer i's."""
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        raise ValueError(f"unknown variants {sorted(unknown)}; choose from {VARIANTS}")
    n = len(layers)
    if len(plans) != n:
        raise ValueError(f"{len(plans)} routing plans for {n} layers")

    def full():
        for i in range(n):
            runner(x, layers[i], plans[i][1], plans[i][0])

    row = {"dtype": str(x.dtype).replace("torch.", ""), "M": x.shape[0], "layers": n, **runner.describe()}
    torch.cuda.synchronize()
    t0 = time.time()
    full()
    torch.cuda.synchronize()
    row["first_eager_pass_s"] = round(time.time() - t0, 3)
    aligns: List = []
    for variant in variants:
        if variant == "no_align":
            aligns = aligns or [runner.align(ids) for ids, _ in plans]

            def body():
                for i in range(n):
                    runner(x, layers[i], plans[i][1], plans[i][0], align=aligns[i])
        else:
            body = full
        row[variant] = replay_median_us(body, reps, n)
    return row


def random_routing(M: int, shape: MoeShape, gen: torch.Generator) -> Tuple[torch.Tensor, torch.Tensor]:
    """The anchors' routing: k distinct random experts per token (int32) and softmax weights (fp32)."""
    device = gen.device
    ids = torch.rand(M, shape.num_experts, device=device, generator=gen).argsort(dim=1)[:, : shape.top_k]
    weights = torch.softmax(torch.randn(M, shape.top_k, device=device, generator=gen), dim=-1)
    return ids.to(torch.int32).contiguous(), weights.contiguous()
