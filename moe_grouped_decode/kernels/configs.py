"""Launch configurations: defaults per shape, the qwen3.8-tp4 table, and the autotune cache.

A config only changes tiling, never results across runs: the grouped op's
summation order depends on every field (tile shapes and warps place the
reductions), so one shape and token count always use one config, and the
position-independence of a token's bits holds within it.

Tuned configs (``VLLM_AWQ_MOE_GROUPED_DECODE_TUNE=1``, searched at warmup by
``ops.cuda.warmup``) are cached as JSON under ``~/.cache/moe_grouped_decode``
(or ``$MOE_GROUPED_DECODE_CACHE``), one file per GPU name and Triton version,
keyed by shape and token count.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Tuple


@dataclass(frozen=True)
class GroupedConfig:
    w13_block_k: int = 256  # W13: K rows per program (whole groups, a power of two of them); K / this = splits
    w13_block_n: int = 64  # W13: output columns per program (8 per packed int32; a power of two of int32s)
    w13_warps: int = 1
    w2_block_k: int = 128  # W2: output columns per program (8 per packed int32; a power of two of int32s)
    w2_warps: int = 1
    fused_combine: bool = True  # the combine inside the W2 launch (last-arriving program per token tile)
    pdl: bool = True  # programmatic dependent launch between the op's launches (used on Hopper and newer)

    def w13_splits(self, hidden_size: int, group_size: int) -> int:
        """W13 programs per (row, column tile) along K: the partial sums the W2 kernel adds in order."""
        groups_per_split = self.w13_block_k // group_size
        return -(-(hidden_size // group_size) // groups_per_split)

    def fitted(self, group_size: int, hidden_size: int) -> "GroupedConfig":
        """Round the tiles to power-of-two group and int32 counts, growing W13's K tile until
        its splits fit the workspace's partials region (MAX_SPLIT_K)."""
        groups = _pow2_at_most(max(1, self.w13_block_k // group_size))
        while -(-(hidden_size // group_size) // groups) > MAX_SPLIT_K:
            groups *= 2
        return dataclasses.replace(
            self,
            w13_block_k=groups * group_size,
            w13_block_n=8 * _pow2_at_most(max(1, self.w13_block_n // 8)),
            w2_block_k=8 * _pow2_at_most(max(1, self.w2_block_k // 8)),
        )


def _pow2_at_most(n: int) -> int:
    return 1 << (n.bit_length() - 1)


@dataclass(frozen=True)
class DenseConfig:
    block_m: int = 64  # rows per padded expert block
    w13_block_n: int = 64  # gate (and up) columns per program
    block_k: int = 32  # K per tl.dot; must divide G
    w2_block_k: int = 64  # W2 output columns per program
    w2_block_n: int = 32  # intermediate rows per tl.dot; must divide G
    num_warps: int = 4
    num_stages: int = 3

    def fitted(self, group_size: int) -> "DenseConfig":
        return dataclasses.replace(
            self,
            block_k=max(16, math.gcd(self.block_k, group_size)),
            w2_block_n=max(16, math.gcd(self.w2_block_n, group_size)),
        )


# Most W13 K-splits the workspace's partials region holds (ops/workspace.py sizes it).
MAX_SPLIT_K = 32

# (E, k, K, N, G) of the qwen3.8-tp4 contract.
QWEN38_TP4_SHAPE = (512, 10, 2560, 160, 32)

# Sweep winners on H200, fp16 (docs/PERF.md v4, `bench --sweep 2,8`: the default won at both
# M = 2 and M = 8, so M = 4 takes it too); keyed by token count M.
_QWEN38_TP4_GROUPED: Dict[int, GroupedConfig] = {
    2: GroupedConfig(),
    4: GroupedConfig(),
    8: GroupedConfig(),
}


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_GROUPED_DECODE_CACHE", Path.home() / ".cache" / "moe_grouped_decode"))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def cache_path(gpu_name: str, triton_version: str) -> Path:
    return _cache_dir() / f"grouped_{_safe(gpu_name)}_triton{_safe(triton_version)}.json"


def shape_key(shape: Tuple[int, int, int, int, int], dtype_name: str, num_tokens: int) -> str:
    E, k, K, N, G = shape
    return f"E{E}_k{k}_K{K}_N{N}_G{G}_{dtype_name}_M{num_tokens}"


_tuned: Dict[str, GroupedConfig] = {}
_loaded_files: set = set()


def load_tuned(path: Path) -> None:
    """Read a tuning cache file into memory (missing or corrupt files are ignored)."""
    if path in _loaded_files:
        return
    _loaded_files.add(path)
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        return
    for key, fields in entries.items():
        try:
            _tuned[key] = GroupedConfig(**fields)
        except TypeError:
            continue  # written by another version of this file


def store_tuned(path: Path, key: str, config: GroupedConfig) -> None:
    _tuned[key] = config
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError):
        entries = {}
    entries[key] = dataclasses.asdict(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=1, sort_keys=True))
    tmp.replace(path)


def grouped_config(shape: Tuple[int, int, int, int, int], dtype_name: str, num_tokens: int) -> GroupedConfig:
    """The launch config for one shape and token count: tuned, then table, then default."""
    tuned = _tuned.get(shape_key(shape, dtype_name, num_tokens))
    if tuned is not None:
        config = tuned
    elif shape == QWEN38_TP4_SHAPE and num_tokens in _QWEN38_TP4_GROUPED:
        config = _QWEN38_TP4_GROUPED[num_tokens]
    else:
        config = GroupedConfig()
    return config.fitted(shape[4], shape[2])


def dense_config(shape: Tuple[int, int, int, int, int], num_tokens: int) -> DenseConfig:
    """Padded expert blocks sized to the expected rows per active expert."""
    E, k = shape[0], shape[1]
    rows_per_expert = num_tokens * k / E
    if rows_per_expert <= 16:
        config = DenseConfig(block_m=16, w13_block_n=64, w2_block_k=128, num_warps=4)
    elif rows_per_expert <= 48:
        config = DenseConfig(block_m=32, w13_block_n=64, w2_block_k=128, num_warps=4)
    else:
        config = DenseConfig(block_m=64, w13_block_n=64, w2_block_k=128, num_warps=8)
    return config.fitted(shape[4])


def grouped_candidates() -> Tuple[GroupedConfig, ...]:
    """The small search space of the opt-in autotune (and of `bench --sweep`)."""
    return tuple(
        GroupedConfig(w13_block_k=w13_block_k, w13_warps=w13_warps, w2_block_k=w2_block_k, w2_warps=w2_warps)
        for w13_block_k, w13_warps in ((256, 1), (128, 1))
        for w2_block_k, w2_warps in ((128, 1), (64, 1), (128, 2), (256, 2))
    )


def tuned_config(shape, dtype_name: str, num_tokens: int) -> Optional[GroupedConfig]:
    return _tuned.get(shape_key(shape, dtype_name, num_tokens))
