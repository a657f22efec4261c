"""Compile every kernel a layer shape's plans launch, for sm_90 on any machine, and time each compile.

    PYTHONPATH=. python benchmarks/compile_times.py [--shapes E,k,K,N,G;...] [--grouped-m 1,8,64]
        [--prefill-m 256,4096] [--dtype fp16] [--arch 90] [--timeout 600] [--prefill-configs ...]

What a model's warmup compiles (``ops.cuda.warmup``: the grouped op at each token count, the
prefill route at ``prefill_warmup_counts``) is the launches of the plans ``kernels.plan`` builds for
those counts; this builds the same plans (the table's config where the shape has one, else the
default; ``--prefill-configs`` forces prefill configs, e.g. wgmma ones where they would run) and
compiles each distinct launch in a process of its own (a fresh Triton cache, so nothing is read
back; killed after ``--timeout`` seconds). Prints per kernel: seconds, the slowest compiler stages,
registers, spill stores/loads (STL/LDL) and SASS instructions. No GPU needed.
"""
import argparse
import collections
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHAPES = ((512, 10, 2560, 160, 32), (128, 8, 2048, 768, 128), (512, 10, 2048, 512, 128), (128, 8, 4096, 1408, 128),
          (256, 8, 7168, 256, 128), (8, 2, 4096, 7168, 128), (512, 10, 2560, 640, 32))


def plan_launches(route, shape, M, dtype, arch, prefill_config=None, grouped_changes=None):
    """The launches of the grouped (route "grouped") or prefill plan of ``shape`` at M, and the
    integer arguments a launch passes."""
    import torch

    from moe_grouped_decode.kernels import config as kernel_config
    from moe_grouped_decode.kernels import expert_sort
    from moe_grouped_decode.kernels import plan as launch_plan

    E, k, K, N, G = shape
    capability = divmod(arch, 10)
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    gpu = "NVIDIA H200"
    if route == "grouped":
        family = "gluon" if launch_plan.gluon_runs(capability) else "tl"
        config = dataclasses.replace(kernel_config.grouped_config(shape, gpu, family, dtype, M),
                                     **(grouped_changes or {}))
        plan = launch_plan.grouped_plan(M, k, K, N, G, torch_dtype, capability, config.fitted(K), num_experts=E)
        ints = dict(num_arrivals=plan.num_arrivals)
    else:
        config = prefill_config or kernel_config.prefill_config(shape, gpu, dtype, M)
        plan = launch_plan.prefill_plan(M, k, E, K, N, G, torch_dtype, capability, config)
    rows = M * k
    ints = dict(ints if route == "grouped" else {}, x_stride=K, out_stride=K, rows=rows, num_experts=E,
                num_blocks=-(-rows // expert_sort.BLOCK_ROWS),
                max_groups=expert_sort.max_groups(rows, E, plan.config.group_rows if route == "prefill" else 8))
    return plan, ints


def _key(launch):
    return (launch.name, launch.constexprs, tuple((k, v) for k, v in launch.options))


def warmup_launches(shape, dtype, arch, grouped_max, prefill_max):
    """One (route, M, launch, ints) per distinct binary a warmup compiles (``ops.cuda.warmup``: the
    grouped op at 1..grouped_max tokens, the prefill route at ``prefill_warmup_counts(prefill_max)``),
    keyed as Triton's JIT keys a binary: the launch's constexprs and options, and per integer
    argument it specializes whether it is 1 or a multiple of 16."""
    from moe_grouped_decode.ops.cuda import prefill_warmup_counts

    jobs = [("grouped", M) for M in range(1, grouped_max + 1)]
    jobs += [("prefill", M) for M in prefill_warmup_counts(prefill_max)] if prefill_max else []
    seen = set()
    for route, M in jobs:
        plan, ints = plan_launches(route, shape, M, dtype, arch)
        for launch in plan.launches:
            unspecialized = set(getattr(launch.kernel, "do_not_specialize", ()) or ())
            params = [p for p in launch.kernel.params if not p.is_constexpr]
            flags = tuple((name, ints[name] == 1, ints[name] % 16 == 0) for param, name in zip(params, launch.args)
                          if name in ints and param.num not in unspecialized and param.name not in unspecialized)
            key = (_key(launch), flags)
            if key not in seen:
                seen.add(key)
                yield route, M, launch, ints


def compile_warmup(shape, dtype, arch, grouped_max, prefill_max):
    """Compile every distinct binary of a warmup in this process (the worker of --warmup); print
    each kernel's count and seconds and the total."""
    sys.path.insert(0, str(HERE))
    import collections

    import sass_stats
    from triton.backends.compiler import GPUTarget

    sass_stats.TARGET = GPUTarget("cuda", arch, 32)
    seconds, counts = collections.Counter(), collections.Counter()
    start = time.perf_counter()
    for route, M, launch, ints in warmup_launches(shape, dtype, arch, grouped_max, prefill_max):
        begin = time.perf_counter()
        sass_stats.compile_launch(launch, dtype, ints)
        seconds[launch.name] += time.perf_counter() - begin
        counts[launch.name] += 1
    total = time.perf_counter() - start
    print(json.dumps(dict(total=total, binaries=sum(counts.values()),
                          kernels={name: [counts[name], seconds[name]] for name in counts})))


def compile_one(route, shape, M, dtype, arch, index, prefill_config, grouped_changes):
    """Compile launch ``index`` of the plan and print a JSON record of it (the worker process)."""
    sys.path.insert(0, str(HERE))
    import sass_stats
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    sass_stats.TARGET = GPUTarget("cuda", arch, 32)
    plan, ints = plan_launches(route, shape, M, dtype, arch, prefill_config, grouped_changes)
    launch = plan.launches[index]
    stages = {}

    def listener(src, metadata, metadata_group, times, cache_hit):
        stages.update({"make_ir": times.ir_initialization / 1e6,
                       **{name: us / 1e6 for name, us in times.lowering_stages}})

    knobs.compilation.listener = listener
    start = time.perf_counter()
    kernel = sass_stats.compile_launch(launch, dtype, ints)
    seconds = time.perf_counter() - start
    sass = sass_stats.cuobjdump(kernel, "-sass")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", sass_stats.cuobjdump(kernel, "-res-usage"))
    instructions = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))
    print(json.dumps(dict(seconds=seconds, stages=stages, regs=int(usage.group(1)), stack=int(usage.group(2)),
                          stl=len(re.findall(r"\bSTL\b", sass)), ldl=len(re.findall(r"\bLDL\b", sass)),
                          sass=instructions, shared=kernel.metadata.shared)))


