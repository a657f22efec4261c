"""vLLM's Humming MoE layout of AWQ int4 expert weights, in plain PyTorch (CPU-testable).

vLLM 0.32+ picks its HUMMING MoE backend for AutoAWQ layers on compute capability 9.0
(``convert_to_humming_moe_kernel_format`` in ``quantization/utils/humming/moe.py``, the same in
0.34 with humming-kernels 0.1.17 and 0.1.19; ``docs/notebook/humming_layout_study.md``). For
16-bit activations its tensors are Marlin's (``marlin_layout``) but for three things:

1. Padding at the ends only: W13's [K, 2N] (columns ``[gate N | up N]``, not padded each on its
   own) to ``N13 = round_up(2N, 256)`` columns and ``Kp = round_up(K, 128)`` rows; W2's [N, K]
   to ``Np = round_up(N, 128)`` rows and ``K2 = round_up(K, 256)`` columns. Padded weights,
   scales and zero points are 0.
2. Scales always in Marlin's grouped order (no channelwise variant).
3. Zero points in the grouped order, packed 8 a word in plain nibble order: nibble m of word
   ``8 c + i`` holds column ``64 c + i + 8 m`` (Marlin's takes ``MARLIN_PACK_ORDER``).

Weights are Marlin's words exactly (``marlin_layout.repack_values``). Shapes::

    w13_weight [E, Kp / 16, 2 N13] int32   w13_weight_scale [E, Kp / G, N13]   w13_zero_point [E, Kp / G, N13 / 8]
    w2_weight  [E, Np / 16, 2 K2] int32    w2_weight_scale  [E, Np / G, K2]    w2_zero_point  [E, Np / G, K2 / 8]

This is the reference the plugin's kernel over Humming's tensors is checked against; the
bit-equality with humming's own CUDA repack is checked on a GPU, not here. A layer vLLM loaded for
Humming is read as this layout only where :func:`loaded_layer_refusal` finds nothing against it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from .awq import AwqMoeWeights, pack_int4, unpack_int4
from .marlin_layout import (TILE_K, _dequantize, _pack_nibbles, _unpack_nibbles, permute_scales, repack_values,
                            unpack_values, unpermute_scales)

# humming's ``prepare_and_transform_humming_tensors`` as vLLM calls it for MoE layers: each
# sublayer's output columns padded to a multiple of 256, its reduction rows to one of 128
HUMMING_PAD_N = 256
HUMMING_PAD_K = 128


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def humming_padded_sizes(hidden_size: int, intermediate_size: int) -> Tuple[int, int, int, int]:
    """(W13's stored rows, its stored columns, W2's stored rows, its stored columns) for a layer
    of K = ``hidden_size``, N = ``intermediate_size``: [K, 2N] and [N, K] padded at their ends."""
    k, n = hidden_size, intermediate_size
    return (_round_up(k, HUMMING_PAD_K), _round_up(2 * n, HUMMING_PAD_N), _round_up(n, HUMMING_PAD_K),
            _round_up(k, HUMMING_PAD_N))


def humming_tensor_shapes(num_experts: int, hidden_size: int, intermediate_size: int, group_size: int) -> dict:
    """The six tensors' names, as vLLM's Humming load step registers them, and their shapes (the
    module docstring's), in the order ``HummingMoeWeights.tensors`` gives them."""
    E, G = num_experts, group_size
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(hidden_size, intermediate_size)
    return {"w13_weight": (E, k_rows // 16, 2 * w13_columns), "w13_weight_scale": (E, k_rows // G, w13_columns),
            "w13_zero_point": (E, k_rows // G, w13_columns // 8), "w2_weight": (E, n_rows // 16, 2 * w2_columns),
            "w2_weight_scale": (E, n_rows // G, w2_columns), "w2_zero_point": (E, n_rows // G, w2_columns // 8)}


def pack_plain_zeros(zeros: torch.Tensor) -> torch.Tensor:
    """Logical zero points [E, groups, N] -> Humming's [E, groups, N / 8] int32: the grouped scale
    order, then nibble m of word 8 c + i holds column 64 c + i + 8 m."""
    experts, groups, size_n = zeros.shape
    return _pack_nibbles(permute_scales(zeros, grouped=True).reshape(experts, groups, size_n // 8, 8))


def unpack_plain_zeros(words: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_plain_zeros`: [E, groups, N / 8] int32 -> uint8 [E, groups, N]."""
    experts, groups, width = words.shape
    return unpermute_scales(_unpack_nibbles(words).reshape(experts, groups, width * 8), grouped=True)


@dataclass(frozen=True)
class HummingMoeWeights:
    """One MoE layer's expert weights as vLLM's HUMMING backend holds them (module docstring)."""

    w13_weight: torch.Tensor
    w13_weight_scale: torch.Tensor
    w13_zero_point: torch.Tensor
    w2_weight: torch.Tensor
    w2_weight_scale: torch.Tensor
    w2_zero_point: torch.Tensor
    group_size: int
    hidden_size: int  # the layer's own K and N, before padding
    intermediate_size: int

    def tensors(self) -> tuple:
        return (self.w13_weight, self.w13_weight_scale, self.w13_zero_point, self.w2_weight, self.w2_weight_scale,
                self.w2_zero_point)


def _pad(t: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """[E, r, c] zero-padded at the ends to [E, rows, columns]."""
    return torch.nn.functional.pad(t, (0, columns - t.shape[2], 0, rows - t.shape[1]))


def _sublayer(values: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, padded_rows: int,
              padded_columns: int):
    """One [E, rows, columns] matrix's logical values, scales and zeros -> Humming's three tensors."""
    groups = padded_rows // group_size
    return (repack_values(_pad(values, padded_rows, padded_columns)),
            permute_scales(_pad(scales, groups, padded_columns), grouped=True),
            pack_plain_zeros(_pad(zeros, groups, padded_columns)))


def awq_to_humming(weights: AwqMoeWeights) -> HummingMoeWeights:
    """The tensors vLLM's HUMMING backend makes of this AutoAWQ layer (16-bit activations)."""
    k, n, g = weights.hidden_size, weights.intermediate_size, weights.group_size
    if k % TILE_K or k % g or n % g or HUMMING_PAD_K % g:
        raise ValueError(f"K = {k} must be a multiple of {TILE_K} and of G = {g}, N = {n} of G, and G divide "
                         f"{HUMMING_PAD_K}")
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(k, n)
    w13 = _sublayer(unpack_int4(weights.w13_qweight), weights.w13_scales, unpack_int4(weights.w13_qzeros), g,
                    k_rows, w13_columns)
    w2 = _sublayer(unpack_int4(weights.w2_qweight), weights.w2_scales, unpack_int4(weights.w2_qzeros), g, n_rows,
                   w2_columns)
    return HummingMoeWeights(*w13, *w2, group_size=g, hidden_size=k, intermediate_size=n)


def dequantize_humming(weights: HummingMoeWeights):
    """float32 (W13 [E, K, 2N], W2 [E, N, K]) straight from Humming's tensors, w = (q - z) * s,
    padding dropped."""
    k, n, g = weights.hidden_size, weights.intermediate_size, weights.group_size
    w13 = _dequantize(unpack_values(weights.w13_weight), unpermute_scales(weights.w13_weight_scale, grouped=True),
                      unpack_plain_zeros(weights.w13_zero_point), g)
    w2 = _dequantize(unpack_values(weights.w2_weight), unpermute_scales(weights.w2_weight_scale, grouped=True),
                     unpack_plain_zeros(weights.w2_zero_point), g)
    return w13[:, :k, : 2 * n].contiguous(), w2[:, :n, :k].contiguous()


def humming_to_awq(weights: HummingMoeWeights) -> AwqMoeWeights:
    """The AutoAWQ layer back from Humming's tensors (padding dropped): the exact inverse of
    :func:`awq_to_humming`."""
    k, n, g = weights.hidden_size, weights.intermediate_size, weights.group_size

    def back(words, scales, zeros, rows, columns):
        return (pack_int4(unpack_values(words)[:, :rows, :columns]),
                unpermute_scales(scales, grouped=True)[:, : rows // g, :columns].contiguous(),
                pack_int4(unpack_plain_zeros(zeros)[:, : rows // g, :columns]))

    w13 = back(weights.w13_weight, weights.w13_weight_scale, weights.w13_zero_point, k, 2 * n)
    w2 = back(weights.w2_weight, weights.w2_weight_scale, weights.w2_zero_point, n, k)
    return AwqMoeWeights(*w13, *w2, group_size=g)


# what each sublayer's humming LayerConfig must say for its tensors to be ``humming_layout``'s: an
# integer zero point, group scales, weights packed as the repack of 16-bit activations. humming
# fills its modes in when the config is made (None becomes an enum member whose value is "none"),
# so a mode is off where its value is "none"; a flag or mode the config lacks refuses
_HUMMING_OFF = ("is_fp_zero_point", "use_int_weight_scale", "use_fused_e8m0_scale", "use_packed_k_layout",
                "use_raw_weight", "use_flat_weight", "use_ldmatrix_dequant", "use_native_dequant", "has_bias",
                "has_input_scale", "has_input_scale_2", "weight_scale_2_type", "input_quant_mode")
_MISSING = object()


def _is_off(value) -> bool:
    """A LayerConfig mode (an enum member, "none" when off) or flag (off when falsy) that is off."""
    if isinstance(value, enum.Enum):
        return value.value == "none"
    return not value


def _config_refusal(name: str, config, sizes: tuple, G: int, dtype: torch.dtype) -> Optional[str]:
    found = tuple(getattr(config, f, None) for f in ("shape_n", "pad_shape_n", "shape_k", "pad_shape_k"))
    if found != sizes:
        return f"{name}'s (shape_n, pad_shape_n, shape_k, pad_shape_k) are {found}, the kernel reads {sizes}"
    if getattr(config, "has_zero_point", False) is not True or getattr(config, "weight_scale_group_size", None) != G:
        return f"{name} has no integer zero point or its scale groups are not G = {G}"
    scale_type = getattr(config, "weight_scale_type", None)
    if getattr(scale_type, "value", scale_type) != "group":
        return f"{name}'s scales are {scale_type}, not group scales"
    activations = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(dtype)
    if str(getattr(config, "b_dtype", None)) != "uint4" or str(getattr(config, "a_dtype", None)) != activations:
        return (f"{name} holds {getattr(config, 'b_dtype', None)} weights for {getattr(config, 'a_dtype', None)} "
                f"activations, the kernel reads uint4 for {activations}")
    missing = [f for f in _HUMMING_OFF if getattr(config, f, _MISSING) is _MISSING]
    if missing:
        return f"{name}'s humming config has no {', '.join(missing)}"
    on = [f"{f}={getattr(config, f)!r}" for f in _HUMMING_OFF if not _is_off(getattr(config, f))]
    if on:
        return f"{name}'s repack sets {', '.join(on)}"
    return None


def loaded_layer_refusal(layer, num_experts: int, hidden_size: int, intermediate_size: int, group_size: int,
                         dtype: torch.dtype) -> Optional[str]:
    """Why the tensors vLLM's Humming load step left on ``layer`` are not this module's layout of a
    layer of these sizes and activation dtype, or None: each sublayer's ``humming_configs`` entry
    (the padded and the layer's own sizes, the dtypes, scale kind and flags of the 16-bit AutoAWQ
    repack) and the six tensors' shapes and dtypes."""
    K, N, G = hidden_size, intermediate_size, group_size
    k_rows, w13_columns, n_rows, w2_columns = humming_padded_sizes(K, N)
    configs = getattr(layer, "humming_configs", None)
    if not isinstance(configs, dict) or set(configs) != {"w13", "w2"}:
        return "the layer holds no humming_configs for w13 and w2"
    sizes = {"w13": (w13_columns, w13_columns - 2 * N, k_rows, k_rows - K),
             "w2": (w2_columns, w2_columns - K, n_rows, n_rows - N)}
    for name, padded in sizes.items():
        why = _config_refusal(name, configs[name], padded, G, dtype)
        if why is not None:
            return why
    for name, size in humming_tensor_shapes(num_experts, K, N, G).items():
        wanted = dtype if name.endswith("_scale") else torch.int32
        tensor = getattr(layer, name, None)
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != size or tensor.dtype != wanted:
            found = None if not isinstance(tensor, torch.Tensor) else (tuple(tensor.shape), tensor.dtype)
            return f"{name} is {found}, the kernel reads {(size, wanted)}"
    return None
