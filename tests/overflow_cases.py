"""Inputs within their dtype whose intermediates overflow, and the check of what the ops give for them.

Token 0 is scaled so that silu(gate) * up passes what the kernels keep it in (the 16-bit operand
of W2 or the prefill route's 16-bit scratch for fp16: 65504; float32 for bf16: 3.4e38) while its
routing weights (x 1e-3) keep the exact output finite; token 1 so that the exact output is +-Inf
in the output dtype. The other tokens stay as they were and must keep their own results.
"""

from __future__ import annotations

import torch

from moe_grouped_decode.ops import error_stats, reference_moe

# activation scale -> (the intermediate's limit it must pass, whether the output stays finite)
FINITE_SCALE = {torch.float16: 150.0, torch.bfloat16: 1e19}
INF_SCALE = {torch.float16: 1000.0, torch.bfloat16: 1e30}
INTERMEDIATE_LIMIT = {torch.float16: 65504.0, torch.bfloat16: 3.4e38}


def overflowing(x: torch.Tensor, tw: torch.Tensor):
    """(x, tw) with token 0 (and token 1 where there is one) scaled as the module says."""
    x, tw = x.clone(), tw.clone()
    x[0] = (x[0].double() * FINITE_SCALE[x.dtype]).to(x.dtype)
    tw[0] *= 1e-3
    if x.shape[0] > 1:
        x[1] = (x[1].double() * INF_SCALE[x.dtype]).to(x.dtype)
    assert torch.isfinite(x).all()
    return x, tw


def largest_activation(x_row: torch.Tensor, ids_row: torch.Tensor, cpu_weights) -> float:
    """max |silu(gate) * up| over one token's routed experts, in float64."""
    n = cpu_weights.intermediate_size
    largest = 0.0
    for expert in ids_row.tolist():
        w13 = cpu_weights.dequantized_expert(expert)[0].double()
        gate_up = x_row.double() @ w13
        largest = max(largest, (torch.nn.functional.silu(gate_up[:n]) * gate_up[n:]).abs().max().item())
    return largest


def assert_overflow_handled(name: str, out: torch.Tensor, x, tw, ids, cpu_weights, bound: float) -> None:
    """The overflowed tokens give the float64 reference rounded (its +-Inf, finite values within
    one ULP, no NaN); the other tokens meet the usual bound."""
    x, tw, ids, out = x.cpu(), tw.cpu(), ids.cpu(), out.cpu()
    ref = reference_moe(x, tw, ids, cpu_weights)
    want = ref.to(out.dtype)
    assert largest_activation(x[0], ids[0], cpu_weights) > INTERMEDIATE_LIMIT[out.dtype]  # the case under test
    assert torch.isfinite(want[0]).all(), f"{name}: token 0's exact output should stay finite"
    big = min(2, out.shape[0])
    if big > 1:
        assert want[1].isinf().any(), f"{name}: token 1's exact output should reach +-Inf"
    got = out[:big]
    assert not got.isnan().any(), f"{name}: NaN where the reference is {want[:big][got.isnan()][:4].tolist()}"
    inf = want[:big].isinf()
    assert torch.equal(got.isinf(), inf) and torch.equal(got[inf], want[:big][inf]), f"{name}: +-Inf differ"
    assert error_stats(got[~inf], ref[:big][~inf]).max_ulp <= 1, f"{name}: finite outputs off the reference"
    if out.shape[0] > big:
        stats = error_stats(out[big:], ref[big:])
        assert not stats.nan and stats.scaled_max_abs <= bound, f"{name}: the other tokens: {stats}"
