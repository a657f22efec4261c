"""vLLM's Marlin MoE layout of AWQ int4 expert weights, in plain PyTorch (CPU-testable).

What vLLM's MARLIN WNA16 MoE backend does to an AutoAWQ MoE layer at load
(``_process_awq_weights_marlin`` in ``fused_moe/oracle/int_wna16.py``, the same
in vLLM 0.26 and 0.32), reproduced bit for bit so that the plugin can read the
tensors vLLM's Marlin kernel reads, and mapped back to dense weights:

1. Pad the intermediate size N to ``N_p = round_up(N, lcm(64, G))`` with zeros:
   gate and up are padded each on its own (W13 columns ``[gate N_p | up N_p]``),
   W2 gets zero rows. Zero scales make the padded weights dequantize to 0.
2. Weights (``awq_marlin_repack``, CUDA only): each [K, N] matrix, in 16 x 64
   tiles, becomes ``[K / 16, 2 N]`` int32 whose every word is one lane's mma.sync
   fragment (index math in :func:`marlin_weight_location`).
3. Scales: within every 64 columns, column ``i + 8 j`` moves to ``8 i + j``
   (``marlin_permute_scales``'s grouped order); vLLM takes the 32-column
   "channelwise" order instead when ``G >= N`` (see :func:`vllm_scales_grouped`).
4. Zero points: the grouped 64-column order, then packed 8 a word with nibble m
   holding slot ``MARLIN_PACK_ORDER[m]`` (``moe_awq_to_marlin_zero_points``).

Shapes, with N_p the padded intermediate size::

    w13_qweight [E, K / 16, 4 N_p] int32    w2_qweight [E, N_p / 16, 2 K] int32
    w13_scales  [E, K / G, 2 N_p]           w2_scales  [E, N_p / G, K]
    w13_qzeros  [E, K / G, 2 N_p / 8] int32 w2_qzeros  [E, N_p / G, K / 8] int32

Only vLLM's default 16-bit activations are covered (``VLLM_MARLIN_INPUT_DTYPE``
unset); its int8/fp8-activation variants lay the words out differently.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch

from .awq import PACK_FACTOR, AwqMoeWeights, pack_int4, unpack_int4

# A Marlin tile: 16 reduction rows by 64 output columns, 128 words (4 warps x 32 lanes
# of the repack kernel, one word each). Word th * 4 + w of a tile belongs to lane th
# (g = th // 4, t = th % 4) and 16-column subtile w.
TILE_K = 16
TILE_N = 64
WORDS_PER_TILE = TILE_K * TILE_N // PACK_FACTOR
# The 8 values of a lane's word ("value slots" v = 0..7), as the repack gathers them:
# row 2 t + SLOT_ROW_OFFSETS[v % 4], column 16 w + g + 8 (v // 4) of the tile: mma.sync
# m16n8k16 operand elements (k 2t, 2t + 1, 2t + 8, 2t + 9) of columns g and g + 8.
SLOT_ROW_OFFSETS = (0, 1, 8, 9)
# Nibble m of a word holds value slot MARLIN_PACK_ORDER[m] (weights and zero points
# alike): nibbles (m, m + 4) are a pair of slots that one LOP3 turns into a half2.
MARLIN_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# Marlin's supported AWQ group sizes (vLLM also allows -1, channelwise, which AutoAWQ MoE
# checkpoints do not use).
MARLIN_GROUP_SIZES = (32, 64, 128)


def marlin_padded_intermediate(intermediate_size: int, group_size: int) -> int:
    """vLLM's ``marlin_moe_padded_intermediate``: the MoE kernel needs N % 64 == 0 (gate-up
    2N % 128, down K = N % 64), kept a multiple of G so the group count stays whole."""
    step = math.lcm(TILE_N, group_size)
    return -(-intermediate_size // step) * step


def vllm_scales_grouped(group_size: int, intermediate_size: int) -> bool:
    """Which scale order vLLM writes, for W13 and W2 alike: the grouped one when ``G < N``.

    vLLM passes ``size_k = layer.intermediate_size_per_partition`` (the unpadded N) to
    ``marlin_moe_permute_scales`` for both W13 and W2, and that takes the grouped order
    only when ``group_size < size_k``. For W2, whose reduction is N, that is the right
    test; for W13 (reduction K) it is N standing in for K, so at N == G W13 gets the
    channelwise order although it has K / G > 1 groups (see :func:`kernel_scale_order_mismatches`).
    """
    return group_size < intermediate_size


def kernel_scale_order_mismatches(weights: "MarlinMoeWeights") -> Tuple[str, ...]:
    """Names of the scale tensors whose stored order differs from the one the Marlin MoE
    kernel reads: per ``csrc/moe/marlin_moe_wna16/ops.cu`` it reads the grouped order when
    the tensor has more than one group along its reduction, else the channelwise one.

    Read off vLLM's source, not checked on a GPU: a non-empty answer (N == G) says vLLM's
    own Marlin kernel would misread those scales (the GPU test in tests/test_marlin_layout.py
    probes it). The plugin should not serve such a layer from this layout without that check.
    """
    wanted = {
        "w13_scales": weights.w13_scales.shape[1] > 1,
        "w2_scales": weights.w2_scales.shape[1] > 1,
    }
    return tuple(name for name, grouped in wanted.items() if grouped != weights.scales_grouped)


# --------------------------------------------------------------------------- nibble packing


def _pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """[..., 8] integers in [0, 15] -> int32 [...], value m at bits 4m..4m+3 (plain order)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    packed = (values.to(torch.int64) << shifts).sum(dim=-1)
    # the low 32 bits as a signed int32 (bit 31 set -> negative)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_pack_nibbles`: int32 [...] -> uint8 [..., 8]."""
    if words.dtype != torch.int32:
        raise TypeError(f"packed int4 tensors are int32, got {words.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 0xF).to(torch.uint8)


_PACK_ORDER = list(MARLIN_PACK_ORDER)
# slot v sits at nibble _SLOT_NIBBLE[v]
_SLOT_NIBBLE = [MARLIN_PACK_ORDER.index(v) for v in range(8)]


# --------------------------------------------------------------------------- weights


def marlin_weight_location(k: int, n: int, size_n: int) -> Tuple[int, int, int]:
    """Where weight (k, n) of a [K, size_n] matrix sits in its Marlin repack [K / 16, 2 size_n]:
    (row, word column, nibble). The repack kernel's thread mapping, one element at a time."""
    tile = n // TILE_N
    col_in_tile = n % TILE_N
    subtile, col_in_subtile = divmod(col_in_tile, 16)  # w, then g + 8 (v // 4)
    g, upper_half = col_in_subtile % 8, col_in_subtile // 8
    k_in_tile = k % TILE_K
    t = (k_in_tile % 8) // 2
    slot = SLOT_ROW_OFFSETS.index(k_in_tile - 2 * t) + 4 * upper_half
    lane = 4 * g + t
    word = tile * WORDS_PER_TILE + lane * 4 + subtile
    return k // TILE_K, word, _SLOT_NIBBLE[slot]


def _check_tiles(size_k: int, size_n: int) -> None:
    if size_k % TILE_K or size_n % TILE_N:
        raise ValueError(f"Marlin tiles are {TILE_K} x {TILE_N}: got K = {size_k}, N = {size_n}")


def repack_values(values: torch.Tensor) -> torch.Tensor:
    """Logical int4 values [E, K, N] (row k, column n) -> Marlin words [E, K / 16, 2 N] int32,
    what ``awq_marlin_repack`` / ``gptq_marlin_repack`` write (for 16-bit activations)."""
    experts, size_k, size_n = values.shape
    _check_tiles(size_k, size_n)
    # k = 16 kt + 8 kh + 2 t + kl, n = 64 nt + 16 w + 8 hi + g; slot v = 4 hi + 2 kh + kl
    v = values.reshape(experts, size_k // TILE_K, 2, 4, 2, size_n // TILE_N, 4, 2, 8)
    #                   0        1                2  3  4  5                 6  7  8
    v = v.permute(0, 1, 5, 8, 3, 6, 7, 2, 4)  # [E, kt, nt, g, t, w, hi, kh, kl]
    v = v.reshape(experts, size_k // TILE_K, size_n // TILE_N, 32, 4, 8)  # [.., lane, w, slot]
    words = _pack_nibbles(v[..., _PACK_ORDER])  # nibble m <- slot MARLIN_PACK_ORDER[m]
    return words.reshape(experts, size_k // TILE_K, 2 * size_n)


def unpack_values(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`repack_values`: Marlin words [E, K / 16, 2 N] -> uint8 [E, K, N]."""
    experts, k_tiles, width = words.shape
    size_k, size_n = k_tiles * TILE_K, width // 2
    _check_tiles(size_k, size_n)
    nibbles = _unpack_nibbles(words.reshape(experts, k_tiles, size_n // TILE_N, 32, 4))
    slots = nibbles[..., _SLOT_NIBBLE]  # slot v <- nibble _SLOT_NIBBLE[v]
    v = slots.reshape(experts, k_tiles, size_n // TILE_N, 8, 4, 4, 2, 2, 2)  # [.., g, t, w, hi, kh, kl]
    v = v.permute(0, 1, 7, 4, 8, 2, 5, 6, 3)  # [E, kt, kh, t, kl, nt, w, hi, g]
    return v.reshape(experts, size_k, size_n).contiguous()


# --------------------------------------------------------------------------- scales and zeros


def permute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """[E, groups, N] in column order -> vLLM's ``marlin_moe_permute_scales`` order.

    grouped: in every 64 columns, column i + 8 j (i, j < 8) goes to 8 i + j, so a lane's
    16-byte load holds the 8 columns g + 8 j its fragments cover. Channelwise: in every 32,
    column 8 a + 2 i + b (a, i < 4, b < 2) goes to 8 i + 2 a + b.
    """
    experts, groups, size_n = scales.shape
    if grouped:
        s = scales.reshape(experts, groups, size_n // 64, 8, 8)  # [.., j, i]
        return s.transpose(-1, -2).reshape(experts, groups, size_n).contiguous()
    s = scales.reshape(experts, groups, size_n // 32, 4, 4, 2)  # [.., a, i, b]
    return s.permute(0, 1, 2, 4, 3, 5).reshape(experts, groups, size_n).contiguous()


def unpermute_scales(scales: torch.Tensor, grouped: bool) -> torch.Tensor:
    """Inverse of :func:`permute_scales`, which is its own inverse: both orders transpose square
    blocks (8 x 8 grouped, 4 x 4 channelwise)."""
    return permute_scales(scales, grouped)


def pack_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """Logical zero points [E, groups, N] -> Marlin's packed [E, groups, N / 8] int32: the
    grouped scale order, then nibble m of word q = 8 c + i holds column 64 c + i + 8 P[m],
    P = MARLIN_PACK_ORDER (always grouped: zero points take part in every mma)."""
    experts, groups, size_n = zeros.shape
    permuted = permute_scales(zeros, grouped=True).reshape(experts, groups, size_n // 8, 8)
    return _pack_nibbles(permuted[..., _PACK_ORDER])


def unpack_zeros(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_zeros`: [E, groups, N / 8] int32 -> uint8 [E, groups, N]."""
    experts, groups, width = words.shape
    permuted = _unpack_nibbles(words)[..., _SLOT_NIBBLE].reshape(experts, groups, width * 8)
    return unpermute_scales(permuted, grouped=True)


# --------------------------------------------------------------------------- a layer


@dataclass(frozen=True)
class MarlinMoeWeights:
    """One MoE layer's expert weights as vLLM's MARLIN backend holds them (module docstring)."""

    w13_qweight: torch.Tensor
    w13_scales: torch.Tensor
    w13_qzeros: torch.Tensor
    w2_qweight: torch.Tensor
    w2_scales: torch.Tensor
    w2_qzeros: torch.Tensor
    group_size: int
    intermediate_size: int  # the layer's own N, before padding
    scales_grouped: bool  # which order both scale tensors are in (vllm_scales_grouped)

    @property
    def num_experts(self) -> int:
        return self.w13_qweight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_qweight.shape[1] * TILE_K

    @property
    def padded_intermediate_size(self) -> int:
        return self.w2_qweight.shape[1] * TILE_K

    def tensors(self) -> tuple:
        return (self.w13_qweight, self.w13_scales, self.w13_qzeros, self.w2_qweight, self.w2_scales, self.w2_qzeros)


def pad_intermediate(weights: AwqMoeWeights, padded_size: int) -> AwqMoeWeights:
    """The AWQ layer with N zero-padded to ``padded_size``, as vLLM pads it before the repack:
    gate and up columns each padded on their own, W2 rows; padded scales are 0."""
    n, g = weights.intermediate_size, weights.group_size
    if padded_size == n:
        return weights
    if padded_size < n or padded_size % PACK_FACTOR or padded_size % g:
        raise ValueError(f"cannot pad N = {n} to {padded_size} (needs a multiple of 8 and of G = {g})")

    def gate_up(t: torch.Tensor, unit: int, padded_unit: int) -> torch.Tensor:
        e, rows, _ = t.shape
        halves = t.reshape(e, rows, 2, unit)
        return torch.nn.functional.pad(halves, (0, padded_unit - unit)).reshape(e, rows, 2 * padded_unit)

    def rows(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, padded_rows - t.shape[1]))

    return AwqMoeWeights(
        w13_qweight=gate_up(weights.w13_qweight, n // PACK_FACTOR, padded_size // PACK_FACTOR),
        w13_scales=gate_up(weights.w13_scales, n, padded_size),
        w13_qzeros=gate_up(weights.w13_qzeros, n // PACK_FACTOR, padded_size // PACK_FACTOR),
        w2_qweight=rows(weights.w2_qweight, padded_size),
        w2_scales=rows(weights.w2_scales, padded_size // g),
        w2_qzeros=rows(weights.w2_qzeros, padded_size // g),
        group_size=g,
    )


def awq_to_marlin(weights: AwqMoeWeights) -> MarlinMoeWeights:
    """The tensors vLLM's MARLIN backend makes of this AutoAWQ layer, bit for bit."""
    n, g, k = weights.intermediate_size, weights.group_size, weights.hidden_size
    if g not in MARLIN_GROUP_SIZES:
        raise ValueError(f"Marlin takes AWQ group sizes {MARLIN_GROUP_SIZES}, got {g}")
    if k % TILE_N or k % g or n % g:
        raise ValueError(f"hidden size {k} must be a multiple of {TILE_N} and of G = {g}; N = {n} of G")
    padded = pad_intermediate(weights, marlin_padded_intermediate(n, g))
    grouped = vllm_scales_grouped(g, n)
    return MarlinMoeWeights(
        w13_qweight=repack_values(unpack_int4(padded.w13_qweight)),
        w13_scales=permute_scales(padded.w13_scales, grouped),
        w13_qzeros=pack_zeros(unpack_int4(padded.w13_qzeros)),
        w2_qweight=repack_values(unpack_int4(padded.w2_qweight)),
        w2_scales=permute_scales(padded.w2_scales, grouped),
        w2_qzeros=pack_zeros(unpack_int4(padded.w2_qzeros)),
        group_size=g,
        intermediate_size=n,
        scales_grouped=grouped,
    )


def marlin_to_awq(weights: MarlinMoeWeights) -> AwqMoeWeights:
    """The AutoAWQ layer back from Marlin's tensors (padding dropped): the exact inverse of
    :func:`awq_to_marlin`, so the layout loses nothing."""
    n, n_p, g = weights.intermediate_size, weights.padded_intermediate_size, weights.group_size

    def gate_up(t: torch.Tensor, unit: int, padded_unit: int) -> torch.Tensor:
        return torch.cat([t[..., :unit], t[..., padded_unit : padded_unit + unit]], dim=-1).contiguous()

    w13_q = unpack_values(weights.w13_qweight)
    w13_z = unpack_zeros(weights.w13_qzeros)
    w13_s = unpermute_scales(weights.w13_scales, weights.scales_grouped)
    return AwqMoeWeights(
        w13_qweight=pack_int4(gate_up(w13_q, n, n_p)),
        w13_scales=gate_up(w13_s, n, n_p),
        w13_qzeros=pack_int4(gate_up(w13_z, n, n_p)),
        w2_qweight=pack_int4(unpack_values(weights.w2_qweight)[:, :n]),
        w2_scales=unpermute_scales(weights.w2_scales, weights.scales_grouped)[:, : n // g].contiguous(),
        w2_qzeros=pack_int4(unpack_zeros(weights.w2_qzeros)[:, : n // g]),
        group_size=g,
    )


def _dequantize(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int) -> torch.Tensor:
    z = zeros.to(torch.float32).repeat_interleave(group_size, dim=-2)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-2)
    return (values.to(torch.float32) - z) * s


def dequantize_marlin(weights: MarlinMoeWeights, keep_padding: bool = False):
    """float32 (W13 [E, K, 2N], W2 [E, N, K]) straight from Marlin's tensors, w = (q - z) * s.

    ``keep_padding`` keeps vLLM's padded columns and rows (N_p instead of N; they are 0).
    """
    g = weights.group_size
    w13 = _dequantize(
        unpack_values(weights.w13_qweight),
        unpermute_scales(weights.w13_scales, weights.scales_grouped),
        unpack_zeros(weights.w13_qzeros),
        g,
    )
    w2 = _dequantize(
        unpack_values(weights.w2_qweight),
        unpermute_scales(weights.w2_scales, weights.scales_grouped),
        unpack_zeros(weights.w2_qzeros),
        g,
    )
    if keep_padding:
        return w13, w2
    n, n_p = weights.intermediate_size, weights.padded_intermediate_size
    w13 = torch.cat([w13[..., :n], w13[..., n_p : n_p + n]], dim=-1)
    return w13, w2[:, :n].contiguous()


def layer_bytes(num_experts: int, hidden_size: int, intermediate_size: int, group_size: int,
                scale_bytes: int = 2) -> int:
    """Bytes of a layer's six tensors at this N (int4 weights and zeros, 16-bit scales): the
    AutoAWQ layout at the layer's N, the Marlin one at its padded N_p."""
    k, n, g = hidden_size, intermediate_size, group_size
    per_expert = 3 * k * n // 2 + 3 * (k * n // g) * scale_bytes + 3 * (k * n // g) // 2
    return num_experts * per_expert
