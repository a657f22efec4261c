"""vLLM's Marlin MoE layout (moe_grouped_decode/marlin_layout.py): index math, exact round trips,
and bit-equality with vLLM's own code.

What is checked against vLLM where:
- CPU, vLLM's Python: the scale and zero-point conversions vLLM runs at load
  (``marlin_moe_permute_scales``, ``moe_awq_to_marlin_zero_points``); the weight repack against
  ``marlin_weights(..., get_weight_perm(4))``, the Python reference vLLM's own GPU test asserts
  ``awq_marlin_repack`` equal to; and vLLM's whole AWQ load step (``_process_awq_weights_marlin``:
  padding, argument choices) with only its CUDA repack op swapped for that Python reference.
- GPU only (skipped here): the same load step with vLLM's CUDA repack, and vLLM's Marlin MoE
  kernel computing a layer from these tensors against the float64 reference.
"""

from types import SimpleNamespace

import pytest
import torch

from moe_grouped_decode.awq import AwqMoeWeights, dequantize, pack_int4, synthetic_moe_weights, unpack_int4
from moe_grouped_decode.marlin_layout import (
    MARLIN_PACK_ORDER,
    awq_to_marlin,
    dequantize_marlin,
    kernel_scale_order_mismatches,
    layer_bytes,
    marlin_padded_intermediate,
    marlin_to_awq,
    marlin_weight_location,
    pack_zeros,
    pad_intermediate,
    permute_scales,
    repack_values,
    unpack_values,
    unpack_zeros,
    unpermute_scales,
)

# (E, K, N, G): G = 32 and 128 with and without padding (N -> N_p), N == G (vLLM's
# channelwise scale order), G = 64; K a multiple of 128 as vLLM's Marlin MoE requires
SHAPES = [
    (2, 128, 64, 32),
    (2, 256, 160, 32),  # N_p = 192, like qwen3.8-tp4's N = 160
    (2, 128, 96, 32),  # N_p = 128
    (2, 256, 256, 128),
    (2, 384, 384, 128),  # N_p = 384, three 128-groups of W2
    (3, 256, 128, 128),  # N == G
    (2, 256, 192, 64),
]
SHAPE_IDS = [f"E{e}-K{k}-N{n}-G{g}" for e, k, n, g in SHAPES]


def _layer(shape, dtype=torch.float16, seed=0) -> AwqMoeWeights:
    e, k, n, g = shape
    return synthetic_moe_weights(e, k, n, g, dtype=dtype, seed=seed)


# --------------------------------------------------------------------------- index math


# (k, n) -> (row, word, nibble), read off awq_marlin_repack.cu: lane th = 4 g + t writes word
# th * 4 + w of each 16 x 64 tile; its slots are rows 2t + (0, 1, 8, 9) of columns 16 w + g
# (slots 0-3) and 16 w + g + 8 (slots 4-7); nibble m holds slot (0, 2, 4, 6, 1, 3, 5, 7)[m].
PINNED_LOCATIONS = [
    ((0, 0), (0, 0, 0)),
    ((1, 0), (0, 0, 4)),  # slot 1
    ((8, 0), (0, 0, 1)),  # slot 2
    ((9, 0), (0, 0, 5)),  # slot 3
    ((0, 8), (0, 0, 2)),  # slot 4: column g + 8
    ((9, 8), (0, 0, 7)),  # slot 7
    ((2, 0), (0, 4, 0)),  # t = 1: lane 1
    ((0, 1), (0, 16, 0)),  # g = 1: lane 4
    ((0, 16), (0, 1, 0)),  # subtile w = 1
    ((0, 64), (0, 128, 0)),  # the next tile
    ((16, 0), (1, 0, 0)),  # the next 16 rows
    ((15, 63), (0, 127, 7)),  # the tile's last word: lane 31, subtile 3, slot 7
]


@pytest.mark.parametrize("k_n,location", PINNED_LOCATIONS)
def test_weight_location_pinned(k_n, location):
    assert marlin_weight_location(*k_n, size_n=128) == location


