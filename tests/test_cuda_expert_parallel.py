"""Expert parallelism on the GPU: one layer's four EP ranks run in turn on one GPU.

The README's Qwen3.8 EP form (``--tensor-parallel-size 4 --enable-expert-parallel``: each rank
holds 128 of the 512 experts at the full intermediate size, N = 640). Each rank maps the router's
global ids through its expert map (``ops.local_expert_ids``, as the vLLM method does) and runs the
ops on its shard: every route (the grouped op inside the EP contract's window, the prefill
route above it) against the float64 reference of that rank's share, and the ranks' shares
summed against the global layer's reference (what vLLM's all-reduce adds up). The mapping
and the grouped op are also captured in a CUDA graph and replayed with new global routing, as
vLLM's graphs replay them. Needs no vLLM: the maps are built here as vLLM's
``determine_expert_map`` builds them (linear: rank r holds experts [r E/ep, (r + 1) E/ep);
round-robin: experts r, r + ep, ...; tests/test_plugin_expert_parallel.py checks the mapping
against vLLM's own maps on CPU).
"""

from __future__ import annotations

import pytest
import torch

from moe_grouped_decode.awq import AwqMoeWeights, slice_ep, synthetic_moe_weights
from moe_grouped_decode.ops import alloc_workspace, error_stats, local_expert_ids, reference_moe

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = 512, 10, 2560, 640, 32  # the global layer; N: the full intermediate size
EP = 4
E_LOCAL = E // EP
WINDOW = 8  # the README's EP contract admits 1..8 tokens to the grouped op
BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # as tests/test_cuda_ops.py's
OPS = torch.ops.moe_grouped_decode


def expert_map(rank: int, placement: str) -> torch.Tensor:
    """Global id -> local id on ``rank``, -1 where another rank holds the expert."""
    experts = torch.arange(E)
    if placement == "linear":
        held = experts // E_LOCAL == rank
        local = experts - rank * E_LOCAL
    else:  # round_robin
        held = experts % EP == rank
        local = experts // EP
    return torch.where(held, local, -1).to(torch.int32)


@pytest.fixture(scope="module", params=[torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def global_layer(request):
    return synthetic_moe_weights(E, K, N, G, dtype=request.param, seed=41)


@pytest.fixture(scope="module")
def workspace():
    return alloc_workspace(WINDOW, TOP_K, K, N, "cuda")


def routing(M: int, gen: torch.Generator, num_picked: int = E):
    """Global ids [M, k] from ``num_picked`` random experts of the E (fewer: many rows per expert,
    and a float64 reference that dequantizes fewer experts), one slot -1; float32 weights."""
    picked = torch.randperm(E, generator=gen)[:num_picked]
    ids = picked[torch.rand(M, num_picked, generator=gen).topk(TOP_K, dim=1).indices].to(torch.int32)
    ids[0, -1] = -1  # vLLM's unused slot: no rank's expert
    weights = torch.rand(M, TOP_K, generator=gen)
    return ids, weights / weights.sum(1, keepdim=True)


def rank_reference(x, tw, local_ids, local: AwqMoeWeights) -> torch.Tensor:
    """A rank's share in float64: its own experts' slots, the others weighted 0."""
    nowhere = local_ids < 0
    return reference_moe(x, tw.masked_fill(nowhere, 0.0), local_ids.clamp(min=0), local)


def run_rank(x, tw, ids, local_cuda: AwqMoeWeights, mapping, workspace):
    local_ids = local_expert_ids(ids.cuda(), mapping.cuda())
    if x.shape[0] <= WINDOW:
        workspace.fill_(-1)
        return local_ids, OPS.awq_moe_grouped_decode(x.cuda(), tw.cuda(), local_ids, *local_cuda.op_args(), workspace)
    return local_ids, OPS.awq_moe_dense(x.cuda(), tw.cuda(), local_ids, *local_cuda.op_args())


@pytest.mark.parametrize("placement", ["linear", "round_robin"])
def test_ep_ranks_sum_to_the_global_layer(global_layer, workspace, placement):
    dtype = global_layer.dtype
    maps = [expert_map(rank, placement) for rank in range(EP)]
    shards = [slice_ep(global_layer, m) for m in maps]
    gen = torch.Generator().manual_seed(7)
    # the grouped op at 1..8 tokens, the prefill route above (96: ~20 rows per expert)
    cases = [(M, *routing(M, gen, num_picked=E if M <= WINDOW else 48)) for M in (1, 3, 8, 96)]
    cases = [(M, torch.randn(M, K, generator=gen).to(dtype), ids, tw) for M, ids, tw in cases]
    totals = {M: torch.zeros(M, K, dtype=torch.float64) for M, *_ in cases}
    for rank in range(EP):
        local = shards[rank].to("cuda")
        for M, x, ids, tw in cases:
            local_ids, out = run_rank(x, tw, ids, local, maps[rank], workspace)
            assert torch.equal(local_ids.cpu(), torch.tensor(
                [[int(maps[rank][g]) if g >= 0 else -1 for g in row] for row in ids.tolist()], dtype=torch.int32))
            ref = rank_reference(x, tw, local_ids.cpu(), shards[rank])
            stats = error_stats(out.cpu(), ref)
            assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], f"rank {rank} {placement} M={M}: {stats}"
            totals[M] += out.cpu().double()
        del local
    for M, x, ids, tw in cases:
        ref = reference_moe(x, tw.masked_fill(ids < 0, 0.0), ids.clamp(min=0), global_layer)
        stats = error_stats(totals[M].to(dtype), ref)
        assert stats.scaled_max_abs <= BOUND[dtype] * EP, f"ranks summed {placement} M={M}: {stats}"


@pytest.mark.parametrize("M", [1, 4])
def test_ep_rank_replays_with_new_global_routing(global_layer, workspace, M):
    """The id mapping and the grouped op captured in one CUDA graph; replays read new global ids."""
    rank, mapping = 2, expert_map(2, "linear")
    local_cpu = slice_ep(global_layer, mapping)
    local = local_cpu.to("cuda")
    gen = torch.Generator().manual_seed(M)
    ids, tw = routing(M, gen)
    x = torch.randn(M, K, generator=gen).to(global_layer.dtype).cuda()
    ids, tw, map_cuda = ids.cuda(), tw.cuda(), mapping.cuda()

    def step():
        return OPS.awq_moe_grouped_decode(x, tw, local_expert_ids(ids, map_cuda), *local.op_args(), workspace)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for replay in range(3):
        new_ids, new_tw = routing(M, gen)
        # slots on this rank's experts for sure, so the replay has work to check
        new_ids[:, 0] = rank * E_LOCAL + replay
        ids.copy_(new_ids)
        tw.copy_(new_tw)
        workspace.fill_(-1)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        local_ids = local_expert_ids(new_ids, mapping)
        stats = error_stats(out.cpu(), rank_reference(x.cpu(), new_tw, local_ids, local_cpu))
        assert not stats.nan and stats.scaled_max_abs <= BOUND[x.dtype], f"replay {replay} M={M}: {stats}"
