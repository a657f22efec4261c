"""Exploration: W2 in Gluon with its weights staged in shared memory (w2_ring) vs the tl W2.
Bits against the tl W2 at the same config, and timings (the op, W2 alone) at M = 2 / 4 / 8."""
import dataclasses
import time

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.bench import random_layer_inputs
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import configs, grouped
from moe_grouped_decode.ops import alloc_workspace, workspace_views
from moe_grouped_decode.ops.cuda import graph_replay_us

LAYERS = 32
E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
t0 = time.time()
gen = torch.Generator().manual_seed(0)
workspace = alloc_workspace(8, k, K, N, "cuda")
table = []
for dtype in (torch.float16, torch.bfloat16):
    name = "fp16" if dtype == torch.float16 else "bf16"
    layers = [synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000 + i, device="cuda") for i in range(LAYERS)]
    for M in ((2, 4, 8) if name == "fp16" else (8,)):
        ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, dtype, "cuda", gen)
        outs = [torch.empty_like(x) for x in xs]
        base = configs.grouped_config((E, k, K, N, G), name, M, True)
        views = workspace_views(workspace, M * k, K, N)
        variants = [(False, w, r) for w in (4, 8) for r in (0, 128)] + [(True, w, 0) for w in (4, 8)]
        want = {}
        for ring, warps, regs in variants:
            config = dataclasses.replace(base, w2_ring=ring, w2_warps=warps, w2_max_registers=regs)
            for o in outs:
                o.fill_(float("nan"))

            def run(i, config=config):
                grouped.grouped_decode(xs[i], tws[i], ids[i], *layers[i].op_args(), views, outs[i], config)

            us = graph_replay_us(run, LAYERS)
            if warps in want:
                same = all(torch.equal(o, w) for o, w in zip(outs, want[warps]))
            else:
                want[warps] = [o.clone() for o in outs]
                same = "first (tl W2)"

            def w2(i, config=config):
                grouped.grouped_decode(xs[i], tws[i], ids[i], *layers[i].op_args(), views, outs[i], config,
                                       stages=("w2",))

            w2_us = graph_replay_us(w2, LAYERS)
            table.append((name, M, "gluon" if ring else "tl", warps, regs, us, w2_us, same))
            print(f"[w2] {name} M={M} {'gluon' if ring else 'tl'} warps={warps} maxnreg={regs}: all={us:.2f} "
                  f"w2={w2_us:.2f} bits={same} ({time.time() - t0:.0f}s)", flush=True)
print("| dtype | M | W2 | warps | maxnreg | all us | W2 alone | bits = tl W2 same warps |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
for row in table:
    print("| " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in row) + " |")
