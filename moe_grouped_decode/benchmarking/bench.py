"""``python -m moe_grouped_decode bench``: per-layer microseconds at every token count, beside vLLM's own.

The layer is qwen3.8-tp4's unless ``--shape E,k,K,N,G`` names another. One CUDA graph per
(column, M) runs ``--layers`` MoE layers with distinct weights (and their
own random routing and activations) back to back, so the 60 MB L2 of an H200 stays cold as in a
real model step; the time per layer is the graph's replay time over the layer count (median of
``--reps`` replays). From M = ``--large-from`` tokens on every layer reads all of its experts
(over 360 MB, six times the L2), so ``--large-layers`` layers keep L2 as cold: fewer layers
there, and the output says so.

Columns, measured in the same run on the same weights, routing and activations:
  grouped      the grouped op (awq_moe_grouped_decode), up to M = --grouped-max
  prefill      the prefill route (awq_moe_dense: the on-device sort, W13 + SiLU, W2, combine)
  plugin       the route the plugin runs at this M for the layer (kernels.lookup's: grouped
               where the layer's contract admits M, prefill elsewhere), and its time
  humming      vLLM 0.32's HUMMING MoE backend (what stock vLLM picks on an H200), and
  marlin       its MARLIN backend, through benchmarking.vllm_moe (an installed vLLM 0.32's
               ops, else built from --vllm-sources); not measured with --no-vllm
  floor1       the read floor: one launch streaming exactly the active experts' bytes
  floor2       the same after a compaction launch (two dependent launches, as the grouped
               op has), up to M = 32
  compute      the tensor-core floor: the layer's FLOPs at --peak-tflops (an H200's dense
               16-bit rate measured on random data, ~790 TFLOP/s)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch

from .. import env
from ..awq import synthetic_moe_weights
from ..contract import QWEN38_TP4, LayerShape, ShapeContract, admits, apply_tables
from ..kernels import device_facts
from ..kernels.lookup import launch_choice
from .replay import graph_replay_us

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
FLOOR2_MAX_TOKENS = 32  # floor2's compaction is one program's sort of the R routed rows


def _expert_bytes(weights) -> int:
    return sum(t[0].numel() * t.element_size() for t in weights.tensors())


def _random_routing(M: int, top_k: int, E: int, gen: torch.Generator):
    ids = torch.rand(M, E, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    tw = torch.rand(M, top_k, generator=gen)
    return ids, tw / tw.sum(1, keepdim=True)


def rotated_layers(count: int, dtype, device, shape=QWEN38_TP4.shape):
    """``count`` layers of ``shape`` (E, k, K, N, G; qwen3.8-tp4's by default) of distinct synthetic
    weights (seeds 1000 + i), the layers every benchmark rotates through one CUDA graph so that L2
    stays cold."""
    E, _, K, N, G = shape
    return [synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000 + i, device=device) for i in range(count)]


def layer_of(args) -> ShapeContract:
    """The layer ``--shape`` names: the contract that admits it in ``--dtype`` (qwen3.8-tp4 by
    default), or an unregistered one named by its numbers (only its sizes are read here)."""
    if not getattr(args, "shape", None):
        return QWEN38_TP4
    try:
        shape = tuple(int(v) for v in args.shape.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise SystemExit(f"bench: --shape takes E,k,K,N,G as five positive integers, got {args.shape!r}")
    dtype = DTYPES[getattr(args, "dtype", "fp16")]
    return admits(LayerShape(*shape, dtype)).contract or ShapeContract("x".join(map(str, shape)), *shape,
                                                                        min_tokens=1, max_tokens=1)


def random_layer_inputs(M: int, top_k: int, E: int, K: int, count: int, dtype, device, gen: torch.Generator):
    """``count`` decode steps of random routing and activations: lists of topk_ids, topk
    weights and x on ``device``, drawn from ``gen`` in one fixed order (every routing, then
    every x), so each benchmark sees the same inputs from the same seed."""
    routings = [_random_routing(M, top_k, E, gen) for _ in range(count)]
    xs = [torch.randn(M, K, generator=gen).to(dtype).to(device) for _ in range(count)]
    return [r[0].to(device) for r in routings], [r[1].to(device) for r in routings], xs


def layer_flops(M: int, top_k: int, K: int, N: int) -> float:
    """Multiply-adds x 2 of one layer: every routed row through W13 (K x 2N) and W2 (N x K)."""
    return 2.0 * M * top_k * (K * 2 * N + N * K)


def time_vllm(sources: Optional[str], layers, inputs: Dict[int, tuple], dtype, reps: int) -> Dict:
    """{backend: {M: us}} of vLLM's Marlin and Humming MoE on the bench's own weights and inputs
    (benchmarking.vllm_moe: an installed vLLM 0.32's ops, else built from ``sources``), or
    {backend: why not} where one cannot run here."""
    from .vllm_moe import time_vllm_backends

    results: Dict[str, object] = {}
    for count in sorted({len(v[0]) for v in inputs.values()}):
        Ms = [M for M, v in inputs.items() if len(v[0]) == count]
        times = time_vllm_backends(layers[:count], layers[0].group_size, Ms, dtype, reps,
                                   xs={M: inputs[M][2][0] for M in Ms},
                                   plans={M: list(zip(inputs[M][0], inputs[M][1])) for M in Ms}, sources=sources)
        for name, value in times.items():
            if not isinstance(value, dict):
                results[name] = value
            elif isinstance(results.setdefault(name, {}), dict):
                results[name].update(value)
    for name, value in results.items():
        shown = value if isinstance(value, str) else ", ".join(f"M={M} {us:.1f}" for M, us in sorted(value.items()))
        print(f"[bench] {name}: {shown}", flush=True)
    return results


def run(args) -> Dict:
    from ..ops import alloc_workspace
    from .read_floor import Compaction, floor2, floor_blocks, read_active_experts

    dtype = DTYPES[args.dtype]
    device = torch.device("cuda")
    apply_tables(device_facts(device).name)  # this GPU's grouped windows, as the vLLM plugin's startup does
    c = layer_of(args)
    E, k, K, N = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size
    t0 = time.time()
    tokens = sorted({int(m) for m in args.tokens.split(",") if m})
    print(f"[bench] generating {args.layers} layers of {c.name} weights on the GPU ...", flush=True)
    layers = rotated_layers(args.layers, dtype, device, c.shape)
    per_expert = _expert_bytes(layers[0])
    grouped_tokens = [M for M in tokens if M <= args.grouped_max]
    workspace = alloc_workspace(max(grouped_tokens), k, K, N, device) if grouped_tokens else None
    gen = torch.Generator().manual_seed(0)
    inputs = {}
    for M in tokens:
        count = args.layers if M < args.large_from else min(args.layers, args.large_layers)
        inputs[M] = random_layer_inputs(M, k, E, K, count, dtype, device, gen)
    rows: List[Dict] = []
    for M in tokens:
        ids, tws, xs = inputs[M]
        count = len(ids)
        active_lists = [torch.unique(i).to(torch.int32) for i in ids]
        mean_active = sum(a.numel() for a in active_lists) / count
        live_counts = [torch.tensor([a.numel()], dtype=torch.int32, device=device) for a in active_lists]
        max_active = min(M * k, E)
        sink = torch.empty(max_active * floor_blocks(layers[0].tensors()), dtype=torch.int32, device=device)
        plugin_route = launch_choice(device, c.shape, dtype, M).route
        row = {"M": M, "layers": count, "active_experts": mean_active, "active_MB": mean_active * per_expert / 1e6,
               "route": plugin_route, "compute_us": layer_flops(M, k, K, N) / (args.peak_tflops * 1e12) * 1e6}

        def floor1(layer):
            read_active_experts(active_lists[layer], live_counts[layer], sink, max_active, layers[layer].tensors())

        def prefill(layer):
            torch.ops.moe_grouped_decode.awq_moe_dense(xs[layer], tws[layer], ids[layer], *layers[layer].op_args())

        columns = {"floor1": floor1, "prefill": prefill}
        if M in grouped_tokens:
            def grouped(layer):
                torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                    xs[layer], tws[layer], ids[layer], *layers[layer].op_args(), workspace)

            columns["grouped"] = grouped
        if M <= FLOOR2_MAX_TOKENS:
            compaction = Compaction.alloc(M * k, device)

            def floor2_step(layer):
                floor2(ids[layer], compaction, sink, max_active, layers[layer].tensors())

            columns["floor2"] = floor2_step
        for name, step in columns.items():
            row[f"{name}_us"] = graph_replay_us(step, count, args.reps)
            print(f"[bench] M={M:<5} {name:<8} {row[f'{name}_us']:9.2f} us/layer  ({time.time() - t0:.0f}s)", flush=True)
        row["plugin_us"] = row.get(f"{plugin_route}_us")
        rows.append(row)
        torch.cuda.empty_cache()
    anchors = (time_vllm(args.vllm_sources, layers, inputs, dtype, args.reps) if args.vllm else
               {name: "not measured (--no-vllm)" for name in ("humming", "marlin")})
    for row in rows:
        for name in ("humming", "marlin"):
            times = anchors[name]
            row[f"{name}_us"] = times.get(row["M"]) if isinstance(times, dict) else None
        vllm = [row[f"{n}_us"] for n in ("humming", "marlin") if row[f"{n}_us"] is not None]
        row["vllm_best_us"] = min(vllm) if vllm else None
        row["speedup"] = row["vllm_best_us"] / row["plugin_us"] if vllm and row["plugin_us"] else None
        floor = max(row["floor1_us"], row["compute_us"])
        row["plugin_over_floor"] = row["plugin_us"] / floor if row["plugin_us"] else None
    sweep = _sweep(args, layers, workspace, gen) if args.sweep else []
    breakdown = _breakdown(args, layers, workspace, gen) if args.breakdown else []
    prefill_sweep = _prefill_sweep(args, layers, gen) if args.prefill_sweep else []
    prefill_breakdown = _prefill_breakdown(args, layers, gen) if args.prefill_breakdown else []
    return {
        "sweep": sweep,
        "prefill_sweep": prefill_sweep,
        "prefill_breakdown": prefill_breakdown,
        "breakdown": breakdown,
        "contract": c.name,
        # the counts measured here that the lookup sends to the grouped route
        "grouped_window": ([min(grouped), max(grouped)] if (grouped := [r["M"] for r in rows if r["route"] == "grouped"])
                           else None),
        "dtype": args.dtype,
        "layers_rotated": args.layers,
        "large_layers": {"from_M": args.large_from, "layers": args.large_layers},
        "peak_tflops": args.peak_tflops,
        "bytes_per_expert": per_expert,
        "gpu": device_facts(device).name,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "vllm_backends": {name: (value if isinstance(value, str) else "measured") for name, value in anchors.items()},
        "w13_kernel": _w13_kernel_name(),
        "batch_invariant": env.batch_invariant(),
        "rows": rows,
        "seconds": time.time() - t0,
    }


def _time_configs(tag: str, M: int, count: int, layers, gen, args, configs, launch) -> List[Dict]:
    """``launch(x, topk_weights, topk_ids, weights, out, config)`` for each of ``configs`` at M,
    timed the bench's way over ``count`` layers; each config's output on the first layer against
    the prefill route's (the op's ``awq_moe_dense``), as scaled max diff. Printed fastest first."""
    c = layer_of(args)
    ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, count, layers[0].dtype,
                                       torch.device("cuda"), gen)
    outs = [torch.empty_like(x) for x in xs]
    want = torch.ops.moe_grouped_decode.awq_moe_dense(xs[0], tws[0], ids[0], *layers[0].op_args()).float()
    results = []
    for config in configs:
        outs[0].fill_(float("nan"))

        def step(layer, config=config):
            launch(xs[layer], tws[layer], ids[layer], layers[layer], outs[layer], config)

        us = graph_replay_us(step, count, args.reps)
        diff = ((outs[0].float() - want).abs().max() / want.abs().max()).item()
        results.append({"M": M, "us": us, "scaled_diff_vs_prefill": diff, **dataclasses.asdict(config)})
    for result, config in sorted(zip(results, configs), key=lambda rc: rc[0]["us"]):
        print(f"[{tag}] M={M} {result['us']:9.2f} us  diff {result['scaled_diff_vs_prefill']:.1e}  {config}", flush=True)
    torch.cuda.empty_cache()
    return results


def _sweep(args, layers, workspace, gen) -> List[Dict]:
    """Every autotune candidate config of the grouped op at each of ``--sweep``'s token counts
    (the unit tests cover only the table's configs)."""
    from ..kernels import config as kernel_config
    from ..kernels import plan
    from ..ops import launch_grouped

    facts = device_facts(torch.device("cuda"))
    configs = [candidate.fitted(layer_of(args).hidden_size)
               for candidate in kernel_config.grouped_candidates(facts.capability, plan.kernel_family(facts))]

    def launch(x, tw, ids, weights, out, config):
        launch_grouped(x, tw, ids, weights, workspace, out, config)

    return [row for M in (int(m) for m in args.sweep.split(","))
            for row in _time_configs("sweep", M, args.layers, layers, gen, args, configs, launch)]


def _breakdown(args, layers, workspace, gen) -> List[Dict]:
    """Each grouped stage alone, same method (the plan's ``stages``).

    Stages after W13 reuse whatever partials the last layer left in the workspace: the timing
    is right, the numbers are not. W2 alone with the fused combine leaves out the combine's
    sums: only the W13 launch zeroes the arrival counters, so without it no W2 program arrives
    last."""
    from ..ops import grouped_plan_for, launch_grouped

    c = layer_of(args)
    device = torch.device("cuda")
    results = []
    for M in [int(m) for m in args.breakdown.split(",")]:
        ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, args.layers, layers[0].dtype,
                                           device, gen)
        out = torch.empty_like(xs[0])
        full = grouped_plan_for(xs[0], ids[0], layers[0])
        row = {"M": M, "config": dataclasses.asdict(full.config)}
        launched = tuple(dict.fromkeys(launch.stage for launch in full.launches))
        # one sort scratch for every call: a stage alone then reads the groups the last sort left
        sort_scratch = torch.empty(max(1, full.sort_numel), dtype=torch.int32, device=device)
        for stages in (launched,) + tuple((stage,) for stage in launched):
            def step(layer, stages=stages):
                launch_grouped(xs[layer], tws[layer], ids[layer], layers[layer], workspace, out, stages=stages,
                               sort_scratch=sort_scratch)

            name = "+".join(stages)
            row[name] = graph_replay_us(step, args.layers, args.reps)
            print(f"[breakdown] M={M} {name:<24} {row[name]:8.2f} us/layer", flush=True)
        results.append(row)
    return results


def parse_prefill_configs(text: str):
    """``;``-separated PrefillConfigs, each ``TB,W13_WARPS,W2_WARPS`` (the mma kernels) or
    ``field=value,...`` (any fields, e.g. ``kernel=dot,block_rows=64,w13_warps=4``)."""
    from ..kernels.config import PrefillConfig

    defaults = PrefillConfig()

    def value(field: str, text: str):
        default = getattr(defaults, field)
        return text if isinstance(default, str) else bool(int(text)) if isinstance(default, bool) else int(text)

    def parse(item: str):
        if "=" not in item:
            return PrefillConfig(*(int(v) for v in item.split(",")))
        fields = dict(pair.split("=", 1) for pair in item.split(","))
        return PrefillConfig(**{k: value(k, v) for k, v in fields.items()})

    return [parse(item) for item in text.split(";") if item]


def _prefill_prefix_us(plan, end: int, inputs, layers, scratch, outs, count: int, reps: int) -> float:
    """us per layer of the first ``end`` launches of a prefill ``plan`` over ``count`` layers
    (``inputs``: random_layer_inputs' ids, weights and activations; ``outs`` one per layer)."""
    from ..kernels import plan as launch_plan

    ids, tws, xs = inputs
    prefix = dataclasses.replace(plan, launches=plan.launches[:end])

    def step(layer):
        launch_plan.launch_prefill(prefix, xs[layer], tws[layer], ids[layer], layers[layer], scratch, outs[layer])

    return graph_replay_us(step, count, reps)


def _prefill_sweep(args, layers, gen) -> List[Dict]:
    """The prefill route at each of ``--prefill-sweep``'s token counts under each of
    ``--prefill-configs`` (``--large-layers`` layers; the tests cover every config's numerics):
    the whole route, and its launches up to and including W13 (``through_w13_us``: the sort and
    W13), so W13 and W2 variants can be told apart in one sweep."""
    from ..kernels.config import prefill_candidates
    from ..ops import prefill_plan_for

    configs = (list(prefill_candidates()) if args.prefill_configs == "candidates"
               else parse_prefill_configs(args.prefill_configs))
    count = min(args.layers, args.large_layers)
    c = layer_of(args)
    device = torch.device("cuda")
    results = []
    for M in (int(m) for m in args.prefill_sweep.split(",")):
        ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, count, layers[0].dtype, device,
                                           gen)
        outs = [torch.empty_like(x) for x in xs]
        want = torch.ops.moe_grouped_decode.awq_moe_dense(xs[0], tws[0], ids[0], *layers[0].op_args()).float()
        rows = []
        for config in configs:
            plan = prefill_plan_for(xs[0], ids[0], layers[0], config)
            scratch = torch.empty(plan.scratch_numel, dtype=torch.int32, device=device)
            through_w13 = 1 + max(i for i, launch in enumerate(plan.launches) if launch.stage == "w13")
            row = {"M": M, **dataclasses.asdict(config)}
            for name, end in (("through_w13_us", through_w13), ("us", len(plan.launches))):
                outs[0].fill_(float("nan"))
                row[name] = _prefill_prefix_us(plan, end, (ids, tws, xs), layers, scratch, outs, count, args.reps)
            row["scaled_diff_vs_prefill"] = ((outs[0].float() - want).abs().max() / want.abs().max()).item()
            rows.append(row)
        for row in sorted(rows, key=lambda r: r["us"]):
            print(f"[prefill-sweep] M={M} {row['us']:9.2f} us (sort+W13 {row['through_w13_us']:8.2f}) "
                  f"diff {row['scaled_diff_vs_prefill']:.1e}  "
                  + ",".join(f"{k}={row[k]}" for k in dataclasses.asdict(configs[0])), flush=True)
        results += rows
        torch.cuda.empty_cache()
    return results


