"""CUDA-graph capture of graphs the grouped decode pass rewrote (GPU only; torch 2.11 or later).

A small decode block (fp32 router, softmax top-k, the dense MoE op, residual) is
compiled by Inductor with the pass and a dynamic token count, then captured:

* FULL: ``torch.cuda.CUDAGraph`` around the compiled block, one graph per M in
  1..8 (how vLLM captures decode). M=2..8 share one compiled graph whose MoE call
  the pass turned into the grouped op; M=1 is specialized by Dynamo and stays dense.
* PIECEWISE: Inductor's own CUDA graphs (``mode="reduce-overhead"``), with the
  pass given vLLM's compile range (1, 8) so the call becomes the routed op.

Every replay gets fresh activations copied into the captured input buffer, which
changes the routing; outputs must match eager (the dense op), routing exactly.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch._inductor.config as inductor_config

import moe_grouped_decode  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.contract import ShapeContract, contract_registered
from moe_grouped_decode.lowerings import GroupedDecodePass, grouped_decode_installed
from moe_grouped_decode.ops import error_stats

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

E, TOP_K, K, N, G = 16, 4, 128, 64, 32
SMALL = ShapeContract("test-cuda-small", E, TOP_K, K, N, G, min_tokens=2, max_tokens=8)
SCALED_MAX_ABS_BOUND = 2e-3  # the ops' fp16 evidence bound: max|out - ref| <= 2e-3 * max|ref|
REPLAYS = 3


class DecodeBlock(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.router = torch.nn.Parameter(torch.randn(E, K, generator=gen).to(device), requires_grad=False)
        self.experts = synthetic_moe_weights(E, K, N, G, torch.float16, seed=1).to(device)

    def forward(self, x):
        # fp32 router: eager and Inductor agree to ~1e-6, far below the gaps top-k decides on
        probs = torch.softmax(x.float() @ self.router.t(), dim=-1)
        weights, ids = torch.topk(probs, TOP_K, dim=-1)
        moe = torch.ops.moe_grouped_decode.awq_moe_dense(x, weights, ids, *self.experts.op_args())
        return x + moe, ids


def activations(m, seed):
    """Fresh activations; M=2 is marked dynamic 2..8, so M=2..8 share one compiled graph (M=1 is Dynamo-specialized)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, K, generator=gen).to("cuda", torch.float16)
    if m == 2:
        torch._dynamo.mark_dynamic(x, 0, min=2, max=8)
    return x


def assert_matches_eager(block, x, out, ids):
    eager_out, eager_ids = block(x)
    assert torch.equal(ids, eager_ids)
    stats = error_stats(out, eager_out)
    assert not stats.nan and stats.scaled_max_abs <= SCALED_MAX_ABS_BOUND, stats


@contextlib.contextmanager
def compiled_block(token_range=None, **compile_kwargs):
    torch._dynamo.reset()
    block = DecodeBlock("cuda")
    grouped = GroupedDecodePass(token_range)
    with contract_registered(SMALL), inductor_config.patch(fx_graph_cache=False), grouped_decode_installed(grouped):
        yield block, torch.compile(block, fullgraph=True, **compile_kwargs), grouped
    torch._dynamo.reset()


@torch.no_grad()
def test_full_cuda_graph_per_token_count():
    with compiled_block() as (block, compiled, grouped):
        for m in range(1, 9):
            x = activations(m, seed=m)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm up: compile and run every kernel before capture
                compiled(x)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, ids = compiled(x)
            seen_routings = set()
            for replay in range(REPLAYS):
                x.copy_(activations(m, seed=100 * m + replay))
                graph.replay()
                torch.cuda.synchronize()
                assert_matches_eager(block, x, out, ids)
                seen_routings.add(tuple(ids.flatten().tolist()))
            assert len(seen_routings) == REPLAYS  # the replays really changed the routing
        # M=1 compiled static (dense, untouched); M=2..8 one dynamic graph with the grouped op
        assert (grouped.total_rewrites, grouped.last_report.grouped) == (1, 1)


@torch.no_grad()
def test_inductor_cuda_graphs_with_routed_op():
    counters = torch._dynamo.utils.counters
    counters.clear()
    with compiled_block(token_range=(1, 8), mode="reduce-overhead") as (block, compiled, grouped):
        for m in range(1, 9):
            for replay in range(REPLAYS):  # warm-up, record, then replays of the recorded graph
                x = activations(m, seed=100 * m + replay)
                out, ids = (t.clone() for t in compiled(x))
                assert_matches_eager(block, x, out, ids)
    # M=1 static (dense, untouched); M=2..8 one dynamic graph with the routed op
    assert (grouped.total_rewrites, grouped.last_report.routed) == (1, 1)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
