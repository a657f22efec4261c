"""``python -m moe_grouped_decode bench``: per-layer microseconds under CUDA-graph replay.

One CUDA graph per (column, M) runs ``--layers`` MoE layers with distinct
weights (and their own random routing and activations) back to back, so the
60 MB L2 of an H200 stays cold as in a real model step; the time per layer is
the graph's replay time over the layer count (median of ``--reps`` replays).

Columns, measured in the same run:
  grouped      the grouped op (compaction, W13, SiLU, W2, combine)
  dense        the dense route (align over all E experts + tensor-core GEMMs + combine)
  floor2       the read floor, two dependent launches: compaction + a kernel streaming
               exactly the active experts' bytes
  floor1       the read floor, one launch: the same stream from an active list made ahead
  vllm         vLLM's fused_experts int4 path, when vllm is importable
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

from . import env
from .awq import synthetic_moe_weights
from .contract import QWEN38_TP4
from .ops.cuda import graph_replay_us

BYTES_PER_EXPERT_NOTE = "packed int4 + scales + zeros of W13 and W2"


def _expert_bytes(weights) -> int:
    return sum(t[0].numel() * t.element_size() for t in weights.tensors())


def _random_routing(M: int, top_k: int, E: int, gen: torch.Generator):
    ids = torch.rand(M, E, generator=gen).topk(top_k, dim=1).indices.to(torch.int32)
    tw = torch.rand(M, top_k, generator=gen)
    return ids, tw / tw.sum(1, keepdim=True)


def rotated_layers(count: int, dtype, device):
    """``count`` qwen3.8-tp4 layers of distinct synthetic weights (seeds 1000 + i), the layers every
    benchmark rotates through one CUDA graph so that L2 stays cold."""
    c = QWEN38_TP4
    return [synthetic_moe_weights(c.num_experts, c.hidden_size, c.intermediate_size, c.group_size, dtype=dtype,
                                  seed=1000 + i, device=device) for i in range(count)]


def floor2(topk_ids, views, sink, max_active: int, tensors) -> None:
    """The two-launch read floor of one layer: the compaction of ``topk_ids`` into the workspace
    ``views``, then one launch streaming exactly the active experts' bytes of ``tensors``."""
    from .kernels import grouped as grouped_kernels
    from .kernels.read_floor import read_active_experts

    grouped_kernels.compact(topk_ids, views.sorted_rows, views.sorted_experts, views.active_experts,
                            views.segment_offsets, views.live_count)
    read_active_experts(views.active_experts, views.live_count, sink, max_active, tensors)


def random_layer_inputs(M: int, top_k: int, E: int, K: int, count: int, dtype, device, gen: torch.Generator):
    """``count`` decode steps of random routing and activations: lists of topk_ids, topk
    weights and x on ``device``, drawn from ``gen`` in one fixed order (every routing, then
    every x), so each benchmark sees the same inputs from the same seed."""
    routings = [_random_routing(M, top_k, E, gen) for _ in range(count)]
    xs = [torch.randn(M, K, generator=gen).to(dtype).to(device) for _ in range(count)]
    return [r[0].to(device) for r in routings], [r[1].to(device) for r in routings], xs


def _vllm_status() -> str:
    try:
        import vllm  # noqa: F401
    except Exception as exc:  # any import failure means the column is not measurable here
        return f"not importable here ({type(exc).__name__}); vllm column not measured"
    return "importable, but its fused_experts int4 column is not wired yet (needs its own weight layout)"


