"""Compile the grouped kernels for sm_90 on any machine (Triton's bundled ptxas) and count SASS.

    PYTHONPATH=. python benchmarks/sass_stats.py [--dump DIR] [--arch 80]

No GPU needed: the counts explain the measured times (docs/PERF.md) without device time. The
kernels, grids and constexprs come from the op's own launch plan (``kernels.plan``) at the
qwen3.8-tp4 shape, specialized as a launch specializes them (pointer and integer alignment).
Exits non-zero if an inline mma's operands in a ``tl`` kernel are not laid out one row per lane
(check_fragment_layouts; the Gluon kernels write their layouts out, nothing for Triton to
choose). Prints, per kernel, dtype, launch config and token count M: registers, stack (spills),
instructions by class and lane-instructions per weight, and for the launched kernels how many
programs share an SM (registers, warps, shared memory) and how many waves the grid takes. The
tile programs are loop-free, so a static count is what one program issues; the W2 count
includes the fused combine, which one program per token and tile runs. Beside the W13 the
table runs, the "w13-tl" line compiles the tl W13 at the same split (what runs where Gluon
does not).
"""
import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import config as kernel_config
from moe_grouped_decode.kernels import plan as launch_plan
from moe_grouped_decode.kernels import prefill_wgmma

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def compile_kernel(fn, constexprs, pointer_types, num_warps, ints=None, options=None, source=ASTSource):
    """Compile ``fn`` for TARGET (sm_90, or ``--arch``) as a launch would specialize it: every pointer 16-byte aligned
    (torch allocations and the workspace regions are) and every integer argument given in
    ``ints`` marked divisible by 16 where it is (Triton's JIT does both at launch time).
    ``source``: GluonASTSource for a ``@gluon.jit`` kernel."""
    ints = ints or {}
    # a constexpr left to its default stays one (not an i32 argument, which compiles every branch on it)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types.get(name, "*fp32")
            attrs[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if ints.get(name, 1) % 16 == 0:
                attrs[(index,)] = [["tt.divisibility", 16]]
    src = source(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps, **(options or {})})


def cuobjdump(kernel, flag) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(CUOBJDUMP), flag, f.name], capture_output=True, text=True, check=True).stdout


def check_fragment_layouts(name, kernel, num_warps):
    """The inline-PTX mma (kernels/awq_mma.py) takes each lane's 8 consecutive elements as its
    fragment registers: that holds only if Triton lays its [32 * warps, 8] operands out one
    row per lane (threadsPerWarp [32, 1], warpsPerCTA [warps, 1]). Nothing in Triton promises
    that layout, so check it in the compiled TTGIR (a Triton upgrade could change it)."""
    ttgir = kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<\{.*\}>)$", ttgir, re.M))
    calls = [line for line in ttgir.splitlines() if "elementwise_inline_asm" in line and "mma.sync" in line]
    if not calls:
        raise SystemExit(f"{name}: no inline mma found in the TTGIR")
    want = f"threadsPerWarp = [32, 1], warpsPerCTA = [{num_warps}, 1]"
    for line in calls:
        for ref in set(re.findall(r"tensor<[^>]*, (#\w+)>", line.split(" : ", 1)[1])):
            if want not in layouts.get(ref, ""):
                raise SystemExit(f"{name}: an inline mma operand is laid out as {layouts.get(ref, ref)}, not one row per "
                                 f"lane ({want})")


# Per-SM limits of sm_80 / sm_90: registers, resident warps, resident programs (CTAs), shared
# memory; and the SM count of the H200 the measurements come from.
SM_REGISTERS, SM_WARPS, SM_PROGRAMS = 65536, 64, 32
SM_SHARED = {80: 164 * 1024, 90: 228 * 1024}
H200_SMS = 132