def test_repack_puts_every_value_where_the_index_math_says():
    gen = torch.Generator().manual_seed(11)
    size_k, size_n = 32, 128
    values = torch.randint(0, 16, (1, size_k, size_n), generator=gen, dtype=torch.uint8)
    words = repack_values(values)[0].tolist()
    flat = values[0].tolist()
    for k in range(size_k):
        for n in range(size_n):
            row, word, nibble = marlin_weight_location(k, n, size_n)
            assert (words[row][word] >> (4 * nibble)) & 0xF == flat[k][n], (k, n)


def test_every_word_holds_one_lanes_mma_fragments():
    """The 8 values of one word: rows 2t, 2t+1, 2t+8, 2t+9 of columns g and g+8 of one 16-column
    subtile, i.e. lane (g, t)'s elements of an m16n8k16 operand for two 8-column blocks."""
    seen = {}
    for k in range(16):
        for n in range(64):
            row, word, nibble = marlin_weight_location(k, n, 64)
            assert (row, word, nibble) not in seen, "two weights in one nibble"
            seen[row, word, nibble] = (k, n)
    assert len(seen) == 16 * 64
    for word in range(128):
        lane, subtile = divmod(word, 4)
        g, t = divmod(lane, 4)
        cells = {seen[0, word, m] for m in range(8)}
        assert cells == {(2 * t + dk, 16 * subtile + g + dn) for dk in (0, 1, 8, 9) for dn in (0, 8)}
        # one LOP3 (mask 0x000F000F) takes nibbles (m, m + 4): a row pair (2t + d, 2t + d + 1)
        for m in range(4):
            (k0, n0), (k1, n1) = seen[0, word, m], seen[0, word, m + 4]
            assert (k1 - k0, n1 - n0) == (1, 0)


def test_repack_round_trips():
    gen = torch.Generator().manual_seed(12)
    values = torch.randint(0, 16, (3, 48, 192), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_values(repack_values(values)), values)


def test_repack_refuses_partial_tiles():
    with pytest.raises(ValueError, match="16 x 64"):
        repack_values(torch.zeros(1, 16, 96, dtype=torch.uint8))


def test_scale_orders_pinned():
    columns = torch.arange(128, dtype=torch.float32).reshape(1, 1, 128)
    grouped = permute_scales(columns, grouped=True)[0, 0].tolist()
    # 64-column chunks, position 8 i + j holds column i + 8 j
    assert grouped[:10] == [0, 8, 16, 24, 32, 40, 48, 56, 1, 9]
    assert grouped[64:66] == [64, 72]
    channelwise = permute_scales(columns, grouped=False)[0, 0].tolist()
    # 32-column chunks, position 8 i + 2 a + b holds column 8 a + 2 i + b
    assert channelwise[:10] == [0, 1, 8, 9, 16, 17, 24, 25, 2, 3]
    assert channelwise[32:34] == [32, 33]


@pytest.mark.parametrize("grouped", [True, False])
def test_scale_orders_round_trip(grouped):
    gen = torch.Generator().manual_seed(13)
    scales = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16)
    assert torch.equal(unpermute_scales(permute_scales(scales, grouped), grouped), scales)


def test_zero_points_pinned():
    zeros = torch.zeros(1, 1, 128, dtype=torch.uint8)
    zeros[0, 0, 16] = 3  # column 16 = 0 + 8 * 2: word 0, the nibble holding slot 2
    zeros[0, 0, 1] = 5  # column 1: word 1 (i = 1), nibble 0
    zeros[0, 0, 72] = 7  # second chunk, i = 0, j = 1: word 8, the nibble holding slot 1
    words = pack_zeros(zeros)[0, 0].tolist()
    assert words[0] == 3 << (4 * MARLIN_PACK_ORDER.index(2))
    assert words[1] == 5
    assert words[8] == 7 << (4 * MARLIN_PACK_ORDER.index(1))
    assert sum(1 for w in words if w) == 3


def test_zero_points_round_trip():
    gen = torch.Generator().manual_seed(14)
    zeros = torch.randint(0, 16, (2, 4, 192), generator=gen, dtype=torch.uint8)
    assert torch.equal(unpack_zeros(pack_zeros(zeros)), zeros)


