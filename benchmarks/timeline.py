"""Where a layer's microseconds go: per-program timestamps of the grouped op (kernels/timeline.py).

    PYTHONPATH=. python benchmarks/timeline.py [M,M,...] [--out docs/bench/timeline.md] [--fields JSON]

For each M (default 2, 4, 8): the table's config, fp16, the qwen3.8-tp4 shape, 32 layers of
distinct weights replayed in one CUDA graph (as the benchmark times them; L2 cold), random
routing. Every program stamps %globaltimer at fixed points (W13: start, end; W2: start, after
the PDL wait, activations written, row output stored, end); times are us from the layer's first
W13 program start, medians over layers 1..30 (the first and last have no neighbour on one side).
The stamps cost a little (the "us per layer" row is with them). The smallest step seen between
stamps (the timer's resolution, or finer than it) is printed. They can also move where W2 runs:
the registers they take can change the carveout the driver gives a kernel, and with it whether
W2's programs start beside W13's (kernels/carveout.py; M = 8's 3-stage ring W13 takes 75
registers in the op, 71 with the stamps). The last row says, by sass_stats' carveout model, for
the op and for the stamped build; where they differ the timeline is not the op's. The SM rows
say how the programs spread over the GPU's SMs (each program stores the SM it ran on), and
whether W2 programs on the SMs that host the most of them end later.
"""
import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path

import torch

from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.benchmarking.stamps import alloc_stamps
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import cuda_capability
from moe_grouped_decode.kernels.timeline import W2_STAMPS, W13_STAMPS
from moe_grouped_decode.ops import alloc_workspace, grouped_plan_for, launch_grouped
from sass_stats import driver_carveout_kb

LAYERS = 32
W13_SM, W2_SM = W13_STAMPS.index("sm"), W2_STAMPS.index("sm")  # the stamp buffers' SM slots
E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size


def _median(values) -> float:
    return statistics.median(values.flatten().tolist())


def layer_points(w13, w2, next_w13, prev_w2, rows, w13_sm, w2_sm):
    """One layer's measures, us: ``w13`` [programs, 2] and ``w2`` [grid rows, tiles, 5] time stamps
    (ns, from a common base) of the layer, the next layer's W13 and the previous layer's W2 time
    stamps; ``w13_sm`` [programs] and ``w2_sm`` [grid rows, tiles]: the SM each program ran on."""
    t0 = w13[:, 0].min()
    us = lambda t: float(t - t0) / 1000.0  # noqa: E731
    tile_programs = w13[1:]  # program 0 zeroes the counters; it is in the firsts and lasts
    # tile programs are numbered (row, split, tile) row-major: a row's W13 is done at its last program's end
    row_done = tile_programs[:, 1].reshape(rows, -1).max(dim=1).values
    tiles = w2[:rows]  # the (row, tile) programs
    per_program = lambda a, b: _median(tiles[..., b] - tiles[..., a]) / 1000.0  # noqa: E731
    return {
        "previous layer's last W2 end": us(prev_w2[:rows, :, 4].max()),
        "W13: last program start": us(w13[:, 0].max()),
        "W13: median tile program, start to end": _median(tile_programs[:, 1] - tile_programs[:, 0]) / 1000.0,
        "W13: last program end": us(w13[:, 1].max()),
        "W13: first row done (all its programs ended)": us(row_done.min()),
        "W13: median row done": us(_median(row_done)),
        "W2: first program start": us(tiles[..., 0].min()),
        "W2: median program start": us(_median(tiles[..., 0])),
        "W2: last program start": us(tiles[..., 0].max()),
        "W2: median pass of the PDL wait": us(_median(tiles[..., 1])),
        "W2 program: wait to activations written": per_program(1, 2),
        "W2 program: activations to row output stored": per_program(2, 3),
        "W2 program: row stored to end (arrival, combine)": per_program(3, 4),
        "W2 program: start to end": per_program(0, 4),
        "W2: median program end": us(_median(tiles[..., 4])),
        "W2: last program end": us(tiles[..., 4].max()),
        # the arrivals and the last arriver's combine, after the last row output is in memory
        "W2: last program end after the last row output stored":
            float(tiles[..., 4].max() - tiles[..., 3].max()) / 1000.0,
        "next layer's first W13 start": us(next_w13[:, 0].min()),
        **sm_points(w13_sm, w2_sm[:rows].flatten(), tiles.reshape(-1, tiles.shape[-1]), us),
    }


def sm_points(w13_sm, w2_sm, w2, us):
    """How the programs spread over the SMs, and what it does to W2's programs: ``w2_sm`` [W2 tile
    programs] and ``w2`` [W2 tile programs, 5] their time stamps (ns)."""
    on_sm = torch.bincount(w2_sm.long())
    busy = on_sm[w2_sm.long()]  # W2 tile programs on each program's SM
    busiest, least = busy == busy.max(), busy == busy.min()
    mma = w2[:, 3] - w2[:, 2]  # activations written to row output stored
    return {
        "W13: SMs with a program": len(w13_sm.unique()),
        "W2: SMs with a tile program": len(w2_sm.unique()),
        "W2: tile programs on the busiest SM": busy.max().item(),
        "W2: tile programs on the least busy SM with one": busy.min().item(),
        "W2 program on the busiest SMs: activations to row output stored": _median(mma[busiest]) / 1000.0,
        "W2 program on the least busy SMs: activations to row output stored": _median(mma[least]) / 1000.0,
        "W2: median end of the programs on the busiest SMs": us(_median(w2[busiest, 4])),
        "W2: median end of the programs on the least busy SMs": us(_median(w2[least, 4])),
    }