def _prefill_breakdown(args, layers, gen) -> List[Dict]:
    """The prefill route's stages at each of ``--prefill-breakdown``'s token counts: the plan's
    launches run up to and including each stage (the sort's four, W13, W2, the combine), same
    method; a stage's time is the difference to the run before it."""
    from ..ops import prefill_plan_for

    c = layer_of(args)
    device = torch.device("cuda")
    results = []
    for M in [int(m) for m in args.prefill_breakdown.split(",")]:
        count = min(args.layers, args.large_layers)
        ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, count, layers[0].dtype, device,
                                           gen)
        plan = prefill_plan_for(xs[0], ids[0], layers[0])
        scratch = torch.empty(plan.scratch_numel, dtype=torch.int32, device=device)
        out = torch.empty_like(xs[0])
        stage_ends = [i + 1 for i, launch in enumerate(plan.launches)
                      if i + 1 == len(plan.launches) or plan.launches[i + 1].stage != launch.stage]
        row, before = {"M": M, "config": dataclasses.asdict(plan.config)}, 0.0
        for end in stage_ends:
            us = _prefill_prefix_us(plan, end, (ids, tws, xs), layers, scratch, [out] * count, count, args.reps)
            row[plan.launches[end - 1].stage] = us - before
            before = us
        row["all"] = before
        print(f"[prefill-breakdown] M={M} " + " ".join(f"{k} {v:.1f}" for k, v in row.items() if k not in ("M", "config")),
              flush=True)
        results.append(row)
    return results