@pytest.mark.parametrize(
    "n,g,padded", [(160, 32, 192), (512, 128, 512), (96, 32, 128), (128, 128, 128), (32, 32, 64), (192, 64, 192)]
)
def test_padded_intermediate(n, g, padded):
    assert marlin_padded_intermediate(n, g) == padded


# --------------------------------------------------------------------------- a layer


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_marlin_equals_autoawq_exactly(shape, dtype):
    awq = _layer(shape, dtype, seed=sum(shape))
    marlin = awq_to_marlin(awq)
    w13, w2 = dequantize_marlin(marlin)
    # the independent reference: awq.dequantize of the AutoAWQ tensors
    assert torch.equal(w13, dequantize(awq.w13_qweight, awq.w13_scales, awq.w13_qzeros, awq.group_size))
    assert torch.equal(w2, dequantize(awq.w2_qweight, awq.w2_scales, awq.w2_qzeros, awq.group_size))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_marlin_to_awq_inverts_awq_to_marlin(shape):
    awq = _layer(shape, seed=100 + sum(shape))
    back = marlin_to_awq(awq_to_marlin(awq))
    for name, got, want in zip(("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"),
                               back.tensors(), awq.tensors()):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_marlin_shapes_and_zero_padding(shape):
    e, k, n, g = shape
    n_p = marlin_padded_intermediate(n, g)
    marlin = awq_to_marlin(_layer(shape, seed=7))
    assert marlin.padded_intermediate_size == n_p and marlin.hidden_size == k
    assert [tuple(t.shape) for t in marlin.tensors()] == [
        (e, k // 16, 4 * n_p), (e, k // g, 2 * n_p), (e, k // g, 2 * n_p // 8),
        (e, n_p // 16, 2 * k), (e, n_p // g, k), (e, n_p // g, k // 8),
    ]
    w13, w2 = dequantize_marlin(marlin, keep_padding=True)
    pad_columns = torch.cat([w13[..., n:n_p], w13[..., n_p + n:]], dim=-1)
    assert not pad_columns.any() and not w2[:, n:].any()


def test_scale_order_follows_vllm_and_flags_n_equal_g():
    grouped = awq_to_marlin(_layer((2, 256, 160, 32)))
    assert grouped.scales_grouped and kernel_scale_order_mismatches(grouped) == ()
    # N == G: vLLM writes the channelwise order, the kernel reads W13's K / G = 2 groups grouped
    n_equals_g = awq_to_marlin(_layer((2, 256, 128, 128)))
    assert not n_equals_g.scales_grouped
    assert kernel_scale_order_mismatches(n_equals_g) == ("w13_scales",)
    # N == G = 32, padded to 64: W2 has two groups too
    small = awq_to_marlin(_layer((2, 128, 32, 32)))
    assert kernel_scale_order_mismatches(small) == ("w13_scales", "w2_scales")


def test_layer_bytes_counts_the_tensors():
    awq = _layer((2, 256, 160, 32))
    marlin = awq_to_marlin(awq)
    assert layer_bytes(2, 256, 160, 32) == sum(t.numel() * t.element_size() for t in awq.tensors())
    assert layer_bytes(2, 256, 192, 32) == sum(t.numel() * t.element_size() for t in marlin.tensors())


def test_pad_intermediate_refuses_a_partial_group():
    with pytest.raises(ValueError, match="cannot pad"):
        pad_intermediate(_layer((1, 128, 64, 32)), 80)


# --------------------------------------------------------------------------- vLLM's own code (CPU)


def _vllm_modules():
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16
    from vllm.model_executor.layers.quantization.utils import marlin_utils, marlin_utils_test, quant_utils

    return int_wna16, marlin_utils, marlin_utils_test, quant_utils


def _vllm_reference_repack(awq_qweight: torch.Tensor, size_k: int, size_n: int) -> torch.Tensor:
    """A CPU stand-in for ``ops.awq_marlin_moe_repack`` made of vLLM's Python only: AWQ words
    unpacked and un-interleaved as vLLM's ``awq_to_marlin_zero_points`` does, then
    ``marlin_weights`` with ``get_weight_perm(4)``, which vLLM's GPU test
    (tests/kernels/quantization/test_marlin_gemm.py::test_awq_marlin_repack) asserts equal to
    the CUDA repack."""
    _, _, marlin_utils_test, quant_utils = _vllm_modules()
    undo_interleave = torch.argsort(torch.tensor(MARLIN_PACK_ORDER))
    perm = marlin_utils_test.get_weight_perm(4)
    out = []
    for expert in awq_qweight:
        q = quant_utils.unpack_cols(expert, 4, size_k, size_n)
        q = q.reshape(-1, 8)[:, undo_interleave].reshape(size_k, size_n)
        out.append(marlin_utils_test.marlin_weights(q, size_k, size_n, 4, perm))
    return torch.stack(out)


def test_autoawq_packing_matches_vllms_awq_pack():
    _, _, _, quant_utils = _vllm_modules()
    gen = torch.Generator().manual_seed(21)
    values = torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.int32)
    assert torch.equal(quant_utils.awq_pack(values, 4, 64, 128), pack_int4(values))


@pytest.mark.parametrize("shape", SHAPES[:4], ids=SHAPE_IDS[:4])
def test_weights_match_vllms_reference_repack(shape):
    awq = _layer(shape, seed=31)
    marlin = awq_to_marlin(awq)
    padded = pad_intermediate(awq, marlin.padded_intermediate_size)
    n_p, k = marlin.padded_intermediate_size, awq.hidden_size
    assert torch.equal(marlin.w13_qweight, _vllm_reference_repack(padded.w13_qweight, k, 2 * n_p))
    assert torch.equal(marlin.w2_qweight, _vllm_reference_repack(padded.w2_qweight, n_p, k))


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_scales_and_zeros_match_vllm(shape):
    _, marlin_utils, _, _ = _vllm_modules()
    awq = _layer(shape, dtype=torch.bfloat16, seed=41)
    marlin = awq_to_marlin(awq)
    padded = pad_intermediate(awq, marlin.padded_intermediate_size)
    n, g = awq.intermediate_size, awq.group_size
    # the calls as _process_awq_weights_marlin makes them (size_k = the unpadded N for both)
    for ours, scales in ((marlin.w13_scales, padded.w13_scales), (marlin.w2_scales, padded.w2_scales)):
        theirs = marlin_utils.marlin_moe_permute_scales(s=scales, size_k=n, size_n=scales.shape[2], group_size=g)
        assert torch.equal(ours, theirs)
    for ours, zeros in ((marlin.w13_qzeros, padded.w13_qzeros), (marlin.w2_qzeros, padded.w2_qzeros)):
        theirs = marlin_utils.moe_awq_to_marlin_zero_points(
            zeros, size_k=zeros.shape[1], size_n=zeros.shape[2] * 8, num_bits=4
        )
        assert torch.equal(ours, theirs)


def _vllm_load(awq: AwqMoeWeights):
    """vLLM's AWQ -> Marlin load step, on whatever device the tensors are on."""
    int_wna16, _, _, _ = _vllm_modules()
    k, n, g = awq.hidden_size, awq.intermediate_size, awq.group_size
    layer = SimpleNamespace(intermediate_size_per_partition=n, num_groups_w13=k // g, num_groups_w2=n // g)
    converted = int_wna16._process_awq_weights_marlin(
        layer, 4, 8, g, None, *(t.clone() for t in (awq.w13_qweight, awq.w2_qweight, awq.w13_scales,
                                                     awq.w2_scales, awq.w13_qzeros, awq.w2_qzeros))
    )
    # vLLM 0.32 returns (qweights, scales, qzeros, ...) in 10 entries; 0.26 puts 4 g_idx
    # entries before the qzeros (14 entries)
    zeros_at = {10: 4, 14: 8}[len(converted)]
    w13_q, w2_q, w13_s, w2_s = converted[:4]
    w13_z, w2_z = converted[zeros_at : zeros_at + 2]
    return w13_q, w13_s, w13_z, w2_q, w2_s, w2_z


@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[5]], ids=[SHAPE_IDS[1], SHAPE_IDS[5]])
def test_vllms_load_step_on_cpu_gives_these_tensors(shape, monkeypatch):
    int_wna16, _, _, _ = _vllm_modules()

    def cpu_repack(b_q_weight, *args, size_k, size_n, num_bits, is_a_8bit=False):
        assert num_bits == 4 and not is_a_8bit
        return _vllm_reference_repack(b_q_weight, size_k, size_n)

    # vLLM 0.26 passes a sort-indices tensor before size_k, 0.32 does not: *args takes either
    monkeypatch.setattr(int_wna16.ops, "awq_marlin_moe_repack", cpu_repack)
    awq = _layer(shape, seed=51)
    theirs = _vllm_load(awq)
    ours = awq_to_marlin(awq).tensors()
    for name, a, b in zip(("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"),
                          ours, theirs):
        assert torch.equal(a, b), name