def run(args) -> Dict:
    from .kernels.read_floor import floor_blocks, read_active_experts
    from .ops import alloc_workspace, workspace_views

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    c = QWEN38_TP4
    E, k, K, N = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size
    device = torch.device("cuda")
    t0 = time.time()
    print(f"[bench] generating {args.layers} layers of {c.name} weights on the GPU ...", flush=True)
    layers = rotated_layers(args.layers, dtype, device)
    per_expert = _expert_bytes(layers[0])
    vllm_note = _vllm_status()
    grouped_tokens = [int(m) for m in args.tokens.split(",") if m]
    dense_only = [int(m) for m in args.dense_tokens.split(",") if m]
    max_grouped = max(grouped_tokens)
    workspace = alloc_workspace(max_grouped, k, K, N, device)
    gen = torch.Generator().manual_seed(0)
    rows: List[Dict] = []
    for M in grouped_tokens + dense_only:
        with_grouped = M in grouped_tokens
        ids, tws, xs = random_layer_inputs(M, k, E, K, args.layers, dtype, device, gen)
        active_lists = [torch.unique(i).to(torch.int32) for i in ids]
        mean_active = sum(a.numel() for a in active_lists) / len(active_lists)
        live_counts = [torch.tensor([a.numel()], dtype=torch.int32, device=device) for a in active_lists]
        max_active = min(M * k, E)
        sink = torch.empty(max_active * floor_blocks(layers[0].tensors()), dtype=torch.int32, device=device)
        row = {"M": M, "active_experts": mean_active, "active_MB": mean_active * per_expert / 1e6}

        def floor1(layer):
            read_active_experts(active_lists[layer], live_counts[layer], sink, max_active, layers[layer].tensors())

        columns = {"floor1": floor1}
        if with_grouped:
            views = workspace_views(workspace, M * k, K, N)

            def grouped(layer):
                torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                    xs[layer], tws[layer], ids[layer], *layers[layer].op_args(), workspace)

            def floor2_step(layer):
                floor2(ids[layer], views, sink, max_active, layers[layer].tensors())

            columns = {"grouped": grouped, "floor2": floor2_step, "floor1": floor1}

        def dense(layer):
            torch.ops.moe_grouped_decode.awq_moe_dense(xs[layer], tws[layer], ids[layer], *layers[layer].op_args())

        columns["dense"] = dense
        for name, step in columns.items():
            row[f"{name}_us"] = graph_replay_us(step, args.layers, args.reps)
            print(f"[bench] M={M:<5} {name:<8} {row[f'{name}_us']:8.2f} us/layer  ({time.time() - t0:.0f}s)", flush=True)
        bytes_read = mean_active * per_expert
        for name in ("grouped", "dense", "floor2", "floor1"):
            if f"{name}_us" in row:
                row[f"{name}_TBps"] = bytes_read / (row[f"{name}_us"] * 1e-6) / 1e12
        if with_grouped:
            row["grouped_over_floor2"] = row["grouped_us"] / row["floor2_us"]
            row["grouped_over_floor1"] = row["grouped_us"] / row["floor1_us"]
            row["dense_over_grouped"] = row["dense_us"] / row["grouped_us"]
        row["dense_over_floor1"] = row["dense_us"] / row["floor1_us"]
        row["vllm_us"] = None
        rows.append(row)
    sweep = _sweep(args, layers, workspace, gen) if args.sweep else []
    breakdown = _breakdown(args, layers, workspace, gen) if args.breakdown else []
    return {
        "sweep": sweep,
        "breakdown": breakdown,
        "contract": c.name,
        "dtype": args.dtype,
        "layers_rotated": args.layers,
        "bytes_per_expert": per_expert,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "python": platform.python_version(),
        "vllm": vllm_note,
        "w13_kernel": _w13_kernel_name(),
        "rows": rows,
        "seconds": time.time() - t0,
    }


def _sweep(args, layers, workspace, gen) -> List[Dict]:
    """Time every autotune candidate config of the grouped op (L2 cold, same method), and check
    each one's output on the first layer against the dense route (the unit tests cover only
    the table's configs)."""
    from .kernels import configs, cuda_capability, grouped as grouped_kernels
    from .ops.cuda import launch_grouped

    c = QWEN38_TP4
    device = torch.device("cuda")
    results = []
    for M in [int(m) for m in args.sweep.split(",")]:
        ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, args.layers, layers[0].dtype,
                                           device, gen)
        out = torch.empty_like(xs[0])
        dense_out = torch.ops.moe_grouped_decode.awq_moe_dense(xs[0], tws[0], ids[0], *layers[0].op_args()).float()
        timed = []
        capability = cuda_capability(device)
        for candidate in configs.grouped_candidates(capability, grouped_kernels.ring_available(capability)):
            config = candidate.fitted(c.hidden_size)
            out.fill_(float("nan"))
            launch_grouped(xs[0], tws[0], ids[0], *layers[0].op_args(), workspace, out, config)
            error = ((out.float() - dense_out).abs().max() / dense_out.abs().max()).item()

            def step(layer, config=config):
                launch_grouped(xs[layer], tws[layer], ids[layer], *layers[layer].op_args(), workspace, out, config)

            us = graph_replay_us(step, args.layers, args.reps)
            timed.append((us, error, config))
            results.append({"M": M, "us": us, "scaled_diff_vs_dense": error, **config.__dict__})
        timed.sort(key=lambda t: t[0])
        for us, error, config in timed:
            print(f"[sweep] M={M} {us:7.2f} us  diff/dense {error:.1e}  {config}", flush=True)
    return results


