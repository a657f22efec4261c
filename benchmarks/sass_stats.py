"""Compile the grouped kernels for sm_90 on any machine (Triton's bundled ptxas) and count SASS.

    PYTHONPATH=. python benchmarks/sass_stats.py [--dump DIR] [--arch 80]

No GPU needed: the counts explain the measured times (docs/PERF.md) without device time.
Exits non-zero if an inline mma's operands in a ``tl`` kernel are not laid out one row per lane
(check_fragment_layouts; the Gluon W13 writes its layout out, nothing for Triton to choose). Prints, per kernel at the qwen3.8-tp4 shape, dtype, launch config and token count M, specialized
as a launch specializes it (pointer and integer alignment): registers, stack (spills),
instructions by class and lane-instructions per weight, and for the launched kernels how many
programs share an SM (registers, warps, shared memory) and how many waves the grid takes. The tile programs are loop-free,
so a static count is what one program issues, except that the tl W13 kernel also holds
program 0's sort (the "w13-tl-tile-path" line compiles it at the same split with that part cut
to nothing, next to the Gluon ring W13 where that one runs) and the W2 count includes the fused
combine, which one program per token and tile runs (and, with the ring W13, the compaction).
"""
import argparse
import collections
import dataclasses
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import grouped, w13_ring, w2_ring
from moe_grouped_decode.kernels import configs
from moe_grouped_decode.kernels.configs import QWEN38_TP4_SHAPE

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
    choice (explorations run 73); nothing documents it. (Explicit preferences follow no such
    rule: run 74. kernels/carveout.py.)"""
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


PTR16 = {"x_ptr": "*fp16", "ids_ptr": "*i32", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "qzeros_ptr": "*i32",
         "sorted_rows_ptr": "*i32", "sorted_experts_ptr": "*i32", "active_experts_ptr": "*i32",
         "segment_offsets_ptr": "*i32", "live_count_ptr": "*i32", "arrivals_ptr": "*i32",
         "topk_weights_ptr": "*fp32", "out_ptr": "*fp16", "timeline_ptr": "*i64"}


def launched_kernels(dtype, M, timeline=False, changes=None):
    """Compile, for TARGET, the kernels one grouped call at the qwen3.8-tp4 shape launches for
    ``dtype`` and M (the table's config, with ``changes`` to its fields), and the tl W13 at the
    same split with program 0's sort and counter zeroing cut down to nothing (the tile programs'
    own count). Yields (name, kernel, weights per program, grid or None, warps, whether its
    fragment layouts are Triton's to check); ``timeline``: with the per-program timestamps
    compiled in (kernels/timeline.py)."""
    K, N, G, k = c.hidden_size, c.intermediate_size, c.group_size, c.top_k
    capability = divmod(TARGET.arch, 10)
    config = dataclasses.replace(configs.grouped_config(QWEN38_TP4_SHAPE, dtype, M, grouped.ring_available(capability)),
                                 **(changes or {}))
    use_pdl = config.pdl and TARGET.arch >= 90  # as kernels.pdl.pdl_supported decides at launch
    pointers = dict(PTR16, **{name: f"*{dtype}" for name in ("x_ptr", "scales_ptr", "out_ptr")})
    rows = M * k
    ring = grouped.uses_w13_ring(config, capability)
    w13_grid, w2_grid = grouped._grids(rows, K, N, config, ring)  # the launches' grids
    arrivals = M * w2_grid[1] if config.fused_combine else 0
    w13_consts = dict(TOP_K=k, K=K, TWO_N=2 * N, G=G, CHUNKS=config.w13_chunks, WARPS=config.w13_warps,
                      SPLITS=config.w13_splits(K), IS_BF16=dtype == "bf16", USE_PDL=use_pdl, TIMELINE=timeline)
    w13_ints = dict(stride_xm=K, rows=rows, num_arrivals=arrivals)
    w13_weights = config.w13_block_k * 64
    arrivals_pad = grouped._next_pow2(arrivals) if arrivals else 0
    if ring:
        from triton.experimental.gluon._runtime import GluonASTSource

        w13 = compile_kernel(w13_ring.w13_ring_kernel, dict(
            TOP_K=k, K=K, TWO_N=2 * N, G=G, CHUNKS=config.w13_chunks,
            CHUNKS_PAD=grouped._next_pow2(config.w13_chunks), SPLITS=config.w13_splits(K),
            STAGES=config.w13_ring_stages, ARRIVALS_PAD=arrivals_pad, IS_BF16=dtype == "bf16", USE_PDL=use_pdl,
            TIMELINE=timeline), pointers, 1, w13_ints, source=GluonASTSource)
        # its fragment layout is written out in Gluon, not chosen by Triton: nothing to check
        yield f"M={M} {dtype} w13", w13, w13_weights, w13_grid, 1, False
    else:
        w13 = compile_kernel(grouped._w13_kernel, dict(w13_consts, R_PAD=max(16, grouped._next_pow2(rows)),
                                                       ARRIVALS_PAD=arrivals_pad),
                             pointers, config.w13_warps, w13_ints)
        yield f"M={M} {dtype} w13", w13, w13_weights, w13_grid, config.w13_warps, True
    w13_tile = compile_kernel(grouped._w13_kernel, dict(w13_consts, R_PAD=16, ARRIVALS_PAD=0), pointers,
                              config.w13_warps, w13_ints)
    yield f"M={M} {dtype} w13-tl-tile-path", w13_tile, w13_weights, None, config.w13_warps, True
    w2_consts = dict(K=K, N=N, G=G, SPLITS=config.w13_splits(K), WARPS=config.w2_warps, TOP_K=k,
                     IS_BF16=dtype == "bf16", USE_PDL=use_pdl, COMPACT=ring, R_PAD=max(16, grouped._next_pow2(rows)),
                     ACT_SPLIT=config.w2_act_split,
                     TIMELINE=timeline)
    w2_is_gluon = grouped.uses_w2_ring(config, capability, K)
    if w2_is_gluon:
        from triton.experimental.gluon._runtime import GluonASTSource

        w2 = compile_kernel(w2_ring.w2_ring_kernel, dict(w2_consts, CHUNKS_PAD=grouped._next_pow2(N // 32),
                                                         AHEAD=min(config.w2_copy_ahead, N // 32)),
                            pointers, config.w2_warps, dict(rows=rows, stride_om=K),
                            config.w2_compile_options(capability), source=GluonASTSource)
    else:
        w2 = compile_kernel(grouped._w2_rows_kernel, dict(w2_consts, N_PAD=grouped._next_pow2(N),
                                                          FUSED_COMBINE=config.fused_combine), pointers,
                            config.w2_warps, dict(rows=rows, stride_om=K), config.w2_compile_options(capability))
    yield (f"M={M} {dtype} w2", w2, N * config.w2_block_k, w2_grid[0] * w2_grid[1], config.w2_warps,
           not w2_is_gluon)


def timer_reads(kernel) -> int:
    """How many times the SASS reads the GPU's global timer (kernels/timeline.py's stamps)."""
    return len(re.findall(r"SR_GLOBALTIMER(?:LO)?\b", cuobjdump(kernel, "-sass")))


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", default="")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (80: the kernels' minimum)")
    parser.add_argument("--timeline", action="store_true",
                        help="instead: the timer reads per kernel at M = 8 fp16, without and with the timestamps")
    args = parser.parse_args(argv)
    global TARGET
    TARGET = GPUTarget("cuda", args.arch, 32)
    if args.timeline:
        for timeline in (False, True):
            for name, kernel, *_ in launched_kernels("fp16", 8, timeline):
                print(f"{name} timeline={timeline}: timer reads={timer_reads(kernel)}", flush=True)
        return 0
    # M = 2 and 4: the 4-warp Gluon W2 under the cap; 3: a count off the table (GroupedConfig's
    # defaults), the tl W2, whose fragment layouts Triton chooses; 8: the 8-warp Gluon W2; bf16: its own PTX
    for dtype, M in (("fp16", 2), ("fp16", 3), ("fp16", 4), ("fp16", 8), ("bf16", 8)):
        for name, kernel, weights, grid, warps, tl_layouts in launched_kernels(dtype, M):
            stats(name, kernel, weights, args.dump, grid)
            if tl_layouts:
                check_fragment_layouts(name, kernel, warps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
