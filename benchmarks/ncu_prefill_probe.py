"""Profile target for Nsight Compute: the prefill route at M tokens of any layer shape, one layer.

    ncu --clock-control none --kernel-name regex:w2_wgmma --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats \
        python3 benchmarks/ncu_prefill_probe.py --shape 128,8,2048,384,128 --tokens 128

Runs the config the shipped table names for this GPU, shape, dtype and M (or the op's default),
three times, so ``--launch-skip 2`` profiles a warm launch.
"""
import argparse

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.benchmarking.bench import random_layer_inputs
from moe_grouped_decode.contract import apply_tables
from moe_grouped_decode.kernels import device_facts
from moe_grouped_decode.ops import launch_prefill, prefill_plan_for

parser = argparse.ArgumentParser()
parser.add_argument("--shape", default="512,10,2560,160,32", help="E,k,K,N,G")
parser.add_argument("--tokens", type=int, default=128)
parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
args = parser.parse_args()
E, k, K, N, G = (int(v) for v in args.shape.split(","))
dtype = torch.float16 if args.dtype == "fp16" else torch.bfloat16
apply_tables(device_facts(torch.device("cuda")).name)
layer = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000, device="cuda")
ids, tws, xs = random_layer_inputs(args.tokens, k, E, K, 1, dtype, "cuda", torch.Generator().manual_seed(0))
out = torch.empty_like(xs[0])
print(prefill_plan_for(xs[0], ids[0], layer).config, flush=True)
for _ in range(3):
    launch_prefill(xs[0], tws[0], ids[0], layer, out)
torch.cuda.synchronize()
