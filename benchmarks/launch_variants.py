"""The grouped op's launch structure, side by side: 3 plain launches vs PDL vs the fused combine.

    PYTHONPATH=. python benchmarks/launch_variants.py [VARIANT;VARIANT|all] [M,M,...]

For each M: the three plain launches' eager output on layer 0 is checked against the
float64 reference; every variant is timed under CUDA-graph replay over 32 layers
of distinct weights (L2 cold, ``benchmarking.replay.graph_replay_us``), per stage too, and
every layer's replayed output is compared bit for bit with the three plain launches' eager
output (the variants change launches, not arithmetic). The per-stage times of a fused
config time W2 alone without the combine's sums: nothing re-zeroes the arrival
counters without the W13 launch, so no program ever arrives last there.
Also: the cost of a chain of empty launches per layer, with and without PDL.
"""
import dataclasses
import sys
import time

import torch
import triton
import triton.language as tl

import moe_grouped_decode.ops  # noqa: F401  (registers the ops)
from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.kernels.config import GroupedConfig
from moe_grouped_decode.ops import alloc_workspace, grouped_plan_for, launch_grouped
from moe_grouped_decode.ops.reference import error_stats, reference_moe

LAYERS = 32


@triton.jit
def _empty(p, USE_PDL: tl.constexpr):
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if tl.program_id(0) == 0:
        tl.store(p, 1)


def launch_gaps():
    sink = torch.zeros(4, dtype=torch.int32, device="cuda")
    for pdl in (False, True):
        for n in (1, 2, 3, 4):
            def step(i, n=n, pdl=pdl):
                for _ in range(n):
                    _empty[(264,)](sink, USE_PDL=pdl, num_warps=1, **({"launch_pdl": True} if pdl else {}))
            print(f"[gaps] pdl={pdl} {n} empty launches: {graph_replay_us(step, LAYERS):6.2f} us", flush=True)


def main():
    torch.manual_seed(0)
    E, k, K, N = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size
    t0 = time.time()
    launch_gaps()
    layers = rotated_layers(LAYERS, torch.float16, "cuda")
    print(f"[variants] layers built in {time.time() - t0:.0f}s", flush=True)
    base = GroupedConfig(fused_combine=False, pdl=False)  # three plain launches: W13, W2, combine
    variants = {
        "3 launches": base,
        "pdl": dataclasses.replace(base, pdl=True),
        "fused": dataclasses.replace(base, fused_combine=True),
        "fused+pdl (default)": GroupedConfig(),
    }
    only = sys.argv[1].split(";") if len(sys.argv) > 1 and sys.argv[1] != 'all' else None
    gen = torch.Generator().manual_seed(0)
    workspace = alloc_workspace(8, k, K, N, "cuda")
    table = []
    for M in [int(m) for m in (sys.argv[2] if len(sys.argv) > 2 else '2,4,8').split(',')]:
        if not 1 <= M <= 8:
            raise SystemExit(f"M={M}: the workspace here holds 8 tokens")
        ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, torch.float16, "cuda", gen)
        outs = [torch.empty_like(x) for x in xs]
        want = []
        for i in range(LAYERS):
            launch_grouped(xs[i], tws[i], ids[i], layers[i], workspace, outs[i], base)
            want.append(outs[i].clone())
        ref = reference_moe(xs[0], tws[0], ids[0], layers[0])
        s = error_stats(want[0].cpu(), ref)
        print(f"[variants] M={M} 3 launches eager vs float64 reference: scaled={s.scaled_max_abs:.2e} ulp={s.max_ulp}", flush=True)
        for name, config in variants.items():
            if only and name not in only:
                continue
            config = config.fitted(K)
            for o in outs:
                o.fill_(float("nan"))

            def step(i, config=config):
                launch_grouped(xs[i], tws[i], ids[i], layers[i], workspace, outs[i], config)

            us = graph_replay_us(step, LAYERS)
            same_bits = all(torch.equal(o.view(torch.int16), w.view(torch.int16)) for o, w in zip(outs, want))
            diff = max(((o.float() - w.float()).abs().max() / w.float().abs().max()).item() for o, w in zip(outs, want))
            nan = any(torch.isnan(o).any().item() for o in outs)
            stages = {}
            for launch in grouped_plan_for(xs[0], ids[0], layers[0], config).launches:
                def one(i, config=config, stage=launch.stage):
                    launch_grouped(xs[i], tws[i], ids[i], layers[i], workspace, outs[i], config, stages=(stage,))
                stages[launch.stage] = graph_replay_us(one, LAYERS)
            table.append((M, name, us, diff, nan, stages))
            print(f"[variants] M={M} {name:<16} {us:7.2f} us  diff/3 launches={diff:.1e} same bits={same_bits} nan={nan}  "
                  + " ".join(f"{s}={t:.2f}" for s, t in stages.items()), flush=True)
    print("\n| M | variant | us | diff vs 3 launches | stages |\n| --- | --- | --- | --- | --- |")
    for M, name, us, diff, nan, stages in table:
        print(f"| {M} | {name} | {us:.2f} | {diff:.1e}{' NaN' if nan else ''} | "
              + " ".join(f"{s} {t:.2f}" for s, t in stages.items()) + " |")


if __name__ == "__main__":
    main()
