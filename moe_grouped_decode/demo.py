"""Operator demo: both ops on a synthetic qwen3.8-tp4 layer against the per-expert reference."""

from __future__ import annotations

import sys
import time

import torch

from .awq import synthetic_for_contract
from .contract import QWEN38_TP4, LayerShape, admits
from .ops import alloc_workspace, error_stats, reference_moe

# fp16 bound from the evidence standard: max |out - ref| <= 2e-3 * max |ref|
SCALED_MAX_ABS_BOUND = 2e-3


def random_routing(num_tokens: int, num_experts: int, top_k: int, generator: torch.Generator, device):
    """Distinct experts per token (as a top-k router gives) and softmax-like weights."""
    scores = torch.rand(num_tokens, num_experts, generator=generator)
    topk_weights, topk_ids = scores.topk(top_k, dim=-1)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    return topk_weights.to(device), topk_ids.to(torch.int32).to(device)


def run_operator_check(device: str = "cpu", dtype: torch.dtype = torch.float16, tokens=range(1, 10), seed: int = 0) -> bool:
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
        route = "grouped" if admits(shape, m) else "dense"
        ref = reference_moe(x, topk_weights, topk_ids, *weights.op_args())
        active = topk_ids.unique().numel()
        outputs = {}
        for name, op, extra in (
            ("dense", torch.ops.moe_grouped_decode.awq_moe_dense, ()),
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
        agree = error_stats(outputs["grouped"], outputs["dense"].to(torch.float64))
        if agree.scaled_max_abs > SCALED_MAX_ABS_BOUND:
            all_ok = False
            print(f"    dense and grouped disagree at M={m}: max_abs {agree.max_abs:.3e}")
    print(f"route: 'grouped' where admits() accepts M (window {contract.min_tokens}..{contract.max_tokens}); "
          f"bound: max_abs <= {SCALED_MAX_ABS_BOUND} * max|ref|")
    print("operator check:", "PASS" if all_ok else "FAIL")
    return all_ok


def main(argv=None) -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ok = run_operator_check(device=device)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
