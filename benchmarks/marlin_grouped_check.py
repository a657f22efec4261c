"""The grouped decode reading vLLM's Marlin tensors, against vLLM's Marlin MoE on the same tensors.

Can one copy of a layer's weights serve both the plugin (few tokens) and vLLM's Marlin kernel
(the rest)? This answers the speed half on a GPU, per shape and token count, side by side in one
process: the layers are generated in AutoAWQ's layout and converted by vLLM's own load step
(``benchmarking.vllm_moe.prepare_marlin_layer``: vLLM 0.32's repack, built from the fetched
sources or an installed vLLM); then, per M, CUDA-graph replays over the layers (L2 cold) of

    marlin    vLLM's Marlin MoE (align, W13, SiLU-and-mul, W2, sum): what vLLM 0.26 runs
    plugin    the plugin's grouped op on the AutoAWQ copy (its shipped launch table)
    shared    kernels/marlin_grouped.py on the Marlin tensors, each config of --configs

and the exactness of ``shared`` and ``marlin`` against the float64 reference of layer 0.

    python benchmarks/marlin_grouped_check.py --out DIR [--shapes E,k,K,N,G ...] [--tokens 1,2,4,8]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.benchmarking.bench import random_layer_inputs
from moe_grouped_decode.benchmarking.replay import graph_replay_us
from moe_grouped_decode.benchmarking.vllm_moe import (MarlinRunner, MoeShape, awq_tensors, load_ops, make_locks,
                                                      prepare_marlin_layer)
from moe_grouped_decode.benchmarking.coserve import COSERVE_CANDIDATES, parse_config
from moe_grouped_decode.kernels.marlin_grouped import launch_marlin_grouped
from moe_grouped_decode.marlin_layout import awq_to_marlin, vllm_scales_grouped
from moe_grouped_decode.ops import alloc_workspace, error_stats, reference_moe

SHAPES = {
    "qwen3-30b-a3b-tp1": "128,8,2048,768,128",
    "qwen3-next-tp1": "512,10,2048,512,128",
    "qwen3-235b-tp4": "128,8,4096,384,128",
    "qwen3.8-tp4": "512,10,2560,160,32",
}
# as the tune's co-serving candidates (benchmarking/coserve.py: W13WARPSxCHUNKSxW2WARPS[rROWWARPS][s])
CONFIGS = ",".join(COSERVE_CANDIDATES)
COLD_BYTES = 256e6  # one token's experts over the rotated layers: L2 cold


def run_shape(name: str, spec: str, tokens, configs, dtype, max_layers: int = 64) -> dict:
    E, k, K, N, G = (int(v) for v in spec.split(","))
    dev = torch.device("cuda")
    shape = MoeShape(E, k, K, N, G)
    per_expert = (3 * K * N) // 2
    count = max(2, min(max_layers, math.ceil(COLD_BYTES / (k * per_expert))))
    print(f"[{name}] {count} layers of E={E} k={k} K={K} N={N} G={G}", flush=True)
    awq_layers = [synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000 + i, device=dev) for i in range(count)]
    t0 = time.time()
    ops = load_ops([shape])  # the Marlin kernels of this shape's group sizes (built ones are kept)
    print(f"[{name}] vLLM's ops: {ops.origin} ({time.time() - t0:.0f} s)", flush=True)
    marlin_layers = [prepare_marlin_layer(awq_tensors(layer), shape, dtype, ops) for layer in awq_layers]
    grouped = vllm_scales_grouped(G, N)
    ours = awq_to_marlin(awq_layers[0])
    theirs = marlin_layers[0]
    repack_equal = all(torch.equal(a, b) for a, b in zip(
        ours.tensors(), (theirs.w13, theirs.w13_scales, theirs.w13_zeros, theirs.w2, theirs.w2_scales, theirs.w2_zeros)))
    print(f"[{name}] vLLM's load step gives marlin_layout's tensors bit for bit: {repack_equal}", flush=True)
    locks = make_locks(dev)
    gen = torch.Generator().manual_seed(0)
    result = {"name": name, "shape": spec, "layers": count, "repack_equal": repack_equal, "rows": []}

    def shared_args(i):
        m = marlin_layers[i]
        return (m.w13, m.w13_scales, m.w13_zeros, m.w2, m.w2_scales, m.w2_zeros, N, G, grouped)

    for M in tokens:
        ids, tws, xs = random_layer_inputs(M, k, E, K, count, dtype, dev, gen)
        plans = list(zip(ids, tws))
        row = {"M": M}
        ref = reference_moe(xs[0].cpu(), plans[0][1].cpu(), plans[0][0].cpu(), awq_layers[0].to("cpu"))
        runner = MarlinRunner(shape, M, dtype, ops, locks)
        got = runner(xs[0], marlin_layers[0], plans[0][1], plans[0][0]).clone()
        row["marlin_scaled_err"] = error_stats(got.cpu(), ref).scaled_max_abs
        row["marlin_us"] = graph_replay_us(lambda i: runner(xs[i], marlin_layers[i], plans[i][1], plans[i][0]), count)
        workspace = alloc_workspace(M, k, K, N, dev)
        awq_args = [layer.op_args() for layer in awq_layers]
        try:
            row["plugin_us"] = graph_replay_us(lambda i: torch.ops.moe_grouped_decode.awq_moe_grouped_decode(
                xs[i], plans[i][1], plans[i][0], *awq_args[i], workspace), count)
        except Exception as exc:  # the plugin's own op may refuse a shape; the comparison stands without it
            row["plugin_us"] = f"{type(exc).__name__}: {exc}"[:200]
        use_pdl = torch.cuda.get_device_capability(dev)[0] >= 9
        row["shared"] = {}
        for text in configs:
            config = parse_config(text)
            try:
                config.splits(K, N)
            except ValueError:
                continue
            out = torch.full((M, K), float("nan"), dtype=dtype, device=dev)
            launch_marlin_grouped(xs[0], plans[0][1], plans[0][0], *shared_args(0), config, use_pdl, out=out)
            err = error_stats(out.cpu(), ref).scaled_max_abs
            us = graph_replay_us(lambda i: launch_marlin_grouped(xs[i], plans[i][1], plans[i][0], *shared_args(i),
                                                                 config, use_pdl), count)
            row["shared"][text] = {"us": us, "scaled_err": err}
        if not row["shared"]:
            raise SystemExit(f"marlin_grouped_check: no config of --configs tiles K = {K}")
        best = min(row["shared"].items(), key=lambda kv: kv[1]["us"])
        row["shared_best"] = {"config": best[0], **best[1]}
        row["marlin_over_shared"] = row["marlin_us"] / best[1]["us"]
        print(f"[{name}] M={M}: marlin {row['marlin_us']:.1f} us (err {row['marlin_scaled_err']:.2e}), "
              f"plugin {row['plugin_us'] if isinstance(row['plugin_us'], str) else round(row['plugin_us'], 1)}, "
              f"shared best {best[1]['us']:.1f} us ({best[0]}, err {best[1]['scaled_err']:.2e}): "
              f"{row['marlin_over_shared']:.2f}x", flush=True)
        result["rows"].append(row)
        del workspace
        torch.cuda.empty_cache()
    return result


def markdown(results, device: str, dtype: str) -> str:
    lines = [f"# Grouped decode on vLLM's Marlin tensors: {device}, {dtype}", "",
             "`python benchmarks/marlin_grouped_check.py` (us per layer, CUDA-graph replay, L2 cold; "
             "scaled error: max |out - float64 reference| / max |reference|).", ""]
    for r in results:
        lines += [f"## {r['name']} ({r['shape']}), {r['layers']} layers; vLLM's repack equals marlin_layout's: "
                  f"{r['repack_equal']}", "",
                  "| M | vLLM Marlin us | plugin (AWQ copy) us | shared (Marlin copy) us | config | Marlin / shared "
                  "| shared err | Marlin err |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in r["rows"]:
            plugin = row["plugin_us"] if isinstance(row["plugin_us"], str) else f"{row['plugin_us']:.1f}"
            b = row["shared_best"]
            lines.append(f"| {row['M']} | {row['marlin_us']:.1f} | {plugin} | {b['us']:.1f} | {b['config']} | "
                         f"{row['marlin_over_shared']:.2f}x | {b['scaled_err']:.2e} | {row['marlin_scaled_err']:.2e} |")
        lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES), help="names of SHAPES or E,k,K,N,G")
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--configs", default=CONFIGS,
                        help="W13WARPSxCHUNKSxW2WARPS[rROWWARPS][s], comma separated (r: W2 row warps; s: the "
                             "combine unfused)")
    parser.add_argument("--dtype", choices=("fp16", "bf16"), default="fp16")
    parser.add_argument("--max-layers", type=int, default=64,
                        help="rotate at most this many layers (fewer: faster, L2 warmer if under its size)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("marlin_grouped_check: needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    tokens = [int(v) for v in args.tokens.split(",")]
    configs = args.configs.split(",")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for item in args.shapes:
        name, spec = (item, SHAPES[item]) if item in SHAPES else (item, item)
        results.append(run_shape(name, spec, tokens, configs, dtype, args.max_layers))
        (out / "marlin_grouped.json").write_text(json.dumps(results, indent=1, default=str))
    device = torch.cuda.get_device_name()
    (out / "marlin_grouped.md").write_text(markdown(results, device, args.dtype))
    print(markdown(results, device, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
