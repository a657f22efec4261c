"""On a GPU: the first call's time (its compiles) and the results of both routes at large layer shapes, and
a whole warmup's time.

    PYTHONPATH=. python benchmarks/large_shapes_check.py [--shapes E,k,K,N,G;...] [--dtypes fp16,bf16]
        [--grouped-m 1,8,64] [--prefill-m 256,4096] [--warmup 112,8192] [--prefill-configs ...]

For each shape (default: benchmarks/compile_times.py's, from qwen3.8-tp4 to a Mixtral-shaped
N = 7168), synthetic AWQ weights on the GPU and a fresh Triton cache: per dtype, the grouped op at
each --grouped-m and the prefill route at each --prefill-m (each a first call, so the seconds are
its compiles plus one run), with the first 8 tokens' outputs checked against the float64
reference (a token's output does not depend on the other tokens); ``--prefill-configs`` also runs
the prefill route under those configs (e.g. the wgmma ones, where they run); then ``ops.warmup``
as vLLM calls it (the grouped op at 1..GROUPED_MAX tokens, the prefill route at
``prefill_warmup_counts(PREFILL_MAX)``), timed in a fresh cache. Exits non-zero on a result
outside the bound.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# fp16 max |out - ref| <= 2e-3 max |ref| (the evidence bound of the GPU tests); bf16 8x
BOUND = {"fp16": 2e-3, "bf16": 16e-3}
CHECKED_TOKENS = 8


def main(argv=None):
    from compile_times import SHAPES

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--dtypes", default="fp16,bf16")
    parser.add_argument("--grouped-m", default="1,8,64")
    parser.add_argument("--prefill-m", default="256,4096")
    parser.add_argument("--warmup", default="112,8192", help="GROUPED_MAX,PREFILL_MAX, or empty: no warmup")
    parser.add_argument("--prefill-configs", default="", help="PrefillConfigs as in bench --prefill-configs")
    parser.add_argument("--phase", default="", help=argparse.SUPPRESS)  # the worker: "calls" or "warmup"
    args = parser.parse_args(argv)
    if args.phase:
        shape = tuple(int(v) for v in args.shapes.split(","))
        return int(check_calls(shape, args.dtypes, args) if args.phase == "calls" else time_warmup(shape, args.dtypes,
                                                                                                   args))
    failed = False
    for shape in (s for s in args.shapes.split(";") if s):
        for dtype_name in args.dtypes.split(","):
            for phase in ("calls", "warmup") if args.warmup else ("calls",):
                # a process and a Triton cache of its own: every binary compiled afresh (Triton also
                # keeps the binaries it compiled in the process)
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TRITON_CACHE_DIR=cache)
                    command = [sys.executable, __file__, "--phase", phase, "--shapes", shape, "--dtypes", dtype_name,
                               "--grouped-m", args.grouped_m, "--prefill-m", args.prefill_m, "--warmup", args.warmup,
                               "--prefill-configs", args.prefill_configs]
                    failed |= subprocess.run(command, env=env).returncode != 0
    return 1 if failed else 0


def check_calls(shape, dtype_name, args) -> bool:
    """The first call of each route and M: its seconds and its first tokens against the reference.
    Returns whether one failed."""
    import torch

    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.benchmarking.bench import parse_prefill_configs
    from moe_grouped_decode.ops import alloc_workspace, launch_grouped, launch_prefill, reference_moe
    from moe_grouped_decode.ops.cuda import random_routing

    E, k, K, N, G = shape
    device = torch.device("cuda")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    configs = [None] + (parse_prefill_configs(args.prefill_configs) if args.prefill_configs else [])
    weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1, device=device)
    cpu_weights = weights.to("cpu")
    gen = torch.Generator(device=device).manual_seed(2)
    runs = [("grouped", int(m), None) for m in args.grouped_m.split(",") if m]
    runs += [("prefill", int(m), config) for m in args.prefill_m.split(",") if m for config in configs]
    workspace = alloc_workspace(max([m for route, m, _ in runs if route == "grouped"] + [1]), k, K, N, device)
    failed = False
    for route, M, config in runs:
        x = torch.randn(M, K, device=device, dtype=dtype, generator=gen)
        tw = torch.rand(M, k, device=device, dtype=torch.float32, generator=gen)
        ids = random_routing(M, k, E, device, gen)
        out = torch.empty_like(x)
        torch.cuda.synchronize()
        start = time.perf_counter()
        if route == "grouped":
            launch_grouped(x, tw, ids, weights, workspace, out)
        else:
            launch_prefill(x, tw, ids, weights, out, config)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        t = min(M, CHECKED_TOKENS)
        ref = reference_moe(x[:t].cpu(), tw[:t].cpu(), ids[:t].cpu(), cpu_weights)
        scaled = ((out[:t].cpu().double() - ref).abs().max() / ref.abs().max()).item()
        ok = scaled <= BOUND[dtype_name] and not out[:t].isnan().any()
        failed |= not ok
        print(f"{'ok  ' if ok else 'FAIL'} {shape} {dtype_name} {route} M={M}"
              f"{'' if config is None else f' {config}'}: first call {seconds:.1f} s, scaled max error "
              f"{scaled:.3g} (bound {BOUND[dtype_name]})", flush=True)
    return failed


def time_warmup(shape, dtype_name, args) -> bool:
    """``ops.warmup`` as vLLM calls it, timed (every binary compiled in it)."""
    import torch

    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.ops import warmup
    from moe_grouped_decode.ops.cuda import prefill_warmup_counts

    E, k, K, N, G = shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype_name]
    weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1, device=torch.device("cuda"))
    grouped_max, prefill_max = (int(v) for v in args.warmup.split(","))
    torch.cuda.synchronize()
    start = time.perf_counter()
    warmup(weights, k, range(1, grouped_max + 1), prefill_warmup_counts(prefill_max), dtype=dtype)
    print(f"     {shape} {dtype_name} warmup (grouped 1..{grouped_max}, prefill to {prefill_max}): "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return False


if __name__ == "__main__":
    sys.exit(main())