def _breakdown(args, layers, workspace, gen) -> List[Dict]:
    """Each grouped stage alone, same method (the compaction program is in W13's launch with
    the tl W13, in W2's with the Gluon one).

    Stages after W13 reuse whatever partials the last layer left in the
    workspace: the timing is right, the numbers are not. W2 alone with the
    fused combine leaves out the combine's sums: only the W13 launch zeroes the
    arrival counters, so without it no W2 program arrives last."""
    import dataclasses

    from .kernels import configs, cuda_capability, grouped as grouped_kernels
    from .ops import workspace_views

    c = QWEN38_TP4
    device = torch.device("cuda")
    shape = (c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size)
    ring = grouped_kernels.ring_available(cuda_capability(device))
    results = []
    for M in [int(m) for m in args.breakdown.split(",")]:
        config = configs.grouped_config(shape, args.dtype, M, ring)
        ids, tws, xs = random_layer_inputs(M, c.top_k, c.num_experts, c.hidden_size, args.layers, layers[0].dtype,
                                           device, gen)
        out = torch.empty_like(xs[0])
        views = workspace_views(workspace, M * c.top_k, c.hidden_size, c.intermediate_size)
        row = {"M": M, "config": dataclasses.asdict(config)}
        launched = grouped_kernels.launched_stages(config)
        for stages in (launched,) + tuple((stage,) for stage in launched):
            def step(layer, stages=stages):
                grouped_kernels.grouped_decode(
                    xs[layer], tws[layer], ids[layer], *layers[layer].op_args(), views, out, config, stages=stages)

            name = "+".join(stages)
            row[name] = graph_replay_us(step, args.layers, args.reps)
            print(f"[breakdown] M={M} {name:<24} {row[name]:8.2f} us/layer", flush=True)
        results.append(row)
    return results


def _fmt(value, spec):
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _w13_kernel_name() -> str:
    """Which W13 kernel the grouped op ran (kernels.grouped.uses_w13_ring, for the table's configs)."""
    from .kernels import cuda_capability, grouped as grouped_kernels

    if not env.gluon_w13_enabled():
        return f"tl ({env.GLUON_W13_ENV}=0)"
    return "Gluon ring" if grouped_kernels.ring_available(cuda_capability(torch.device("cuda"))) else "tl (no Gluon)"


def markdown(result: Dict) -> str:
    lines = [
        f"{result['contract']} {result['dtype']}, {result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
        f"{result['layers_rotated']} layers rotated in one CUDA graph; us per layer (median); W13: "
        f"{result.get('w13_kernel', 'tl')}; vLLM: {result['vllm']}",
        "",
        "| M | active experts | MB read | grouped | dense | floor2 | floor1 | grouped/floor2 | grouped/floor1 | dense/grouped | grouped TB/s | floor2 TB/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rows"]:
        g = r.get
        lines.append(
            f"| {r['M']} | {r['active_experts']:.1f} | {r['active_MB']:.1f} | {_fmt(g('grouped_us'), '.2f')} | "
            f"{_fmt(g('dense_us'), '.2f')} | {_fmt(g('floor2_us'), '.2f')} | {_fmt(g('floor1_us'), '.2f')} | "
            f"{_fmt(g('grouped_over_floor2'), '.2f')} | {_fmt(g('grouped_over_floor1'), '.2f')} | "
            f"{_fmt(g('dense_over_grouped'), '.2f')} | {_fmt(g('grouped_TBps'), '.2f')} | {_fmt(g('floor2_TBps'), '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: Dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ("grouped", "dense", "floor2", "floor1"):
        pts = [(r["M"], r[f"{name}_us"]) for r in result["rows"] if r.get(f"{name}_us") is not None]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens M")
    ax.set_ylabel("us per MoE layer (CUDA-graph replay, L2 cold)")
    ax.set_title(f"{result['contract']} {result['dtype']} on {result['gpu']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,2,4,8,16,32", help="token counts for every column")
    parser.add_argument("--dense-tokens", default="256,1024", help="extra token counts for the dense route and floor only")
    parser.add_argument("--layers", type=int, default=32, help="layers of distinct weights rotated in one graph (>= 32 keeps L2 cold)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--out", default="artifacts/bench", help="output directory (JSON, Markdown, PNG)")
    parser.add_argument("--breakdown", default="", help="token counts at which to time each grouped stage alone (e.g. 2,8)")
    parser.add_argument("--sweep", default="", help="token counts at which to time every autotune candidate (e.g. 2,4,8)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: needs a CUDA GPU (none visible)", file=sys.stderr)
        return 2
    import moe_grouped_decode.ops  # noqa: F401  (registers the ops)

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
