"""Independent references the ops and kernels are tested against.

Written for clarity, not speed, and deliberately unlike the implementations:
the MoE reference works in float64 one routed row at a time; the compaction
reference is a plain Python walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ..awq import AwqMoeWeights, dequantize


def reference_moe(hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  weights: AwqMoeWeights) -> torch.Tensor:
    """Per-expert dense MoE in float64 (CPU). Returns float64 [M, K].

    Loops over the experts that own rows, dequantizes each once (``awq.dequantize``, not the
    ops' code), and adds ``topk_weights[t, j] * W2(silu(gate) * up)`` for each of its rows. A
    slot whose id lies outside [0, E) (vLLM's -1 for an expert on another rank) names no
    expert of the layer: it adds nothing, whatever its weight.
    """
    x = hidden_states.detach().cpu().to(torch.float64)
    routing_weights = topk_weights.detach().cpu().to(torch.float64)
    ids = topk_ids.detach().cpu().to(torch.int64)
    n = weights.intermediate_size
    g = weights.group_size
    out = torch.zeros_like(x)
    for expert in sorted(e for e in set(ids.flatten().tolist()) if 0 <= e < weights.num_experts):
        w13 = dequantize(weights.w13_qweight[expert].cpu(), weights.w13_scales[expert].cpu(),
                         weights.w13_qzeros[expert].cpu(), g).to(torch.float64)
        w2 = dequantize(weights.w2_qweight[expert].cpu(), weights.w2_scales[expert].cpu(),
                        weights.w2_qzeros[expert].cpu(), g).to(torch.float64)
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        for t, j in zip(tokens.tolist(), slots.tolist()):
            gate_up = x[t] @ w13
            act = torch.nn.functional.silu(gate_up[:n]) * gate_up[n:]
            out[t] += routing_weights[t, j] * (act @ w2)
    return out


@dataclass(frozen=True)
class Segments:
    """Routed rows compacted into contiguous per-expert segments.

    Row r is routed slot ``(r // k, r % k)``. Segment a covers
    ``sorted_rows[offsets[a]:offsets[a + 1]]``, all routed to ``active_experts[a]``.
    """

    active_experts: List[int]  # A ids, ascending
    segment_offsets: List[int]  # A + 1
    sorted_rows: List[int]  # R


def reference_segments(topk_ids: torch.Tensor) -> Segments:
    """Compact the M*k routed rows by expert: experts ascending, rows ascending within."""
    flat = topk_ids.detach().cpu().flatten().tolist()
    by_expert: dict = {}
    for row, expert in enumerate(flat):
        by_expert.setdefault(expert, []).append(row)
    active, offsets, rows = [], [0], []
    for expert in sorted(by_expert):
        active.append(expert)
        rows.extend(by_expert[expert])
        offsets.append(len(rows))
    return Segments(active, offsets, rows)


def _ordered_bits(t: torch.Tensor) -> torch.Tensor:
    """Map 16-bit floats to integers whose order and spacing are the floats' ULPs."""
    bits = t.contiguous().view(torch.int16).to(torch.int32)
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


@dataclass(frozen=True)
class ErrorStats:
    max_abs: float  # max |out - ref|
    max_ulp: int  # max ULP distance between out and ref rounded to out's dtype
    rel_err: float  # ||out - ref|| / ||ref||
    scaled_max_abs: float  # max_abs / max |ref|  (the "relative to output scale" bound)
    nan: bool

    def row(self) -> dict:
        return {
            "max_abs": self.max_abs,
            "max_ulp": self.max_ulp,
            "rel_err": self.rel_err,
            "scaled_max_abs": self.scaled_max_abs,
        }


def error_stats(out: torch.Tensor, ref: torch.Tensor) -> ErrorStats:
    """Compare a 16-bit op output with a (float64) reference."""
    out_cpu = out.detach().cpu()
    ref64 = ref.detach().cpu().to(torch.float64)
    diff = out_cpu.to(torch.float64) - ref64
    ulp = (_ordered_bits(out_cpu) - _ordered_bits(ref64.to(out_cpu.dtype))).abs()
    scale = ref64.abs().max().item() or 1.0
    norm = ref64.norm().item() or 1.0
    return ErrorStats(
        max_abs=diff.abs().max().item(),
        max_ulp=int(ulp.max().item()),
        rel_err=diff.norm().item() / norm,
        scaled_max_abs=diff.abs().max().item() / scale,
        nan=bool(torch.isnan(out_cpu).any().item()),
    )
