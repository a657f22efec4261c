"""The kernels of the largest shapes compile in seconds, to small code and without spills (sm_90, Triton's
bundled ptxas).

A kernel that unrolls a loop over a whole N or K compiles in time that grows with it: before the
chunk loops (``awq_mma.UNROLLED_CHUNKS``, ``w2_tl.HELD_CHUNKS``, the wgmma W2's ``PrefillConfig.w2_unrolled_pieces``)
the tl W2 of a Mixtral-shaped layer (N = 7168) took 134 s in Triton's compiler on a 2-core CPU
(58,000 SASS instructions, 13 KB spilled), the prefill W2 85 s (34,000), the prefill W13 at
K = 7168 13.5 s (9,200) and the wgmma W2 at N = 6144 22 s (33,000, spilling); with them each
compiles in 0.5-2.5 s there to at most 1,800 instructions (docs/PERF.md). The time bound is a
generous multiple of that (a loaded CI machine must not fail it); the instruction bound, which
no load moves, fails any full unroll coming back. Needs no GPU.
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# seconds one kernel may take to compile (the looped kernels: 0.5-2.5 s on a 2-core CPU)
BOUND_S = 45
# SASS instructions one kernel may have (the looped kernels: 460-1,800)
SASS_BOUND = 5000

# (route, (E, k, K, N, G), M, prefill config or "", the launches to compile): the largest N, the
# largest K, and the wgmma W2 at the largest N it serves (its act rows fill 96 KB of shared memory)
CASES = [
    ("grouped", (8, 2, 4096, 7168, 128), 1, "", ("w13_gluon", "w2_tl")),
    ("grouped", (8, 2, 4096, 7168, 128), 64, "", ("activations", "w2_prefill", "combine_valid")),
    ("prefill", (256, 8, 7168, 256, 128), 256, "kernel=mma", ("w13_prefill",)),  # not the shipped table's
    ("prefill", (8, 2, 4096, 6144, 128), 256,
     "kernel=wgmma,block_rows=8,w13_block_k=128,w13_stages=2,w2_stages=5,w13_scales_ahead=1,w13_tiles=narrow",
     ("w13_prefill_wgmma", "w2_prefill_wgmma")),
]

WORKER = """
import json, re, sys, time
sys.path.insert(0, {benchmarks!r})
import compile_times, sass_stats
for route, shape, M, config, names in json.loads(sys.argv[1]):
    pcfg = compile_times.parse_prefill_configs(config)[0] if config else None
    plan, ints = compile_times.plan_launches(route, tuple(shape), M, "fp16", 90, pcfg)
    launches = [launch for launch in plan.launches if launch.name in names]
    assert sorted(launch.name for launch in launches) == sorted(names), [launch.name for launch in plan.launches]
    for launch in launches:
        start = time.perf_counter()
        kernel = sass_stats.compile_launch(launch, "fp16", ints)
        seconds = time.perf_counter() - start
        usage = re.search(r"REG:(\\d+) STACK:(\\d+)", sass_stats.cuobjdump(kernel, "-res-usage"))
        sass = len(re.findall(r"^\\s+/\\*[0-9a-f]{{4,}}\\*/\\s+\\S", sass_stats.cuobjdump(kernel, "-sass"), re.M))
        print(json.dumps(dict(shape=shape, M=M, name=launch.name, seconds=seconds, regs=int(usage.group(1)),
                              stack=int(usage.group(2)), sass=sass)), flush=True)
"""


def test_largest_shapes_compile_in_seconds_without_spills():
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=cache)  # nothing read back from a cache
        env.pop("TRITON_INTERPRET", None)
        code = WORKER.format(benchmarks=str(ROOT / "benchmarks"))
        result = subprocess.run([sys.executable, "-c", code, json.dumps(CASES)], env=env, capture_output=True,
                                text=True, timeout=BOUND_S * 12 + 120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == sum(len(names) for *_, names in CASES), result.stdout
    for row in rows:
        assert row["seconds"] < BOUND_S and row["sass"] < SASS_BOUND, row
        assert 0 < row["regs"] <= 255 and row["stack"] == 0, row


def test_gluon_w2_leaves_an_n_whose_chunks_outgrow_shared_memory_to_the_tl_w2():
    """The Gluon W2 holds (and unrolls over) every 32-row chunk of its tile's weights: where they
    outgrow a program's shared memory the plan launches the tl W2, which loops over them."""
    import torch

    from moe_grouped_decode.kernels import plan as launch_plan
    from moe_grouped_decode.kernels.config import GroupedConfig

    if not launch_plan.gluon_runs((9, 0)):
        pytest.skip("the Gluon kernels do not run here (no Gluon, or MOE_GROUPED_DECODE_GLUON=0)")
    config = GroupedConfig(w2_kernel="gluon", w2_warps=4, w2_copy_ahead=3).fitted(4096)

    def w2(N, capability=(9, 0)):
        plan = launch_plan.grouped_plan(8, 2, 4096, N, 128, torch.float16, capability, config, num_experts=8)
        return plan.launch_for("w2").name

    assert w2(1408) == "w2_gluon"  # 220 KB of Hopper's 227
    assert w2(1408, (8, 0)) == "w2_tl"  # over the A100's 163 KB
    assert w2(7168) == "w2_tl"
