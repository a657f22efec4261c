"""A/B, one process: M = 8's old table config (tl W2, 4 warps, cap 128) against the new one (Gluon W2, 8 warps)."""
import dataclasses
import sys

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.bench import random_layer_inputs
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import configs, grouped
from moe_grouped_decode.ops import alloc_workspace, workspace_views
from moe_grouped_decode.ops.cuda import graph_replay_us

LAYERS = 32
E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
for dtype, name in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
    layers = [synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000 + i, device="cuda") for i in range(LAYERS)]
    gen = torch.Generator().manual_seed(0)
    for M in (8,):
        ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, dtype, "cuda", gen)
        new = configs.grouped_config((E, k, K, N, G), name, M, True)
        old = dataclasses.replace(new, w2_ring=False, w2_warps=4, w2_max_registers=128)
        views = workspace_views(alloc_workspace(M, k, K, N, "cuda"), M * k, K, N)
        outs = [torch.empty_like(x) for x in xs]
        res = {"old": [], "new": []}
        for rep in range(3):
            for label, config in (("old", old), ("new", new)):
                def step(i, config=config):
                    grouped.grouped_decode(xs[i], tws[i], ids[i], *layers[i].op_args(), views, outs[i], config)
                res[label].append(graph_replay_us(step, LAYERS))
        print(f"[ab] {name} M={M} old (tl W2 4w cap128): {' '.join(f'{v:.2f}' for v in res['old'])}  "
              f"new (Gluon W2 8w): {' '.join(f'{v:.2f}' for v in res['new'])}", flush=True)
