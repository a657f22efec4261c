"""Measured tables: one per (GPU model, layer shape, dtype), the data every decision reads.

A table holds what ``python -m moe_grouped_decode tune`` measured for one MoE layer shape
(E, k, K, N, G) and activation dtype on one GPU model:

* the **route table**: at each measured token count M, the time of the plugin's best route
  (the grouped op or the prefill route) beside vLLM's own MoE backends (Marlin, Humming),
  timed side by side in one process on the same weights and inputs, and the grouped window
  (the token counts the grouped route serves);
* the two **launch tables**: the grouped op's config per (kernel family, M) and the prefill
  route's config per M (an entry serves every M up to its own, the last every M above);
* optionally, the **co-serving tables** (:class:`CoserveTable`): at the first few M, the plugin's
  grouped decode over vLLM's own Marlin tensors (``kernels/marlin_grouped.py``) beside vLLM's
  backends, timed side by side in one process of its own, with its launch table; and the same
  kernel over vLLM's Humming tensors (``coserve_humming``), for engines where vLLM runs Humming.

Its **verdict** (:func:`verdict`) admits the shape on that GPU only where the plugin is faster
than every vLLM backend at every measured M from 1 up to the engine's largest step; the layer
is then served whole by the plugin from AutoAWQ's tensors. Where it is not, the **co-serving
verdict** (:func:`coserve_verdict`) may still give the plugin the few-token steps: vLLM
repacks the weights for its backend as usual (one copy) and runs every step except those of the
window, where the plugin's kernel reads the same tensors faster. The shipped tables live in
``moe_grouped_decode/tables/``; ``tune`` writes a user's to a cache directory keyed by GPU,
shape, dtype and the torch / Triton / vLLM versions, which startup reads before the shipped
ones. Pure data: no torch, no vLLM.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence, Tuple

Shape = Tuple[int, int, int, int, int]  # (E, k, K, N, G)
DTYPE_NAMES = ("fp16", "bf16")
VLLM_BACKENDS = ("marlin", "humming")  # what vLLM 0.32+ runs for AWQ MoE on NVIDIA GPUs
# vLLM's compile ranges reach this many tokens a step; a table must reach it to admit a shape
# for an engine whose steps are that large
LARGEST_STEP = 16384
SHIPPED_DIR = Path(__file__).resolve().parent / "tables"
# Where a GPU has no table of a shape, launch configs come from this GPU's (then any other's)
PREFERRED_GPUS = ("NVIDIA H200",)
FORMAT = 1


@dataclass(frozen=True)
class RouteTable:
    """Per measured M (ascending): the plugin's route and time, and each vLLM backend's time."""

    tokens: Tuple[int, ...]
    routes: Tuple[str, ...]  # "grouped" or "prefill"
    plugin_us: Tuple[float, ...]
    vllm_us: Dict[str, Tuple[Optional[float], ...]]  # backend -> time per M (None: not measured there)
    grouped_tokens: Optional[Tuple[int, int]]  # [lo, hi] the grouped route serves; None: never

    def vllm_best_us(self, i: int) -> Optional[float]:
        times = [us[i] for us in self.vllm_us.values() if us[i] is not None]
        return min(times) if times else None

    def speedups(self) -> List[Optional[float]]:
        """vLLM's faster backend over the plugin, per M."""
        out = []
        for i, us in enumerate(self.plugin_us):
            best = self.vllm_best_us(i)
            out.append(None if best is None else best / us)
        return out


@dataclass(frozen=True)
class CoserveTable:
    """Per measured M (ascending, from 1): the co-served kernel's time and vLLM's backends', timed
    side by side in one process, and the kernel's launch table ({"M", "config": MarlinGroupedConfig
    fields}; an entry serves every M up to its own, the last every M above)."""

    tokens: Tuple[int, ...]
    coserved_us: Tuple[float, ...]
    vllm_us: Dict[str, Tuple[Optional[float], ...]]
    launch: Tuple[dict, ...] = ()
    generator: str = ""  # the command that measured it (a table's co-serving may be measured on its own)

    def vllm_best_us(self, i: int) -> Optional[float]:
        times = [us[i] for us in self.vllm_us.values() if us[i] is not None]
        return min(times) if times else None


