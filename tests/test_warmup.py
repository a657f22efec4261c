"""The CUDA warmup compiles the binaries vLLM then launches (run on CPU: the calls it makes).

Triton keys a binary by every pointer argument's dtype and alignment and by the ints it
specializes, so the warmup only keeps compilation out of CUDA-graph capture if it calls each op
with the argument dtypes vLLM calls it with. vLLM runs the warmup (the plugin's
``process_weights_after_loading``) under ``set_default_torch_dtype(model dtype)``, and its
routers give float32 router weights (``fused_topk``) and int32 ids whatever that dtype is.
"""

import types

import pytest
import torch
import triton
import triton.language as tl

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.ops import cuda


@pytest.fixture
def recorded_calls(monkeypatch):
    """The warmup's op calls on CPU weights, each as (op, argument dtypes), nothing run."""
    calls = []

    def recorder(op):
        def call(hidden_states, topk_weights, topk_ids, *rest):
            calls.append((op, hidden_states.dtype, topk_weights.dtype, topk_ids.dtype, hidden_states.shape[0]))
            return torch.empty_like(hidden_states)
        return call

    for op in ("awq_moe_grouped_decode", "awq_moe_dense"):
        monkeypatch.setattr(torch.ops.moe_grouped_decode, op, recorder(op))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return calls


@pytest.mark.parametrize("model_dtype", [torch.float16, torch.bfloat16])
def test_warmup_calls_the_ops_with_vllms_argument_dtypes_under_the_models_default_dtype(recorded_calls,
                                                                                          model_dtype):
    weights = synthetic_moe_weights(8, 64, 32, 32, dtype=model_dtype)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(model_dtype)  # as vLLM's model loader has it while the plugin warms up
    try:
        cuda.warmup(weights, 2, [1, 2, 3], dense_token_counts=[4, 8])
    finally:
        torch.set_default_dtype(previous)
    assert [(op, m) for op, *_, m in recorded_calls] == [
        ("awq_moe_grouped_decode", 1), ("awq_moe_grouped_decode", 2), ("awq_moe_grouped_decode", 3),
        ("awq_moe_dense", 4), ("awq_moe_dense", 8)]
    for _, hidden, topk_weights, ids, _ in recorded_calls:
        assert (hidden, topk_weights, ids) == (model_dtype, torch.float32, torch.int32)


def test_warmup_takes_the_router_weights_dtype_of_another_caller(recorded_calls):
    weights = synthetic_moe_weights(8, 64, 32, 32, dtype=torch.float16)
    cuda.warmup(weights, 2, [2], weights_dtype=torch.float16)
    assert [c[2] for c in recorded_calls] == [torch.float16]


@triton.jit
def _kernel(x_ptr, weights_ptr, stride, rows, stamps_ptr, BLOCK: tl.constexpr):
    pass


def test_a_compile_after_warmup_names_each_arguments_dtype_and_specialization(monkeypatch):
    """The warning names what Triton keyed the new binary by (Triton's own ``repr`` lists one
    parameter), so a binary the warmup missed says which argument differed."""
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", None)
    monkeypatch.setattr(cuda, "_compile_watch", {})
    logged = []
    assert cuda.watch_compiles_after_warmup(logged.append)
    # the record as Triton 3.6's JITFunction._call_hook passes it (paths into the arguments as keys)
    record = {
        "key": "k", "signature": {"x_ptr": "*fp16", "weights_ptr": "*fp32", "stride": "i32", "rows": "constexpr",
                                  "stamps_ptr": "constexpr", "BLOCK": "constexpr"},
        "constants": {(3,): 1, (4,): None, (5,): 64},
        "configs": [{(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]], (2,): []}],
    }
    fn = types.SimpleNamespace(module="moe_grouped_decode.kernels.combine", name="_kernel", jit_function=_kernel)
    triton.knobs.runtime.jit_post_compile_hook(key="k", repr="_kernel[num_warps=4, num_stages=3](x_ptr: ()", fn=fn,
                                               compile=record)
    (line,) = logged
    assert line.endswith("_kernel[num_warps=4, num_stages=3](x_ptr *fp16/16, weights_ptr *fp32/16, stride i32, "
                         "rows=1, stamps_ptr=None)")
    assert cuda.compiled_arguments({"fn": fn}) == ""  # no record: nothing to name