def _fmt(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _w13_kernel_name() -> str:
    """Which kernel family the grouped op runs here (kernels.plan.gluon_runs)."""
    from ..kernels import plan

    if not env.gluon_w13_enabled():
        return f"tl ({env.GLUON_W13_ENV}=0)"
    return "Gluon" if plan.kernel_family(torch.device("cuda")) == "gluon" else "tl (no Gluon)"


def markdown(result: Dict) -> str:
    large = result["large_layers"]
    lines = [
        f"{result['contract']} {result['dtype']}, {result['gpu']}, torch {result['torch']}, triton {result['triton']}; "
        f"us per layer (median of CUDA-graph replays), {result['layers_rotated']} layers of distinct weights rotated "
        f"(from M = {large['from_M']} on, {large['layers']}: every layer reads all of its experts there); "
        + (f"grouped route at the measured M from {result['grouped_window'][0]} to {result['grouped_window'][1]}"
           if result["grouped_window"] else "no grouped route at the measured M")
        + ("; batch-invariant mode (the prefill route, one config, at every M)" if result.get("batch_invariant") else "")
        + "; vLLM's backends: "
        + ", ".join(f"{name} {status}" for name, status in result["vllm_backends"].items()),
        "",
        "| M | plugin route | plugin | humming | marlin | speedup vs vLLM's faster | grouped | prefill | read floor "
        "| compute floor | plugin / floor |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        g = r.get
        lines.append(
            f"| {r['M']} | {r['route']} | {_fmt(g('plugin_us'), '.1f')} | {_fmt(g('humming_us'), '.1f')} | "
            f"{_fmt(g('marlin_us'), '.1f')} | {_fmt(g('speedup'), '.2f')}{'x' if g('speedup') else ''} | {_fmt(g('grouped_us'), '.1f')} | "
            f"{_fmt(g('prefill_us'), '.1f')} | {_fmt(g('floor1_us'), '.1f')} | {_fmt(g('compute_us'), '.1f')} | "
            f"{_fmt(g('plugin_over_floor'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: Dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ratio) = plt.subplots(2, 1, figsize=(8, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    styles = {"plugin": dict(lw=3, color="black"), "humming": dict(color="tab:red"), "marlin": dict(color="tab:orange"),
              "grouped": dict(ls="--", color="tab:blue"), "prefill": dict(ls="--", color="tab:green"),
              "floor1": dict(ls=":", color="gray"), "compute": dict(ls="-.", color="gray")}
    labels = {"floor1": "read floor", "compute": "compute floor", "plugin": "plugin (its route per M)",
              "humming": "vLLM Humming", "marlin": "vLLM Marlin"}
    for name, style in styles.items():
        pts = [(r["M"], r[f"{name}_us"]) for r in result["rows"] if r.get(f"{name}_us") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", ms=3, label=labels.get(name, name), **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("us per MoE layer (CUDA-graph replay, L2 cold)")
    ax.set_title(f"{result['contract']} {result['dtype']} on {result['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    # the promise, where a log scale hides it: faster than vLLM's faster backend above the line
    pts = [(r["M"], r["speedup"]) for r in result["rows"] if r.get("speedup")]
    if pts:
        ratio.plot(*zip(*pts), marker="o", ms=4, lw=2, color="black", label="plugin's speedup over vLLM's faster")
        for m, value in pts:
            if value < 1.0:
                ratio.plot([m], [value], marker="o", ms=7, color="tab:red")
    ratio.axhline(1.0, color="tab:red", lw=1, ls="--")
    ratio.set_ylabel("vLLM's faster / plugin")
    ratio.set_xlabel("tokens M")
    ratio.grid(True, which="both", alpha=0.3)
    ratio.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default=None, help="E,k,K,N,G: the layer timed (default: qwen3.8-tp4's "
                        "512,10,2560,160,32); the plugin's routes and configs as the lookup gives them on this GPU")
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64,128,160,192,224,256,320,384,512,1024,2048,4096,8192",
                        help="token counts (every column at each; 128..384 finely, where the routes and vLLM's "
                        "backends cross)")
    parser.add_argument("--grouped-max", type=int, default=1024,
                        help="the grouped op and floor2 up to this M")
    parser.add_argument("--layers", type=int, default=32, help="layers of distinct weights rotated in one graph (>= 32 keeps L2 cold)")
    parser.add_argument("--large-from", type=int, default=1024, help="from this M on, time --large-layers layers")
    parser.add_argument("--large-layers", type=int, default=8, help="layers rotated from --large-from on")
    parser.add_argument("--reps", type=int, default=30, help="graph replays per column (the median is reported)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp16")
    parser.add_argument("--vllm-sources", default=".vllm_moe_src", help="vLLM's fetched sources (python -m "
                        "moe_grouped_decode vllm-moe-fetch), where vLLM 0.32 is not installed with its CUDA ops")
    parser.add_argument("--no-vllm", dest="vllm", action="store_false", help="leave out vLLM's backends")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="tensor-core rate of the compute floor")
    parser.add_argument("--out", default="artifacts/bench", help="output directory (JSON, Markdown, PNG)")
    parser.add_argument("--breakdown", default="", help="token counts at which to time each grouped stage alone (e.g. 2,8)")
    parser.add_argument("--sweep", default="", help="token counts at which to time every autotune candidate (e.g. 2,4,8)")
    parser.add_argument("--prefill-sweep", default="", help="token counts at which to time the prefill route under each "
                        "of --prefill-configs")
    parser.add_argument("--prefill-breakdown", default="", help="token counts at which to time the prefill route's stages")
    parser.add_argument("--prefill-configs", default="candidates",
                        help="PrefillConfigs as TOKEN_BLOCKS,W13_WARPS,W2_WARPS;... or FIELD=VALUE,...;...; "
                        "'candidates': kernels.config.prefill_candidates()")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    from .. import ops  # noqa: F401  (registers the ops)

    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "bench.md").write_text(table)
    plot(result, out / "bench.png")
    print(table)
    print(f"[bench] wrote {out}/bench.json, bench.md, bench.png in {result['seconds']:.0f}s", flush=True)
    return 0
