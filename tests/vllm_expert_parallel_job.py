"""Run by tests/test_plugin_expert_parallel.py in a fresh process: vLLM's expert parallelism on
CPU, two ranks over gloo (tensor_parallel_size=2, enable_expert_parallel=True), one real vLLM
MoE layer per rank built by ``FusedMoEFactory`` with the plugin's quantization config and an
expert-parallel contract from ``MOE_GROUPED_DECODE_CONTRACTS``. Each rank loads its half of one
global AWQ layer through vLLM's own expert-weight loader, then runs the method's ``apply`` on
global router ids (eager dense, eager grouped, compiled with the lowering pass) and the whole
vLLM layer (router, ``apply``, vLLM's all-reduce). The parent prints one JSON line: what vLLM
built, and every output against the float64 reference of the global layer.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from vllm_moe_forward_job import plugin_ops_recorded  # this script's folder is on sys.path

RESULT_PREFIX = "EP_JOB "
LAYER_NAME = "model.layers.0.mlp.experts"
EP = 2
E, TOP_K, K, N, G = 8, 3, 128, 64, 32  # the global layer; each rank holds E / EP experts at the full N
CONTRACT = dict(name="ep-test", num_experts=E // EP, top_k=TOP_K, hidden_size=K, intermediate_size=N,
                group_size=G, min_tokens=2, max_tokens=8, dtypes=["float16"])
WEIGHT_NAMES = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")
M_ROUTER = 6  # tokens through the whole layer (vLLM's router picks the experts)


def global_weights():
    from moe_grouped_decode.awq import synthetic_moe_weights

    return synthetic_moe_weights(E, K, N, G, torch.float16, seed=3)


def explicit_routing():
    """Global ids as vLLM's router hands them to ``apply``, rank 0 holding experts 0..3 and rank 1
    4..7 (vLLM's linear placement), with the ids a map must not be indexed by."""
    ids = torch.tensor([
        [0, 1, 2],  # every slot on rank 0: rank 1 adds exactly nothing
        [4, 5, 7],  # every slot on rank 1
        [-1, 7, 3],  # vLLM's -1 slot: indexed directly it would read expert 7's entry (local on rank 1)
        [E, 2**30, 6],  # past the map: no read out of bounds, nothing added
        [3, 4, 1],
    ], dtype=torch.int32)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(ids.shape[0], K, generator=gen).to(torch.float16)
    tw = torch.rand(ids.shape, generator=gen) + 0.1
    outside = (ids < 0) | (ids >= E)
    return x, tw.masked_fill(outside, float("nan")), ids, outside  # an outside slot's weight is never read


def router_inputs():
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(M_ROUTER, K, generator=gen).to(torch.float16)
    logits = torch.randn(M_ROUTER, E, generator=gen).to(torch.float16)
    return x, logits


def rank_main(rank: int, port: int, out_dir: str) -> None:
    from vllm.config import ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import (destroy_distributed_environment, destroy_model_parallel, init_distributed_environment,
                                  initialize_model_parallel)
    from vllm.forward_context import set_forward_context

    from moe_grouped_decode.awq import to_hub_expert_tensors
    from moe_grouped_decode.compile_plugin import register
    from moe_grouped_decode.compile_plugin.moe_method import unservable_reason
    from moe_grouped_decode.compile_plugin.quant_config import GroupedDecodeAwqConfig
    from moe_grouped_decode.compile_plugin.startup import LAYER_DECISIONS
    from moe_grouped_decode.compile_plugin.vllm_compat import fused_moe_factory
    from moe_grouped_decode.lowerings import GroupedDecodePass

    register()
    vllm_config = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=EP, enable_expert_parallel=True))
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=EP, rank=rank, local_rank=rank,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(EP, 1)
        quant_config = GroupedDecodeAwqConfig.from_config(
            {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"})
        runner = fused_moe_factory()(
            num_experts=E, top_k=TOP_K, hidden_size=K, intermediate_size=N, params_dtype=torch.float16,
            renormalize=True, quant_config=quant_config, prefix=LAYER_NAME,
        )
    experts = runner.routed_experts
    method = experts.quant_method
    moe = experts.moe_config
    # vLLM's own loader, as for a checkpoint: per-expert hub tensors of the whole layer; each rank keeps its own
    hub = to_hub_expert_tensors(global_weights(), LAYER_NAME.removesuffix(".experts"))
    loaded = list(experts.load_weights((name.removeprefix(LAYER_NAME + "."), t) for name, t in hub.items()))
    method.process_weights_after_loading(experts)
    decision = LAYER_DECISIONS[LAYER_NAME]

    expert_map = experts.expert_map
    local_weights = tuple(getattr(experts, name) for name in WEIGHT_NAMES)
    x, tw, ids, _ = explicit_routing()

    def apply(x, tw, ids):
        return method.apply(experts, x, tw, ids, None, None)

    dense = apply(x, tw, ids)
    # the same call on local ids looked up here, one by one: what apply must hand the ops
    map_list = expert_map.tolist()
    local_ids = torch.tensor([[map_list[g] if 0 <= g < E else -1 for g in row] for row in ids.tolist()],
                             dtype=torch.int32)
    on_local_ids = torch.ops.moe_grouped_decode.awq_moe_dense(x, tw, local_ids, *local_weights, G)
    with method.grouped_route(), plugin_ops_recorded() as grouped_ops:
        grouped = apply(x, tw, ids)  # the CUDA build's eager body of the swapped moe_forward
    graph_pass = GroupedDecodePass()
    with torch._inductor.config.patch(post_grad_custom_post_pass=graph_pass, force_disable_caches=True):
        compiled = torch.compile(apply, fullgraph=True, dynamic=False)(x, tw, ids)  # no graph break, no host sync

    router_x, router_logits = router_inputs()
    with set_current_vllm_config(vllm_config), set_forward_context(None, vllm_config):
        layer_out = runner(router_x, router_logits)  # router, apply, vLLM's all-reduce over the EP ranks

    torch.save({
        "use_ep": moe.moe_parallel_config.use_ep, "ep_size": moe.moe_parallel_config.ep_size,
        "ep_rank": moe.moe_parallel_config.ep_rank, "num_experts": moe.num_experts,
        "num_local_experts": moe.num_local_experts, "intermediate_size_per_partition": moe.intermediate_size_per_partition,
        "expert_map": map_list, "loaded_params": sorted(set(loaded)),
        "local_weights": [t.detach().clone() for t in local_weights],
        "unservable": unservable_reason(experts, quant_config), "method_name": method.method_name,
        "admitted": decision.admission.contract.name if decision.admission else None,
        "admission_reason": decision.admission.reason, "served_by_plugin": decision.served_by_plugin,
        "shape": [method.shape.num_experts, method.shape.top_k, method.shape.hidden_size,
                  method.shape.intermediate_size, method.shape.group_size],
        "dense": dense, "on_local_ids": on_local_ids, "grouped": grouped, "grouped_ops": grouped_ops,
        "compiled": compiled, "graph_rewrites": graph_pass.total_rewrites, "layer_out": layer_out,
    }, Path(out_dir) / f"rank{rank}.pt")
    destroy_model_parallel()  # frees the shared memory vLLM's CPU all-reduce set up
    destroy_distributed_environment()


def scaled_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).abs().max() / (ref.abs().max() or 1.0)).item()


