"""AWQ int4 "GEMM" format: packing, (de)quantization, TP slicing, synthetic checkpoints.

The layout is exactly what vLLM's AWQ MoE methods create (no repack):

    w13_qweight [E, K, 2N/8] int32     w2_qweight [E, N, K/8] int32
    w13_scales  [E, K/G, 2N] fp16/bf16 w2_scales  [E, N/G, K] fp16/bf16
    w13_qzeros  [E, K/G, 2N/8] int32   w2_qzeros  [E, N/G, K/8] int32

Rows are the GEMM's input dimension, columns its output; W13 columns are gate
(N) then up (N). Eight 4-bit values share one int32 along the columns in
AutoAWQ's interleave: nibble i (bits 4i..4i+3) holds column ``AWQ_PACK_ORDER[i]``.
Dequantization is ``w = (q - z) * s`` with one (s, z) per G rows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional

import torch

# nibble i of an int32 holds logical column AWQ_PACK_ORDER[i] of its 8-column block
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# logical column c of a block sits at nibble AWQ_COLUMN_NIBBLE[c]
AWQ_COLUMN_NIBBLE = (0, 4, 1, 5, 2, 6, 3, 7)
PACK_FACTOR = 8


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack integers in [0, 15] along the last dim, 8 per int32, in AWQ order."""
    if values.shape[-1] % PACK_FACTOR:
        raise ValueError(f"last dim must be a multiple of 8 to pack int4, got {values.shape[-1]}")
    if values.numel() and (int(values.min()) < 0 or int(values.max()) > 15):
        raise ValueError("int4 values must lie in [0, 15]")
    blocks = values.to(torch.int64).reshape(*values.shape[:-1], -1, PACK_FACTOR)
    packed = torch.zeros(blocks.shape[:-1], dtype=torch.int64, device=values.device)
    for nibble, column in enumerate(AWQ_PACK_ORDER):
        packed |= blocks[..., column] << (4 * nibble)
    # reinterpret the low 32 bits as a signed int32 (bit 31 set -> negative)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [..., C/8] -> uint8 [..., C] in [0, 15]."""
    if packed.dtype != torch.int32:
        raise TypeError(f"packed int4 tensors are int32, got {packed.dtype}")
    shifts = torch.tensor([4 * n for n in AWQ_COLUMN_NIBBLE], dtype=torch.int32, device=packed.device)
    values = (packed.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(*packed.shape[:-1], -1).to(torch.uint8)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, group_size: int) -> torch.Tensor:
    """[..., rows, cols/8] int4 + per-group scales/zeros -> float32 [..., rows, cols]."""
    q = unpack_int4(qweight).to(torch.float32)
    z = unpack_int4(qzeros).to(torch.float32).repeat_interleave(group_size, dim=-2)
    s = scales.to(torch.float32).repeat_interleave(group_size, dim=-2)
    if q.shape != z.shape:
        raise ValueError(f"qweight {tuple(q.shape)} and group-expanded qzeros {tuple(z.shape)} disagree")
    return (q - z) * s


def quantize(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype = torch.float16):
    """Asymmetric 4-bit quantization per group of ``group_size`` rows (AutoAWQ's rule).

    weight: float [..., rows, cols] -> (qweight [..., rows, cols/8] int32,
    scales [..., rows/G, cols] scale_dtype, qzeros [..., rows/G, cols/8] int32).
    """
    *lead, rows, cols = weight.shape
    if rows % group_size:
        raise ValueError(f"rows={rows} must be a multiple of group_size={group_size}")
    grouped = weight.to(torch.float32).reshape(*lead, rows // group_size, group_size, cols)
    w_min = grouped.amin(dim=-2)
    w_max = grouped.amax(dim=-2)
    scales = ((w_max - w_min).clamp(min=1e-5) / 15).to(scale_dtype)
    s = scales.to(torch.float32)
    zeros = (-w_min / s).round().clamp(0, 15)
    q = (grouped / s.unsqueeze(-2)).round() + zeros.unsqueeze(-2)
    q = q.clamp(0, 15).reshape(*lead, rows, cols)
    return pack_int4(q), scales, pack_int4(zeros)


@dataclass(frozen=True)
class AwqMoeWeights:
    """One MoE layer's expert weights in vLLM's AWQ layout (see module docstring)."""

    w13_qweight: torch.Tensor
    w13_scales: torch.Tensor
    w13_qzeros: torch.Tensor
    w2_qweight: torch.Tensor
    w2_scales: torch.Tensor
    w2_qzeros: torch.Tensor
    group_size: int

    def __post_init__(self):
        # a bool is an int to Python, and True would pass as G = 1; a SymInt is a traced int
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, (int, torch.SymInt)):
            raise ValueError(f"group_size must be an int (the AWQ group size, e.g. 32 or 128), got {self.group_size!r}")

    @property
    def num_experts(self) -> int:
        return self.w13_qweight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13_qweight.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2_qweight.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.w13_scales.dtype

    def tensors(self) -> tuple:
        """The six tensors in the ops' argument order."""
        return (self.w13_qweight, self.w13_scales, self.w13_qzeros, self.w2_qweight, self.w2_scales, self.w2_qzeros)

    def op_args(self) -> tuple:
        """The six tensors and group_size, as the ops take them after the routing."""
        return (*self.tensors(), self.group_size)

    def to(self, device=None, dtype: Optional[torch.dtype] = None) -> "AwqMoeWeights":
        """Move to ``device``; ``dtype`` recasts the scales only (packed ints stay int32)."""
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor):
                value = value.to(device=device, dtype=dtype if value.is_floating_point() and dtype else None)
            moved[f.name] = value
        return AwqMoeWeights(**moved)

    def dequantized_expert(self, expert: int):
        """float32 (W13 [K, 2N], W2 [N, K]) of one expert."""
        w13 = dequantize(self.w13_qweight[expert], self.w13_scales[expert], self.w13_qzeros[expert], self.group_size)
        w2 = dequantize(self.w2_qweight[expert], self.w2_scales[expert], self.w2_qzeros[expert], self.group_size)
        return w13, w2