def measure(M: int, layers, workspace, gen, fields=None):
    ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, torch.float16, "cuda", gen)
    outs = [torch.empty_like(x) for x in xs]
    config = dataclasses.replace(grouped_plan_for(xs[0], ids[0], layers[0]).config, **(fields or {})).fitted(K)
    plan = grouped_plan_for(xs[0], ids[0], layers[0], config, timeline=True)
    timelines = [alloc_stamps(plan, "cuda") for _ in range(LAYERS)]

    def step(i):
        launch_grouped(xs[i], tws[i], ids[i], layers[i], workspace, outs[i], config, stamps=timelines[i], timeline=True)

    # the op's build and the stamped one, once each, before the replays (which then overwrite these stamps)
    beside = [w2_beside_w13(launch_grouped(xs[0], tws[0], ids[0], layers[0], workspace, outs[0], config), config),
              w2_beside_w13(launch_grouped(xs[0], tws[0], ids[0], layers[0], workspace, outs[0], config,
                                           stamps=timelines[0], timeline=True), config)]
    us = graph_replay_us(step, LAYERS)
    raw = {"w13": torch.stack([t["w13_stamps"] for t in timelines]).cpu(),
           "w2": torch.stack([t["w2_stamps"] for t in timelines]).cpu()}
    # the stamps are ns since 1970 (~2^61): from a common base first, so doubles hold them exactly
    base = raw["w13"][:, :, 0].min()
    w13 = (raw["w13"][..., :W13_SM] - base).double()
    w2 = (raw["w2"][..., :W2_SM] - base).double()
    w13_sm, w2_sm = raw["w13"][..., W13_SM], raw["w2"][..., W2_SM]
    stamps = sorted(set(torch.cat([w.flatten() for w in w13[1:4]]).tolist()))
    grain_ns = min(b - a for a, b in zip(stamps, stamps[1:]) if b > a)
    points = [layer_points(w13[i], w2[i], w13[i + 1], w2[i - 1], M * k, w13_sm[i], w2_sm[i])
              for i in range(1, LAYERS - 1)]
    medians = {name: statistics.median(float(p[name]) for p in points) for name in points[0]}
    medians["W2 beside W13 by the carveout model: the op / with the stamps"] = " / ".join(beside)
    return us, config, grain_ns, medians, raw


def w2_beside_w13(kernels, config) -> str:
    """Whether the W2 launch's programs may start beside W13's (``kernels``: what launch_grouped
    returned), by sass_stats.driver_carveout_kb: "yes" under the largest carveout for both, else
    where W2's carveout is no larger than W13's; with both kernels' registers. The model and its
    carveouts are Hopper's."""
    w13, w2 = kernels
    if cuda_capability(torch.device("cuda"))[0] != 9:
        return "n/a (the carveout model is Hopper's)"
    if config.max_shared_carveout:
        return f"yes, the largest ({w13.n_regs}, {w2.n_regs} registers)"
    kb = [driver_carveout_kb(kernel.n_regs, kernel.metadata.num_warps, kernel.metadata.shared) for kernel in kernels]
    return f"{'yes' if kb[1] <= kb[0] else 'no'} ({w13.n_regs} / {w2.n_regs} registers, {kb[0]} / {kb[1]} KB)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("tokens", nargs="?", default="2,4,8")
    parser.add_argument("--out", default="", help="also write the Markdown table here")
    parser.add_argument("--fields", default="{}", help="GroupedConfig fields over the table's, as JSON")
    parser.add_argument("--raw", default="", help="also save every layer's stamps here (torch.save: "
                        "{M: {'w13': [layers, programs, 3], 'w2': [layers, rows, tiles, 6]}}, int64 as stamped)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("timeline: needs a CUDA GPU")
    Ms = [int(m) for m in args.tokens.split(",")]
    if not all(1 <= m <= 8 for m in Ms):
        sys.exit(f"timeline: token counts {Ms}; the workspace here holds 1..8 tokens")
    gen = torch.Generator().manual_seed(0)
    workspace = alloc_workspace(8, k, K, N, "cuda")
    layers = rotated_layers(LAYERS, torch.float16, "cuda")
    results = {}
    for M in Ms:
        results[M] = measure(M, layers, workspace, gen, json.loads(args.fields))
        print(f"[timeline] M = {M}: {results[M][0]:.2f} us per layer, config {results[M][1]}", flush=True)
    grain = min(r[2] for r in results.values())
    lines = [f"us from the layer's first W13 program start, medians over layers 1..30 (smallest step between "
             f"stamps {grain:.0f} ns; `PYTHONPATH=. python benchmarks/timeline.py {args.tokens}`, "
             f"{torch.cuda.get_device_name()})", "",
             "| | " + " | ".join(f"M = {M}" for M in Ms) + " |", "| --- |" + " --- |" * len(Ms),
             "| us per layer (graph replay, with the stamps) | " + " | ".join(f"{results[M][0]:.2f}" for M in Ms) + " |"]
    for name in results[Ms[0]][3]:
        cells = (results[M][3][name] for M in Ms)
        cells = (cell if isinstance(cell, str) else f"{cell:.2f}" for cell in cells)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.raw:
        torch.save({M: result[4] for M, result in results.items()}, args.raw)
    return 0


if __name__ == "__main__":
    sys.exit(main())
