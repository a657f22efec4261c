"""Launch configurations: what a config holds, the measured tables (data files), the autotune cache.

A config never changes results across runs: the grouped op's summation order depends on its
W13 split, warps and kernels (the tile shapes place the reductions), so one shape and token
count always use one config, and the position-independence of a token's bits holds within it.
One field also sets W2's precision (``w2_act_split``); the autotune never varies it.

The tables are the measured tables' launch tables (``moe_grouped_decode/tables.py``: one per
GPU model, layer shape and dtype, written by ``python -m moe_grouped_decode tune``), one grouped
entry per (kernel family, M): the kernel family is ``gluon`` where Gluon runs and ``tl`` where it
does not (``plan.gluon_runs``), each with its own measured winners; and one prefill entry per M.
A GPU with no table of its own for a shape uses another GPU's (``tables.config_table``); a shape
no GPU measured runs the defaults. docs/PERF.md says why the shipped entries won. The opt-in autotune (``MOE_GROUPED_DECODE_TUNE=1``,
``ops.autotune``) writes the same entry format to a cache under ``~/.cache/moe_grouped_decode``
(or ``$MOE_GROUPED_DECODE_CACHE``), one file per kernel version, GPU name and Triton version.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Tuple

from .. import tables as measured_tables

# (E, k, K, N, G): what a table or cache entry is keyed by besides GPU, kernel family, dtype and M
Shape = Tuple[int, int, int, int, int]
KERNEL_FAMILIES = ("gluon", "tl")

# Part of the tuning cache's file name: a kernel change that moves the timings, or a search space
# that grows, bumps it, so configs tuned for older kernels or found among fewer are not read back.
KERNELS_VERSION = "v17"

# The default config's W13 runs over the sort's groups from this many tokens (the table's entries
# name their own): below it the sort's four launches cost more than the rows sharing experts save.
OVER_GROUPS_FROM_TOKENS = 40

# Most W13 K-splits the workspace's partials region holds (ops/workspace.py sizes it).
MAX_SPLIT_K = 32


@dataclass(frozen=True)
class GroupedConfig:
    # W13: "gluon" (w13_gluon.py: loads staged in a shared-memory ring; 1-warp programs) or "tl"
    # (w13_tl.py); the same bits at the same split. Where Gluon does not run, "tl".
    w13_kernel: str = "gluon"
    w13_block_k: int = 256  # W13: K rows per program (one split); whole 32-row chunks for each warp
    w13_warps: int = 1  # W13: warps per program, each over its own chunks of the split (tl only)
    w13_ring_stages: int = 4  # the Gluon W13's ring: 32-row chunks in flight per program
    # W2: "gluon" (w2_gluon.py: weights staged in shared memory, not registers; the combine fused)
    # or "tl" (w2_tl.py); the Gluon W2 gives the tl W2's bits built with RN_SCALE
    w2_kernel: str = "tl"
    w2_warps: int = 4  # W2: warps per program, 64 output columns each
    # W2: registers per thread the compiler may use (0: its own choice; Hopper+). 128 by default:
    # the tl W2 with its fused combine's float64 recompute then compiles without spills, four
    # 4-warp programs per SM (measured on the H200 at 9..39 tokens: 0.4-6.9 us faster than its own
    # choice, docs/PERF.md)
    w2_max_registers: int = 128
    # the Gluon W2's weight copies: issued this many 32-row chunks ahead of the chunk its mma works
    # on (>= 1; N / 32 or more: all before the PDL wait, though each chunk is waited for on its own)
    w2_copy_ahead: int = 2
    # W2's float32 activations rounded to one 16-bit value, one mma per chunk (as vLLM's fused_moe
    # stores them between its GEMMs); True: a 16-bit hi + lo pair, two mma per chunk (exact to
    # ~2^-22 of each value in fp16, ~2^-17 in bf16), 0.2-1.2 us slower at M = 2-8. A change of its
    # default must bump KERNELS_VERSION: tuned cache entries carry it
    w2_act_split: bool = False
    fused_combine: bool = True  # the combine inside the W2 launch (last-arriving program per token tile)
    pdl: bool = True  # programmatic dependent launch between the op's launches (used on Hopper and newer)
    # both launches prefer the largest shared-memory carveout (carveout.py): then W2's programs
    # start beside W13's whatever registers the compiler gives either; False: the driver's choice
    # per kernel, which lets them only where W2 asks no larger carveout than W13
    max_shared_carveout: bool = False
    # both GEMMs over the on-device sort's groups (up to 8 rows of one expert as the B operand's
    # columns: each weight tile read once per group, not per row) instead of per routed row: the
    # sort's four launches first, then W13 (this config's kernel and split), the activations, W2
    # (prefill.py's, 4 warps) and the combine as launches of their own; the same bits. The W2
    # fields above then go unused
    w13_over_groups: bool = False
    # over groups: 8-row B operands per program (groups of 8 or 16 rows; 2 dequantizes each A
    # fragment once for both); 1 otherwise
    group_blocks: int = 1

    def __post_init__(self) -> None:
        for field, value in (("w13_kernel", self.w13_kernel), ("w2_kernel", self.w2_kernel)):
            if value not in KERNEL_FAMILIES:
                raise ValueError(f"GroupedConfig.{field} must be one of {KERNEL_FAMILIES}, got {value!r}")
        if self.w13_kernel == "gluon" and (self.w13_warps != 1 or self.w13_ring_stages < 1):
            raise ValueError(f"the Gluon W13 runs 1-warp programs with a ring of at least one stage, got "
                             f"w13_warps={self.w13_warps}, w13_ring_stages={self.w13_ring_stages}")
        if self.w2_kernel == "gluon" and not self.fused_combine:
            raise ValueError("the Gluon W2 fuses the combine: w2_kernel='gluon' needs fused_combine=True")
        if self.group_blocks not in (1, 2) or (self.group_blocks == 2 and not self.w13_over_groups):
            raise ValueError(f"group_blocks must be 1 or 2, and 2 only over the sort's groups (w13_over_groups), got "
                             f"{self.group_blocks}")
        if self.w13_over_groups and self.w2_act_split:
            raise ValueError("W2 over the sort's groups rounds its activations to one half: w13_over_groups=True "
                             "needs w2_act_split=False")
        if self.w2_copy_ahead < 1:
            raise ValueError(f"w2_copy_ahead (the Gluon W2's chunks copied ahead of its mma) must be at least 1, "
                             f"got {self.w2_copy_ahead}")

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

    def as_tl(self) -> "GroupedConfig":
        """This config with both launches on the tl kernels (same split, warps and fields)."""
        return dataclasses.replace(self, w13_kernel="tl", w2_kernel="tl")


# the most W2 pieces a wgmma config may unroll: at N = 1408 (44 pieces) unrolled W2 spills, and
# its compile grows with the pieces
MAX_UNROLLED_PIECES = 16


@dataclass(frozen=True)
class PrefillConfig:
    """The prefill route's launches: the ``mma`` kernels (prefill.py, groups of 8 * token_blocks
    rows, inline-PTX mma.sync with the nibbles in the A fragments), the ``dot`` kernels
    (prefill_dot.py, groups of block_rows rows, tl.dot on weight tiles dequantized in registers)
    or the ``wgmma`` kernels (prefill_wgmma.py, Hopper and Gluon only, groups of block_rows rows,
    the GEMM transposed with the dequantized weights as wgmma's register operand; elsewhere the
    plan runs the mma kernels for up to 32-row groups, the dot kernels above)."""

    token_blocks: int = 1  # mma: 8-row B operands per program (rows per group / 8): 1, 2 or 4
    w13_warps: int = 4  # mma: warps over K (chunks unrolled); dot: num_warps
    w2_warps: int = 4  # mma: warps of 64 output columns each; dot: num_warps
    kernel: str = "mma"  # "mma", "dot" or "wgmma"
    block_rows: int = 16  # dot, wgmma: rows per group (the tl.dot M, a power of two >= 16; wgmma's N, 8 to 128)
    w13_block_n: int = 32  # dot: gate columns per W13 program (and as many up columns)
    w13_block_k: int = 32  # dot: W13's reduction rows per step (a divisor or a multiple of G); wgmma: 32, 64, 128 or 256
    w2_block_n: int = 128  # dot: output columns per W2 program
    w13_stages: int = 3  # dot: software-pipeline depth of W13's steps (w13_block_k rows each); wgmma: ring depth
    w2_stages: int = 3  # dot, wgmma: the same for W2 (wgmma: N / 32 stages, one allocation per piece)
    # wgmma: W13's scales and zero words requested a step ahead, so their global-load latency
    # overlaps the previous step (as W2 always does); 11-15 more registers, which at 32- and 64-row
    # groups cost W13 programs per SM
    w13_scales_ahead: bool = False
    # wgmma: W13's programs over a group's columns: "wide" (64 gate + 64 up columns each, the last
    # padded where 64 does not divide N) or "narrow" (32 + 32, no padding where 32 divides N)
    w13_tiles: str = "wide"
    # programmatic dependent launch (Hopper and newer) through the sort, the wgmma kernels and the
    # combine: each launch starts while the one before finishes; W13 and W2 request their first
    # weights before they wait for it
    pdl: bool = True
    # wgmma: W2's 128-column tiles per program (the group's act rows copied to shared memory once
    # for all of them): fewer give a layer of few experts or a small K more programs to spread
    w2_tiles_per_program: int = 4
    # wgmma: W2's pieces of a tile (N / 32) unrolled at compile time up to this many, a loop past
    # it; unrolled, a piece issues about 40% fewer instructions but registers (and the compile)
    # grow with N. Unrolled pieces with w2_stages == N / 32 get a ring stage each (one shared
    # allocation a piece, fewer barriers); any other depth shares one ring
    w2_unrolled_pieces: int = 8

    def __post_init__(self) -> None:
        if self.kernel != "wgmma" and (self.w2_tiles_per_program, self.w2_unrolled_pieces) != (4, 8):
            raise ValueError("PrefillConfig: w2_tiles_per_program and w2_unrolled_pieces are the wgmma kernels' "
                             f"(kernel {self.kernel!r} takes the defaults 4 and 8)")
        if self.w2_tiles_per_program not in (1, 2, 4):
            raise ValueError(f"PrefillConfig.w2_tiles_per_program must be 1, 2 or 4, got {self.w2_tiles_per_program}")
        if not 1 <= self.w2_unrolled_pieces <= MAX_UNROLLED_PIECES:
            raise ValueError(f"PrefillConfig.w2_unrolled_pieces must be 1 to {MAX_UNROLLED_PIECES}, "
                             f"got {self.w2_unrolled_pieces}")
        for field in ("w13_warps", "w2_warps", "w13_stages", "w2_stages"):
            if getattr(self, field) < 1:
                raise ValueError(f"PrefillConfig.{field} must be at least 1, got {getattr(self, field)}")
        if self.kernel not in ("mma", "dot", "wgmma"):
            raise ValueError(f"PrefillConfig.kernel must be 'mma', 'dot' or 'wgmma', got {self.kernel!r}")
        if self.kernel == "wgmma" and (self.block_rows > 128 or self.w13_stages < 2 or self.w2_stages < 2
                                       or self.w13_block_k not in (32, 64, 128, 256)):
            raise ValueError("PrefillConfig: the wgmma kernels take block_rows <= 128, rings of >= 2 stages and "
                             "w13_block_k 32, 64, 128 or 256")
        if self.w13_tiles not in ("wide", "narrow"):
            raise ValueError(f"PrefillConfig.w13_tiles must be 'wide' or 'narrow', got {self.w13_tiles!r}")
        if self.token_blocks not in (1, 2, 4):
            raise ValueError(f"PrefillConfig.token_blocks must be 1, 2 or 4, got {self.token_blocks}")
        for field, least in (("block_rows", 8 if self.kernel == "wgmma" else 16), ("w13_block_n", 16),
                             ("w13_block_k", 32), ("w2_block_n", 16)):
            value = getattr(self, field)
            if value < least or value & (value - 1):
                raise ValueError(f"PrefillConfig.{field} must be a power of two >= {least}, got {value}")

    @property
    def group_rows(self) -> int:
        return 8 * self.token_blocks if self.kernel == "mma" else self.block_rows


# Batch-invariant mode's one prefill config at every M: the mma kernels over 8-row groups, where
# each token is its own mma B column and the K split's sums are one fixed tree, so its bits
# depend on nothing else in the call; the fastest config below ~1000 tokens, where decode runs.
BATCH_INVARIANT_PREFILL = PrefillConfig(token_blocks=1, w13_warps=4, w2_warps=4)


def prefill_candidates() -> Tuple[PrefillConfig, ...]:
    """The prefill route's search space (``bench --prefill-sweep``'s default, the generator of the
    prefill tables): the mma kernels over 8- and 16-row groups; the dot kernels over 32-, 64- and
    128-row groups, each with six W13 variants (gate columns, reduction rows per step, warps,
    pipeline depth) paired with six W2 variants (columns, warps, depth), and two over 256-row
    groups; the wgmma kernels over 8- to 128-row groups, W13's scales a step ahead or not, W13's
    programs wide or narrow, W2's ring one stage per piece up to 32-row groups (measured faster
    there at 128-1024 tokens on the H200; 64-row groups not measured with it). W13 and W2 are
    timed apart (sort + W13, then the rest), so the pairing costs no coverage."""
    w13 = ((32, 32, 4, 3), (32, 64, 4, 3), (64, 32, 4, 3), (64, 64, 4, 4), (64, 64, 8, 3), (32, 128, 4, 3))
    w2 = ((128, 8, 3), (256, 8, 3), (64, 4, 3), (128, 4, 3), (256, 4, 3), (64, 8, 2))
    dot = [(rows, a, b) for rows in (32, 64, 128) for a, b in zip(w13, w2)]
    dot += [(256, (64, 32, 8, 3), (128, 8, 3)), (256, (32, 64, 8, 3), (256, 8, 2))]
    wgmma = [(8, 64, 3, 5, True, "wide"), (8, 64, 3, 5, True, "narrow"),
             (16, 32, 4, 5, False, "wide"), (16, 64, 3, 5, False, "wide"), (16, 64, 3, 5, True, "wide"),
             (8, 128, 3, 5, True, "narrow"), (8, 128, 2, 5, True, "narrow"), (8, 256, 2, 5, True, "narrow"),
             (16, 64, 3, 5, True, "narrow"), (16, 64, 4, 5, True, "narrow"),
             (16, 128, 3, 5, True, "narrow"), (32, 128, 3, 5, False, "narrow"),
             (32, 32, 4, 5, False, "wide"), (32, 64, 3, 5, False, "wide"), (32, 64, 3, 5, True, "wide"),
             (32, 64, 3, 5, False, "narrow"), (64, 32, 4, 4, False, "wide"),
             (64, 64, 3, 4, False, "wide"), (64, 64, 4, 4, False, "wide"), (64, 64, 4, 4, False, "narrow"),
             (128, 32, 3, 3, False, "wide")]
    return (PrefillConfig(token_blocks=1), PrefillConfig(token_blocks=2)) + tuple(
        PrefillConfig(kernel="dot", block_rows=rows, w13_block_n=a[0], w13_block_k=a[1], w13_warps=a[2],
                      w13_stages=a[3], w2_block_n=b[0], w2_warps=b[1], w2_stages=b[2]) for rows, a, b in dot) + tuple(
        PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=k, w13_stages=a, w2_stages=b, w13_scales_ahead=ahead,
                      w13_tiles=tiles)
        for rows, k, a, b, ahead, tiles in wgmma)


# --------------------------------------------------------------------------- entries (tables and cache)

_FIELDS = {f.name for f in dataclasses.fields(GroupedConfig)}
EntryKey = Tuple[Shape, str, str, str, int]  # (shape, GPU name, kernel family, dtype name, M)


def config_from_fields(fields) -> Optional[GroupedConfig]:
    """A config from an entry's fields, or None when they are not exactly this version's fields
    (an entry written by another version: a field it lacks was not searched, a field it has is
    not known here) or do not make a valid config."""
    if not isinstance(fields, dict) or set(fields) != _FIELDS:
        return None
    try:
        return GroupedConfig(**fields)
    except (TypeError, ValueError):
        return None


def entry_key(entry: dict) -> Optional[EntryKey]:
    try:
        shape = tuple(int(v) for v in entry["shape"])
        key = (shape, str(entry["gpu"]), str(entry["kernels"]), str(entry["dtype"]), int(entry["M"]))
    except (KeyError, TypeError, ValueError):
        return None
    return key if len(shape) == 5 and key[2] in KERNEL_FAMILIES else None


def make_entry(key: EntryKey, config: GroupedConfig) -> dict:
    shape, gpu, kernels, dtype_name, num_tokens = key
    return {"shape": list(shape), "gpu": gpu, "kernels": kernels, "dtype": dtype_name, "M": num_tokens,
            "config": dataclasses.asdict(config)}


def read_entries(entries: Iterable) -> Dict[EntryKey, GroupedConfig]:
    """The valid entries of a table or cache file; the rest are skipped."""
    out = {}
    for entry in entries:
        key = entry_key(entry) if isinstance(entry, dict) else None
        config = config_from_fields(entry.get("config")) if key is not None else None
        if config is not None:
            out[key] = config
    return out


# --------------------------------------------------------------------------- the measured tables


def table_config(shape: Shape, gpu_name: str, kernels: str, dtype_name: str, num_tokens: int) -> Optional[GroupedConfig]:
    """The measured config for one key, from the GPU's table of the shape (or the table
    ``tables.config_table`` falls back to): the kernel family's entry of the smallest M at or
    above ``num_tokens``; None above the largest (the default config serves there)."""
    table = measured_tables.config_table(gpu_name, tuple(shape), dtype_name)
    if table is None:
        return None
    entries = sorted((e for e in table.grouped if e.get("kernels") == kernels), key=lambda e: e["M"])
    entry = next((e for e in entries if e["M"] >= num_tokens), None)
    return None if entry is None else config_from_fields(entry.get("config"))


# --------------------------------------------------------------------------- the autotune cache


def _cache_dir() -> Path:
    return Path(os.environ.get("MOE_GROUPED_DECODE_CACHE", Path.home() / ".cache" / "moe_grouped_decode"))


def _safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def cache_path(gpu_name: str, triton_version: str) -> Path:
    return _cache_dir() / f"grouped_{KERNELS_VERSION}_{_safe(gpu_name)}_triton{_safe(triton_version)}.json"


_tuned: Dict[EntryKey, GroupedConfig] = {}
_loaded_files: set = set()
_tuned_generation = 0  # bumped whenever _tuned changes (lookups cached downstream key on it)


def tuned_generation() -> int:
    return _tuned_generation


def _read_cache(path: Path) -> list:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    entries = data.get("entries") if isinstance(data, dict) else None
    return entries if isinstance(entries, list) else []


def load_tuned(path: Path) -> None:
    """Read a tuning cache file into memory once (missing or corrupt files and entries are ignored)."""
    global _tuned_generation
    if path in _loaded_files:
        return
    _loaded_files.add(path)
    _tuned.update(read_entries(_read_cache(path)))
    _tuned_generation += 1


def store_tuned(path: Path, key: EntryKey, config: GroupedConfig) -> None:
    """Remember ``config`` for ``key`` and write it to the cache file (atomically)."""
    global _tuned_generation
    _tuned[key] = config
    _tuned_generation += 1
    entries = {entry_key(e): e for e in _read_cache(path) if isinstance(e, dict) and entry_key(e) is not None}
    entries[key] = make_entry(key, config)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"generator": "moe_grouped_decode autotune (MOE_GROUPED_DECODE_TUNE=1)",
                               "entries": sorted(entries.values(), key=lambda e: entry_key(e))}, indent=1))
    tmp.replace(path)


def tuned_config(key: EntryKey) -> Optional[GroupedConfig]:
    return _tuned.get(key)


def forget_tuned() -> None:
    """Drop every tuned config read or stored in this process (the next load_tuned reads its
    file again)."""
    global _tuned_generation
    _tuned.clear()
    _loaded_files.clear()
    _tuned_generation += 1


# --------------------------------------------------------------------------- lookups


def grouped_config(shape: Shape, gpu_name: str, kernels: str, dtype_name: str, num_tokens: int) -> GroupedConfig:
    """The launch config for one shape and token count: tuned, then the table, then the default
    (on the tl kernels where ``kernels`` is "tl"), fitted to K."""
    key = (tuple(shape), gpu_name, kernels, dtype_name, num_tokens)
    config = _tuned.get(key) or table_config(*key)
    if config is None:
        config = GroupedConfig(w13_over_groups=num_tokens >= OVER_GROUPS_FROM_TOKENS)
        config = config if kernels == "gluon" else config.as_tl()
    return config.fitted(shape[2])


def prefill_table_token_counts() -> Tuple[int, ...]:
    """Every token count at which some prefill launch table's config changes (its entries' M)."""
    return tuple(sorted({int(e["M"]) for table in measured_tables.all_tables() for e in table.prefill}))


def prefill_config(shape: Shape, gpu_name: str, dtype_name: str, num_tokens: int) -> PrefillConfig:
    """The prefill route's config for one shape and token count: the table entry of the smallest
    M at or above ``num_tokens`` (the largest entry above them all) in the GPU's table of the
    shape (or the one ``tables.config_table`` falls back to); the default elsewhere."""
    return _prefill_config(tuple(shape), gpu_name, dtype_name, num_tokens, measured_tables.generation())


@functools.lru_cache(maxsize=4096)
def _prefill_config(shape: Shape, gpu_name: str, dtype_name: str, num_tokens: int, generation: int) -> PrefillConfig:
    table = measured_tables.config_table(gpu_name, shape, dtype_name)
    entries = sorted(table.prefill, key=lambda e: e["M"]) if table is not None else []
    # an entry this version cannot read (a field it does not know, written by a newer tune) is skipped
    entries = [(e["M"], c) for e in entries for c in [prefill_config_from_fields(e.get("config"))] if c is not None]
    if not entries:
        return PrefillConfig()
    return next((c for m, c in entries if m >= num_tokens), entries[-1][1])


def prefill_config_from_fields(fields) -> Optional[PrefillConfig]:
    """A prefill config from a table entry's fields (those it lacks take their defaults), or None
    when a field is not known here or the values do not make a valid config."""
    if not isinstance(fields, dict):
        return None
    try:
        return PrefillConfig(**fields)
    except (TypeError, ValueError):
        return None


def grouped_candidates(capability: Tuple[int, int], kernels: str) -> Tuple[GroupedConfig, ...]:
    """The small search space of the opt-in autotune (and of `bench --sweep`) on a GPU of compute
    ``capability`` (the register cap only where it applies: w2_compile_options). With the Gluon
    kernels: W13 splits of 128 / 256 / 512 rows (they tile qwen3.8's K = 2560; elsewhere the last
    split masks its chunks past K) through rings 2, 3 and 4 deep, against the tl W2 with 4- and
    8-warp programs, the 4-warp Gluon W2 (three chunks ahead, the largest carveout: it runs beside
    W13) and the 8-warp Gluon W2 (two ahead); with the tl kernels, the tl W13's splits and the tl
    W2. Both also try the default over the sort's groups (one and two 8-row blocks a program), as
    `tune` does; its W2 is the prefill route's, on which the register cap does nothing, so it is
    tried once, as the tables hold it. The tables' entries are among them."""
    capped = bool(GroupedConfig(w2_max_registers=128).w2_compile_options(capability))

    def caps(*values):  # 0 (the compiler's choice) and, where a cap applies, the table's caps
        return (0,) + (values if capped else ())

    if kernels == "gluon":
        w13 = [dict(w13_kernel="gluon", w13_block_k=rows, w13_ring_stages=stages)
               for rows in (128, 256, 512) for stages in (2, 3, 4)]
    else:
        w13 = [dict(w13_kernel="tl", w13_block_k=rows) for rows in (128, 192, 256, 384, 512)]
    w2 = [dict(w2_kernel="tl", w2_warps=4, w2_max_registers=cap) for cap in caps(128, 160, 168)]
    w2 += [dict(w2_kernel="tl", w2_warps=8, w2_max_registers=cap) for cap in caps(128)]
    if kernels == "gluon":
        w2 += [dict(w2_kernel="gluon", w2_warps=4, w2_max_registers=cap, w2_copy_ahead=3, max_shared_carveout=True)
               for cap in caps(96, 128)]
        w2 += [dict(w2_kernel="gluon", w2_warps=8, w2_max_registers=0)]
    return tuple([GroupedConfig(**a, **b) for a in w13 for b in w2] + over_groups_candidates(kernels))


def over_groups_candidates(kernels: str) -> List[GroupedConfig]:
    """The default run over the sort's groups, one and two 8-row blocks a program (searched by the
    autotune and by `tune`)."""
    base = GroupedConfig() if kernels == "gluon" else GroupedConfig().as_tl()
    return [dataclasses.replace(base, w13_over_groups=True, group_blocks=blocks) for blocks in (1, 2)]
