"""Four-way tensor-parallel check of the grouped decode op (issue 6).

Slices one synthetic full qwen3.8 MoE checkpoint (E=512, k=10, hidden 2560,
intermediate 640, G=32) into TP4 shards with ``awq.slice_tp``, runs the grouped
op on every shard with the same routing, all-reduces (sums) the partial
outputs and compares with the full-model float64 reference, for fp16 and bf16
at M = 2, 4, 8. Then times the per-rank op and the all-reduce under CUDA-graph
replay rotating ``--layers`` layers of distinct weights.

Modes:
  (default)      one process per GPU over NCCL; needs 4 GPUs (NVLink multicast off)
  --procs 2      the same over 2 GPUs, each process holding two of the four rank shards
                 (the NCCL path where only two GPUs are lent; its all-reduce is over 2 GPUs)
  --single-gpu   one GPU computes the four rank shards in turn and sums them on the
                 device (correctness of the sharded math; no all-reduce timing)

  PYTHONPATH=. python benchmarks/tp4_check.py [--single-gpu | --procs 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# NVLink multicast stays off: a program using it can take the host's shared GPUs down.
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import torch  # noqa: E402

from moe_grouped_decode.awq import slice_tp, synthetic_moe_weights  # noqa: E402
from moe_grouped_decode.ops import alloc_workspace, error_stats, reference_moe  # noqa: E402
from moe_grouped_decode.benchmarking.replay import graph_replay_us  # noqa: E402

WORLD = 4  # the tensor-parallel degree: four rank shards, over --procs processes
E, TOP_K, K, FULL_N, G = 512, 10, 2560, 640, 32
SHARD_N = FULL_N // WORLD
TOKENS = (2, 4, 8)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # bf16: 8x, its own output rounding (tests/test_cuda_ops.py)


def routing(M: int, seed: int):
    """Same on every rank: generated on the CPU from the seed."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=gen).topk(TOP_K, dim=1).indices.to(torch.int32)
    tw = torch.rand(M, TOP_K, generator=gen)
    x = torch.randn(M, K, generator=gen)
    return x, tw / tw.sum(1, keepdim=True), ids


def full_checkpoint(dtype, device):
    return synthetic_moe_weights(E, K, FULL_N, G, dtype=dtype, seed=42, device=device)


def grouped(x, tw, ids, shard, workspace):
    return torch.ops.moe_grouped_decode.awq_moe_grouped_decode(x, tw, ids, *shard.op_args(), workspace)


def check_rows(partials_by_rank, full_cpu, x, tw, ids, dtype_name, M):
    """Sum the rank partials in float32 (as NCCL's sum of 16-bit values would, up to order)."""
    total = torch.stack([p.float() for p in partials_by_rank]).sum(0).to(partials_by_rank[0].dtype)
    ref = reference_moe(x, tw, ids, full_cpu)
    stats = error_stats(total, ref)
    ok = not stats.nan and stats.scaled_max_abs <= BOUND[total.dtype]
    return {"dtype": dtype_name, "M": M, "max_abs": stats.max_abs, "max_ulp": stats.max_ulp,
            "scaled_max_abs": stats.scaled_max_abs, "ok": ok}


def timing_layers(dtype, device, layers: int, rank: int):
    """Per-rank shard-shaped layers of distinct weights (each shard's own slice shape)."""
    return [synthetic_moe_weights(E, K, SHARD_N, G, dtype=dtype, seed=7000 + 31 * layer + rank, device=device)
            for layer in range(layers)]


def single_gpu(args) -> dict:
    device = torch.device("cuda")
    workspace = alloc_workspace(max(TOKENS), TOP_K, K, SHARD_N, device)
    rows, timings = [], []
    for dtype_name, dtype in DTYPES.items():
        full = full_checkpoint(dtype, device)
        full_cpu = full.to("cpu")
        shards = [slice_tp(full, rank, WORLD) for rank in range(WORLD)]
        for M in TOKENS:
            x, tw, ids = routing(M, seed=M)
            partials = [grouped(x.to(dtype).to(device), tw.to(device), ids.to(device), shard, workspace).clone()
                        for shard in shards]
            row = check_rows(partials, full_cpu, x.to(dtype), tw, ids, dtype_name, M)
            rows.append(row)
            print(f"[tp4] {dtype_name} M={M} max_abs={row['max_abs']:.3g} scaled={row['scaled_max_abs']:.3g} "
                  f"ulp={row['max_ulp']} {'ok' if row['ok'] else 'FAIL'}", flush=True)
        del full, full_cpu, shards
    layers = timing_layers(torch.float16, device, args.layers, rank=0)
    for M in TOKENS:
        inputs = [routing(M, seed=100 * M + layer) for layer in range(args.layers)]
        inputs = [(x.half().to(device), tw.to(device), ids.to(device)) for x, tw, ids in inputs]
        us = graph_replay_us(lambda l: grouped(*inputs[l], layers[l], workspace), args.layers)
        timings.append({"M": M, "rank_op_us": us, "allreduce_us": None})
        print(f"[tp4] timing fp16 M={M}: per-rank op {us:.2f} us/layer (all-reduce: n/a on one GPU)", flush=True)
    return {"mode": "single-gpu (4 shards in turn, summed on the device)", "gpu": torch.cuda.get_device_name(),
            "rows": rows, "timings": timings}


