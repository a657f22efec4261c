"""AWQ int4 format: nibble order, (de)quantization, TP slicing, synthetic checkpoints."""

import pytest
import torch

from moe_grouped_decode.awq import (
    AWQ_PACK_ORDER,
    dequantize,
    pack_int4,
    quantize,
    regroup,
    slice_ep,
    slice_tp,
    synthetic_moe_weights,
    to_hub_expert_tensors,
    unpack_int4,
)
from moe_grouped_decode.ops import reference_moe


def _signed(u32: int) -> int:
    return u32 - 2**32 if u32 >= 2**31 else u32


# Hand-written words: nibble i (bits 4i..4i+3) holds column [0,2,4,6,1,3,5,7][i].
PINNED = [
    # columns 0..7 hold 1..8 -> nibbles (low to high) 1,3,5,7,2,4,6,8
    ([1, 2, 3, 4, 5, 6, 7, 8], _signed(0x86427531)),
    # columns hold their own index -> nibbles 0,2,4,6,1,3,5,7
    ([0, 1, 2, 3, 4, 5, 6, 7], 0x75316420),
    # only column 1 set: it lives in nibble 4
    ([0, 15, 0, 0, 0, 0, 0, 0], 0x000F0000),
    # only column 7 set: it lives in nibble 7 (the sign bit)
    ([0, 0, 0, 0, 0, 0, 0, 9], _signed(0x90000000)),
]


@pytest.mark.parametrize("columns,word", PINNED)
def test_nibble_order_pinned(columns, word):
    packed = pack_int4(torch.tensor([columns]))
    assert packed.dtype == torch.int32
    assert packed.tolist() == [[word]]
    assert unpack_int4(packed).tolist() == [columns]


def test_pack_order_constant_is_autoawq():
    assert AWQ_PACK_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)


def test_pack_unpack_round_trip():
    gen = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (3, 5, 64), generator=gen)
    assert torch.equal(unpack_int4(pack_int4(values)).to(torch.int64), values)


def test_unpack_every_bit_pattern_round_trips():
    gen = torch.Generator().manual_seed(2)
    words = torch.randint(-(2**31), 2**31 - 1, (1000,), generator=gen, dtype=torch.int64).to(torch.int32)
    assert torch.equal(pack_int4(unpack_int4(words.view(-1, 1))).view(-1), words)


def test_pack_rejects_out_of_range_and_ragged():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((1, 8), 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(1, 12, dtype=torch.int64))


