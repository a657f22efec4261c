"""``tune``'s compile workers (benchmarking/precompile.py): which candidates they launch at which
counts, that they run real launches in spawned processes and report a launch that raises (the
interpreter, precompile_interpret_check.py), and on a GPU that the search's own first launch of
a candidate they ran compiles nothing more (Triton's on-disk cache holds every binary)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_grouped_decode.benchmarking import tune
from moe_grouped_decode.benchmarking.precompile import CompileJob, compile_candidates, jobs_for
from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig

HERE = Path(__file__).resolve().parent
QWEN = (512, 10, 2560, 160, 32)


def test_compile_jobs_are_what_the_search_launches():
    prefill = [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3, w2_stages=4)
               for rows in (8, 16, 32, 64, 128)]
    grouped = [GroupedConfig(w13_kernel="tl"), GroupedConfig(), GroupedConfig(w13_kernel="tl")]  # one twice
    jobs = tune.compile_jobs(QWEN, (1, 4), grouped, (256, 16384), prefill + [PrefillConfig()])
    # the reference config first, a job at each count either search launches it at for the check
    assert jobs[:4] == [CompileJob("prefill", PrefillConfig(), (M,)) for M in (1, 4, 256, 16384)]
    # each grouped candidate once at the grouped counts; each prefill candidate at the counts whose
    # group-size filter keeps it (an expert has 5 rows at 256 tokens, 320 at 16384), 32-row groups at none
    assert jobs[4:] == [CompileJob("grouped", grouped[0], (1, 4)), CompileJob("grouped", grouped[1], (1, 4)),
                        CompileJob("prefill", prefill[0], (256,)), CompileJob("prefill", prefill[1], (256,)),
                        CompileJob("prefill", prefill[3], (16384,)), CompileJob("prefill", prefill[4], (16384,))]


def test_jobs_for_refuses_an_unknown_route_and_no_workers_run_nothing():
    with pytest.raises(ValueError, match="route must be one of"):
        jobs_for("decode", [GroupedConfig()], (1,))
    lines = []
    assert compile_candidates(QWEN, "fp16", [CompileJob("grouped", GroupedConfig(), (1,))], 0, 10.0, lines.append) == []
    assert compile_candidates(QWEN, "fp16", [], 4, 10.0, lines.append) == [] and lines == []


def test_workers_launch_on_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    result = subprocess.run([sys.executable, str(HERE / "precompile_interpret_check.py")], env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "precompile interpreter check passed" in result.stdout


GPU_CHECK = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import torch
    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.benchmarking import tune
    from moe_grouped_decode.benchmarking.precompile import compile_candidates
    from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig

    spec = tune.LayerSpec((512, 10, 2560, 160, 32), "fp16", "precompile-check")
    grouped = [GroupedConfig(), GroupedConfig(w13_kernel="tl", w2_kernel="tl", w13_block_k=128)]
    prefill = [PrefillConfig(kernel="wgmma", block_rows=32, w13_block_k=64), PrefillConfig()]
    grouped_counts, prefill_counts = (1, 5), (256,)
    jobs = tune.compile_jobs(spec.shape, grouped_counts, grouped, prefill_counts, prefill)
    results = compile_candidates(spec.shape, "fp16", jobs, workers=3, timeout_s=600, max_grouped=max(grouped_counts))
    assert len(results) == len(jobs) and all(r.error is None for r in results), results
    cache = Path(os.environ["TRITON_CACHE_DIR"])
    before = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert before, "the workers wrote no binary"

    # the search itself, in this process, as tune runs it: its launches must all hit the cache
    layers = [synthetic_moe_weights(512, 2560, 160, 32, dtype=torch.float16, seed=1000, device="cuda")]

    def clock(step, calls, key):
        for i in range(calls):
            step(i)
        torch.cuda.synchronize()
        return 1.0

    measure = tune.Measurement(spec, layers, clock, lambda inputs: {}, torch.device("cuda"))
    progress = tune.Progress(100, out=open(os.devnull, "w"))
    tune.search(measure, "grouped", grouped_counts, grouped, progress, time.time() + 600)
    tune.search(measure, "prefill", prefill_counts, prefill, progress, time.time() + 600)
    after = sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file())
    assert after == before, sorted(set(after) - set(before))
    print("gpu precompile check passed", len(before))
""")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_searchs_first_launch_compiles_nothing_more(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), PYTHONPATH=str(HERE.parent))
    result = subprocess.run([sys.executable, "-c", GPU_CHECK], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    assert "gpu precompile check passed" in result.stdout
