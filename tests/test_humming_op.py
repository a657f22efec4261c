"""The co-served op over Humming's tensors, ``moe_grouped_decode::awq_humming_grouped_decode``, on
the CPU: its implementation against the float64 reference of the AutoAWQ layer the tensors came
from, torch.library's opcheck (schema, fake kernel, autograd registration) over several inputs,
and its argument errors. The CUDA implementation's kernels run on the interpreter in
interpret_marlin_check.py and at full size in test_cuda_marlin_grouped.py."""

import pytest
import torch

from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.humming_layout import awq_to_humming
from moe_grouped_decode.ops import awq_humming_grouped_decode, error_stats, reference_moe

# (E, k, K, N, G, M, dtype): every sublayer padded (K 128 -> W2's 256 columns, N 96 -> 128 rows,
# 2N 192 -> 256 columns), N == G, bf16, several tokens
CASES = [(4, 2, 128, 96, 32, 3, torch.float16), (4, 2, 256, 128, 128, 2, torch.bfloat16),
         (8, 3, 128, 64, 64, 5, torch.float16)]
BOUND = {torch.float16: 2e-3, torch.bfloat16: 16e-3}  # as the GPU tests' bounds


def layer_and_inputs(E, k, K, N, G, M, dtype, seed=0):
    gen = torch.Generator().manual_seed(200 + seed)
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=seed)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weights = torch.rand(M, k, generator=gen)
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(M)]).to(torch.int32)
    return awq, awq_to_humming(awq), x, weights, ids


def op_args(hum, x, weights, ids):
    return (x, weights, ids, *hum.tensors(), hum.intermediate_size, hum.group_size)


@pytest.mark.parametrize("E, k, K, N, G, M, dtype", CASES)
def test_the_op_computes_the_awq_layer_its_humming_tensors_came_from(E, k, K, N, G, M, dtype):
    awq, hum, x, weights, ids = layer_and_inputs(E, k, K, N, G, M, dtype)
    ids[-1, -1] = -1  # an expert on another rank: adds nothing
    out = awq_humming_grouped_decode(*op_args(hum, x, weights, ids))
    stats = error_stats(out, reference_moe(x, weights, ids, awq))
    assert out.dtype == dtype and out.shape == x.shape
    assert not stats.nan and stats.scaled_max_abs <= BOUND[dtype], stats


@pytest.mark.parametrize("E, k, K, N, G, M, dtype", CASES)
def test_opcheck(E, k, K, N, G, M, dtype):
    _, hum, x, weights, ids = layer_and_inputs(E, k, K, N, G, M, dtype, seed=1)
    torch.library.opcheck(torch.ops.moe_grouped_decode.awq_humming_grouped_decode.default,
                          op_args(hum, x, weights, ids))


def test_the_fake_kernel_gives_the_output_shape_without_computing():
    from torch._subclasses.fake_tensor import FakeTensorMode

    _, hum, x, weights, ids = layer_and_inputs(4, 2, 128, 96, 32, 3, torch.float16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in op_args(hum, x, weights, ids)]
        out = torch.ops.moe_grouped_decode.awq_humming_grouped_decode(*fake)
    assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("change, message", [
    (lambda a: (a[0].float(),) + a[1:], "one dtype"),
    (lambda a: (a[0], a[1][:1], a[2][:1]) + a[3:], "rows of ids"),
    (lambda a: (a[0], a[1], a[2].to(torch.int16)) + a[3:], "int32 or int64"),
    (lambda a: (a[0].repeat(1, 4),) + a[1:], "not a layer of hidden size 512"),
    (lambda a: a[:9] + (160,) + a[10:], "intermediate size 160"),
    (lambda a: (a[0], a[1].double()) + a[2:], "topk_weights must be float32 or torch.float16"),
])
def test_bad_arguments_are_errors_that_say_what(change, message):
    """(Humming pads K to 128 rows and 256 columns: a hidden size inside the same padding, 64 for
    this layer's 128, cannot be told from the tensors; the method checks the layer's own sizes
    against vLLM's humming_configs at load.)"""
    _, hum, x, weights, ids = layer_and_inputs(4, 2, 128, 96, 32, 3, torch.float16)
    with pytest.raises(ValueError, match=message):
        awq_humming_grouped_decode(*change(op_args(hum, x, weights, ids)))
