"""Dump the SASS of every distinct kernel the qwen3.8-tp4 shape launches, to compare two trees byte for byte.

    PYTHONPATH=. python benchmarks/qwen_sass_dump.py OUT_DIR [--arch 90] [--families gluon,tl]

The launches of ``kernels.plan``'s plans at the contract's shape: the grouped op at every token
count of its window (1..112) under both kernel families' configs (the table's entries, the default
elsewhere), and the prefill route at ``prefill_warmup_counts`` of 8192 tokens (the table's
configs), fp16 and bf16; one file per distinct launch (kernel, constexprs, options, argument
types), named by a hash of those. ``diff -r`` of two dumps shows what a kernel change moved.
No GPU needed.
"""
import argparse
import dataclasses
import hashlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass_stats  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moe_grouped_decode.contract import QWEN38_TP4 as c  # noqa: E402
from moe_grouped_decode.kernels import config as kernel_config  # noqa: E402
from moe_grouped_decode.kernels import expert_sort  # noqa: E402
from moe_grouped_decode.kernels import plan as launch_plan  # noqa: E402


def launches(arch, families):
    """(dtype, launch, ints) of every launch the contract's shape runs, in plan order."""
    from moe_grouped_decode.ops.cuda import prefill_warmup_counts

    E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
    shape = (E, k, K, N, G)
    capability = divmod(arch, 10)
    for dtype in ("fp16", "bf16"):
        torch_dtype = sass_stats.DTYPES[dtype]
        for family in families:
            for M in range(1, 113):
                config = kernel_config.grouped_config(shape, sass_stats.TABLE_GPU, family, dtype, M)
                if family == "tl":
                    config = dataclasses.replace(config, w13_kernel="tl", w2_kernel="tl")
                plan = launch_plan.grouped_plan(M, k, K, N, G, torch_dtype, capability, config.fitted(K),
                                                num_experts=E)
                ints = dict(x_stride=K, out_stride=K, rows=M * k, num_arrivals=plan.num_arrivals, num_experts=E,
                            num_blocks=-(-M * k // expert_sort.BLOCK_ROWS), max_groups=plan.max_groups or 1)
                for launch in plan.launches:
                    yield dtype, launch, ints
        for M in prefill_warmup_counts(8192):
            config = kernel_config.prefill_config(shape, sass_stats.TABLE_GPU, dtype, M)
            plan = launch_plan.prefill_plan(M, k, E, K, N, G, torch_dtype, capability, config)
            rows = M * k
            ints = dict(x_stride=K, out_stride=K, rows=rows, num_blocks=-(-rows // expert_sort.BLOCK_ROWS),
                        max_groups=expert_sort.max_groups(rows, E, plan.config.group_rows), num_experts=E)
            for launch in plan.launches:
                yield dtype, launch, ints


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--families", default="gluon,tl")
    args = parser.parse_args(argv)
    sass_stats.TARGET = GPUTarget("cuda", args.arch, 32)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    seen = set()
    for dtype, launch, ints in launches(args.arch, args.families.split(",")):
        types = sass_stats.argument_types(launch, dtype)
        aligned = sorted((name, ints[name] % 16 == 0) for name in launch.args if name in ints)
        key = repr((launch.name, launch.kernel.fn.__name__, launch.constexprs, launch.options,
                    sorted(types.items()), aligned))
        if key in seen:
            continue
        seen.add(key)
        kernel = sass_stats.compile_launch(launch, dtype, ints)
        digest = hashlib.sha1(key.encode()).hexdigest()[:12]
        name = f"{dtype}_{launch.name}_{digest}"
        (out / f"{name}.sass").write_text(sass_stats.cuobjdump(kernel, "-sass"))
        (out / f"{name}.key").write_text(key + "\n")
        print(name, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
