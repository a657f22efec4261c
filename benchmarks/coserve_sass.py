"""Static SASS of the two grouped routes at one shape: the AutoAWQ route's W13 and W2 (its
launch table's config at M, both kernel families) beside the co-served kernel's (Marlin tensors).

No GPU needed (Triton's bundled ptxas for sm_90): lane-instructions per weight say how much of the
SMs' issue rate each stage needs to read weights at the memory's rate. A lead for where the
co-served kernel loses time, not a measurement of it (``benchmarks/coserve_stages.py`` times it).

    PYTHONPATH=. python benchmarks/coserve_sass.py [--shape 512,10,2048,512,128] [--gpu "NVIDIA H100 80GB HBM3"]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sass_stats  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from moe_grouped_decode.kernels import config as kernel_config  # noqa: E402
from moe_grouped_decode.kernels import plan as launch_plan  # noqa: E402
from moe_grouped_decode.benchmarking.coserve import parse_config  # noqa: E402
from moe_grouped_decode.kernels.marlin_grouped import (ACT_LAUNCH_BLOCK, marlin_act_kernel, marlin_w13_kernel,  # noqa: E402
                                                       marlin_w2_kernel)
from moe_grouped_decode.marlin_layout import marlin_padded_intermediate, vllm_scales_grouped  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,10,2048,512,128")
    parser.add_argument("--gpu", default="NVIDIA H100 80GB HBM3", help="whose launch table gives the AutoAWQ config")
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--marlin-configs", default="2x4x2,4x4x2",
                        help="as the tune's co-serving candidates (benchmarking/coserve.py)")
    args = parser.parse_args(argv)
    E, k, K, N, G = (int(v) for v in args.shape.split(","))
    M, dtype = args.tokens, "fp16"
    sass_stats.TARGET = GPUTarget("cuda", 90, 32)
    for family in ("gluon", "tl"):
        config = kernel_config.grouped_config((E, k, K, N, G), args.gpu, family, dtype, M).fitted(K)
        plan = launch_plan.grouped_plan(M, k, K, N, G, sass_stats.DTYPES[dtype], (9, 0), config, num_experts=E)
        ints = dict(x_stride=K, out_stride=K, rows=M * k, num_arrivals=plan.num_arrivals, num_experts=E)
        for launch in plan.launches:
            if launch.stage in ("w13", "w2"):
                weights = config.w13_block_k * 64 if launch.stage == "w13" else N * config.w2_block_k
                sass_stats.stats(f"AutoAWQ {launch.name} ({launch.num_warps} warps)",
                                 sass_stats.compile_launch(launch, dtype, ints), weights)
    N_p = marlin_padded_intermediate(N, G)
    for text in args.marlin_configs.split(","):
        config = parse_config(text)
        w13_warps, chunks, w2_warps = config.w13_warps, config.w13_chunks, config.w2_warps
        row_warps = config.w2_row_warps
        splits = config.splits(K, N)
        shape = dict(K=K, N=N, N_P=N_p, G=G, SCALES_GROUPED=vllm_scales_grouped(G, N), IS_BF16=False, USE_PDL=True)
        w13 = sass_stats.compile_kernel(
            marlin_w13_kernel, dict(shape, WARPS=w13_warps, TOP_K=k, CHUNKS=chunks, SPLITS=splits, ARRIVALS_PAD=64),
            dict(x_ptr="*fp16", ids_ptr="*i32", qweight_ptr="*i32", scales_ptr="*fp16", qzeros_ptr="*i32",
                 partials_ptr="*fp32", arrivals_ptr="*i32"), w13_warps, dict(stride_xm=K))
        sass_stats.stats(f"Marlin w13 {text} ({w13_warps} warps)", w13, 64 * (K // splits))
        w2 = sass_stats.compile_kernel(
            marlin_w2_kernel, dict(shape, WARPS=w2_warps, SPLITS=splits, N_PAD=1 << (N - 1).bit_length(), TOP_K=k,
                                   FUSED_COMBINE=config.fused_combine, ROW_WARPS=row_warps,
                                   N_SPLITS=config.w2_n_splits, ACT_READY=config.act_launch),
            dict(ids_ptr="*i32", partials_ptr="*fp32", qweight_ptr="*i32", scales_ptr="*fp16", qzeros_ptr="*i32",
                 act_ptr="*fp16", row_out_ptr="*fp32", out_ptr="*fp16", topk_weights_ptr="*fp32", arrivals_ptr="*i32"),
            w2_warps * row_warps, dict(stride_om=K))
        sass_stats.stats(f"Marlin w2 {text} ({w2_warps * row_warps} warps)", w2, N // config.w2_n_splits * 64 * w2_warps)
        if config.act_launch:  # no weights: "per weight" here is per activation its program writes
            block = min(1 << (N - 1).bit_length(), ACT_LAUNCH_BLOCK)
            act = sass_stats.compile_kernel(marlin_act_kernel, dict(N=N, SPLITS=splits, BLOCK=block, USE_PDL=True),
                                            dict(partials_ptr="*fp32", act_ptr="*fp16"), 1)
            sass_stats.stats(f"Marlin act {text} (1 warp)", act, block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