@pytest.mark.parametrize("group_size", [32, 128])  # the contract's G and the common checkpoint G
def test_quantize_error_within_one_step(group_size):
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(2, 256, 48, generator=gen) * 0.02
    qweight, scales, qzeros = quantize(weight, group_size)
    assert qweight.shape == (2, 256, 6) and scales.shape == (2, 256 // group_size, 48)
    assert qzeros.shape == (2, 256 // group_size, 6)
    restored = dequantize(qweight, scales, qzeros, group_size)
    step = scales.to(torch.float32).repeat_interleave(group_size, dim=-2)
    # asymmetric rounding: half a step from the value, half a step from the zero point
    assert ((restored - weight).abs() <= step * 1.001).all()
    # and on average far better than the bound (a wrong nibble order would not be)
    assert ((restored - weight).abs() / step).mean() < 0.35


def test_dequantize_matches_elementwise_formula():
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (64, 16), generator=gen)
    z = torch.randint(0, 16, (2, 16), generator=gen)
    s = torch.rand(2, 16, generator=gen, dtype=torch.float32).to(torch.float16) + 0.01
    got = dequantize(pack_int4(q), s, pack_int4(z), 32)
    for row in (0, 31, 32, 63):
        g = row // 32
        want = (q[row].float() - z[g].float()) * s[g].float()
        assert torch.equal(got[row], want)


FULL = dict(num_experts=6, hidden_size=64, intermediate_size=128, group_size=32)


@pytest.mark.parametrize("rank", [0, 3])  # first and last shard (the evidence standard's TP4 ranks)
def test_slice_tp_matches_slicing_dequantized_weights(rank):
    full = synthetic_moe_weights(**FULL, seed=5)
    shard = slice_tp(full, rank, 4)
    n, full_n = 32, 128
    assert shard.intermediate_size == n and shard.hidden_size == 64
    for expert in (0, 5):
        w13_full, w2_full = full.dequantized_expert(expert)
        w13, w2 = shard.dequantized_expert(expert)
        gate = w13_full[:, rank * n : (rank + 1) * n]
        up = w13_full[:, full_n + rank * n : full_n + (rank + 1) * n]
        assert torch.equal(w13, torch.cat([gate, up], dim=1))
        assert torch.equal(w2, w2_full[rank * n : (rank + 1) * n])


def test_slice_ep_holds_each_ranks_experts_at_their_local_ids():
    """Round-robin over two ranks (global 1, 3, 5 -> local 0, 1, 2 on rank 1): each local expert
    is its global expert's tensors, bit for bit, and no other."""
    full = synthetic_moe_weights(**FULL, seed=8)
    expert_map = torch.tensor([-1, 0, -1, 1, -1, 2], dtype=torch.int32)
    shard = slice_ep(full, expert_map)
    assert shard.num_experts == 3 and shard.intermediate_size == full.intermediate_size
    for local, g in ((0, 1), (1, 3), (2, 5)):
        for part, whole in zip(shard.tensors(), full.tensors()):
            assert torch.equal(part[local], whole[g])


def test_tp_shards_sum_to_the_full_layer():
    full = synthetic_moe_weights(**FULL, seed=6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(3, 64, generator=gen).to(torch.float16)
    ids = torch.stack([torch.randperm(6, generator=gen)[:2] for _ in range(3)]).to(torch.int32)
    w = torch.rand(3, 2, generator=gen)
    whole = reference_moe(x, w, ids, full)
    parts = sum(reference_moe(x, w, ids, slice_tp(full, r, 4)) for r in range(4))
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-12)


def test_slice_tp_rejects_bad_splits():
    full = synthetic_moe_weights(**FULL, seed=8)
    with pytest.raises(ValueError, match="rank"):
        slice_tp(full, 4, 4)
    with pytest.raises(ValueError, match="divisible"):
        slice_tp(full, 0, 3)
    with pytest.raises(ValueError, match="multiple of 8 and of group_size"):
        slice_tp(full, 0, 8)  # 16-wide shards cannot hold a 32-row W2 group


def test_synthetic_is_deterministic_and_realistic():
    a = synthetic_moe_weights(4, 128, 64, 32, seed=9)
    b = synthetic_moe_weights(4, 128, 64, 32, seed=9)
    c = synthetic_moe_weights(4, 128, 64, 32, seed=10)
    for ta, tb, tc in zip(a.tensors(), b.tensors(), c.tensors()):
        assert torch.equal(ta, tb)
        assert not torch.equal(ta, tc)
    assert a.w13_qweight.shape == (4, 128, 16) and a.w13_scales.shape == (4, 4, 128)
    assert a.w2_qweight.shape == (4, 64, 16) and a.w2_qzeros.shape == (4, 2, 16)
    zeros = unpack_int4(a.w13_qzeros)
    assert zeros.min() >= 5 and zeros.max() <= 10
    nibbles = unpack_int4(a.w13_qweight).float()
    assert nibbles.min() == 0 and nibbles.max() == 15 and abs(nibbles.mean().item() - 7.5) < 0.2
    assert (a.w13_scales > 0).all()
    # unit-variance inputs give roughly unit-variance gate/up outputs
    w13, _ = a.dequantized_expert(0)
    x = torch.randn(256, 128, generator=torch.Generator().manual_seed(11))
    assert 0.5 < (x @ w13).std().item() < 2.0


def test_hub_tensors_split_gate_up_down():
    w = synthetic_moe_weights(3, 64, 32, 32, seed=12)
    hub = to_hub_expert_tensors(w, "model.layers.0.mlp")
    assert len(hub) == 3 * 3 * 3
    gate = hub["model.layers.0.mlp.experts.2.gate_proj.qweight"]
    up = hub["model.layers.0.mlp.experts.2.up_proj.qweight"]
    assert gate.shape == (64, 4) and up.shape == (64, 4)
    assert torch.equal(torch.cat([gate, up], dim=1), w.w13_qweight[2])
    assert torch.equal(
        torch.cat([hub["model.layers.0.mlp.experts.2.gate_proj.scales"], hub["model.layers.0.mlp.experts.2.up_proj.scales"]], 1),
        w.w13_scales[2],
    )
    assert torch.equal(hub["model.layers.0.mlp.experts.1.down_proj.qzeros"], w.w2_qzeros[1])
    assert hub["model.layers.0.mlp.experts.0.down_proj.scales"].shape == (1, 64)


def test_regroup_g128_as_g32_keeps_every_weight():
    g128 = synthetic_moe_weights(2, 256, 128, 128, seed=13)
    g32 = regroup(g128, 32)
    assert g32.group_size == 32 and g32.w13_scales.shape == (2, 8, 256) and g32.w2_qzeros.shape == (2, 4, 32)
    for expert in range(2):
        for a, b in zip(g128.dequantized_expert(expert), g32.dequantized_expert(expert)):
            assert torch.equal(a, b)
    with pytest.raises(ValueError, match="must divide"):
        regroup(g128, 48)
