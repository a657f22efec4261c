"""Where the co-served kernel loses time against the plugin's grouped route, stage by stage.

The co-served kernel (``kernels/marlin_grouped.py`` on vLLM's Marlin tensors) against the grouped
route on AutoAWQ's tensors at the same token count (on the H100, 1.4-1.6x its time with two W13
warps, 1.0-1.13x with one: ``docs/PERF.md``). Side by side in one
process, on the same rotated layers (tune's rotation, L2 cold) in both layouts and the same
inputs, CUDA-graph replays of, per M:

    awq        the grouped op as the plugin runs it (its table's launch plan)
    awq_w13    that plan's W13 launch alone
    marlin     the co-served kernel (its table's config, else the default)
    marlin_w13 its W13 launch alone
    marlin_<config>  the co-served kernel under each ``--marlin-configs`` config (the tune's
               candidate syntax), after its output on the first layer is checked against the
               float64 reference (its scaled error in the row; one past the tune's bound is not timed)
    marlin_w13_<config>  that config's W13 launch alone (W2 and the combine: the difference)

    python benchmarks/coserve_stages.py --shape 512,10,2048,512,128 --tokens 1,2,4,8 --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import triton

from moe_grouped_decode.benchmarking.coserve import SCALED_DIFF_BOUND, parse_config
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.benchmarking.tune import LayerSpec, Measurement, rotation_layers
from moe_grouped_decode.kernels import device_facts
from moe_grouped_decode.kernels import plan as plans
from moe_grouped_decode.kernels.marlin_grouped import (MARLIN_TILE_COLUMNS, coserved_config, launch_marlin_grouped,
                                                       marlin_w13_kernel)
from moe_grouped_decode.kernels.pdl import pdl_supported
from moe_grouped_decode.marlin_layout import awq_to_marlin
from moe_grouped_decode.ops import alloc_workspace, error_stats, grouped_plan_for, reference_moe, workspace_views


def marlin_w13_only(x, ids, marlin, N, G, config, partials, use_pdl):
    """The co-served kernel's W13 launch, as ``launch_marlin_grouped`` makes it (no fused combine)."""
    M, K = x.shape
    R = M * ids.shape[1]
    tiles = 2 * triton.cdiv(N, MARLIN_TILE_COLUMNS.value)
    splits = config.splits(K, N)
    arrivals = partials.new_empty(1, dtype=torch.int32)
    marlin_w13_kernel[(R * splits * tiles,)](
        x, x.stride(0), ids, marlin.num_experts, marlin.w13_qweight, marlin.w13_scales, marlin.w13_qzeros, partials, R,
        arrivals, 1, TOP_K=ids.shape[1], K=K, N=N, N_P=marlin.padded_intermediate_size, G=G,
        CHUNKS=config.w13_chunks, WARPS=config.w13_warps, SPLITS=splits, SCALES_GROUPED=marlin.scales_grouped,
        IS_BF16=x.dtype == torch.bfloat16, USE_PDL=use_pdl, ARRIVALS_PAD=0, num_warps=config.w13_warps)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="512,10,2048,512,128")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--tokens", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--marlin-configs", default="",
                        help="more co-served launch configs to time whole, as the tune's candidates "
                             "(e.g. 2x4x2r4; benchmarking/coserve.py)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("coserve_stages: needs a CUDA GPU", file=sys.stderr)
        return 2
    shape = tuple(int(v) for v in args.shape.split(","))
    E, k, K, N, G = shape
    device = torch.device("cuda")
    facts = device_facts(device)
    spec = LayerSpec(shape, args.dtype, "coserve-stages")
    layers = rotation_layers(spec, device)
    marlin = [awq_to_marlin(layer) for layer in layers]
    measure = Measurement(spec, layers, lambda *a: 0.0, lambda inputs: {}, device)
    use_pdl = pdl_supported(facts.capability)
    rows = []
    for M in (int(m) for m in args.tokens.split(",")):
        ids, tws, xs = measure.inputs(M)
        count = measure.count(M)
        workspace = alloc_workspace(M, k, K, N, device)
        out = torch.empty(M, K, dtype=xs[0].dtype, device=device)
        plan = grouped_plan_for(xs[0], ids[0], layers[0])
        w13_plan = dataclasses.replace(plan, launches=tuple(l for l in plan.launches if l.stage == "w13"))
        views = workspace_views(workspace, plan.rows, K, N)
        config = coserved_config(facts.name, shape, args.dtype, M)
        partials = torch.empty(config.splits(K, N), M * k, 2 * N, dtype=torch.float32, device=device)
        clocks = {
            "awq": lambda i: plans.launch_plan(plan, xs[i], tws[i], ids[i], layers[i], views, out),
            "awq_w13": lambda i: plans.launch_plan(w13_plan, xs[i], tws[i], ids[i], layers[i], views, out),
            "marlin": lambda i: launch_marlin_grouped(xs[i], tws[i], ids[i], *marlin[i].tensors(), N, G,
                                                      marlin[i].scales_grouped, config, use_pdl, out),
            "marlin_w13": lambda i: marlin_w13_only(xs[i], ids[i], marlin[i], N, G, config, partials, use_pdl),
        }
        row = {"M": M, "awq_launches": [l.name for l in plan.launches], "marlin_config": dataclasses.asdict(config)}
        extras = {text: parse_config(text) for text in filter(None, args.marlin_configs.split(","))}
        want = reference_moe(xs[0], tws[0], ids[0], layers[0]) if extras else None  # once per M, for every config
        for text, extra in extras.items():
            try:
                extra.splits(K, N)
            except ValueError as error:
                print(f"{text}: {error}", file=sys.stderr)
                continue
            got = launch_marlin_grouped(xs[0], tws[0], ids[0], *marlin[0].tensors(), N, G, marlin[0].scales_grouped,
                                        extra, use_pdl)
            error = error_stats(got, want).scaled_max_abs
            row[f"marlin_{text}_scaled_error"] = error
            if not error <= SCALED_DIFF_BOUND[args.dtype]:  # NaN too
                print(f"{text}: scaled error {error:.3g} over the bound, not timed", file=sys.stderr)
                continue
            clocks[f"marlin_{text}"] = lambda i, c=extra: launch_marlin_grouped(
                xs[i], tws[i], ids[i], *marlin[i].tensors(), N, G, marlin[i].scales_grouped, c, use_pdl, out)
            extra_partials = torch.empty(extra.splits(K, N), M * k, 2 * N, dtype=torch.float32, device=device)
            clocks[f"marlin_w13_{text}"] = lambda i, c=extra, p=extra_partials: marlin_w13_only(
                xs[i], ids[i], marlin[i], N, G, c, p, use_pdl)
        for name, step in clocks.items():
            row[f"{name}_us"] = round(graph_replay_us(step, count, args.reps), 2)
        print(json.dumps(row), flush=True)
        rows.append(row)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "coserve_stages.json").write_text(json.dumps({"gpu": facts.name, "shape": shape, "dtype": args.dtype,
                                                              "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