@dataclass(frozen=True)
class MeasuredTable:
    gpu: str  # the GPU model's name as NVML gives it (torch.cuda.get_device_name)
    shape: Shape
    dtype: str  # "fp16" or "bf16"
    name: str  # a label for people (a model and its parallelism), not a key
    generator: str  # the command that wrote it
    versions: Dict[str, str]
    routes: RouteTable
    grouped: Tuple[dict, ...] = ()  # {"kernels": "gluon"/"tl", "M": int, "config": GroupedConfig fields}
    prefill: Tuple[dict, ...] = ()  # {"M": int, "config": PrefillConfig fields}
    coserve: Optional[CoserveTable] = None  # the kernel over vLLM's Marlin tensors
    coserve_humming: Optional[CoserveTable] = None  # the same kernel over vLLM's Humming tensors
    path: Optional[Path] = field(default=None, compare=False)

    def coserve_table(self, layout: str) -> Optional[CoserveTable]:
        """The co-serving table of the kernel over vLLM's ``layout`` ("marlin" or "humming") tensors."""
        return {"marlin": self.coserve, "humming": self.coserve_humming}[layout]

    @property
    def key(self) -> Tuple[str, Shape, str]:
        return (self.gpu, self.shape, self.dtype)


@dataclass(frozen=True)
class Verdict:
    admitted: bool
    reason: str
    # the closest call: (M, vLLM's faster backend over the plugin) where that ratio is smallest
    closest: Optional[Tuple[int, float]] = None


def verdict(table: MeasuredTable, max_tokens: int = LARGEST_STEP) -> Verdict:
    """Whether ``table`` admits its shape for an engine whose steps hold up to ``max_tokens``
    tokens: measured at M = 1 and at some M >= ``max_tokens``, every backend of VLLM_BACKENDS
    measured there, and the plugin faster than each at every measured M up to the first one at
    or above ``max_tokens``."""
    r = table.routes
    where = f"{table.gpu}, {'x'.join(map(str, table.shape))} {table.dtype}"
    if not r.tokens or r.tokens[0] != 1:
        return Verdict(False, f"not measured at 1 token ({where})")
    reach = next((i for i, m in enumerate(r.tokens) if m >= max_tokens), None)
    if reach is None:
        return Verdict(False, f"measured up to {r.tokens[-1]} tokens, the engine's steps reach {max_tokens} ({where})")
    for backend in VLLM_BACKENDS:
        times = r.vllm_us.get(backend, (None,) * len(r.tokens))[: reach + 1]
        missing = [m for m, us in zip(r.tokens, times) if us is None]
        if missing:
            return Verdict(False, f"vLLM's {backend} backend not measured at M={_ranges(missing)} ({where})")
    speedups = r.speedups()[: reach + 1]
    i = min(range(len(speedups)), key=speedups.__getitem__)
    closest = (r.tokens[i], speedups[i])
    losses = [m for m, s in zip(r.tokens, speedups) if s <= 1.0]
    if losses:
        return Verdict(False, f"vLLM is as fast or faster at M={_ranges(losses)} "
                              f"(the plugin down to {closest[1]:.2f}x, at M={closest[0]}; {where})", closest)
    return Verdict(True, f"faster than vLLM at every measured M from 1 to {r.tokens[reach]} "
                         f"(at least {closest[1]:.2f}x, at M={closest[0]}; {where})", closest)


# the co-served kernel's least margin over vLLM's faster backend at a count of the window: it adds
# a second kernel to a layer vLLM serves, worth it only for a gain clear of run-to-run noise
COSERVE_MARGIN = 1.05


