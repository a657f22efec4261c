"""The clock every measurement here uses: CUDA-graph replay of a sequence of calls."""

from __future__ import annotations

from typing import Callable

import torch


def graph_replay_us(step: Callable[[int], None], calls: int, replays: int = 30) -> float:
    """Median microseconds per call of one CUDA graph that runs ``step(i)`` for i < ``calls``.

    Every call runs once before the capture (Triton compiles, the allocator settles); the
    benchmark, the TP4 check and the autotune all time this way.
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
