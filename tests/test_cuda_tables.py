"""Every launch config a shipped table names, at that table's full shape, against the float64
per-expert reference: the grouped op's entries at their own token counts, the prefill route's at
a group-filling count (every token on the same k experts, so each expert's rows fill the
config's groups to the brim, plus one row past them).

The tuner checks each candidate against the prefill route's default before timing it; this keeps
the shipped configs checked against an independent reference, on every GPU the suite runs on
(a config whose kernels do not run here runs what the plan substitutes, as at run time).
Runs on a CUDA GPU only (skipped elsewhere). Bounds as tests/test_cuda_ops.py's.
"""

from __future__ import annotations

import pytest
import torch

from moe_grouped_decode import tables
from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.kernels.config import PrefillConfig, config_from_fields
from moe_grouped_decode.ops import alloc_workspace, error_stats, launch_grouped, launch_prefill, reference_moe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # as tests/test_cuda_ops.py's
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
GROUPED_MAX_CHECKED = 64  # the float64 reference walks every routed row: larger entries are checked here
TABLES = tables.shipped_tables()
DEVICE = "cuda"


def _id(table: tables.MeasuredTable) -> str:
    return tables.file_name(*table.key).removesuffix(".json")


@pytest.fixture(scope="module", params=TABLES, ids=[_id(t) for t in TABLES])
def shipped(request):
    table = request.param
    E, k, K, N, G = table.shape
    dtype = DTYPES[table.dtype]
    weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=29, device=DEVICE)
    yield table, weights, weights.to("cpu")
    del weights
    torch.cuda.empty_cache()


def _inputs(M: int, shape, dtype, same_experts: bool, seed: int):
    E, k, K = shape[:3]
    gen = torch.Generator().manual_seed(seed)
    if same_experts:
        ids = torch.randperm(E, generator=gen)[:k].repeat(M, 1)
    else:
        ids = torch.rand(M, E, generator=gen).topk(k, dim=1).indices
    weights = torch.rand(M, k, generator=gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    return x.to(DEVICE), (weights / weights.sum(1, keepdim=True)).to(DEVICE), ids.to(torch.int32).to(DEVICE)


def _check(name, out, x, tw, ids, cpu_weights):
    stats = error_stats(out, reference_moe(x.cpu(), tw.cpu(), ids.cpu(), cpu_weights))
    assert not stats.nan, f"{name}: NaN in output"
    assert stats.scaled_max_abs <= BOUND[out.dtype], f"{name}: {stats}"


def test_grouped_entries_match_the_reference(shipped):
    table, weights, cpu_weights = shipped
    E, k, K, N, G = table.shape
    entries = [e for e in table.grouped if e["M"] <= GROUPED_MAX_CHECKED]
    workspace = alloc_workspace(max([e["M"] for e in entries], default=1), k, K, N, DEVICE)
    for i, entry in enumerate(entries):
        config = config_from_fields(entry["config"])
        if config is None:
            continue
        M = entry["M"]
        x, tw, ids = _inputs(M, table.shape, weights.w13_scales.dtype, same_experts=False, seed=100 + i)
        out = torch.full_like(x, float("nan"))
        launch_grouped(x, tw, ids, weights, workspace, out, config)
        _check(f"{_id(table)} grouped {entry.get('kernels')} M={M} {config}", out, x, tw, ids, cpu_weights)


def test_prefill_entries_fill_their_groups_and_match_the_reference(shipped):
    table, weights, cpu_weights = shipped
    seen = set()
    for i, entry in enumerate(table.prefill):
        config = PrefillConfig(**entry["config"])
        if config in seen:
            continue
        seen.add(config)
        M = config.group_rows + 1  # each of the k experts: one full group and one of a single row
        x, tw, ids = _inputs(M, table.shape, weights.w13_scales.dtype, same_experts=True, seed=200 + i)
        out = torch.full_like(x, float("nan"))
        launch_prefill(x, tw, ids, weights, out, config)
        _check(f"{_id(table)} prefill M={M} {config}", out, x, tw, ids, cpu_weights)