# --------------------------------------------------------------------------- vLLM's CUDA code


def _cuda_marlin_ops() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import vllm._custom_ops  # noqa: F401  (loads vLLM's compiled ops)
    except Exception:
        return False
    return hasattr(torch.ops._C, "awq_marlin_repack") and hasattr(torch.ops, "_moe_C") and hasattr(
        torch.ops._moe_C, "moe_wna16_marlin_gemm")


needs_cuda_marlin = pytest.mark.skipif(
    not _cuda_marlin_ops(), reason="needs a CUDA GPU and vLLM's compiled Marlin ops"
)


@pytest.mark.cuda
@needs_cuda_marlin
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_cuda_repack_matches_vllm(shape):
    awq = _layer(shape, seed=61)
    theirs = _vllm_load(awq.to("cuda"))
    ours = awq_to_marlin(awq).tensors()
    for name, a, b in zip(("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros"),
                          ours, theirs):
        assert torch.equal(a, b.cpu()), name


def _kernel_case(shape):
    marks = []
    if kernel_scale_order_mismatches(awq_to_marlin(_layer(shape))):
        # strict: read off vLLM's source, the kernel misreads these scales; should it compute them
        # right on a GPU, the pass fails this test and the layout's refusal of N == G can go
        marks.append(pytest.mark.xfail(strict=True, reason="N == G: vLLM's scale order and the kernel's "
                                                           "disagree (docs/notebook/marlin_layout_study.md)"))
    return pytest.param(shape, marks=marks, id="E{}-K{}-N{}-G{}".format(*shape))


