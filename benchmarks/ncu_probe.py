"""Profile target for Nsight Compute: the grouped op at M tokens, one layer, a few launches.

    ncu --kernel-name regex:"w13" --launch-skip 2 --launch-count 1 --section WarpStateStats \
        --section SchedulerStats python3 benchmarks/ncu_probe.py M [RING_STAGES [W13_SPLIT_ROWS]]

The table's config for M, with the W13 ring depth and split overridden where
given (0: the tl W13).
import dataclasses
import sys

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.benchmarking.bench import random_layer_inputs
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.ops import alloc_workspace, grouped_plan_for, launch_grouped

M = int(sys.argv[1]) if len(sys.argv) > 1 else 8
if not 1 <= M <= 8:
    sys.exit(f"ncu_probe: M = {M}; the workspace here holds 1..8 tokens")
E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
layer = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=1000, device="cuda")
ids, tws, xs = random_layer_inputs(M, k, E, K, 1, torch.float16, "cuda", torch.Generator().manual_seed(0))
workspace = alloc_workspace(8, k, K, N, "cuda")
out = torch.empty_like(xs[0])
config = grouped_plan_for(xs[0], ids[0], layer).config
if len(sys.argv) > 2:
    stages = int(sys.argv[2])
    config = dataclasses.replace(config, w13_kernel="gluon" if stages else "tl", w13_ring_stages=max(stages, 1))
if len(sys.argv) > 3:
    config = dataclasses.replace(config, w13_block_k=int(sys.argv[3])).fitted(K)
for _ in range(3):
    launch_grouped(xs[0], tws[0], ids[0], layer, workspace, out, config)
torch.cuda.synchronize()
print(config)
