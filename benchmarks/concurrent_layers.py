"""How much faster a layer gets when independent layers overlap: the bench's graph, split over streams.

    PYTHONPATH=. python benchmarks/concurrent_layers.py [M,M,...] [--streams 1,2,4] [--out FILE.md]

The bench (``python -m moe_grouped_decode bench``) runs 32 layers of distinct weights back to
back in one CUDA graph (L2 cold) and divides the replay time by 32. Here layer i of the same 32
runs on stream i % S, each stream with its own workspace and sink, so S layers are in flight at
once in arbitrary phases: one layer's W2 beside another's W13, and S times the programs to hide
each other's latencies. How much faster a layer gets says how much of its time is latency that
other work could hide; it does not say how much of it one layer's own phases could hide (a model's
layers run one after the other), and floor2 gains from the overlap too.

Columns per (M, S): the grouped op and floor2 (compaction + the read-only stream of the active
experts' bytes, the bench's floor2), us per layer, and their ratio. Before timing, every layer's
grouped output from the S-stream graph is checked bit-identical to the same layer run alone.
GPU only.
"""
import argparse
import sys
from pathlib import Path

import torch

from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers
from moe_grouped_decode.benchmarking.read_floor import Compaction, floor2, floor_blocks
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.ops import alloc_workspace

LAYERS = 32
E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size


def over_streams(run_layer, streams):
    """A graph step that runs layer i on ``streams[i % S]`` (``streams[0]`` is None: the capture
    stream itself): every side stream forks from the capture stream before layer 0, so no layer
    waits for another stream's, and joins it after the last layer."""
    def step(i: int) -> None:
        main = torch.cuda.current_stream()
        if i == 0:
            for side in streams[1:]:
                side.wait_stream(main)
        side = streams[i % len(streams)]
        if side is None:
            run_layer(i, 0)
        else:
            with torch.cuda.stream(side):
                run_layer(i, i % len(streams))
        if i == LAYERS - 1:
            for side in streams[1:]:
                main.wait_stream(side)
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("tokens", nargs="?", default="2,4,8", help="token counts M, comma-separated")
    parser.add_argument("--streams", default="1,2,4", help="stream counts S, comma-separated; 1 must be first")
    parser.add_argument("--reps", type=int, default=30, help="replays per timing (median)")
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    try:
        tokens = [int(m) for m in args.tokens.split(",") if m]
        stream_counts = [int(s) for s in args.streams.split(",") if s]
    except ValueError:
        parser.error("token and stream counts are comma-separated integers")
    if not tokens or min(tokens) < 1 or not stream_counts or stream_counts[0] != 1 or max(stream_counts) > LAYERS:
        parser.error(f"token counts >= 1; stream counts in 1..{LAYERS}, starting with 1 (the baseline column)")
    if args.reps < 1:
        parser.error("--reps must be >= 1")
    if not torch.cuda.is_available():
        print("concurrent_layers: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    layers = rotated_layers(LAYERS, torch.float16, device)
    blocks = floor_blocks(layers[0].tensors())
    gen = torch.Generator().manual_seed(0)
    lines = ["| M | streams | grouped us/layer | floor2 us/layer | grouped / floor2 | grouped vs 1 stream |",
             "| --- | --- | --- | --- | --- | --- |"]
    for M in tokens:
        ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, torch.float16, device, gen)
        max_active = min(M * k, E)
        alone = []
        workspace = alloc_workspace(M, k, K, N, device)
        for i in range(LAYERS):
            alone.append(torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                xs[i], tws[i], ids[i], *layers[i].op_args(), workspace))
        base = None
        for S in stream_counts:
            workspaces = [alloc_workspace(M, k, K, N, device) for _ in range(S)]
            compactions = [Compaction.alloc(M * k, device) for _ in range(S)]
            sinks = [torch.empty(max_active * blocks, dtype=torch.int32, device=device) for _ in range(S)]
            outs = {}  # layer -> its output in the graph's memory pool, written by the replays only
            streams = [None] + [torch.cuda.Stream() for _ in range(S - 1)]

            def grouped(i, s):
                outs[i] = torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                    xs[i], tws[i], ids[i], *layers[i].op_args(), workspaces[s])

            def floor2_step(i, s):
                floor2(ids[i], compactions[s], sinks[s], max_active, layers[i].tensors())

            grouped_us = graph_replay_us(over_streams(grouped, streams), LAYERS, args.reps)
            torch.cuda.synchronize()
            for i in range(LAYERS):
                if not torch.equal(outs[i], alone[i]):
                    print(f"concurrent_layers: M={M} S={S} layer {i}: output differs from the layer run alone",
                          file=sys.stderr)
                    return 1
            floor_us = graph_replay_us(over_streams(floor2_step, streams), LAYERS, args.reps)
            if S == 1:
                base = grouped_us
            lines.append(f"| {M} | {S} | {grouped_us:.2f} | {floor_us:.2f} | {grouped_us / floor_us:.2f} | "
                         f"{grouped_us / base:.2f} |")
            print(f"[concurrent] M={M} streams={S}: grouped {grouped_us:.2f} floor2 {floor_us:.2f} us/layer",
                  flush=True)
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(f"`benchmarks/concurrent_layers.py {args.tokens} --streams {args.streams}` on "
                            f"{torch.cuda.get_device_name()}, fp16, {c.name}, {LAYERS} layers:\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
