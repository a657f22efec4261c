"""vLLM's Humming MoE layout (moe_grouped_decode/humming_layout.py): shapes, exact round trips,
and every value read back by the element-wise map of the layout study.

What is checked against what:
- the padded shapes against the ones humming 0.1.17 made on an H200 for qwen3.8-tp4's layer
  (``docs/bench/humming_moe_anchor.json``, ``prep``);
- every weight, scale and zero point against an element-wise reader written from humming's
  loaders (``docs/notebook/humming_layout_study.md``, section 3), not from the converter's
  tensor reshapes;
- the inverse and the dequantized weights against the AutoAWQ layer.
Bit-equality with humming's own CUDA repack needs a GPU and is not checked here.
"""

import json
from pathlib import Path

import pytest
import torch

from moe_grouped_decode.awq import dequantize, synthetic_moe_weights, unpack_int4
from moe_grouped_decode.humming_layout import (awq_to_humming, dequantize_humming, humming_to_awq, pack_plain_zeros,
                                               unpack_plain_zeros)

ROOT = Path(__file__).resolve().parents[1]
# (E, K, N, G): no padding; 2N and N padded (N = 160, G = 32); K's W2 columns padded (K = 320);
# G = 64; and an N == G layer (Humming has no channelwise scale order)
SHAPES = [(2, 256, 128, 128), (2, 256, 160, 32), (3, 320, 192, 64), (2, 128, 64, 64), (2, 384, 128, 128)]
# the weight nibble of each of a lane's 8 value slots (Marlin's, which Humming's words share)
SLOT_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)


def read_humming(words, scales, zeros, group_size):
    """Every element of one [E, K, N] sublayer, read one (k, n) at a time as humming's loaders do:
    weight word 128 (n // 64) + 4 (4 g + t) + w of row k // 16; scale 64 (n // 64) + 8 g + (n % 64) // 8
    of group row k // G; zero word 8 (n // 64) + g, nibble (n % 64) // 8; with g = n % 8,
    w = (n % 64) // 16, t = (k % 8) // 2. Returns (values, scales, zeros) as [E, K, N] tensors."""
    experts, k_tiles, width = words.shape
    size_k, size_n = k_tiles * 16, width // 2
    k = torch.arange(size_k)[:, None]
    n = torch.arange(size_n)[None, :]
    g, w, t = n % 8, (n % 64) // 16, (k % 8) // 2
    slot = torch.tensor([0, 1, -1, -1, -1, -1, -1, -1, 2, 3])[(k % 16) - 2 * t] + 4 * ((n % 16) // 8)
    nibble = torch.tensor(SLOT_NIBBLE)[slot]
    word = words[:, k // 16, 128 * (n // 64) + 4 * (4 * g + t) + w]
    values = (word >> (4 * nibble)) & 0xF
    scale = scales[:, k // group_size, 64 * (n // 64) + 8 * g + (n % 64) // 8]
    zero = (zeros[:, k // group_size, 8 * (n // 64) + g] >> (4 * ((n % 64) // 8))) & 0xF
    return values, scale, zero


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("E, K, N, G", SHAPES)
def test_every_value_sits_where_humming_reads_it(E, K, N, G, dtype):
    awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=E + K + N + G)
    hum = awq_to_humming(awq)
    for name, words, scales, zeros, qweight, awq_scales, qzeros in (
            ("w13", hum.w13_weight, hum.w13_weight_scale, hum.w13_zero_point, awq.w13_qweight, awq.w13_scales,
             awq.w13_qzeros),
            ("w2", hum.w2_weight, hum.w2_weight_scale, hum.w2_zero_point, awq.w2_qweight, awq.w2_scales,
             awq.w2_qzeros)):
        values, scale, zero = read_humming(words, scales, zeros, G)
        rows, columns = qweight.shape[1], qweight.shape[2] * 8
        assert torch.equal(values[:, :rows, :columns], unpack_int4(qweight).to(values.dtype)), name
        assert torch.equal(scale[:, :rows, :columns], awq_scales.repeat_interleave(G, dim=1)), name
        assert torch.equal(zero[:, :rows, :columns], unpack_int4(qzeros).repeat_interleave(G, dim=1).to(zero.dtype)), name
        # the padding is zeros everywhere: it dequantizes to 0 whatever the activations
        pad = torch.ones_like(values, dtype=torch.bool)
        pad[:, :rows, :columns] = False
        assert not values[pad].any() and not scale[pad].any() and not zero[pad].any(), name


def test_padded_shapes_are_the_ones_humming_made_on_the_gpu():
    """qwen3.8-tp4's layer as humming 0.1.17 padded it on an H200 (E cut to 2: the rest is per expert)."""
    anchor = json.loads((ROOT / "docs/bench/humming_moe_anchor.json").read_text())
    made = anchor["prep"]["float16"]["trace"]
    hum = awq_to_humming(synthetic_moe_weights(2, 2560, 160, 32, dtype=torch.float16, seed=3))
    ours = {"w13": (hum.w13_weight, hum.w13_weight_scale, hum.w13_zero_point),
            "w2": (hum.w2_weight, hum.w2_weight_scale, hum.w2_zero_point)}
    for name, tensors in ours.items():
        for key, tensor in zip(("weight", "weight_scale", "zero_point"), tensors):
            shape, dtype = made[name]["tensors"][key]
            assert list(tensor.shape) == [2, *shape[1:]], (name, key)
            assert str(tensor.dtype) == f"torch.{dtype}", (name, key)


@pytest.mark.parametrize("E, K, N, G", SHAPES)
def test_the_layout_loses_nothing(E, K, N, G):
    awq = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=11 * E + N)
    back = humming_to_awq(awq_to_humming(awq))
    for a, b in zip(awq.tensors(), back.tensors()):
        assert torch.equal(a, b)
    w13, w2 = dequantize_humming(awq_to_humming(awq))
    for e in range(E):
        assert torch.equal(w13[e], dequantize(awq.w13_qweight[e], awq.w13_scales[e], awq.w13_qzeros[e], G))
        assert torch.equal(w2[e], dequantize(awq.w2_qweight[e], awq.w2_scales[e], awq.w2_qzeros[e], G))


def test_plain_zeros_put_column_64c_plus_i_plus_8m_at_nibble_m_of_word_8c_plus_i():
    zeros = torch.randint(0, 16, (1, 2, 128), generator=torch.Generator().manual_seed(5), dtype=torch.int32)
    words = pack_plain_zeros(zeros)
    for c in range(2):
        for i in range(8):
            for m in range(8):
                got = (int(words[0, 1, 8 * c + i]) >> (4 * m)) & 0xF
                assert got == int(zeros[0, 1, 64 * c + i + 8 * m])
    assert torch.equal(unpack_plain_zeros(words).to(torch.int32), zeros)


def test_a_layer_humming_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="G = 256"):
        awq_to_humming(synthetic_moe_weights(2, 512, 256, 256, dtype=torch.float16, seed=1))
