"""Launch configurations: defaults per shape, the qwen3.8-tp4 table, and the autotune cache.

A config never changes results across runs: the grouped op's summation order
depends on every field (tile shapes and warps place the reductions), so one
shape and token count always use one config, and the position-independence of a
token's bits holds within it. One field also sets W2's precision
(``w2_act_split``); the autotune never varies it.

Tuned configs (``VLLM_AWQ_MOE_GROUPED_DECODE_TUNE=1``, searched at warmup by
``ops.cuda.warmup``) are cached as JSON under ``~/.cache/moe_grouped_decode``
(or ``$MOE_GROUPED_DECODE_CACHE``), one file per kernel version, GPU name and Triton version,
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
    w13_block_k: int = 256  # W13: K rows per program (one split); whole 32-row chunks for each warp
    w13_warps: int = 1  # W13: warps per program, each over its own chunks of the split
    w2_warps: int = 4  # W2: warps per program, 64 output columns each
    fused_combine: bool = True  # the combine inside the W2 launch (last-arriving program per token tile)
    pdl: bool = True  # programmatic dependent launch between the op's launches (used on Hopper and newer)
    w2_max_registers: int = 0  # W2: registers per thread the compiler may use (0: its own choice; Hopper+)
    # W13 as the Gluon kernel (w13_ring.py) with a shared-memory ring of this many 32-row chunks,
    # for 1-warp W13 programs where Gluon runs (grouped.uses_w13_ring); 0: the tl kernel. Same bits.
    w13_ring_stages: int = 4
    # W2 as the Gluon kernel (w2_ring.py: weights staged in shared memory, not registers) where
    # Gluon runs (grouped.uses_w2_ring); same bits as the tl W2 with RN_SCALE and the same w2_act_split
    w2_ring: bool = False
    # the Gluon W2's weight copies: issued this many 32-row chunks ahead of the chunk its mma works
    # on (>= 1; N / 32 or more: all before the PDL wait, v10's issue order, though each chunk is
    # still waited for on its own). 2 won at M = 8 (explorations run 54)
    w2_copy_ahead: int = 2
    # W2's float32 activations rounded to one 16-bit value, one mma per chunk (as vLLM's fused_moe
    # stores them between its GEMMs; since v12); True: as a 16-bit hi + lo pair, two mma per chunk
    # (exact to ~2^-22 of each value in fp16, ~2^-17 in bf16), 0.2-1.2 us slower at M = 2-8
    # (explorations runs 57-58). A change of its default must bump KERNELS_VERSION: tuned cache entries carry it
    w2_act_split: bool = False
    # both launches prefer the largest shared-memory carveout (kernels/carveout.py): then W2's
    # programs start beside W13's whatever registers the compiler gives either; False: the
    # driver's choice per kernel, which lets them only where W2 asks no larger carveout than W13
    max_shared_carveout: bool = False

    @property
    def w13_chunks(self) -> int:
        """32-row chunks per W13 warp."""
        return self.w13_block_k // (32 * self.w13_warps)

    @property
    def w2_block_k(self) -> int:
        """W2 output columns per program."""
        return 64 * self.w2_warps

    def w2_compile_options(self, capability: Tuple[int, int]) -> dict:
        """Extra compile options of the W2 launch on a GPU of compute ``capability``: the register
        cap (128 fits four 4-warp programs per SM), on Hopper and newer only, where it was
        measured and compiles without spills (sm_80's schedule, without PDL, spills at 128)."""
        return {"maxnreg": self.w2_max_registers} if self.w2_max_registers and capability >= (9, 0) else {}

    def w13_splits(self, hidden_size: int) -> int:
        """W13 programs per (row, column tile) along K: the partial sums the W2 kernel adds in order."""
        return -(-hidden_size // self.w13_block_k)

    def fitted(self, hidden_size: int) -> "GroupedConfig":
        """Round W13's split down to whole chunks for every warp, growing it until the splits
        fit the workspace's partials region (MAX_SPLIT_K)."""
        chunks = max(1, self.w13_chunks)
        while -(-hidden_size // (chunks * 32 * self.w13_warps)) > MAX_SPLIT_K:
            chunks *= 2
        return dataclasses.replace(self, w13_block_k=chunks * 32 * self.w13_warps)


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

# Measured winners on H200, fp16, keyed by M, with the Gluon W13 (docs/PERF.md v9;
# docs/bench/explorations.md runs 11-12 for W2, 25-26 for the W13 ring): the ring W13 wants longer splits than v8's tl kernel (256
# rows at M = 2 and 4, 512 at M = 8, splits that tile K = 2560 exactly); more tokens want fewer
# splits (every W2 program sums its row's splits again); the W2 register cap (four 4-warp
# programs per SM instead of three) pays ~1.2 us at M = 4. At M = 8 the Gluon W2 with 8-warp
# programs wins by 0.3-1.2 us in one process (explorations run 47), 0.4-0.9 more with its copies
# two chunks ahead of its mma (run 54). At M = 4 it lost with hi + lo activations (run 48) and wins
# by 0.1-0.3 us with one half (v12, runs 60-61; the 128-register cap, kept from the tl W2's entry,
# lets it take 128 registers instead of 68: 0.2 us faster in fp16), 0.1-0.25 more with its copies
# three chunks ahead (runs 62-63, same bits). At M = 2 the same 4-warp W2 (capped, three ahead)
# beats the 8-warp tl W2 by 0.1 us in fp16 and 0.4 in bf16 (run 68; 8-warp Gluon programs lose
# 4.9, run 60). Both run their W2 beside W13 under the largest shared-memory carveout: no faster
# (run 75), but without it a W2 uncapped (56 registers) or a 2-stage W13 ring lost ~5 us at M = 2,
# the driver then keeping W2 off W13's SMs (runs 68, 71, 73-75; kernels/carveout.py). At M = 8 a
# 3-stage W13 ring beats the 2-stage one by 0.2-0.3 us in fp16, 0.1 in bf16 (runs 78-79, same bits);
# elsewhere other depths lose: 4 at M = 8 +0.55 us, 6 and 8 at M = 2 and 4 +0.2 to +0.8, 3 at M = 2 +0.25.
_W2_GLUON_4_WARPS = dict(w2_warps=4, w2_max_registers=128, w2_ring=True, w2_copy_ahead=3, max_shared_carveout=True)
_QWEN38_TP4_GROUPED: Dict[int, GroupedConfig] = {
    2: GroupedConfig(w13_block_k=256, w13_ring_stages=4, **_W2_GLUON_4_WARPS),
    4: GroupedConfig(w13_block_k=256, w13_ring_stages=4, **_W2_GLUON_4_WARPS),
    8: GroupedConfig(w13_block_k=512, w2_warps=8, w13_ring_stages=3, w2_ring=True),
}
# Where the Gluon W13 does not run (no Gluon, VLLM_AWQ_MOE_GROUPED_DECODE_GLUON=0): v8's table for
# the tl W13, which wants shorter splits (run 25: the tl W13 at 256 rows is 2 us slower at M = 2).
_QWEN38_TP4_GROUPED_TL: Dict[int, GroupedConfig] = {
    2: GroupedConfig(w13_block_k=128, w2_warps=8, w13_ring_stages=0),
    4: GroupedConfig(w13_block_k=192, w2_warps=4, w2_max_registers=128, w13_ring_stages=0),
    8: GroupedConfig(w13_block_k=384, w2_warps=4, w2_max_registers=128, w13_ring_stages=0),
}


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_GROUPED_DECODE_CACHE", Path.home() / ".cache" / "moe_grouped_decode"))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


# Part of the cache file name: a kernel change that moves the timings bumps it, so configs
# tuned for older kernels are not read back.
KERNELS_VERSION = "v12"


def cache_path(gpu_name: str, triton_version: str) -> Path:
    return _cache_dir() / f"grouped_{KERNELS_VERSION}_{_safe(gpu_name)}_triton{_safe(triton_version)}.json"


def shape_key(shape: Tuple[int, int, int, int, int], dtype_name: str, num_tokens: int, ring: bool = True) -> str:
    """Cache key; ``ring``: tuned with the Gluon W13 available (a config tuned without it is not
    read back where it runs, and the other way round)."""
    E, k, K, N, G = shape
    return f"E{E}_k{k}_K{K}_N{N}_G{G}_{dtype_name}_M{num_tokens}" + ("" if ring else "_tl")


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
    if not isinstance(entries, dict):
        return
    names = {f.name for f in dataclasses.fields(GroupedConfig)}
    for key, fields in entries.items():
        # written by another version of this file: a field it lacks was not searched, a field it
        # has is not known here (a config tuned without max_shared_carveout would run without it)
        if isinstance(fields, dict) and set(fields) == names:
            _tuned[key] = GroupedConfig(**fields)


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


def grouped_config(shape: Tuple[int, int, int, int, int], dtype_name: str, num_tokens: int,
                   ring: bool = True) -> GroupedConfig:
    """The launch config for one shape and token count: tuned, then table, then default.
    ``ring``: whether the Gluon W13 runs (grouped.ring_available); if not, the tl W13's table."""
    tuned = _tuned.get(shape_key(shape, dtype_name, num_tokens, ring))
    table = _QWEN38_TP4_GROUPED if ring else _QWEN38_TP4_GROUPED_TL
    if tuned is not None:
        config = tuned
    elif shape == QWEN38_TP4_SHAPE and num_tokens in table:
        config = table[num_tokens]
    else:
        config = GroupedConfig()
    return config.fitted(shape[2])


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


def grouped_candidates(capability: Tuple[int, int], ring: bool) -> Tuple[GroupedConfig, ...]:
    """The small search space of the opt-in autotune (and of `bench --sweep`) on a GPU of
    compute ``capability`` (the register cap only where it applies: w2_compile_options); with
    ``ring`` (the Gluon W13 runs there), W13 splits of 128 / 256 / 512 rows (they tile qwen3.8's
    K = 2560; elsewhere the last split masks its chunks past K) and ring depths 2, 3 and 4 (2 and 4
    won in explorations run 25, 3 at M = 8 in runs 78-79) and also the Gluon W2 with 4- and 8-warp programs (8 won at
    M = 8 in runs 27, 46 and 47, its copies two chunks ahead; 4 with the cap at M = 4 in runs
    60-61, three ahead in runs 62-63, under the largest carveout, beside W13, since run 75), else
    the tl W13's splits and the tl W2. The table's entries are among them."""
    caps = (0, 128) if GroupedConfig(w2_max_registers=128).w2_compile_options(capability) else (0,)
    w13 = ([(rows, stages) for rows in (128, 256, 512) for stages in (2, 3, 4)] if ring
           else [(rows, 0) for rows in (128, 192, 256, 384, 512)])
    # (Gluon W2, warps, register cap, chunks copied ahead: 2, the default, which the tl W2 ignores,
    # the largest carveout: for the 4-warp Gluon W2, which runs beside W13)
    w2 = [(False, warps, cap, 2, False) for warps in (4, 8) for cap in caps]
    w2 += [(True, 4, cap, 3, True) for cap in caps] + [(True, 8, 0, 2, False)] if ring else []
    return tuple(
        GroupedConfig(w13_block_k=w13_block_k, w13_ring_stages=stages, w2_warps=w2_warps,
                      w2_max_registers=w2_max_registers, w2_ring=w2_ring, w2_copy_ahead=ahead,
                      max_shared_carveout=max_shared)
        for w13_block_k, stages in w13
        for w2_ring, w2_warps, w2_max_registers, ahead, max_shared in w2
    )


def tuned_config(shape, dtype_name: str, num_tokens: int, ring: bool = True) -> Optional[GroupedConfig]:
    return _tuned.get(shape_key(shape, dtype_name, num_tokens, ring))