def parse_changes(text):
    """GroupedConfig field changes from ``field=value,...``."""
    from moe_grouped_decode.kernels.config import GroupedConfig

    defaults = GroupedConfig()
    changes = {}
    for item in (i for i in text.split(",") if i):
        field, value = item.split("=", 1)
        default = getattr(defaults, field)
        changes[field] = value if isinstance(default, str) else bool(int(value)) if isinstance(
            default, bool) else int(value)
    return changes


def parse_prefill_configs(text):
    if not text:
        return [None]
    from moe_grouped_decode.benchmarking.bench import parse_prefill_configs as parse

    return parse(text)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=";".join(",".join(map(str, s)) for s in SHAPES))
    parser.add_argument("--grouped-m", default="1,8,64")
    parser.add_argument("--prefill-m", default="256,4096")
    parser.add_argument("--dtype", default="fp16")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--prefill-configs", default="", help="PrefillConfigs as in bench --prefill-configs")
    parser.add_argument("--grouped-config", default="", help="changes to the grouped config: field=value,...")
    parser.add_argument("--only", default="", help="compile only the launches whose name contains one of these")
    parser.add_argument("--warmup", default="", help="instead: GROUPED_MAX,PREFILL_MAX: compile every distinct "
                        "binary a warmup at those token counts compiles, per shape, and time the whole")
    parser.add_argument("--count-only", action="store_true", help="with --warmup: count the binaries, compile none")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--worker-warmup", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.warmup:
        grouped_max, prefill_max = (int(v) for v in args.warmup.split(","))
        for shape in (tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s):
            label = f"{','.join(map(str, shape))} warmup (grouped 1..{grouped_max}, prefill to {prefill_max})"
            if args.count_only:
                names = collections.Counter(launch.name for _, _, launch, _ in warmup_launches(
                    shape, args.dtype, args.arch, grouped_max, prefill_max))
                print(f"{label}: {sum(names.values())} binaries {dict(names)}", flush=True)
                continue
            with tempfile.TemporaryDirectory() as cache:
                env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=str(HERE.parent))
                env.pop("TRITON_INTERPRET", None)
                command = [sys.executable, __file__, "--worker-warmup", json.dumps([list(shape), grouped_max,
                                                                                    prefill_max]),
                           "--dtype", args.dtype, "--arch", str(args.arch)]
                try:
                    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    print(f"{label}: TIMEOUT after {args.timeout:.0f} s", flush=True)
                    continue
                if result.returncode:
                    print(f"{label}: FAILED {result.stderr[-1500:]}", flush=True)
                    continue
                r = json.loads(result.stdout.strip().splitlines()[-1])
                slow = sorted(r["kernels"].items(), key=lambda kv: -kv[1][1])[:4]
                print(f"{label}: {r['total']:.1f} s for {r['binaries']} binaries; slowest: "
                      + ", ".join(f"{name} {n}x {t:.1f} s" for name, (n, t) in slow), flush=True)
        return 0
    if args.worker_warmup:
        shape, grouped_max, prefill_max = json.loads(args.worker_warmup)
        compile_warmup(tuple(shape), args.dtype, args.arch, grouped_max, prefill_max)
        return 0
    if args.worker:
        route, shape, M, index, config = json.loads(args.worker)
        prefill_config = parse_prefill_configs(config)[0] if config else None
        compile_one(route, tuple(shape), M, args.dtype, args.arch, index, prefill_config,
                    parse_changes(args.grouped_config))
        return 0
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s]
    config_texts = [""] + [c for c in args.prefill_configs.split(";") if c] if args.prefill_configs else [""]
    only = [s for s in args.only.split(",") if s]
    seen = set()
    for shape in shapes:
        jobs = [("grouped", M, "") for M in (int(m) for m in args.grouped_m.split(",") if m)]
        jobs += [("prefill", M, c) for M in (int(m) for m in args.prefill_m.split(",") if m) for c in config_texts]
        for route, M, config_text in jobs:
            prefill_config = parse_prefill_configs(config_text)[0] if config_text else None
            plan, _ = plan_launches(route, shape, M, args.dtype, args.arch, prefill_config,
                                    parse_changes(args.grouped_config))
            for index, launch in enumerate(plan.launches):
                if only and not any(name in launch.name for name in only):
                    continue
                key = (shape, _key(launch))
                if key in seen:
                    continue
                seen.add(key)
                worker = json.dumps([route, list(shape), M, index, config_text])
                label = f"{','.join(map(str, shape))} {route} M={M} {launch.name}"
                with tempfile.TemporaryDirectory() as cache:
                    env = dict(os.environ, TRITON_CACHE_DIR=cache, PYTHONPATH=str(HERE.parent))
                    env.pop("TRITON_INTERPRET", None)
                    start = time.perf_counter()
                    try:
                        command = [sys.executable, __file__, "--worker", worker, "--dtype", args.dtype,
                                   "--arch", str(args.arch), "--grouped-config", args.grouped_config]
                        result = subprocess.run(command, env=env, capture_output=True, text=True,
                                                timeout=args.timeout)
                    except subprocess.TimeoutExpired:
                        print(f"{label}: TIMEOUT after {args.timeout:.0f} s", flush=True)
                        continue
                    if result.returncode:
                        print(f"{label}: FAILED {result.stderr[-1500:]}", flush=True)
                        continue
                    r = json.loads(result.stdout.strip().splitlines()[-1])
                    slow = sorted(r["stages"].items(), key=lambda kv: -kv[1])[:3]
                    print(f"{label}: {r['seconds']:.1f} s ({', '.join(f'{k} {v:.1f}' for k, v in slow)}) "
                          f"regs={r['regs']} stack={r['stack']} STL={r['stl']} LDL={r['ldl']} sass={r['sass']} "
                          f"shared={r['shared']} [process {time.perf_counter() - start:.1f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
