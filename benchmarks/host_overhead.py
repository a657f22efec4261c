"""Host time per eager call of the prefill route, piece by piece (GPU).

Outside vLLM's CUDA graphs (prefill steps above the largest captured batch) every MoE layer's
call runs its Python: the argument checks, the lookup of route and config, the plan, the scratch
views and one Triton launch per kernel. A step of 48 layers at 512 prompt tokens is host-bound
(the GPU idles between launches), so the microseconds here are the time to first token there.

Each piece is called ``--calls`` times back to back without a sync (fewer launches than the
GPU's queue holds, so no launch waits and the host's time is what is measured), ``--repeats``
times; the pieces take turns over ``--rounds`` rounds after a warm-up of every piece (so a host
still settling after the machine's start weighs on none of them alone); reported: the median of
the rounds' medians per call, and each round's.

    python benchmarks/host_overhead.py --tokens 512,2048 --out /tmp/host
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.kernels import expert_sort
from moe_grouped_decode.kernels import plan as launch_plans
from moe_grouped_decode.ops import awq_moe_dense_cuda, check_moe_args, ids_flag, launch_prefill, prefill_plan_for


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def per_call_us(fn, calls: int, repeats: int, device: str) -> float:
    fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        synchronize(device)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="512,10,2560,160,32", help="E,k,K,N,G")
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cuda", help="cuda; cpu with TRITON_INTERPRET=1 checks the script only")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    E, k, K, N, G = (int(v) for v in args.shape.split(","))
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=0, device=args.device)
    weight_args = (weights.w13_qweight, weights.w13_scales, weights.w13_qzeros, weights.w2_qweight,
                   weights.w2_scales, weights.w2_qzeros, G)
    rows = []
    for M in (int(v) for v in args.tokens.split(",")):
        gen = torch.Generator(device=args.device).manual_seed(M)
        x = torch.randn(M, K, device=args.device, generator=gen).half()
        tw = torch.rand(M, k, device=args.device, generator=gen)
        ids = torch.rand(M, E, device=args.device, generator=gen).topk(k, dim=1).indices.to(torch.int32)
        out = torch.empty_like(x)
        plan = prefill_plan_for(x, ids, weights)
        scratch = torch.empty(plan.scratch_numel, dtype=torch.int32, device=args.device)
        launch_plans.launch_prefill(plan, x, tw, ids, weights, scratch, out)  # every region as a call leaves it

        def launch_values(launch):
            """A launch's arguments over a scratch of its own, as the whole call leaves it: a launch
            repeated alone must read what the ones before it write. The sort's [prefix] rewrites
            its counts in place, so it gets them zeroed: their prefix stays zero however often it
            runs (repeated over real counts it would grow them past int32 and send the launches
            after it out of bounds)."""
            own = scratch.clone()
            views = plan.scratch_views(own)
            if launch.name == "sort_prefix":
                views["block_counts"].zero_()
            return {
                "x": x, "x_stride": x.stride(0), "topk_ids": ids, "topk_weights": tw, "out": torch.empty_like(x),
                "out_stride": out.stride(0), "rows": plan.rows,
                "num_blocks": -(-plan.rows // expert_sort.BLOCK_ROWS), "max_groups": views["group_expert"].numel(),
                "w13_qweight": weights.w13_qweight, "w13_scales": weights.w13_scales,
                "w13_qzeros": weights.w13_qzeros, "w2_qweight": weights.w2_qweight, "w2_scales": weights.w2_scales,
                "w2_qzeros": weights.w2_qzeros, **views, "id_flag": ids_flag(x.device) if plan.check_ids else None,
            }

        pieces = {
            "op (torch.ops ... awq_moe_dense)": lambda: torch.ops.moe_grouped_decode.awq_moe_dense(x, tw, ids,
                                                                                                   *weight_args),
            "awq_moe_dense_cuda (the op's implementation, as apply calls it)": lambda: awq_moe_dense_cuda(
                x, tw, ids, *weight_args),
            "launch_prefill (no op dispatch, no checks)": lambda: launch_prefill(x, tw, ids, weights, out),
            "check_moe_args": lambda: check_moe_args("awq_moe_dense", x, tw, ids, weights),
            "prefill_plan_for (lookup + plan)": lambda: prefill_plan_for(x, ids, weights),
            "scratch_views (shaped, for inspection)": lambda: plan.scratch_views(scratch),
            "torch.empty (scratch)": lambda: torch.empty(plan.scratch_numel, dtype=torch.int32, device=args.device),
            "kernels.plan.launch_prefill (views + launches)": lambda: launch_plans.launch_prefill(
                plan, x, tw, ids, weights, scratch, out),
        }
        for launch in plan.launches:
            values = launch_values(launch)

            def one(launch=launch, values=values):
                return launch.kernel[launch.grid](*[values[name] for name in launch.args], **dict(launch.constexprs),
                                                  **dict(launch.options))
            pieces[f"launch {launch.name} ({len(launch.args)} args)"] = one
            # the floor a launch could reach: its compiled kernel called with every argument bound,
            # past Triton's binding, specialization and cache lookup (which keep it correct)
            try:
                compiled = one()
                bound = launch.kernel.signature.bind(*[values[name] for name in launch.args],
                                                     **dict(launch.constexprs))
                bound.apply_defaults()
                runner = compiled[tuple(launch.grid) + (1,) * (3 - len(launch.grid))]
                every_arg = tuple(bound.arguments.values())
                runner(*every_arg)
                pieces[f"launch {launch.name}, compiled kernel called directly"] = lambda r=runner, a=every_arg: r(*a)
            except Exception as error:  # the lab piece only: another Triton's API
                print(f"[host] {launch.name}: no direct launch ({type(error).__name__}: {error})", flush=True)
        synchronize(args.device)
        for fn in pieces.values():  # warm-up: every piece 11 calls, twice
            for _ in range(2):
                per_call_us(fn, 10, 1, args.device)
        samples = {name: [] for name in pieces}
        for _ in range(args.rounds):
            for name, fn in pieces.items():
                samples[name].append(per_call_us(fn, args.calls, args.repeats, args.device))
        for name, rounds in samples.items():
            us = statistics.median(rounds)
            rows.append({"M": M, "piece": name, "host_us": us, "rounds_us": rounds})
            print(f"M={M:6d} {name:62s} {us:8.1f} us (rounds {min(rounds):.1f}-{max(rounds):.1f})", flush=True)
    os.makedirs(args.out, exist_ok=True)
    device = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else args.device
    with open(os.path.join(args.out, "host_overhead.json"), "w") as f:
        json.dump({"device": device, "torch": torch.__version__, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "host_overhead.md"), "w") as f:
        f.write(f"Host us per eager call, {device}, shape {args.shape} fp16 (median over {args.rounds} rounds of "
                f"the median of {args.repeats} x {args.calls} calls)\n\n| M | piece | host us | rounds |\n"
                "| --- | --- | --- | --- |\n")
        for row in rows:
            spread = ", ".join(f"{us:.1f}" for us in row["rounds_us"])
            f.write(f"| {row['M']} | {row['piece']} | {row['host_us']:.1f} | {spread} |\n")


if __name__ == "__main__":
    main()