@pytest.mark.cuda
@needs_cuda_marlin
@pytest.mark.parametrize("shape", [_kernel_case(s) for s in SHAPES])
def test_cuda_marlin_kernel_computes_the_dequantized_layer(shape):
    """vLLM's Marlin MoE kernel on these tensors against the float64 reference of the AutoAWQ
    layer: that the kernel reads the layout as dequantize_marlin does."""
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import fused_marlin_moe
    from vllm.scalar_type import scalar_types

    from moe_grouped_decode.ops import reference_moe

    e, k, n, g = shape
    awq = _layer(shape, seed=71)
    marlin = awq_to_marlin(awq)
    gen = torch.Generator().manual_seed(72)
    tokens, top_k = 5, min(2, e)
    x = torch.randn(tokens, k, generator=gen).to(torch.float16)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    weights = torch.rand(tokens, top_k, generator=gen)
    w13_q, w13_s, w13_z, w2_q, w2_s, w2_z = (t.cuda() for t in marlin.tensors())
    out = fused_marlin_moe(
        x.cuda(), w13_q, w2_q, None, None, w13_s, w2_s, weights.cuda(), ids.cuda(),
        quant_type_id=scalar_types.uint4.id, w1_zeros=w13_z, w2_zeros=w2_z,
    )
    want = reference_moe(x, weights, ids, awq)
    got = out.float().cpu().to(torch.float64)
    rel = (got - want).norm() / want.norm()
    assert rel < 1e-2, f"relative L2 error {rel:.3g}"
