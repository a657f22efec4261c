"""What bounds the W13 launch: its access pattern alone, and its arithmetic alone.

    PYTHONPATH=. python benchmarks/w13_bounds.py [M,M,...]

Per M (CUDA-graph replay over 32 layers of distinct weights, L2 cold, random routing):
  w13            the grouped op's W13 launch as shipped
  w13 hot        the same launch on one layer and one routing 32 times: the weights
                 stay in L2, so DRAM is out of the picture (issue and latency only)
  read R x W     a read-only kernel over exactly W13's bytes per routed row, in tiles of
                 R rows x W packed int32 columns per program (xor-reduced, nothing else):
                 256 x 8 and 128 x 16 are tile shapes W13 programs have had; 64 x 64 (masked
                 to the row's 40 int32s) reads whole 160-byte rows
"""
import sys

import torch
import triton
import triton.language as tl

import moe_grouped_decode.ops  # noqa: F401  (registers the ops)
from moe_grouped_decode.benchmarking.bench import random_layer_inputs, rotated_layers
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.ops import alloc_workspace, launch_grouped

LAYERS = 32


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_w13_tiles(ids_ptr, qweight_ptr, scales_ptr, qzeros_ptr, sink_ptr, K: tl.constexpr, PACKED_N: tl.constexpr,
                    G: tl.constexpr, ROWS: tl.constexpr, WORDS: tl.constexpr):
    row = tl.program_id(0)
    split = tl.program_id(1)
    tile = tl.program_id(2)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    k_rows = split * ROWS + tl.arange(0, ROWS)
    words = tile * WORDS + tl.arange(0, WORDS)
    ok = words < PACKED_N
    packed = tl.load(qweight_ptr + expert * (K * PACKED_N) + k_rows[:, None] * PACKED_N + words[None, :],
                     mask=ok[None, :], other=0)
    groups = split * (ROWS // G) + tl.arange(0, ROWS // G)
    zeros = tl.load(qzeros_ptr + expert * (K // G * PACKED_N) + groups[:, None] * PACKED_N + words[None, :],
                    mask=ok[None, :], other=0)
    cols = tile * WORDS * 8 + tl.arange(0, WORDS * 8)
    scales = tl.load(scales_ptr + expert * (K // G * PACKED_N * 8) + groups[:, None] * (PACKED_N * 8) + cols[None, :],
                     mask=cols[None, :] < PACKED_N * 8, other=0.0)
    total = tl.reduce(tl.reduce(packed, 1, _xor), 0, _xor) ^ tl.reduce(tl.reduce(zeros, 1, _xor), 0, _xor)
    total ^= tl.reduce(tl.reduce(scales.to(tl.int16, bitcast=True).to(tl.int32), 1, _xor), 0, _xor)
    tl.store(sink_ptr + (row * tl.num_programs(1) + split) * tl.num_programs(2) + tile, total)


def main():
    E, k, K, N, G = c.num_experts, c.top_k, c.hidden_size, c.intermediate_size, c.group_size
    layers = rotated_layers(LAYERS, torch.float16, "cuda")
    gen = torch.Generator().manual_seed(0)
    workspace = alloc_workspace(8, k, K, N, "cuda")
    sink = torch.empty(8 * k * 64 * 8, dtype=torch.int32, device="cuda")
    rows_out = []
    for M in [int(m) for m in (sys.argv[1] if len(sys.argv) > 1 else "2,8").split(",")]:
        if not 1 <= M <= 8:
            raise SystemExit(f"M={M}: the workspace and sink here hold 8 tokens")
        ids, tws, xs = random_layer_inputs(M, k, E, K, LAYERS, torch.float16, "cuda", gen)
        out = torch.empty_like(xs[0])
        times = {}

        def w13(i, hot=False):
            j = 0 if hot else i
            launch_grouped(xs[j], tws[j], ids[j], layers[j], workspace, out, stages=("w13",))

        times["w13"] = graph_replay_us(w13, LAYERS)
        times["w13 hot"] = graph_replay_us(lambda i: w13(i, hot=True), LAYERS)
        for rows, words in ((256, 8), (128, 16), (64, 64)):
            def read(i, rows=rows, words=words):
                w = layers[i]
                _read_w13_tiles[(M * k, K // rows, triton.cdiv(2 * N // 8, words))](
                    ids[i], w.w13_qweight, w.w13_scales, w.w13_qzeros, sink, K=K, PACKED_N=2 * N // 8, G=G,
                    ROWS=rows, WORDS=words, num_warps=1 if rows * words <= 2048 else 4)
            times[f"read {rows} x {words}"] = graph_replay_us(read, LAYERS)
        for name, us in times.items():
            print(f"[w13-bounds] M={M} {name:<16} {us:7.2f} us", flush=True)
        rows_out.append((M, times))
    names = list(rows_out[0][1])
    print("\n| M | " + " | ".join(names) + " |\n| --- |" + " --- |" * len(names))
    for M, times in rows_out:
        print(f"| {M} | " + " | ".join(f"{times[n]:.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