def programs_per_sm(registers, num_warps, shared_bytes, arch):
    """Programs of one kernel resident per SM: registers are allocated per warp in units of
    256 (8 per thread), so 80 and 73 registers cost the same."""
    per_warp = -(-registers * 32 // 256) * 256
    by_shared = SM_SHARED.get(arch, SM_SHARED[80]) // shared_bytes if shared_bytes else SM_PROGRAMS
    return min(SM_PROGRAMS, SM_REGISTERS // (per_warp * num_warps), SM_WARPS // num_warps, by_shared)


# Hopper's shared-memory carveouts (KB per SM) and the shared memory the driver keeps per program.
HOPPER_CARVEOUTS_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
RESERVED_PER_PROGRAM = 1024


def driver_carveout_kb(registers, num_warps, shared_bytes):
    """The carveout (KB) a kernel gets on Hopper without a preference of ours, as a model: over
    48 KB of shared memory Triton asks for the largest; otherwise the driver picks the smallest
    that holds as many programs as its registers and warps allow, or the largest. An SM
    then runs an early-launched kernel's programs beside another's only where this is no larger
    than the other's: it predicts every co-residence of W2 with W13 measured under the driver's
    choice under the driver's choice; nothing documents it. (Explicit preferences follow no such
    rule: kernels/carveout.py.)"""
    if shared_bytes > 48 * 1024:  # Triton's launcher: CU_FUNC_CACHE_PREFER_SHARED
        return HOPPER_CARVEOUTS_KB[-1]
    need = programs_per_sm(registers, num_warps, 0, 90) * (shared_bytes + RESERVED_PER_PROGRAM)
    return next((kb for kb in HOPPER_CARVEOUTS_KB if need <= kb * 1024), HOPPER_CARVEOUTS_KB[-1])


def stats(name, kernel, weights_per_program, dump=None, grid=None):
    """Print one kernel's counts; with ``grid`` (programs launched), also how many programs share
    an SM and, for sm_90, how many waves the grid takes on an H200."""
    text = cuobjdump(kernel, "-sass")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel, "-res-usage"))
    if dump:
        Path(dump).mkdir(parents=True, exist_ok=True)
        Path(dump, f"{name}.sass").write_text(text)
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    total = sum(v for k, v in ops.items() if k not in ("NOP",))
    md = kernel.metadata
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
    occupancy = ""
    if grid:
        per_sm = programs_per_sm(int(usage.group(1)), md.num_warps, md.shared, TARGET.arch)
        occupancy = f" programs/SM={per_sm} grid={grid}"
        if TARGET.arch == 90:
            occupancy += f" waves(H200)={-(-grid // (per_sm * H200_SMS))}"
            occupancy += f" carveout(unpreferred)={driver_carveout_kb(int(usage.group(1)), md.num_warps, md.shared)}KB"
    print(f"{name}: regs={usage.group(1)} stack={usage.group(2)} instructions={total} "
          f"per weight={total * 32 * md.num_warps / weights_per_program:.2f}{occupancy}  [{top}]", flush=True)


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TABLE_GPU = "NVIDIA H200"  # the launch table's GPU: the entries the measurements come from


def argument_types(launch, dtype: str) -> dict:
    """The Triton type of each runtime argument of ``launch`` (kernels.plan.ARGUMENT_TYPES):
    the activation dtype's pointers for "act", int32 routing ids."""
    types = {"act": f"*{dtype}", "ids": "*i32"}
    return {name: types.get(launch_plan.ARGUMENT_TYPES[name], launch_plan.ARGUMENT_TYPES[name]) for name in launch.args}


def compile_launch(launch, dtype: str, int_values: dict):
    """Compile one plan launch for TARGET: its runtime arguments by their plan types (None
    arguments, the timeline's stamps when off, as the constexpr None a launch makes of them)."""
    types = argument_types(launch, dtype)
    constexprs = dict(launch.constexprs)
    pointers = {}
    ints = {}
    for param, name in zip([p.name for p in launch.kernel.params if not p.is_constexpr], launch.args):
        if name.endswith("_stamps") and not dict(launch.constexprs).get("TIMELINE"):
            constexprs[param] = None
        elif name in launch_plan.GROUP_ARGS and launch.stage == "w13" and not dict(launch.constexprs).get(
                "OVER_GROUPS", True):
            constexprs[param] = None  # the W13 per routed row takes no sort outputs
        elif name == "id_flag" and not dict(launch.constexprs).get("CHECK_IDS"):
            constexprs[param] = None  # the ids debug mode's flag, off
        elif types[name].startswith("*"):
            pointers[param] = types[name]
        else:
            ints[param] = int_values[name]
    options = {k: v for k, v in launch.options if k != "num_warps" and k != "launch_pdl"}
    source = ASTSource
    if launch.name.endswith(("_gluon", "_wgmma")):
        from triton.experimental.gluon._runtime import GluonASTSource

        source = GluonASTSource
    return compile_kernel(launch.kernel, constexprs, pointers, launch.num_warps, ints, options, source=source)


def table_plan(dtype, M, timeline=False, changes=None):
    """The launch plan of one grouped call at the qwen3.8-tp4 shape for ``dtype`` and M on TARGET:
    the table's config (with ``changes`` to its fields)."""
    K = c.hidden_size
    capability = divmod(TARGET.arch, 10)
    shape = (c.num_experts, c.top_k, K, c.intermediate_size, c.group_size)
    family = "gluon" if launch_plan.gluon_runs(capability) else "tl"
    config = dataclasses.replace(kernel_config.grouped_config(shape, TABLE_GPU, family, dtype, M), **(changes or {}))
    return launch_plan.grouped_plan(M, c.top_k, K, c.intermediate_size, c.group_size, DTYPES[dtype],
                                    capability, config.fitted(K), timeline=timeline, num_experts=c.num_experts)