def slice_tp(full: AwqMoeWeights, rank: int, world_size: int) -> AwqMoeWeights:
    """Rank ``rank``'s shard of a full checkpoint under tensor parallelism.

    Gate and up are each split by columns and re-concatenated (gate|up); W2 is
    split by rows. Rows of W13 (the hidden size) stay whole. Works on the packed
    tensors directly, so the shard's N must be a multiple of 8 and of G.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    full_n = full.intermediate_size
    if full_n % world_size:
        raise ValueError(f"intermediate size {full_n} is not divisible by world_size={world_size}")
    n = full_n // world_size
    if n % PACK_FACTOR or n % full.group_size:
        raise ValueError(f"shard intermediate size {n} must be a multiple of 8 and of group_size={full.group_size}")

    def gate_up_columns(t: torch.Tensor, per_int: int) -> torch.Tensor:
        width = n // per_int
        half = full_n // per_int
        lo = rank * width
        return torch.cat([t[..., lo : lo + width], t[..., half + lo : half + lo + width]], dim=-1).contiguous()

    rows = slice(rank * n, (rank + 1) * n)
    groups = slice(rank * n // full.group_size, (rank + 1) * n // full.group_size)
    return AwqMoeWeights(
        w13_qweight=gate_up_columns(full.w13_qweight, PACK_FACTOR),
        w13_scales=gate_up_columns(full.w13_scales, 1),
        w13_qzeros=gate_up_columns(full.w13_qzeros, PACK_FACTOR),
        w2_qweight=full.w2_qweight[:, rows].contiguous(),
        w2_scales=full.w2_scales[:, groups].contiguous(),
        w2_qzeros=full.w2_qzeros[:, groups].contiguous(),
        group_size=full.group_size,
    )


def slice_ep(full: AwqMoeWeights, expert_map: torch.Tensor) -> AwqMoeWeights:
    """The experts one rank holds under expert parallelism, at their local ids, as vLLM's loader
    places them: ``expert_map[g]`` is global expert g's local id there, or -1 (another rank's)."""
    held = sorted((local, g) for g, local in enumerate(expert_map.tolist()) if local >= 0)
    index = torch.tensor([g for _, g in held])
    return AwqMoeWeights(*(t[index].clone() for t in full.tensors()), full.group_size)


def _random_packed(generator: torch.Generator, shape) -> torch.Tensor:
    """Uniform random int4 nibbles, packed: random bytes reinterpreted as int32."""
    *lead, packed_cols = shape
    raw = torch.randint(
        0, 256, (*lead, packed_cols * 4), dtype=torch.uint8, generator=generator, device=generator.device
    )
    return raw.view(torch.int32)


def _random_zeros(generator: torch.Generator, shape) -> torch.Tensor:
    # Real AWQ zero points cluster mid-range; 5..10 keeps (q - z) roughly centred.
    return pack_int4(torch.randint(5, 11, shape, generator=generator, device=generator.device))


def _random_scales(generator: torch.Generator, shape, rows: int, dtype: torch.dtype) -> torch.Tensor:
    # uniform int4 has std ~4.6; this base gives each GEMM output ~unit variance for
    # unit-variance inputs, and the log-normal spread mimics per-group variation.
    base = 1.0 / (4.6 * rows**0.5)
    noise = torch.randn(shape, generator=generator, device=generator.device)
    return (base * torch.exp(0.25 * noise)).to(dtype)


def synthetic_moe_weights(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    group_size: int,
    dtype: torch.dtype = torch.float16,
    seed: int = 0,
    device="cpu",
) -> AwqMoeWeights:
    """A deterministic random AWQ MoE layer for any shape.

    ``intermediate_size`` is the layer's own N (a full checkpoint's, or a shard's).
    On the CPU the same seed gives the same bits on every machine; ``device``
    generates in place (fast for benchmarks), deterministic per device type.
    """
    E, K, N, G = num_experts, hidden_size, intermediate_size, group_size
    for what, size in (("hidden_size", K), ("intermediate_size", N)):
        if size % G or size % PACK_FACTOR:
            raise ValueError(f"{what}={size} must be a multiple of group_size={G} and of 8")
    gen = torch.Generator(device=device).manual_seed(seed)
    return AwqMoeWeights(
        w13_qweight=_random_packed(gen, (E, K, 2 * N // 8)),
        w13_scales=_random_scales(gen, (E, K // G, 2 * N), K, dtype),
        w13_qzeros=_random_zeros(gen, (E, K // G, 2 * N)),
        w2_qweight=_random_packed(gen, (E, N, K // 8)),
        w2_scales=_random_scales(gen, (E, N // G, K), N, dtype),
        w2_qzeros=_random_zeros(gen, (E, N // G, K)),
        group_size=G,
    )


def synthetic_for_contract(contract, dtype: torch.dtype = torch.float16, seed: int = 0, device="cpu") -> AwqMoeWeights:
    """A synthetic layer with a contract's (per-rank) shapes."""
    return synthetic_moe_weights(
        contract.num_experts, contract.hidden_size, contract.intermediate_size, contract.group_size, dtype, seed, device
    )