@dataclass(frozen=True)
class CoserveVerdict:
    window: Optional[Tuple[int, int]]  # (1, hi): the token counts the plugin's kernel serves; None: none
    reason: str
    layout: str = "marlin"  # whose tensors the kernel reads: vLLM's Marlin (forced) or Humming (its own pick)


def coserve_verdict(table: MeasuredTable, vllm_backend: Optional[str], max_tokens: int = LARGEST_STEP) -> CoserveVerdict:
    """Whether a layer that :func:`verdict` leaves to vLLM can be co-served, in which window and
    over whose tensors.

    Where vLLM would pick Humming (``vllm_backend`` as its selection names it, "MARLIN" or
    "HUMMING") and the table measured the kernel over Humming's tensors (``coserve_humming``),
    vLLM keeps Humming and the kernel reads its tensors in the window: the window is the counts
    from 1 where the kernel is at least COSERVE_MARGIN times faster than every backend of
    VLLM_BACKENDS (it ends before the first count where it is not, so an unmeasured count past it
    stays with vLLM). Otherwise co-serving forces vLLM's Marlin backend (its tensors are what the
    kernel reads then), so it needs the same window in the Marlin co-serving table and, where
    vLLM would pick another backend itself, Marlin no slower than that one in the route table at
    every measured M past the window up to the first at or above ``max_tokens``."""
    where = f"{table.gpu}, {'x'.join(map(str, table.shape))} {table.dtype}"
    stock = (vllm_backend or "").lower()
    if stock not in VLLM_BACKENDS:
        return CoserveVerdict(None, f"vLLM's own backend here is {vllm_backend}, not one co-serving is measured against")
    humming_why = None
    if stock == "humming" and table.coserve_humming is not None:
        hi, least, humming_why = _coserve_window(table.coserve_humming, " over Humming's tensors", where)
        if hi is not None:
            return CoserveVerdict((1, hi), f"co-served: the plugin's kernel on vLLM's Humming tensors at 1..{hi} tokens "
                                           f"(at least {least:.2f}x), vLLM's Humming above ({where})", "humming")
    verdict = _marlin_coserve_verdict(table, stock, max_tokens, where)
    if verdict.window is None and humming_why is not None:
        return CoserveVerdict(None, f"{humming_why}; over Marlin's: {verdict.reason}")
    return verdict


def _coserve_window(c: CoserveTable, over: str, where: str) -> Tuple[Optional[int], Optional[float], Optional[str]]:
    """(the window's last count, the least margin in it, None), or (None, None, why there is none);
    ``over``: whose tensors the table's kernel read, for the reason."""
    if not c.tokens or c.tokens[0] != 1:
        return None, None, f"co-serving{over} not measured ({where})"
    hi, least, unmeasured = None, None, None
    for i, m in enumerate(c.tokens):
        times = [c.vllm_us.get(b, (None,) * len(c.tokens))[i] for b in VLLM_BACKENDS]
        if any(us is None for us in times):
            unmeasured = [b for b, us in zip(VLLM_BACKENDS, times) if us is None]
            break
        if min(times) < COSERVE_MARGIN * c.coserved_us[i]:
            break
        ratio = min(times) / c.coserved_us[i]
        hi, least = m, ratio if least is None else min(least, ratio)
    if hi is None and unmeasured:
        return None, None, f"vLLM's {', '.join(unmeasured)} not measured at 1 token in the co-serving{over} table ({where})"
    if hi is None:
        return None, None, f"the co-served kernel{over} is not {COSERVE_MARGIN:.2f}x as fast as vLLM at 1 token ({where})"
    return hi, least, None