def _worker(rank: int, args, result_path: str) -> None:
    """Process ``rank`` of ``args.procs``: GPU ``rank``, rank shards ``rank * per .. rank * per + per - 1``."""
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", rank=rank, world_size=args.procs, device_id=device)
    per = WORLD // args.procs
    my_shards = range(rank * per, rank * per + per)
    workspace = alloc_workspace(max(TOKENS), TOP_K, K, SHARD_N, device)
    rows, timings = [], []
    for dtype_name, dtype in DTYPES.items():
        full = full_checkpoint(dtype, device)
        shards = [slice_tp(full, s, WORLD) for s in my_shards]
        full_cpu = full.to("cpu") if rank == 0 else None
        del full
        for M in TOKENS:
            x, tw, ids = routing(M, seed=M)
            outs = torch.stack([grouped(x.to(dtype).to(device), tw.to(device), ids.to(device), shard, workspace)
                                for shard in shards])
            gathered = [torch.empty_like(outs) for _ in range(args.procs)] if rank == 0 else None
            dist.gather(outs, gathered, dst=0)  # the reference check sums all four in float32 on rank 0
            summed = outs.float().sum(0).to(dtype)  # this process's shards, then across processes
            dist.all_reduce(summed)  # what the model does (with one shard per process)
            if rank == 0:
                row = check_rows(list(torch.cat(gathered)), full_cpu, x.to(dtype), tw, ids, dtype_name, M)
                allreduce_stats = error_stats(summed, reference_moe(x.to(dtype), tw, ids, full_cpu))
                row["allreduce_max_abs"] = allreduce_stats.max_abs
                row["allreduce_max_ulp"] = allreduce_stats.max_ulp
                rows.append(row)
                print(f"[tp4] {dtype_name} M={M} max_abs={row['max_abs']:.3g} ulp={row['max_ulp']} "
                      f"(nccl sum: max_abs={allreduce_stats.max_abs:.3g} ulp={allreduce_stats.max_ulp}) "
                      f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
    layers = timing_layers(torch.float16, device, args.layers, my_shards[0])
    for M in TOKENS:
        inputs = [routing(M, seed=100 * M + layer) for layer in range(args.layers)]
        inputs = [(x.half().to(device), tw.to(device), ids.to(device)) for x, tw, ids in inputs]
        outs = [torch.empty(M, K, dtype=torch.float16, device=device) for _ in range(args.layers)]
        op_us = graph_replay_us(lambda l: grouped(*inputs[l], layers[l], workspace), args.layers)
        dist.barrier()
        ar_us = graph_replay_us(lambda l: dist.all_reduce(outs[l]), args.layers)
        if rank == 0:
            timings.append({"M": M, "rank_op_us": op_us, "allreduce_us": ar_us})
            print(f"[tp4] timing fp16 M={M}: per-rank op {op_us:.2f} us/layer, all-reduce {ar_us:.2f} us/layer", flush=True)
    if rank == 0:
        mode = f"{args.procs} processes, NCCL" + (f", {per} rank shards each" if per > 1 else "")
        Path(result_path).write_text(json.dumps({"mode": mode, "gpu": torch.cuda.get_device_name(),
                                                 "rows": rows, "timings": timings}))
    dist.destroy_process_group()


def markdown(result: dict) -> str:
    lines = [f"TP4 check, {result['mode']}, {result['gpu']}", "",
             "| dtype | M | max abs | max ULP | max abs / max|ref| | ok |", "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        lines.append(f"| {r['dtype']} | {r['M']} | {r['max_abs']:.3g} | {r['max_ulp']} | {r['scaled_max_abs']:.3g} | {'yes' if r['ok'] else 'NO'} |")
    lines += ["", "| M | per-rank op, us/layer | all-reduce, us/layer |", "| --- | --- | --- |"]
    for t in result["timings"]:
        ar = "n/a (one GPU)" if t["allreduce_us"] is None else f"{t['allreduce_us']:.2f}"
        lines.append(f"| {t['M']} | {t['rank_op_us']:.2f} | {ar} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--single-gpu", action="store_true", help="compute the four shards in turn on one GPU")
    parser.add_argument("--procs", type=int, choices=(2, WORLD), default=WORLD,
                        help="processes (GPUs) over NCCL, each holding WORLD / procs rank shards")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--out", default="artifacts/tp4")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tp4_check: needs CUDA", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.single_gpu:
        result = single_gpu(args)
    else:
        if torch.cuda.device_count() < args.procs:
            print(f"tp4_check: needs {args.procs} GPUs, found {torch.cuda.device_count()} (use --single-gpu)",
                  file=sys.stderr)
            return 2
        import torch.multiprocessing as mp

        result_path = str(out / "tp4_raw.json")
        mp.spawn(_worker, args=(args, result_path), nprocs=args.procs, join=True)
        result = json.loads(Path(result_path).read_text())
    result["seconds"] = time.time() - t0
    (out / "tp4.json").write_text(json.dumps(result, indent=1))
    table = markdown(result)
    (out / "tp4.md").write_text(table)
    print(table, flush=True)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