def main() -> int:
    from vllm.utils.network_utils import get_open_port

    from moe_grouped_decode.compile_plugin.contracts_env import CONTRACTS_ENV
    from moe_grouped_decode.ops import reference_moe

    os.environ[CONTRACTS_ENV] = json.dumps([CONTRACT])  # every rank's plugin registers it
    os.environ["VLLM_DIST_IDENT"] = f"moe-grouped-decode-ep-{os.getpid()}"  # vLLM's CPU TP names its shared memory so
    with tempfile.TemporaryDirectory() as out_dir:
        torch.multiprocessing.start_processes(rank_main, args=(get_open_port(), out_dir), nprocs=EP,
                                              start_method="spawn")
        ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(EP)]

    weights = global_weights()
    x, tw, ids, outside = explicit_routing()
    reference = reference_moe(x, tw.masked_fill(outside, 0.0), ids.clamp(0, E - 1), weights)
    single_rank = torch.ops.moe_grouped_decode.awq_moe_dense(x, tw, ids, *weights.op_args())  # the global layer
    partial_sum = sum(r["dense"].double() for r in ranks)
    router_x, router_logits = router_inputs()
    router_tw, router_ids = torch.softmax(router_logits.float(), -1).topk(TOP_K, dim=-1)  # vLLM's softmax top-k
    router_reference = reference_moe(router_x, router_tw / router_tw.sum(-1, keepdim=True), router_ids, weights)

    def held_weights_match(r):
        """Each local expert l holds global expert g where the map says map[g] = l."""
        return all(torch.equal(local[l], full[g]) for local, full in zip(r["local_weights"], weights.tensors())
                   for g, l in enumerate(r["expert_map"]) if l >= 0)

    report = {
        "ranks": [{
            **{key: r[key] for key in ("use_ep", "ep_size", "ep_rank", "num_experts", "num_local_experts",
                                       "intermediate_size_per_partition", "expert_map", "loaded_params", "unservable",
                                       "method_name", "admitted", "admission_reason", "served_by_plugin", "shape",
                                       "grouped_ops", "graph_rewrites")},
            "held_weights_match_the_map": held_weights_match(r),
            "apply_equals_ops_on_local_ids": torch.equal(r["dense"], r["on_local_ids"]),
            "grouped_equals_dense": torch.equal(r["grouped"], r["dense"]),
            "compiled_equals_eager": torch.equal(r["compiled"], r["dense"]),
            "zero_tokens": [t for t in range(x.shape[0]) if torch.equal(r["dense"][t], torch.zeros(K, dtype=x.dtype))],
            "nan": bool(r["dense"].isnan().any() or r["layer_out"].isnan().any()),
            "layer_out_vs_reference": scaled_error(r["layer_out"], router_reference),
        } for r in ranks],
        "partial_sum_vs_reference": scaled_error(partial_sum, reference),
        "partial_sum_vs_single_rank": scaled_error(partial_sum, single_rank.double()),
        "single_rank_vs_reference": scaled_error(single_rank, reference),
        "layer_out_same_on_every_rank": all(torch.equal(r["layer_out"], ranks[0]["layer_out"]) for r in ranks),
    }
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