def _marlin_coserve_verdict(table: MeasuredTable, stock: str, max_tokens: int, where: str) -> CoserveVerdict:
    c = table.coserve
    if c is None:
        return CoserveVerdict(None, f"co-serving not measured ({where})")
    hi, least, why = _coserve_window(c, "", where)
    if hi is None:
        return CoserveVerdict(None, why)
    if stock != "marlin":
        r = table.routes
        reach = next((i for i, m in enumerate(r.tokens) if m >= max_tokens), None)
        marlin, own = r.vllm_us.get("marlin"), r.vllm_us.get(stock)
        if reach is None or marlin is None or own is None:
            return CoserveVerdict(None, f"vLLM would run {stock}; Marlin and {stock} not measured up to "
                                        f"{max_tokens} tokens ({where})")
        slower = [m for i, m in enumerate(r.tokens[: reach + 1])
                  if m > hi and (marlin[i] is None or own[i] is None or marlin[i] > own[i])]
        if slower:
            return CoserveVerdict(None, f"vLLM would run {stock}, faster than Marlin (what co-serving runs past "
                                        f"the window) at M={_ranges(slower)} ({where})")
    return CoserveVerdict((1, hi), f"co-served: the plugin's kernel on vLLM's Marlin tensors at 1..{hi} tokens "
                                   f"(at least {least:.2f}x), vLLM's Marlin above ({where})")


def _ranges(values: Sequence[int]) -> str:
    shown = ", ".join(map(str, values[:6]))
    return shown + (f" and {len(values) - 6} more" if len(values) > 6 else "")


# --------------------------------------------------------------------------- files


def table_to_json(table: MeasuredTable) -> dict:
    r = table.routes
    return {
        "format": FORMAT,
        "generator": table.generator,
        "gpu": table.gpu,
        "shape": list(table.shape),
        "dtype": table.dtype,
        "name": table.name,
        "versions": dict(table.versions),
        "route_table": {
            "tokens": list(r.tokens),
            "route": list(r.routes),
            "plugin_us": [round(us, 2) for us in r.plugin_us],
            "vllm_us": {b: [None if us is None else round(us, 2) for us in times] for b, times in r.vllm_us.items()},
            "grouped_tokens": None if r.grouped_tokens is None else list(r.grouped_tokens),
        },
        "grouped": list(table.grouped),
        "prefill": list(table.prefill),
        **({} if table.coserve is None else {"coserve": _coserve_to_json(table.coserve)}),
        **({} if table.coserve_humming is None else {"coserve_humming": _coserve_to_json(table.coserve_humming)}),
    }


def _coserve_to_json(c: CoserveTable) -> dict:
    return {"generator": c.generator, "tokens": list(c.tokens), "coserved_us": [round(us, 2) for us in c.coserved_us],
            "vllm_us": {b: [None if us is None else round(us, 2) for us in times] for b, times in c.vllm_us.items()},
            "launch": list(c.launch)}


def _coserve_from_json(c: dict, key: str = "coserve") -> CoserveTable:
    table = CoserveTable(tokens=tuple(int(m) for m in c["tokens"]), coserved_us=tuple(float(x) for x in c["coserved_us"]),
                         vllm_us={str(b): tuple(None if x is None else float(x) for x in times)
                                  for b, times in c["vllm_us"].items()},
                         launch=tuple(c.get("launch", ())), generator=str(c.get("generator", "")))
    n = len(table.tokens)
    if list(table.tokens) != sorted(set(table.tokens)) or any(m < 1 for m in table.tokens):
        raise ValueError(f"{key}.tokens must be distinct positive counts, ascending")
    if len(table.coserved_us) != n or any(len(t) != n for t in table.vllm_us.values()):
        raise ValueError(f"every {key} column must have one value per token count")
    if any(not us > 0 for us in table.coserved_us) or any(us is not None and not us > 0
                                                         for times in table.vllm_us.values() for us in times):
        raise ValueError(f"{key} times must be positive")
    if not all(_coserve_launch_entry_ok(e) for e in table.launch):
        raise ValueError(f"{key}.launch entries must be {{\"M\": int >= 1, \"config\": {{"
                         f"{', '.join(sorted(_COSERVE_COUNTS))} (ints >= 1), fused_combine (bool)"
                         f"[, {', '.join(sorted(_COSERVE_OPTIONAL_COUNTS))} (int >= 1)]"
                         f"[, {', '.join(sorted(_COSERVE_OPTIONAL_FLAGS))} (bool)]}}}}")
    return table