def launched_kernels(dtype, M, timeline=False, changes=None):
    """Compile, for TARGET, the kernels one grouped call at the qwen3.8-tp4 shape launches for
    ``dtype`` and M (the table's config, with ``changes`` to its fields), and the tl W13 at the
    same split. Yields (name, kernel, weights per program, grid or None, warps, whether its
    fragment layouts are Triton's to check); ``timeline``: with the per-program timestamps
    compiled in (kernels/timeline.py)."""
    K, N, k = c.hidden_size, c.intermediate_size, c.top_k
    plan = table_plan(dtype, M, timeline, changes)
    config = plan.config
    ints = dict(x_stride=K, out_stride=K, rows=M * k, num_arrivals=plan.num_arrivals, num_experts=c.num_experts)
    tl_plan = table_plan(dtype, M, timeline, dict(changes or {}, w13_kernel="tl", w2_kernel="tl"))
    for launch in plan.launches:
        if launch.stage == "w13":
            yield (f"M={M} {dtype} w13", compile_launch(launch, dtype, ints), config.w13_block_k * 64,
                   launch.programs, launch.num_warps, launch.name == "w13_tl")
            tl_w13 = tl_plan.launch_for("w13")
            yield (f"M={M} {dtype} w13-tl", compile_launch(tl_w13, dtype, ints), config.w13_block_k * 64, None,
                   tl_w13.num_warps, True)
        elif launch.stage == "w2":
            yield (f"M={M} {dtype} w2", compile_launch(launch, dtype, ints), N * config.w2_block_k, launch.programs,
                   launch.num_warps, launch.name == "w2_tl")


def prefill_kernels(dtype, M, config):
    """Compile, for TARGET, the prefill route's launches at the qwen3.8-tp4 shape for ``dtype``, M
    and ``config`` (a kernels.config.PrefillConfig). Yields (name, kernel, weights per program, grid)."""
    K, N, k, E = c.hidden_size, c.intermediate_size, c.top_k, c.num_experts
    plan = launch_plan.prefill_plan(M, k, E, K, N, c.group_size, DTYPES[dtype], divmod(TARGET.arch, 10), config)
    ints = dict(x_stride=K, out_stride=K, rows=M * k, num_blocks=1, max_groups=1)
    weights = {"w13_prefill": K * 64, "w2_prefill": N * 64 * config.w2_warps,
               "w13_prefill_dot": K * 2 * config.w13_block_n, "w2_prefill_dot": N * config.w2_block_n,
               "w13_prefill_wgmma": K * 128, "w2_prefill_wgmma": N * 128 * config.w2_tiles_per_program}
    tag = (f"tb={config.token_blocks}" if config.kernel == "mma" else
           f"wgmma rows={config.block_rows} stages={config.w13_stages},{config.w2_stages} "
           f"w2 tiles={config.w2_tiles_per_program} unrolled={config.w2_unrolled_pieces}" if config.kernel == "wgmma" else
           f"rows={config.block_rows} n={config.w13_block_n},{config.w2_block_n} warps={config.w13_warps},"
           f"{config.w2_warps} stages={config.w13_stages},{config.w2_stages}")
    for launch in plan.launches:
        yield (f"M={M} {dtype} {launch.name} {tag}", compile_launch(launch, dtype, ints),
               weights.get(launch.name, 1), launch.programs)


def timer_reads(kernel) -> int:
    """How many times the SASS reads the GPU's global timer (kernels/timeline.py's stamps)."""
    return len(re.findall(r"SR_GLOBALTIMER(?:LO)?\b", cuobjdump(kernel, "-sass")))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", default="")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: the kernels' minimum)")
    parser.add_argument("--timeline", action="store_true",
                        help="instead: the timer reads per kernel at M = 8 fp16, without and with the timestamps")
    parser.add_argument("--prefill", default="", help="instead: the prefill route's kernels at these token counts, "
                        "under each token-block count (1, 2, 4) or each of --prefill-configs")
    parser.add_argument("--prefill-configs", default="", help="PrefillConfigs as in bench --prefill-configs")
    args = parser.parse_args(argv)
    global TARGET
    TARGET = GPUTarget("cuda", args.arch, 32)
    if args.prefill:
        from moe_grouped_decode.kernels.config import PrefillConfig

        from moe_grouped_decode.benchmarking.bench import parse_prefill_configs

        configs = (parse_prefill_configs(args.prefill_configs) if args.prefill_configs
                   else [PrefillConfig(token_blocks=blocks) for blocks in (1, 2, 4)])
        for M in (int(m) for m in args.prefill.split(",")):
            for i, config in enumerate(configs):
                for name, kernel, weights, grid in prefill_kernels("fp16", M, config):
                    if "prefill" in name or i == 0:
                        stats(name, kernel, weights, args.dump, grid)
        return 0
    if args.timeline:
        for timeline in (False, True):
            for name, kernel, *_ in launched_kernels("fp16", 8, timeline):
                print(f"{name} timeline={timeline}: timer reads={timer_reads(kernel)}", flush=True)
        return 0
    # M = 2 and 4: the 4-warp Gluon W2 under the cap; 3: the tl W2 (GroupedConfig's defaults),
    # whose fragment layouts Triton chooses; 8: the 8-warp Gluon W2; bf16: its own PTX
    for dtype, M in (("fp16", 2), ("fp16", 3), ("fp16", 4), ("fp16", 8), ("bf16", 8)):
        for name, kernel, weights, grid, warps, tl_layouts in launched_kernels(dtype, M):
            stats(name, kernel, weights, args.dump, grid)
            if tl_layouts:
                check_fragment_layouts(name, kernel, warps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
