"""Compile the grouped kernels for sm_90 on any machine (Triton's bundled ptxas) and count SASS.

    PYTHONPATH=. python benchmarks/sass_stats.py [--dump DIR]

No GPU needed: the counts explain the measured times (docs/PERF.md) without device time.
Prints, per kernel at the qwen3.8-tp4 shape and launch config: registers, stack (spills),
instructions by class and lane-instructions per weight (the tile programs are loop-free,
so the static count is what one program issues; the W2 count includes the fused
combine, which only one program per token and tile runs).
"""
import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import grouped
from moe_grouped_decode.kernels import configs
from moe_grouped_decode.kernels.configs import QWEN38_TP4_SHAPE

TARGET = GPUTarget("cuda", 90, 32)
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def _signature(fn, constexprs, pointer_types):
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointer_types.get(name, "*fp32")
        else:
            sig[name] = "i32"
    return sig


def compile_kernel(fn, constexprs, pointer_types, num_warps):
    src = ASTSource(fn=fn, signature=_signature(fn, constexprs, pointer_types),
                    constexprs=constexprs)
    return triton.compile(src, target=TARGET, options={"num_warps": num_warps})


def cuobjdump(kernel, flag) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(CUOBJDUMP), flag, f.name], capture_output=True, text=True, check=True).stdout


def stats(name, kernel, weights_per_program, dump=None):
    text = cuobjdump(kernel, "-sass")
    usage = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(kernel, "-res-usage"))
    if dump:
        Path(dump, f"{name}.sass").write_text(text)
    ops = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", line)
        if m:
            ops[m.group(1).split(".")[0]] += 1
    total = sum(v for k, v in ops.items() if k not in ("NOP",))
    md = kernel.metadata
    top = ", ".join(f"{k} {v}" for k, v in ops.most_common(10))
    print(f"{name}: regs={usage.group(1)} stack={usage.group(2)} instructions={total} "
          f"per weight={total * 32 * md.num_warps / weights_per_program:.2f}  [{top}]", flush=True)


PTR16 = {"x_ptr": "*fp16", "ids_ptr": "*i32", "qweight_ptr": "*i32", "scales_ptr": "*fp16", "qzeros_ptr": "*i32",
         "sorted_rows_ptr": "*i32", "sorted_experts_ptr": "*i32", "active_experts_ptr": "*i32",
         "segment_offsets_ptr": "*i32", "live_count_ptr": "*i32", "arrivals_ptr": "*i32",
         "topk_weights_ptr": "*fp32", "out_ptr": "*fp16"}


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--dump", default="")
    args = parser.parse_args(argv)
    K, N, G, k = c.hidden_size, c.intermediate_size, c.group_size, c.top_k
    seen = set()
    for M in (2, 4, 8):
        config = configs.grouped_config(QWEN38_TP4_SHAPE, "fp16", M)
        if config in seen:
            continue
        seen.add(config)
        # R_PAD = 16: program 0's sort is not part of a tile program's instructions
        w13 = compile_kernel(grouped._w13_kernel, dict(
            TOP_K=k, K=K, TWO_N=2 * N, G=G, GROUPS=config.w13_block_k // G, WORDS=config.w13_block_n // 8,
            R_PAD=16, ARRIVALS_PAD=0, USE_PDL=config.pdl), PTR16, config.w13_warps)
        stats(f"M={M} w13", w13, config.w13_block_k * config.w13_block_n, args.dump)
        ga, gb = grouped.w2_group_chunks(N // G)
        w2 = compile_kernel(grouped._w2_rows_kernel, dict(
            K=K, N=N, G=G, SPLITS=config.w13_splits(K, G), WORDS=config.w2_block_k // 8, GROUPS_A=ga, GROUPS_B=gb,
            TOP_K=k, FUSED_COMBINE=config.fused_combine, USE_PDL=config.pdl), PTR16, config.w2_warps)
        stats(f"M={M} w2", w2, N * config.w2_block_k, args.dump)
    return 0


if __name__ == "__main__":
    sys.exit(main())