# kernels/marlin_grouped.py's launch config: counts, and whether W2 fuses the combine; an entry
# without an optional field gets the config's default
_COSERVE_COUNTS = {"w13_warps", "w13_chunks", "w2_warps"}
_COSERVE_OPTIONAL_COUNTS = {"w2_row_warps", "w2_n_splits"}
_COSERVE_OPTIONAL_FLAGS = {"act_launch"}


def _coserve_launch_entry_ok(entry) -> bool:
    def count(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if not isinstance(entry, dict) or not count(entry.get("M")) or not isinstance(entry.get("config"), dict):
        return False
    config = entry["config"]
    required = _COSERVE_COUNTS | {"fused_combine"}
    flags = {"fused_combine"} | _COSERVE_OPTIONAL_FLAGS
    return (required <= set(config) <= required | _COSERVE_OPTIONAL_COUNTS | _COSERVE_OPTIONAL_FLAGS
            and all(isinstance(v, bool) if f in flags else count(v) for f, v in config.items()))


def table_from_json(data: dict, path: Optional[Path] = None) -> MeasuredTable:
    """A table from its file's content; ValueError naming the file and what is wrong."""
    try:
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, this version reads {FORMAT}")
        r = data["route_table"]
        tokens = tuple(int(m) for m in r["tokens"])
        n = len(tokens)
        routes = RouteTable(
            tokens=tokens,
            routes=tuple(str(x) for x in r["route"]),
            plugin_us=tuple(float(x) for x in r["plugin_us"]),
            vllm_us={str(b): tuple(None if x is None else float(x) for x in times) for b, times in r["vllm_us"].items()},
            grouped_tokens=None if r.get("grouped_tokens") is None else (int(r["grouped_tokens"][0]),
                                                                        int(r["grouped_tokens"][1])),
        )
        if list(tokens) != sorted(set(tokens)) or any(m < 1 for m in tokens):
            raise ValueError("route_table.tokens must be distinct positive counts, ascending")
        if len(routes.routes) != n or len(routes.plugin_us) != n or any(len(t) != n for t in routes.vllm_us.values()):
            raise ValueError("every route_table column must have one value per token count")
        if set(routes.routes) - {"grouped", "prefill"}:
            raise ValueError(f"route_table.route holds {sorted(set(routes.routes) - {'grouped', 'prefill'})}")
        shape = tuple(int(v) for v in data["shape"])
        if len(shape) != 5 or data["dtype"] not in DTYPE_NAMES:
            raise ValueError(f"shape must be [E, k, K, N, G] and dtype one of {DTYPE_NAMES}")
        return MeasuredTable(gpu=str(data["gpu"]), shape=shape, dtype=str(data["dtype"]), name=str(data.get("name", "")),
                             generator=str(data["generator"]), versions=dict(data.get("versions", {})), routes=routes,
                             grouped=tuple(data.get("grouped", ())), prefill=tuple(data.get("prefill", ())),
                             coserve=None if data.get("coserve") is None else _coserve_from_json(data["coserve"]),
                             coserve_humming=None if data.get("coserve_humming") is None
                             else _coserve_from_json(data["coserve_humming"], "coserve_humming"),
                             path=path)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        raise ValueError(f"measured table {path or '(unsaved)'}: {error}") from error


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-")


def file_name(gpu: str, shape: Shape, dtype: str) -> str:
    """``<gpu>_<E>-<k>-<K>-<N>-<G>_<dtype>.json``: one table per GPU model, shape and dtype."""
    return f"{slug(gpu)}_{'-'.join(map(str, shape))}_{dtype}.json"


def dumps(data: dict) -> str:
    """A table file's text: one line per field, per route-table column and per launch-table entry."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict) and key in ("route_table", "coserve", "coserve_humming"):
            inner = [f'  {json.dumps(k)}: {json.dumps(v)}' for k, v in value.items()]
            lines.append(f' {json.dumps(key)}: {{\n' + ",\n".join(inner) + "\n }")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            lines.append(f' {json.dumps(key)}: [\n' + ",\n".join(f"  {json.dumps(e)}" for e in value) + "\n ]")
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(lines) + "\n}\n"


def write_table(table: MeasuredTable, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / file_name(*table.key)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(dumps(table_to_json(table)))
    tmp.replace(path)
    return path


def read_dir(directory: Path) -> List[MeasuredTable]:
    if not directory.is_dir():
        return []
    return [table_from_json(json.loads(path.read_text()), path) for path in sorted(directory.glob("*.json"))]


def cache_dir(versions: Dict[str, str]) -> Path:
    """A user's tables for one set of versions (``tune`` writes there; startup reads there first):
    under ``$MOE_GROUPED_DECODE_CACHE`` (default ``~/.cache/moe_grouped_decode``)."""
    root = Path(os.environ.get("MOE_GROUPED_DECODE_CACHE", Path.home() / ".cache" / "moe_grouped_decode"))
    return root / "tables" / "_".join(f"{name}{slug(versions[name])}" for name in sorted(versions))


# --------------------------------------------------------------------------- lookups

_shipped: Optional[List[MeasuredTable]] = None
_extra: Dict[Tuple[str, Shape, str], MeasuredTable] = {}  # a user's (cache) and tests', over the shipped
_generation = 0  # bumped whenever the set of tables changes (lookups cached downstream key on it)


def generation() -> int:
    return _generation


def shipped_tables() -> List[MeasuredTable]:
    global _shipped
    if _shipped is None:
        _shipped = read_dir(SHIPPED_DIR)
    return _shipped


def use_cached_tables(versions: Dict[str, str]) -> List[MeasuredTable]:
    """Read a user's tables for ``versions`` (if any) over the shipped ones; returns them. A
    corrupt file is an error naming it (a table that decides admission must not be guessed)."""
    global _generation
    found = read_dir(cache_dir(versions))
    for table in found:
        _extra[table.key] = table
    _generation += 1
    return found


def all_tables() -> List[MeasuredTable]:
    tables = {t.key: t for t in shipped_tables()}
    tables.update(_extra)
    return [tables[key] for key in sorted(tables)]


def find_table(gpu: Optional[str], shape: Shape, dtype: str) -> Optional[MeasuredTable]:
    """The table measured on ``gpu`` for ``shape`` and ``dtype``, or None."""
    key = (gpu, tuple(shape), dtype)
    if key in _extra:
        return _extra[key]
    return next((t for t in shipped_tables() if t.key == key), None)


def config_table(gpu: Optional[str], shape: Shape, dtype: str) -> Optional[MeasuredTable]:
    """Where launch configs for ``shape`` come from on ``gpu``: its own table, else the
    preferred GPUs' (then any GPU's) for the same shape and dtype; None where no GPU has one."""
    own = find_table(gpu, shape, dtype)
    if own is not None:
        return own
    others = [t for t in all_tables() if t.shape == tuple(shape) and t.dtype == dtype]
    order = {name: i for i, name in enumerate(PREFERRED_GPUS)}
    others.sort(key=lambda t: (order.get(t.gpu, len(order)), t.gpu))
    return others[0] if others else None


@contextlib.contextmanager
def table_registered(table: MeasuredTable) -> Iterator[MeasuredTable]:
    """Use ``table`` over any other of its key for the duration of a block (tests, the tuner)."""
    global _generation
    previous = _extra.get(table.key)
    _extra[table.key] = table
    _generation += 1
    try:
        yield table
    finally:
        if previous is None:
            _extra.pop(table.key, None)
        else:
            _extra[table.key] = previous
        _generation += 1
