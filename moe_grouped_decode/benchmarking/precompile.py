"""Compile ``tune``'s candidate configs in worker processes before its search times them.

At a new shape each candidate's first launch sits in Triton's compiler for seconds (about 3 s
a grouped candidate at N = 1408 on an H100 host), one after another, and a search budget of a
minute or two ends after a few token counts. Each worker here runs every job given to it
once (one layer of synthetic weights of the shape, fresh inputs at each count), which compiles
its kernels into Triton's on-disk cache; the search's own first launch then loads them from
there. Workers time nothing and check nothing: the search still runs, checks and times every
candidate itself, so a job that fails here changes no result (the search says why it drops a
config).
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor, wait
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

ROUTES = ("grouped", "prefill")


@dataclass(frozen=True)
class CompileJob:
    """One candidate config of one route, launched once at each of ``counts`` tokens."""

    route: str  # "grouped" or "prefill"
    config: object  # GroupedConfig or PrefillConfig
    counts: Tuple[int, ...]


@dataclass(frozen=True)
class CompileResult:
    job: CompileJob
    seconds: float
    error: Optional[str] = None  # what the first failing launch raised (the job's later counts were skipped)


# per worker process: (shape, dtype name, device) -> the layer and a grouped workspace
_worker_layers: Dict[tuple, tuple] = {}


def _layer(shape, dtype_name: str, max_grouped: int):
    import torch

    from ..awq import synthetic_moe_weights
    from ..ops import alloc_workspace

    key = (shape, dtype_name, max_grouped)
    if key not in _worker_layers:
        E, k, K, N, G = shape
        dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
        # under the interpreter the kernels run on the CPU whatever the machine has
        interpreted = os.environ.get("TRITON_INTERPRET", "0") == "1"
        device = torch.device("cuda" if torch.cuda.is_available() and not interpreted else "cpu")
        layer = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=7, device=device)
        _worker_layers[key] = (layer, alloc_workspace(max(1, max_grouped), k, K, N, device), dtype, device)
    return _worker_layers[key]


def run_job(shape, dtype_name: str, max_grouped: int, job: CompileJob) -> CompileResult:
    """In a worker: launch ``job``'s config at each of its counts once (what compiles its kernels)."""
    import torch

    from ..ops import launch_grouped, launch_prefill
    from .bench import random_layer_inputs

    began = time.perf_counter()
    layer, workspace, dtype, device = _layer(shape, dtype_name, max_grouped)
    E, k, K, _, _ = shape
    try:
        for M in job.counts:
            ids, tws, xs = random_layer_inputs(M, k, E, K, 1, dtype, device, torch.Generator().manual_seed(M))
            out = torch.empty_like(xs[0])
            if job.route == "grouped":
                launch_grouped(xs[0], tws[0], ids[0], layer, workspace, out, job.config.fitted(K))
            else:
                launch_prefill(xs[0], tws[0], ids[0], layer, out, job.config)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as error:  # a config this shape cannot take: the search finds out and says so
        return CompileResult(job, time.perf_counter() - began, f"{type(error).__name__}: {error}"[:300])
    return CompileResult(job, time.perf_counter() - began)


def jobs_for(route: str, candidates: Sequence, counts: Sequence[int],
             counts_for: Optional[Callable[[object], Sequence[int]]] = None) -> List[CompileJob]:
    """One job per distinct candidate of ``route``, at ``counts`` (or ``counts_for(config)``,
    the counts the search will time it at; a candidate timed at none gets no job)."""
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, not {route!r}")
    jobs = []
    for config in dict.fromkeys(candidates):
        timed_counts = tuple(counts_for(config)) if counts_for is not None else tuple(counts)
        if timed_counts:
            jobs.append(CompileJob(route, config, timed_counts))
    return jobs


def compile_candidates(shape, dtype_name: str, jobs: Sequence[CompileJob], workers: int, timeout_s: float,
                       log: Callable[[str], None] = print, max_grouped: int = 0) -> List[CompileResult]:
    """Run ``jobs`` in ``workers`` fresh processes (spawned: a CUDA context each), the longest
    first, for at most ``timeout_s``; the results in the jobs' order, without those not done by
    then or lost with a worker that died (the search compiles what is missing itself)."""
    if workers < 1 or not jobs:
        return []
    import multiprocessing

    began = time.perf_counter()
    log(f"[tune] compiling {len(jobs)} candidates in {min(workers, len(jobs))} processes (at most {timeout_s:.0f} s)")
    results: Dict[int, CompileResult] = {}
    order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i].counts))  # the longest first: the pool ends evenly
    pool = ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=multiprocessing.get_context("spawn"))
    try:
        futures = {pool.submit(run_job, shape, dtype_name, max_grouped, jobs[i]): i for i in order}
        done, pending = wait(futures, timeout=timeout_s)
        for future in done:
            try:
                results[futures[future]] = future.result()
            except Exception as error:  # a worker died (BrokenProcessPool) and took this job with it
                log(f"[tune] compiling {jobs[futures[future]].config} in a worker failed: "
                    f"{type(error).__name__}: {error}"[:300])
        if pending:
            log(f"[tune] compiling in workers: {len(pending)} candidates not done in {timeout_s:.0f} s, left to the search")
    finally:
        # every worker gone before the search times anything: one still compiling, running or
        # tearing down its CUDA context would share the GPU and the host with the timings
        processes = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            process.terminate()
        for process in processes:
            process.join(timeout=30)
    failed = sum(r.error is not None for r in results.values())
    log(f"[tune] ran {len(results)} of {len(jobs)} candidates in {min(workers, len(jobs))} processes in "
        f"{time.perf_counter() - began:.0f} s" + (f" ({failed} did not run at this shape)" if failed else ""))
    return [results[i] for i in range(len(jobs)) if i in results]