HUB_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def to_hub_expert_tensors(weights: AwqMoeWeights, prefix: str) -> Dict[str, torch.Tensor]:
    """Per-expert tensors with Hugging Face AutoAWQ names, as vLLM loads them.

    ``prefix`` is the MoE module's name, e.g. ``model.layers.0.mlp``; the result
    holds ``{prefix}.experts.{e}.{gate,up,down}_proj.{qweight,scales,qzeros}``.
    Pass the full (unsharded) layer: vLLM slices it per rank when loading.
    """
    n_packed = weights.intermediate_size // PACK_FACTOR
    n = weights.intermediate_size
    out: Dict[str, torch.Tensor] = {}
    for e in range(weights.num_experts):
        parts = {
            "gate_proj": (
                weights.w13_qweight[e, :, :n_packed],
                weights.w13_scales[e, :, :n],
                weights.w13_qzeros[e, :, :n_packed],
            ),
            "up_proj": (
                weights.w13_qweight[e, :, n_packed:],
                weights.w13_scales[e, :, n:],
                weights.w13_qzeros[e, :, n_packed:],
            ),
            "down_proj": (weights.w2_qweight[e], weights.w2_scales[e], weights.w2_qzeros[e]),
        }
        for proj, (qweight, scales, qzeros) in parts.items():
            base = f"{prefix}.experts.{e}.{proj}"
            out[f"{base}.qweight"] = qweight.contiguous()
            out[f"{base}.scales"] = scales.contiguous()
            out[f"{base}.qzeros"] = qzeros.contiguous()
    return out



def regroup(weights: AwqMoeWeights, group_size: int) -> AwqMoeWeights:
    """The same layer at a smaller effective group size (e.g. a g128 checkpoint as g32).

    Each scale/zero group is repeated ``weights.group_size // group_size`` times
    along the rows, so dequantized values are unchanged; only the (small) scale and
    zero tensors grow. Lets a g128 checkpoint take a g32 contract's kernels.
    """
    if group_size <= 0 or weights.group_size % group_size:
        raise ValueError(f"group_size={group_size} must divide the checkpoint's group size {weights.group_size}")
    factor = weights.group_size // group_size

    def repeat(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(factor, dim=-2).contiguous()

    return AwqMoeWeights(
        w13_qweight=weights.w13_qweight,
        w13_scales=repeat(weights.w13_scales),
        w13_qzeros=repeat(weights.w13_qzeros),
        w2_qweight=weights.w2_qweight,
        w2_scales=repeat(weights.w2_scales),
        w2_qzeros=repeat(weights.w2_qzeros),
        group_size=group_size,
    )
