"""Time what vLLM 0.32 runs for an AWQ MoE layer of any shape: its MARLIN and HUMMING backends.

See the package docstring for the API; this module holds the drivers.
"""

from __future__ import annotations

import traceback
from typing import Dict, List, Optional, Sequence, Union

import torch

from .shape import MoeShape, awq_tensors, vllm_awq_moe_unsupported
from .timing import random_routing, time_runner

BACKENDS = ("marlin", "humming")


def _layers_and_shape(awq_layers, group_size: int, top_k: int):
    tensors = [awq_tensors(layer) for layer in awq_layers]
    if not tensors:
        raise ValueError("no layers given")
    shape = MoeShape.of_awq_layer(tensors[0], group_size, top_k)
    for i, t in enumerate(tensors):
        if MoeShape.of_awq_layer(t, group_size, top_k) != shape:
            raise ValueError(f"layer {i} is not of the first layer's shape {shape}")
    return tensors, shape


def _inputs(shape: MoeShape, Ms, dtype, n_layers: int, xs, plans, seed: int, device):
    """The caller's xs / plans, else the anchors' draws (every backend sees the same)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    out = {}
    for M in Ms:
        x = (xs[M] if xs else torch.randn(M, shape.hidden_size, device=device, generator=gen)).to(dtype)
        plan = list(plans[M]) if plans else [random_routing(M, shape, gen) for _ in range(n_layers)]
        if len(plan) != n_layers:
            raise ValueError(f"plans[{M}] has {len(plan)} entries for {n_layers} layers")
        if x.shape != (M, shape.hidden_size):
            raise ValueError(f"xs[{M}] has shape {tuple(x.shape)}, expected {(M, shape.hidden_size)}")
        for ids, weights in plan:
            if ids.shape != (M, shape.top_k) or weights.dtype != torch.float32:
                raise ValueError(f"plans[{M}]: topk_ids must be [{M}, {shape.top_k}], topk_weights float32")
        out[M] = (x.contiguous(), plan)
    return out


def _time_marlin(tensors, shape, inputs, dtype, reps, variants, ops) -> List[Dict]:
    from .marlin import MarlinRunner, make_locks, prepare_marlin_layer

    layers = [prepare_marlin_layer(t, shape, dtype, ops) for t in tensors]
    locks = make_locks(tensors[0]["w13_qweight"].device)
    rows = []
    for M, (x, plan) in inputs.items():
        rows.append(time_runner(MarlinRunner(shape, M, dtype, ops, locks), x, layers, plan, reps, variants))
    return rows


def _time_humming(tensors, shape, inputs, dtype, reps, variants, ops) -> List[Dict]:
    from .humming import HummingExperts, HummingLayer, HummingRunner, prepare_humming_layer, setup_humming

    setup_humming()
    layers = [HummingLayer(prepare_humming_layer(t, shape, dtype)) for t in tensors]
    for layer in layers[1:]:
        if (layer.config13.to_str(), layer.config2.to_str()) != (layers[0].config13.to_str(), layers[0].config2.to_str()):
            raise RuntimeError("layers of one shape got different Humming LayerConfigs")
    experts = HummingExperts(shape, layers[0])
    device = tensors[0]["w13_qweight"].device
    rows = []
    for M, (x, plan) in inputs.items():
        rows.append(time_runner(HummingRunner(experts, M, dtype, ops, device), x, layers, plan, reps, variants))
    return rows


def time_vllm_backend_rows(awq_layers, group_size: int, Ms: Sequence[int], dtype=torch.float16, reps: int = 30,
                           xs: Optional[Dict] = None, plans: Optional[Dict] = None, top_k: Optional[int] = None,
                           backends: Sequence[str] = BACKENDS, sources=None, variants: Sequence[str] = ("full",),
                           seed: int = 1234, prefer_installed: bool = True, ops=None) -> Dict[str, Union[List[Dict], str]]:
    """{backend: one row per M (time_runner's: block sizes, {variant: {us, us_min, us_max, reps}})
    or "not measured: why"}. Arguments as time_vllm_backends; ``variants`` from VARIANTS;
    ``ops``: a VllmMoeOps to use instead of load_ops(...)."""
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise ValueError(f"unknown backends {sorted(unknown)}; choose from {BACKENDS}")
    if top_k is None:
        if not plans:
            raise ValueError("top_k is needed when no plans are given")
        top_k = next(iter(plans.values()))[0][0].shape[1]
    tensors, shape = _layers_and_shape(awq_layers, group_size, top_k)
    unsupported = vllm_awq_moe_unsupported(shape)
    if unsupported:
        return {b: f"not measured: vLLM 0.32 runs this layer ({shape}) through MoeWNA16, not its AWQ MoE "
                   f"backends: {unsupported}" for b in backends}
    if not all(t.is_cuda for layer in tensors for t in layer.values()):
        raise ValueError("the AWQ tensors must be on the GPU")
    device = tensors[0]["w13_qweight"].device
    inputs = _inputs(shape, list(Ms), dtype, len(tensors), xs, plans, seed, device)
    results: Dict[str, Union[List[Dict], str]] = {}
    if ops is None:
        from .ops import load_ops
        try:
            ops = load_ops([shape] if "marlin" in backends else [], sources, prefer_installed)
        except Exception as exc:  # no sources, no compiler, a failed build: say so per backend
            return {b: f"not measured: vLLM's ops are not available: {type(exc).__name__}: {exc}"[:600]
                    for b in backends}
    for backend in backends:
        try:
            if backend == "humming":
                from .humming import humming_unavailable
                missing = humming_unavailable()
                if missing:
                    results[backend] = f"not measured: {missing}"
                    continue
            timer = _time_marlin if backend == "marlin" else _time_humming
            results[backend] = timer(tensors, shape, inputs, dtype, reps, variants, ops)
        except Exception as exc:  # one backend failing leaves the other's rows
            traceback.print_exc()
            results[backend] = f"not measured: {type(exc).__name__}: {exc}"[:600]
        torch.cuda.empty_cache()
    return results


def time_vllm_backends(awq_layers, group_size: int, Ms: Sequence[int], dtype=torch.float16, reps: int = 30,
                       xs: Optional[Dict] = None, plans: Optional[Dict] = None, top_k: Optional[int] = None,
                       backends: Sequence[str] = BACKENDS, sources=None,
                       prefer_installed: bool = True) -> Dict[str, Union[Dict[int, float], str]]:
    """{backend: {M: median us per layer of the full forward} or "not measured: why"}.

    awq_layers: one per layer (rotated in one CUDA graph; give enough that their weights
        exceed L2), each the six AutoAWQ GEMM tensors on the GPU, by name (a dict) or as
        attributes (awq.AwqMoeWeights): w13_qweight [E, K, 2N/8] int32, w13_scales [E, K/G, 2N],
        w13_qzeros [E, K/G, 2N/8], w2_qweight [E, N, K/8], w2_scales [E, N/G, K], w2_qzeros
        [E, N/G, K/8]. The layer shape comes from them and group_size.
    Ms: token counts; dtype: float16 or bfloat16 (activations; scales are cast to it).
    xs: optional {M: activations [M, K]}; plans: optional {M: [(topk_ids [M, k] int32,
        topk_weights [M, k] float32) per layer]}; default: the anchors' random draws.
    top_k: needed without plans. sources: the fetch step's folder (default .vllm_moe_src).
    prefer_installed: use an installed vLLM 0.32's ops (False beside the shared anchors).
    """
    rows = time_vllm_backend_rows(awq_layers, group_size, Ms, dtype, reps, xs, plans, top_k, backends, sources,
                                  ("full",), prefer_installed=prefer_installed)
    return {b: (r if isinstance(r, str) else {row["M"]: row["full"]["us"] for row in r}) for b, r in rows.items()}
