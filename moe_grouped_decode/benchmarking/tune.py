"""``python -m moe_grouped_decode tune``: measure one MoE layer shape on this GPU against vLLM's
own backends and write its measured table (route table + launch tables), the verdict and a plot.

    python -m moe_grouped_decode tune /path/to/awq-moe-checkpoint [--tensor-parallel-size 4]
                                      [--enable-expert-parallel] [--dtype bf16]
    python -m moe_grouped_decode tune --shape 128,8,2048,768,128 --dtype fp16

The shape is what one rank holds: from a checkpoint's ``config.json`` (experts, top-k, hidden,
MoE intermediate size, AWQ group size, dtype) and the parallelism as vLLM takes it (tensor
parallel splits each expert's intermediate size; expert parallel gives each rank E / size whole
experts), or given as ``E,k,K,N,G``. On the current GPU, side by side in one process on the
same synthetic weights, routing and activations, L2 kept cold by rotating layers of distinct
weights through one CUDA graph:

1. search: the grouped op's launch configs at a few token counts up to ``--grouped-max``, the
   prefill route's at a few counts above (each candidate checked against the prefill route's
   default output first; a wrong one is dropped, said why). The counts go both ends first, then
   each splitting the widest gap left, so a count ``--budget-s`` leaves unsearched lies between
   searched ones and keeps the nearest one's best: the op's default at a new shape can be many
   times slower, most at the largest counts;
2. measure: at every token count of the grid (1..``--max-tokens``, 16384 by default: vLLM's
   compile ranges reach it), the grouped op (up to ``--grouped-max``) and the prefill route
   under the configs found, and vLLM's MARLIN and HUMMING MoE backends (through the installed
   vLLM where it has its compiled ops, else the project's harnesses over vLLM's fetched
   sources, ``--vllm-sources``); then once more between neighbours whose margin is thin, so
   the grid brackets every crossing;
3. refine: the prefill route's configs searched at each count it serves with a margin under
   10% that step 1 did not search (worst first, within ``--refine-budget-s``; the configs other
   counts won first, whatever their group size), each such count then running its own best (a
   group size tuned at a power of two can straddle an expert's rows just above it) where it is
   faster when measured again as the op runs it;
4. co-serve: at the first counts (``--coserve-tokens``), the plugin's grouped decode over vLLM's
   Marlin tensors (the tune's layers in Marlin's layout) under each of a few launch configs,
   then vLLM's backends again on the same inputs (``coserve.py``): the co-serving table (its
   counts end at the first where step 2 puts vLLM clearly ahead: no window reaches past it);
   then, where the kernel can read them, over Humming's tensors under the configs picked (the
   table for engines where vLLM keeps its Humming backend);
5. decide: the grouped window (the longest run of counts from 1 where the grouped op is the
   faster route), the plugin's route and time per count, the verdict (``tables.verdict``:
   admitted only if faster than every vLLM backend at every count) and, for a shape not
   admitted, the co-serving verdict (``tables.coserve_verdict``: the counts from 1 where the
   co-served kernel beats vLLM, the rest left to vLLM's own backend).

``--coserve-only`` measures step 4 alone and writes it into the shape's existing table.

``--compile-workers N`` compiles the search's candidates in N processes before step 1 (each
launched once at the counts it will be timed at, into Triton's on-disk cache), within the
search's budget: at a new shape a candidate's first launch otherwise sits in the compiler for
seconds, one after another, and the budget ends after a few counts.

Writes the measured table to a user's cache (``tables.cache_dir``, keyed by GPU, shape, dtype
and the torch / Triton / vLLM versions), which the vLLM plugin reads at startup, or with
``--ship`` to the package's ``tables/``; and ``--report-dir``'s JSON, Markdown and plot. A shape
takes about 3-5 minutes on one GPU (``--budget-s`` cuts the search short, never the
measurement). Progress is printed as it goes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .. import tables
from .coserve import COSERVE_TOKENS, humming_refusal, measure_coserve, measure_coserve_humming
from .coserve import markdown as coserve_markdown
from .precompile import CompileJob, compile_candidates, jobs_for

# token counts timed on every route (to --max-tokens): every count where decode batches live,
# then about three a doubling, where the routes and vLLM's backends cross
DEFAULT_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 40, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384,
                  512, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 12288, 16384)
GROUPED_SEARCH_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
PREFILL_SEARCH_TOKENS = (256, 512, 1024, 2048, 4096, 8192, 16384)
# between two measured counts whose margin over vLLM is below this, one more count is measured
THIN_MARGIN = 1.05
# a prefill-route count whose margin is below this gets its own config search (step 3)
REFINE_MARGIN = 1.10
# a candidate config must agree with the prefill route's default this well (max |diff| / max |ref|):
# the ops' fp16 bound; bf16's correctly rounded outputs alone can sit 2^-8 apart, 8x it
SCALED_DIFF_BOUND = {"fp16": 2e-3, "bf16": 16e-3}
# the bytes one token's experts span over a layer rotation, at least (several times an H100's /
# H200's L2, so even one-token steps read cold weights); and the rotation's weights at most per
# copy (vLLM's backends keep copies of their own beside ours)
COLD_BYTES, MAX_ROTATION_BYTES = 256e6, 12e9

_CONFIG_KEYS = {
    "experts": ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "moe_top_k", "top_k"),
    "intermediate": ("moe_intermediate_size", "intermediate_size"),
}


# --------------------------------------------------------------------------- the layer's shape


@dataclass(frozen=True)
class LayerSpec:
    shape: tables.Shape  # what one rank holds: (E, k, K, N, G)
    dtype: str  # "fp16" or "bf16"
    name: str  # a label for people


def _first(config: dict, keys: Iterable[str], what: str, path: str):
    for key in keys:
        if config.get(key):
            return config[key]
    raise ValueError(f"{path}: no {what} ({' / '.join(keys)}) in config.json")


def spec_from_checkpoint(directory: Path, tensor_parallel_size: int = 1, enable_expert_parallel: bool = False,
                         dtype: Optional[str] = None) -> LayerSpec:
    """One rank's MoE layer of the AWQ checkpoint in ``directory`` under vLLM's parallelism:
    tensor parallel splits each expert's intermediate size N by ``tensor_parallel_size``;
    expert parallel (vLLM's ``--enable-expert-parallel``, over the same ranks) gives each rank
    E / size whole experts instead."""
    path = Path(directory) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: cannot read it ({error}); pass a Hugging Face checkpoint directory") from None
    text = config.get("text_config") or config
    quant = config.get("quantization_config") or text.get("quantization_config") or {}
    if str(quant.get("quant_method", "")).lower() != "awq" or int(quant.get("bits", quant.get("w_bit", 0))) != 4:
        raise ValueError(f"{path}: not an AWQ 4-bit checkpoint (quantization_config {quant or 'missing'})")
    E = int(_first(text, _CONFIG_KEYS["experts"], "expert count", str(path)))
    k = int(_first(text, _CONFIG_KEYS["top_k"], "experts per token", str(path)))
    N = int(_first(text, _CONFIG_KEYS["intermediate"], "MoE intermediate size", str(path)))
    K = int(_first(text, ("hidden_size",), "hidden size", str(path)))
    G = int(quant.get("group_size", quant.get("q_group_size", 128)))
    size = max(1, int(tensor_parallel_size))
    if enable_expert_parallel:
        if E % size:
            raise ValueError(f"{path}: {E} experts do not split over {size} expert-parallel ranks")
        E_rank, N_rank = E // size, N
    else:
        if N % size:
            raise ValueError(f"{path}: intermediate size {N} does not split over {size} tensor-parallel ranks")
        E_rank, N_rank = E, N // size
    torch_dtype = str(text.get("torch_dtype") or config.get("torch_dtype") or "float16")
    dtype = dtype or ("bf16" if "bfloat16" in torch_dtype else "fp16")
    parallel = f"{'EP' if enable_expert_parallel else 'TP'}{size}"
    name = f"{Path(directory).resolve().name}-{parallel.lower()}"
    return LayerSpec((E_rank, k, K, N_rank, G), dtype, name)


def spec_from_shape(text: str, dtype: str, name: Optional[str] = None) -> LayerSpec:
    try:
        shape = tuple(int(v) for v in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 5 or min(shape) < 1:
        raise ValueError(f"--shape {text!r}: give E,k,K,N,G (experts, top-k, hidden, intermediate per rank, group), "
                         "e.g. 128,8,2048,768,128")
    return LayerSpec(shape, dtype, name or "x".join(map(str, shape)))


def check_spec(spec: LayerSpec) -> None:
    """What the plugin's kernels take: K, N and G multiples of 32, G dividing K and N, k <= E."""
    E, k, K, N, G = spec.shape
    problems = [f"{what}={v} is not a multiple of 32" for what, v in (("K", K), ("N", N), ("G", G)) if v % 32]
    problems += [f"G={G} does not divide {what}={v}" for what, v in (("K", K), ("N", N)) if v % G]
    if k > E:
        problems.append(f"k={k} > E={E}")
    if problems:
        raise ValueError(f"shape {spec.shape}: " + "; ".join(problems) + " (the plugin's kernels cannot serve it)")


# --------------------------------------------------------------------------- the decisions (pure)


def token_grid(max_tokens: int, extra: Sequence[int] = ()) -> Tuple[int, ...]:
    """The default counts up to ``max_tokens``, ``max_tokens`` itself and ``extra``."""
    return tuple(sorted({m for m in DEFAULT_TOKENS if m <= max_tokens} | {max_tokens} | set(extra)))


def grouped_window(tokens: Sequence[int], grouped_us: Sequence[Optional[float]],
                   prefill_us: Sequence[float]) -> Optional[Tuple[int, int]]:
    """(1, hi): the longest run of measured counts from the smallest (which must be 1) where the
    grouped op is at least as fast as the prefill route; None where it loses at 1 token. A win
    after a loss does not count: the window is one range."""
    hi = None
    for m, grouped, prefill in zip(tokens, grouped_us, prefill_us):
        if grouped is None or grouped > prefill:
            break
        hi = m
    return None if hi is None or tokens[0] != 1 else (1, hi)


def thin_pairs(tokens: Sequence[int], speedups: Sequence[Optional[float]], margin: float = THIN_MARGIN) -> List[int]:
    """A count between each pair of neighbours (their geometric mean) where either side's
    speedup over vLLM is below ``margin`` or they straddle 1, not yet measured."""
    new = []
    for (a, sa), (b, sb) in zip(zip(tokens, speedups), zip(tokens[1:], speedups[1:])):
        if b - a < 2 or sa is None or sb is None:
            continue
        if min(sa, sb) < margin or (sa - 1) * (sb - 1) < 0:
            mid = round(math.sqrt(a * b))
            if a < mid < b:
                new.append(mid)
    return sorted(set(new) - set(tokens))


def route_table(tokens: Sequence[int], grouped_us: Sequence[Optional[float]], prefill_us: Sequence[float],
                vllm_us: Dict[str, Sequence[Optional[float]]]) -> tables.RouteTable:
    window = grouped_window(tokens, grouped_us, prefill_us)
    routes = tuple("grouped" if window and m <= window[1] else "prefill" for m in tokens)
    plugin = tuple(g if r == "grouped" else p for r, g, p in zip(routes, grouped_us, prefill_us))
    return tables.RouteTable(tokens=tuple(tokens), routes=routes, plugin_us=plugin,
                             vllm_us={b: tuple(v) for b, v in vllm_us.items()}, grouped_tokens=window)


def entry_for(best: Dict[int, object], M: int):
    """The config of ``best`` ({M: config} as launch-table entries) that serves ``M``: the entry
    of the smallest M at or above it, the largest entry above them all."""
    at = min((m for m in best if m >= M), default=max(best))
    return best[at]


def per_count_entries(best: Dict[int, object], counts: Sequence[int], refined: Dict[int, object]) -> Dict[int, object]:
    """Entries that give each measured count of ``counts`` its ``refined`` config, or else the one
    it ran under ``best``, and keep every other count's config as ``best`` gave it (``best``'s
    entries are among ``counts``); an entry whose config equals the next one's is dropped (the
    next serves its counts too)."""
    counts = sorted(set(counts) | set(best))
    wanted = {m: refined.get(m, entry_for(best, m)) for m in counts}
    return {m: c for i, (m, c) in enumerate(wanted.items()) if i + 1 == len(counts) or wanted[counts[i + 1]] != c}


def refine_counts(tokens: Sequence[int], routes: Sequence[str], speedups: Sequence[Optional[float]],
                  searched: Iterable[int], margin: float = REFINE_MARGIN) -> List[int]:
    """The prefill route's counts worth their own search: served by it, not yet searched, the
    margin over vLLM under ``margin``; the worst first."""
    searched = set(searched)
    thin = [(s, m) for m, r, s in zip(tokens, routes, speedups)
            if r == "prefill" and m not in searched and s is not None and s < margin]
    return [m for _, m in sorted(thin)]


def configs_by_distance(grid: Sequence[int], M: int, config_of: Callable[[int], object]) -> list:
    """The configs the counts of ``grid`` other than ``M`` run (``config_of``), each once, the
    nearest count's (in log2 M; a tie: the smaller count's) first."""
    order = sorted((m for m in grid if m != M), key=lambda m: (abs(math.log2(m / M)), m))
    return list(dict.fromkeys(config_of(m) for m in order))


def launch_table_entries(best: Dict[int, object], family: Optional[str] = None) -> Tuple[dict, ...]:
    """Launch-table entries from {M: config}: an entry serves every M up to its own."""
    entries = []
    for M in sorted(best):
        entry = {"M": M, "config": dataclasses.asdict(best[M])}
        entries.append({"kernels": family, **entry} if family else entry)
    return tuple(entries)


# --------------------------------------------------------------------------- progress


class Progress:
    """One line per step: a bar, the step, seconds so far and an estimate of what is left."""

    def __init__(self, total: int, out=sys.stdout):
        self.total, self.done, self.started, self.out = max(1, total), 0, time.time(), out

    def add(self, steps: int) -> None:
        self.total += steps

    def step(self, what: str) -> None:
        self.done += 1
        elapsed = time.time() - self.started
        left = elapsed / self.done * (self.total - self.done)
        filled = int(24 * self.done / self.total)
        print(f"[tune] [{'#' * filled}{'.' * (24 - filled)}] {self.done}/{self.total} {what} "
              f"({elapsed:.0f} s, ~{left:.0f} s left)", file=self.out, flush=True)


# --------------------------------------------------------------------------- measuring

Clock = Callable[[Callable[[int], None], int, tuple], float]  # (step, calls, key) -> us per call


@dataclass
class Measurement:
    """The weights, inputs and clocks one tune runs on (the GPU's by default; tests give their own)."""

    spec: LayerSpec
    layers: list  # AwqMoeWeights of distinct weights, rotated through every timing
    clock: Clock
    vllm_timer: Callable[[Dict[int, tuple]], Dict[str, object]]  # {M: inputs} -> {backend: {M: us} or why not}
    device: object
    large_layers: int = 8  # layers rotated where every expert is read (large M)
    seed: int = 0

    def inputs(self, M: int):
        """Routing and activations for ``M`` tokens on each rotated layer, the same for every route."""
        import torch

        from .bench import random_layer_inputs

        E, k, K, _, _ = self.spec.shape
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + M)
        return random_layer_inputs(M, k, E, K, self.count(M), self.layers[0].w13_scales.dtype, self.device, gen)

    def count(self, M: int) -> int:
        E, k = self.spec.shape[:2]
        return len(self.layers) if M * k < 4 * E else min(len(self.layers), self.large_layers)


def _scaled_diff(out, want) -> float:
    want = want.float()
    return ((out.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def plausible_prefill(candidates: Sequence, M: int, shape: tables.Shape) -> list:
    """The prefill candidates worth timing at ``M``: groups of rows from an eighth to four times
    the rows an active expert has on average (smaller ones dequantize its weights too often,
    larger ones are mostly padding), and at least every candidate of the two group sizes nearest
    to it (a size has several variants: W2's unrolled pieces, its tiles a program)."""
    rows = _rows_an_expert_has(M, shape)
    sizes = sorted({c.group_rows for c in candidates}, key=lambda size: abs(math.log2(size / rows)))
    return [c for c in candidates if group_rows_fit(c, M, shape) or c.group_rows in sizes[:2]]


def _rows_an_expert_has(M: int, shape: tables.Shape) -> float:
    E, k = shape[:2]
    return max(1.0, M * k / min(E, M * k))


def group_rows_fit(config, M: int, shape: tables.Shape) -> bool:
    """A prefill config's groups span an eighth to four times the rows an active expert has at ``M``."""
    rows = _rows_an_expert_has(M, shape)
    return rows / 8 <= config.group_rows <= 4 * rows


def search_order(token_counts: Iterable[int]) -> List[int]:
    """The order ``search`` visits ``token_counts`` in: the largest, the smallest, then again and
    again the count nearest the middle (in log2 M) of the widest gap between counts already taken
    (ties: the upper gap, the larger count). A budget that runs out then leaves the counts it did
    not reach spread between searched ones, each near one whose best it can keep, not all at the
    top, where the op's default config is at its worst and a search matters most."""
    left = sorted(set(token_counts))
    if len(left) <= 2:
        return left[::-1]
    order = [left.pop(), left.pop(0)]
    while left:
        taken = sorted(order)
        gaps = [(math.log2(b) - math.log2(a), a, b) for a, b in zip(taken, taken[1:])
                if any(a < m < b for m in left)]
        _, a, b = max(gaps, key=lambda g: (g[0], g[1]))
        middle = (math.log2(a) + math.log2(b)) / 2
        pick = min((m for m in left if a < m < b), key=lambda m: (abs(math.log2(m) - middle), -m))
        left.remove(pick)
        order.append(pick)
    return order


# a count the budget leaves keeps a searched count's best only within this many doublings of it
FALLBACK_DOUBLINGS = 2


def nearest_searched(M: int, searched: Iterable[int]) -> Optional[int]:
    """The count of ``searched`` nearest ``M`` in log2 M (ties: the larger) within
    ``FALLBACK_DOUBLINGS``; None if there is none."""
    near = [m for m in searched if abs(math.log2(m / M)) <= FALLBACK_DOUBLINGS]
    return min(near, key=lambda m: (abs(math.log2(m / M)), -m), default=None)


def search(measure: Measurement, route: str, token_counts: Sequence[int], candidates: Sequence, progress: Progress,
           deadline: float, log=print, always: Sequence = (), searched: Optional[set] = None) -> Dict[int, object]:
    """The fastest of ``candidates`` at each count (``route``: "grouped" or "prefill"), among
    those whose output on the first layer agrees with the prefill route's default config. A
    config that cannot run at this shape is dropped from the rest of the search, said why.
    ``always``: candidates timed first at every count, whatever the prefill route's group-size
    filter says.

    The counts are visited in ``search_order``. Past ``deadline`` (time.time()) the search stops:
    each count it did not reach keeps the best of the searched count nearest it (in log2 M, at
    most ``FALLBACK_DOUBLINGS`` away; on the prefill route one whose groups suit this count; that
    config ran at this shape and agreed there), said so, for the op's default at a count it never
    saw can be many times slower; only where no such count was searched (or no candidate ran at
    the count itself) does a count keep the config the op would run without this tune (another
    GPU's table, or the default). ``searched``, if given, gets the counts actually searched."""
    import torch

    from ..kernels import config as kernel_config
    from ..kernels import device_name
    from ..kernels.lookup import launch_choice
    from ..ops import alloc_workspace, launch_grouped, launch_prefill

    E, k, K, N, G = measure.spec.shape
    dtype = measure.layers[0].w13_scales.dtype
    best, broken = {}, set()
    found: Dict[int, float] = {}  # searched count -> its best's time
    rejected: Dict[int, set] = {}  # count -> configs that disagreed or did not run there
    cut: List[int] = []  # counts the budget left without a timed config
    every = list(dict.fromkeys(list(always) + list(candidates)))
    workspace = alloc_workspace(max(token_counts), k, K, N, measure.device) if route == "grouped" else None
    for M in search_order(token_counts):
        if time.time() > deadline:  # nothing more is timed: skip the inputs and the reference too
            for _ in every:
                progress.step(f"search {route} M={M}")
            cut.append(M)
            continue
        ids, tws, xs = measure.inputs(M)
        outs = [torch.empty_like(x) for x in xs]
        want = torch.empty_like(xs[0])
        launch_prefill(xs[0], tws[0], ids[0], measure.layers[0], want, kernel_config.PrefillConfig())
        timed = []
        worth = plausible_prefill(candidates, M, measure.spec.shape) if route == "prefill" else list(candidates)
        worth += list(always)
        for config in every:
            progress.step(f"search {route} M={M}")
            if time.time() > deadline or config in broken or config not in worth:
                continue
            if route == "grouped":
                fitted = config.fitted(K)

                def step(i, config=fitted):
                    launch_grouped(xs[i], tws[i], ids[i], measure.layers[i], workspace, outs[i], config)
            else:
                def step(i, config=config):
                    launch_prefill(xs[i], tws[i], ids[i], measure.layers[i], outs[i], config)
            outs[0].fill_(float("nan"))
            try:
                step(0)
            except Exception as error:  # a config this shape cannot take (too much shared memory, ...)
                broken.add(config)
                rejected.setdefault(M, set()).add(config)
                log(f"[tune] {route}: {config} does not run at this shape: {type(error).__name__}: {error}"[:400])
                continue
            diff = _scaled_diff(outs[0], want)
            if not diff <= SCALED_DIFF_BOUND[measure.spec.dtype]:
                rejected.setdefault(M, set()).add(config)
                log(f"[tune] {route} M={M}: {config} disagrees with the prefill route (scaled diff {diff:.1e}): dropped")
                continue
            timed.append((measure.clock(step, measure.count(M), (route, M, config)), config))
        if timed:
            found[M], best[M] = min(timed, key=lambda t: t[0])
            log(f"[tune] {route} M={M}: {found[M]:.2f} us/layer with {best[M]}")
        elif time.time() > deadline:
            cut.append(M)
        else:
            best[M] = None  # no candidate ran here: the op's own config, below
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    shape = measure.spec.shape
    for M in sorted(set(token_counts) - set(found)):
        # a neighbour's best only where it is not known to fail (dropped at this shape, or rejected
        # here) and, on the prefill route, where its groups suit this count's rows an expert
        usable = [m for m in found if best[m] not in broken and best[m] not in rejected.get(M, ())
                  and (route == "grouped" or group_rows_fit(best[m], M, shape))]
        near = nearest_searched(M, usable) if M in cut else None
        if near is not None:
            best[M] = best[near]
            log(f"[tune] {route} M={M}: not searched (budget spent): keeps M={near}'s best {best[M]}")
            continue
        best[M] = (launch_choice(measure.device, shape, dtype, M, route="grouped").config if route == "grouped" else
                   kernel_config.prefill_config(shape, device_name(measure.device), measure.spec.dtype, M))
        why = "budget spent, no searched count's best to keep" if M in cut else "no candidate ran"
        log(f"[tune] {route} M={M}: not searched ({why}): keeps the op's own {best[M]}")
    if searched is not None:
        searched.update(found)
    return {M: best[M] for M in sorted(best)}


@dataclass
class Timings:
    """What one count measured: the grouped op (None past --grouped-max), the prefill route and
    each vLLM backend (None where it was not measured)."""

    grouped_us: Optional[float]
    prefill_us: float
    vllm_us: Dict[str, Optional[float]]


def time_routes(measure: Measurement, tokens: Sequence[int], grouped_max: int, progress: Progress,
                missing: dict) -> Dict[int, Timings]:
    """Each count of ``tokens`` on the grouped op (up to ``grouped_max``), the prefill route and
    vLLM's backends, as the runtime runs them: the ops themselves, their configs looked up in the
    draft table the caller registered. A vLLM backend that cannot run here is said in ``missing``."""
    import torch

    from ..ops import alloc_workspace

    E, k, K, N, G = measure.spec.shape
    ops = torch.ops.moe_grouped_decode
    grouped_counts = [m for m in tokens if m <= grouped_max]
    workspace = alloc_workspace(max(grouped_counts), k, K, N, measure.device) if grouped_counts else None
    out, inputs = {}, {}
    for M in tokens:
        ids, tws, xs = inputs[M] = measure.inputs(M)
        grouped = None
        if M <= grouped_max:
            progress.step(f"grouped M={M}")
            grouped = measure.clock(lambda i: ops.awq_moe_grouped_decode(
                xs[i], tws[i], ids[i], *measure.layers[i].op_args(), workspace), measure.count(M), ("grouped", M))
        progress.step(f"prefill M={M}")
        prefill = measure.clock(lambda i: ops.awq_moe_dense(xs[i], tws[i], ids[i], *measure.layers[i].op_args()),
                                measure.count(M), ("prefill", M))
        out[M] = Timings(grouped, prefill, {})
    progress.step(f"vLLM's backends at {len(tokens)} counts")
    for backend, times in measure.vllm_timer(inputs).items():
        if not isinstance(times, dict):
            missing[backend] = times
            times = {}
        for M in tokens:
            out[M].vllm_us[backend] = times.get(M)
    return out


def tune(measure: Measurement, gpu: str, versions: Dict[str, str], max_tokens: int = tables.LARGEST_STEP,
         grouped_max: int = 256, budget_s: float = 130.0, refine: bool = True, refine_budget_s: float = 45.0,
         generator: str = "",
         grouped_candidates: Sequence = (), prefill_candidates: Sequence = (), family: str = "gluon",
         compile_workers: int = 0, coserve_tokens: Sequence[int] = (), log=print) -> Tuple[tables.MeasuredTable, dict]:
    """Search, measure and decide (module docstring); returns the table and what could not be
    measured ({"missing": {backend: why}}). ``compile_workers``: compile the search's candidates in
    that many processes first (``precompile``), within the search's budget; ``coserve_tokens``:
    the counts of the co-serving table (none: no table)."""
    tokens = token_grid(max_tokens)
    grouped_search = [m for m in GROUPED_SEARCH_TOKENS if m <= grouped_max]
    prefill_search = sorted({m for m in PREFILL_SEARCH_TOKENS if m <= max_tokens} | {max_tokens})
    progress = Progress(len(grouped_search) * len(grouped_candidates) + len(prefill_search) * len(prefill_candidates)
                        + len(tokens) + sum(m <= grouped_max for m in tokens) + 1
                        + (coserve_steps(measure.spec.shape, coserve_tokens) if coserve_tokens else 0))
    if compile_workers > 0:
        began = time.time()
        try:
            compile_candidates(measure.spec.shape, measure.spec.dtype,
                               compile_jobs(measure.spec.shape, grouped_search, grouped_candidates, prefill_search,
                                            prefill_candidates),
                               compile_workers, timeout_s=budget_s / 2, log=log,
                               max_grouped=max(grouped_search, default=0))
        except Exception as error:  # the workers only save the search time: it compiles what they did not
            log(f"[tune] compiling in workers failed: {type(error).__name__}: {error}"[:300])
        # the search keeps at least half its budget: the workers cannot take the timing's share
        budget_s = max(budget_s - (time.time() - began), budget_s / 2)
    # each route's search gets its share of the budget (new shapes compile every candidate first)
    started = time.time()
    grouped_share = budget_s * len(grouped_search) / max(1, len(grouped_search) + len(prefill_search))
    best_grouped = search(measure, "grouped", grouped_search, grouped_candidates, progress, started + grouped_share, log)
    prefill_searched: set = set()
    best_prefill = search(measure, "prefill", prefill_search, prefill_candidates, progress, started + budget_s, log,
                          searched=prefill_searched)

    def table_of(timings: Dict[int, Timings]) -> tables.MeasuredTable:
        counts = sorted(timings)
        backends = sorted({b for t in timings.values() for b in t.vllm_us})
        routes = route_table(counts, [timings[m].grouped_us for m in counts], [timings[m].prefill_us for m in counts],
                             {b: [timings[m].vllm_us.get(b) for m in counts] for b in backends})
        return tables.MeasuredTable(gpu=gpu, shape=measure.spec.shape, dtype=measure.spec.dtype, name=measure.spec.name,
                                    generator=generator, versions=versions, routes=routes,
                                    grouped=launch_table_entries(best_grouped, family),
                                    prefill=launch_table_entries(best_prefill), coserve=coserve,
                                    coserve_humming=coserve_humming)

    coserve = coserve_humming = None
    missing: dict = {}
    with tables.table_registered(table_of({1: Timings(None, 0.0, {})})):  # the ops look configs up here, as at run time
        timings = time_routes(measure, tokens, grouped_max, progress, missing)
        more = thin_pairs(sorted(timings), table_of(timings).routes.speedups()) if refine else []
        if more:
            log(f"[tune] thin margins: {len(more)} counts more between neighbours: {more}")
            progress.add(len(more) + sum(m <= grouped_max for m in more) + 1)
            timings.update(time_routes(measure, more, grouped_max, progress, missing))
    if refine and prefill_candidates:
        best_prefill = refine_prefill(measure, timings, best_prefill, prefill_candidates, table_of, progress,
                                      time.time() + refine_budget_s, log, searched=prefill_searched)
    if coserve_tokens:
        coserve, coserve_humming = measure_coserving(measure, coserve_tokens, table_of(timings).routes, progress,
                                                     generator, log)
    return table_of(timings), {"missing": missing, "timings": {m: dataclasses.asdict(t) for m, t in timings.items()}}


def coserve_steps(shape, coserve_tokens: Sequence[int]) -> int:
    """The progress steps of :func:`measure_coserving`."""
    return len(coserve_tokens) + 1 + (len(coserve_tokens) if humming_refusal(shape) is None else 0)


def measure_coserving(measure: Measurement, coserve_tokens: Sequence[int], routes: tables.RouteTable, progress,
                      generator: str, log=print) -> Tuple[tables.CoserveTable, Optional[tables.CoserveTable]]:
    """The co-serving tables: over Marlin's tensors, then (where the kernel can read them) over
    Humming's, for engines where vLLM keeps Humming."""
    coserve = measure_coserve(measure, coserve_tokens, step=progress.step, log=log, generator=generator,
                              vllm_best_us=vllm_best_by_count(routes))
    why = humming_refusal(measure.spec.shape)
    if why is not None:
        log(f"[coserve] not over Humming's tensors: {why}")
        return coserve, None
    for _ in range(len(coserve_tokens) - len(coserve.tokens)):
        progress.step("co-served (humming): not measured")
    return coserve, measure_coserve_humming(measure, coserve, step=progress.step, log=log, generator=generator)


def vllm_best_by_count(routes: tables.RouteTable) -> Dict[int, float]:
    """vLLM's faster backend per count a route table measured it at."""
    best = {m: routes.vllm_best_us(i) for i, m in enumerate(routes.tokens)}
    return {m: us for m, us in best.items() if us is not None}


def compile_jobs(shape, grouped_search: Sequence[int], grouped_candidates: Sequence, prefill_search: Sequence[int],
                 prefill_candidates: Sequence) -> List[CompileJob]:
    """What the first ``search`` of each route will launch: each grouped candidate at the grouped
    counts, each prefill candidate at the prefill counts whose group-size filter keeps it, and the
    prefill route's default config (every count's reference output) at each of them, a job a
    count so that no one worker compiles all its buckets. (The refinement and the measurement
    launch the winners at more counts; those compile there.)"""
    from ..kernels.config import PrefillConfig

    timed_at = {M: plausible_prefill(prefill_candidates, M, shape) for M in prefill_search}
    jobs = jobs_for("grouped", grouped_candidates, grouped_search)
    jobs += jobs_for("prefill", prefill_candidates, prefill_search,
                     counts_for=lambda config: [M for M in prefill_search if config in timed_at[M]])
    references = [CompileJob("prefill", PrefillConfig(), (M,)) for M in sorted({*grouped_search, *prefill_search})]
    return references + [job for job in jobs if job.config != PrefillConfig()]


def refine_prefill(measure: Measurement, timings: Dict[int, "Timings"], best: Dict[int, object],
                   candidates: Sequence, table_of: Callable, progress: Progress, deadline: float,
                   log=print, searched: Optional[Iterable[int]] = None) -> Dict[int, object]:
    """Step 3 of the module docstring: search the prefill route's configs at each count
    ``refine_counts`` names (until ``deadline``; the config it runs timed first), give each
    measured count its own entry and time the prefill route again where a count's config changed
    (``timings`` updated in place), keeping a change only where it is faster as the op runs it;
    returns the new entries. A count between two measured ones runs the upper one's config, as
    everywhere in the tables: the grid brackets it, it is not itself timed. ``searched``: the
    counts the first search reached (default: ``best``'s); one it did not reach runs a
    neighbour's best and is searched again here like any other, worst margin first."""
    routes = table_of(timings).routes
    counts = refine_counts(routes.tokens, routes.routes, routes.speedups(), best if searched is None else searched)
    if not counts:
        return best
    log(f"[tune] prefill configs searched again at {len(counts)} counts with a margin under "
        f"{REFINE_MARGIN:.2f}x: {counts}")
    refined: Dict[int, object] = {}
    grid = sorted(timings)
    with tables.table_registered(table_of(timings)):
        for M in counts:
            if time.time() > deadline:
                log(f"[tune] refine: budget spent; {len(counts) - len(refined)} counts keep their configs")
                break
            current = entry_for(best, M)  # timed first, so a search cut short cannot drop it
            # the configs other measured counts run come first, the nearest count's first, whatever
            # their group size: a config can win for what the group-size filter does not weigh (W2's
            # unrolled pieces, its tiles a program), and they are few
            winners = configs_by_distance(grid, M, lambda m: refined.get(m, entry_for(best, m)))
            worth = [c for c in dict.fromkeys(winners + plausible_prefill(candidates, M, measure.spec.shape))
                     if c != current]
            progress.add(len(worth) + 1)
            refined.update(search(measure, "prefill", [M], worth, progress, deadline, log, always=(current,)))
    counts_measured = sorted(timings)
    entries = per_count_entries(best, counts_measured, refined)
    changed = [m for m in counts_measured if entry_for(entries, m) != entry_for(best, m)]
    if not changed:
        return best
    log(f"[tune] refine: new configs at {changed}; timed again")
    progress.add(len(changed))
    import torch

    ops = torch.ops.moe_grouped_decode
    before = {m: timings[m].prefill_us for m in changed}
    with tables.table_registered(dataclasses.replace(table_of(timings), prefill=launch_table_entries(entries))):
        for M in changed:
            ids, tws, xs = measure.inputs(M)
            progress.step(f"prefill M={M} (refined)")
            timings[M].prefill_us = measure.clock(
                lambda i: ops.awq_moe_dense(xs[i], tws[i], ids[i], *measure.layers[i].op_args()),
                measure.count(M), ("prefill", M))
    # the route as the op runs it must beat what it replaces, or the count keeps its config and time
    slower = [m for m in changed if not timings[m].prefill_us < before[m]]
    if slower:
        log(f"[tune] refine: no faster as the op runs it at {slower}: those keep their configs")
        for m in slower:
            refined[m] = entry_for(best, m)
            timings[m].prefill_us = before[m]
        entries = per_count_entries(best, counts_measured, refined)
    return entries


# --------------------------------------------------------------------------- candidates


def grouped_candidates(capability, family: str) -> list:
    """The grouped op's search space for a new shape: every config the shipped tables hold for this
    kernel family, the default with W13 splits of 128, 256 and 512 rows, per routed row and over
    the sort's groups (one and two 8-row blocks a program)."""
    from ..kernels.config import GroupedConfig, config_from_fields, over_groups_candidates

    found = [config_from_fields(e["config"]) for t in tables.shipped_tables() for e in t.grouped
             if e.get("kernels") == family]
    base = GroupedConfig() if family == "gluon" else GroupedConfig().as_tl()
    found += [dataclasses.replace(base, w13_block_k=rows) for rows in (256, 128, 512)]
    found += over_groups_candidates(family)
    return list(dict.fromkeys(c for c in found if c is not None))


def prefill_candidates(capability, shape: Optional[tables.Shape] = None) -> list:
    """The prefill route's search space. On Hopper the wgmma kernels: every config the shipped
    tables hold, one per group size from 8 to 128 rows and two more of 128 rows over narrow W13
    tiles; for a ``shape`` whose W2 tile has 9-16 pieces, 16- and 32-row groups with those
    pieces unrolled (one and four tiles a program); for a layer of few W2 programs (every expert
    active, four tiles a program, at most 512), 16- and 32-row groups of one and two W2 tiles a
    program. Elsewhere the mma kernels over 8- and 16-row groups and the dot kernels over 32 to
    128 (``kernels.config.prefill_candidates``'s first variants)."""
    from ..kernels.config import MAX_UNROLLED_PIECES, PrefillConfig, prefill_candidates as all_candidates

    if tuple(capability) >= (9, 0):
        found = [PrefillConfig(**e["config"]) for t in tables.shipped_tables() for e in t.prefill]
        found = [c for c in found if c.kernel == "wgmma"]
        found += [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3, w2_stages=4)
                  for rows in (8, 16, 32, 64)]
        # 128-row groups halve the weights' dequantizations where experts hold 130-1000 rows; W13's
        # narrow tiles keep its accumulator at 64 registers a thread there
        found += [PrefillConfig(kernel="wgmma", block_rows=128, w13_block_k=32, w13_stages=3, w2_stages=3)]
        found += [PrefillConfig(kernel="wgmma", block_rows=128, w13_block_k=64, w13_stages=stages, w2_stages=3,
                                w13_tiles="narrow") for stages in (2, 3)]
        if shape is not None:
            E, _, K, N, _ = shape
            pieces = N // 32
            if 8 < pieces <= MAX_UNROLLED_PIECES:  # a ring stage a piece: one allocation each, fewer barriers
                # (over one tile a program, about half the registers of four)
                found += [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3,
                                        w2_stages=pieces, w2_unrolled_pieces=MAX_UNROLLED_PIECES,
                                        w2_tiles_per_program=tiles) for rows in (16, 32) for tiles in (1, 4)]
            if E * -(-K // 512) <= 512:
                found += [PrefillConfig(kernel="wgmma", block_rows=rows, w13_block_k=64, w13_stages=3, w2_stages=4,
                                        w2_tiles_per_program=tiles) for rows in (16, 32) for tiles in (1, 2)]
    else:
        found = [c for c in all_candidates() if c.kernel == "mma"]
        seen_rows: set = set()
        for c in all_candidates():
            if c.kernel == "dot" and c.block_rows <= 128 and c.block_rows not in seen_rows:
                seen_rows.add(c.block_rows)
                found.append(c)
    return list(dict.fromkeys(found))


# --------------------------------------------------------------------------- reports


def markdown(table: tables.MeasuredTable, verdict: tables.Verdict) -> str:
    r = table.routes
    backends = list(r.vllm_us)
    lines = [f"# {table.name}: E={table.shape[0]} k={table.shape[1]} K={table.shape[2]} N={table.shape[3]} "
             f"G={table.shape[4]} {table.dtype} on {table.gpu}", "",
             f"Verdict: **{'admitted' if verdict.admitted else 'not admitted'}**: {verdict.reason}", "",
             f"Grouped window: {r.grouped_tokens or 'none (the prefill route at every M)'}; `{table.generator}`", "",
             "| M | route | plugin us | " + " | ".join(f"{b} us" for b in backends) + " | speedup |",
             "| --- | --- | --- | " + " | ".join("---" for _ in backends) + " | --- |"]
    for i, (m, route, us, s) in enumerate(zip(r.tokens, r.routes, r.plugin_us, r.speedups())):
        cells = " | ".join("n/a" if r.vllm_us[b][i] is None else f"{r.vllm_us[b][i]:.1f}" for b in backends)
        shown = "n/a" if s is None else (f"**{s:.2f}x**" if s > 1 else f"{s:.2f}x")
        lines.append(f"| {m} | {route} | {us:.1f} | {cells} | {shown} |")
    return "\n".join(lines) + "\n"


def plot(table: tables.MeasuredTable, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r = table.routes
    fig, ax = plt.subplots(figsize=(8, 4.5))
    points = [(m, s) for m, s in zip(r.tokens, r.speedups()) if s is not None]
    ax.plot([m for m, _ in points], [s for _, s in points], "o-", label="vLLM's faster backend / plugin")
    for layout, c in (("Marlin", table.coserve), ("Humming", table.coserve_humming)):
        if c is None:
            continue
        shared = [(m, c.vllm_best_us(i) / c.coserved_us[i]) for i, m in enumerate(c.tokens)
                  if c.vllm_best_us(i) is not None]
        ax.plot([m for m, _ in shared], [s for _, s in shared], "s--" if layout == "Marlin" else "^:",
                label=f"vLLM's faster backend / co-served kernel ({layout} tensors)")
    ax.axhline(1.0, color="grey", lw=1)
    if r.grouped_tokens:
        ax.axvspan(r.grouped_tokens[0], r.grouped_tokens[1], color="tab:green", alpha=0.1, label="grouped route")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens per step (M)")
    ax.set_ylabel("speedup over vLLM (>1: plugin faster)")
    ax.set_title(f"{table.name} ({'x'.join(map(str, table.shape))} {table.dtype}) on {table.gpu}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- the GPU run


def versions() -> Dict[str, str]:
    import torch
    import triton

    from .vllm_moe.ops import VLLM_SERIES, installed_vllm_version
    from .vllm_moe.sources import VLLM_VERSION

    installed = installed_vllm_version()
    # the vLLM whose kernels the table was measured against: an installed 0.32, else the fetched sources'
    vllm_version = installed if installed and installed.startswith(VLLM_SERIES) else f"{VLLM_VERSION} (sources)"
    return {"torch": torch.__version__, "triton": triton.__version__, "vllm": vllm_version}


def rotation_layers(spec: LayerSpec, device) -> list:
    """Layers of distinct synthetic weights: enough that one token's k experts over the rotation
    span COLD_BYTES (L2 stays cold at every M), at least 4 and at most 32, within
    MAX_ROTATION_BYTES."""
    import torch

    from ..awq import synthetic_moe_weights

    E, k, K, N, G = spec.shape
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[spec.dtype]
    per_expert = K * 2 * N // 2 + N * K // 2 + (K // G * 2 * N + N // G * K) * (2 + 1 / 4)
    count = int(min(32, max(4, math.ceil(COLD_BYTES / (k * per_expert))), max(1, MAX_ROTATION_BYTES // (E * per_expert))))
    return [synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=1000 + i, device=device) for i in range(count)]


def run(args, spec: LayerSpec) -> int:
    import torch

    from ..kernels import device_facts, plan
    from .replay import graph_replay_us
    from .bench import time_vllm

    device = torch.device("cuda")
    facts = device_facts(device)
    gpu, capability = facts.name, facts.capability
    ver = versions()
    print(f"[tune] {spec.name}: E={spec.shape[0]} k={spec.shape[1]} K={spec.shape[2]} N={spec.shape[3]} "
          f"G={spec.shape[4]} {spec.dtype} on {gpu} ({', '.join(f'{k} {v}' for k, v in ver.items())})", flush=True)
    if args.coserve_only:
        tables.use_cached_tables(ver)
        table = tables.find_table(gpu, spec.shape, spec.dtype)
        if table is None:
            print(f"[tune] --coserve-only: no table of {spec.shape} {spec.dtype} on {gpu} to add co-serving to "
                  "(run the tune without it)", file=sys.stderr)
            return 2
    started = time.time()
    layers = rotation_layers(spec, device)
    print(f"[tune] {len(layers)} layers of distinct weights rotated per timing", flush=True)

    def clock(step, calls, key):
        return graph_replay_us(step, calls, args.reps)

    def vllm_timer(inputs):
        """vLLM's backends on the tune's own weights, routing and activations, as bench times them."""
        return time_vllm(args.vllm_sources, layers, inputs, layers[0].w13_scales.dtype, args.reps)

    measure = Measurement(spec, layers, clock, vllm_timer, device, large_layers=args.large_layers)
    family = plan.kernel_family(facts)
    # the command that reproduces the table (where its report goes does not change it)
    command = "python -m moe_grouped_decode tune " + " ".join(args.argv)
    command = re.sub(r" --report-dir[ =]\S+", "", command)
    directory = tables.SHIPPED_DIR if args.ship else tables.cache_dir(ver)
    if args.coserve_only:
        progress = Progress(coserve_steps(spec.shape, args.coserve_tokens))
        coserve, coserve_humming = measure_coserving(measure, args.coserve_tokens, table.routes, progress, command)
        table = dataclasses.replace(table, coserve=coserve, coserve_humming=coserve_humming)
        extra = {"missing": {}}
    else:
        table, extra = tune(measure, gpu, ver, max_tokens=args.max_tokens, grouped_max=args.grouped_max,
                            budget_s=args.budget_s, refine=not args.no_refine, refine_budget_s=args.refine_budget_s,
                            generator=command,
                            grouped_candidates=grouped_candidates(capability, family),
                            prefill_candidates=prefill_candidates(capability, spec.shape), family=family,
                            compile_workers=args.compile_workers, coserve_tokens=args.coserve_tokens)
    for backend, why in extra["missing"].items():
        print(f"[tune] vLLM's {backend}: {why}", flush=True)
    verdict = tables.verdict(table, args.max_tokens)
    path = tables.write_table(table, directory)
    report = Path(args.report_dir)
    report.mkdir(parents=True, exist_ok=True)
    stem = Path(tables.file_name(*table.key)).stem
    text = markdown(table, verdict)
    coserve_verdicts = {}
    if table.coserve is not None:
        for backend in ("MARLIN", "HUMMING"):  # vLLM's own pick: Marlin (0.26), Humming (0.32+ on Hopper)
            coserve_verdicts[backend] = tables.coserve_verdict(table, backend, args.max_tokens)
            text += "\n" + coserve_markdown(table, coserve_verdicts[backend], backend)
    (report / f"{stem}.md").write_text(text)
    (report / f"{stem}.json").write_text(json.dumps({"table": tables.table_to_json(table), "verdict": dataclasses.asdict(
        verdict), "coserve_verdicts": {b: dataclasses.asdict(v) for b, v in coserve_verdicts.items()}, **extra,
        "seconds": round(time.time() - started, 1)}, indent=1))
    plot(table, report / f"{stem}.png")
    print(text)
    print(f"[tune] wrote {path} (read by the vLLM plugin at startup) and {report}/{stem}.md/.json/.png in "
          f"{time.time() - started:.0f} s", flush=True)
    return 0


def _counts(text: str) -> Tuple[int, ...]:
    counts = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    if any(m < 1 for m in counts) or (counts and counts[0] != 1):
        raise argparse.ArgumentTypeError(f"token counts from 1, positive: {text!r}")
    return counts


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", nargs="?", help="an AWQ MoE checkpoint directory (its config.json is read)")
    parser.add_argument("--shape", help="E,k,K,N,G of one rank's layer, instead of a checkpoint")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="as vLLM takes it")
    parser.add_argument("--enable-expert-parallel", action="store_true", help="as vLLM takes it")
    parser.add_argument("--dtype", choices=tables.DTYPE_NAMES, help="activation dtype (default: the checkpoint's, "
                        "else fp16)")
    parser.add_argument("--name", help="a label for the table (default: the checkpoint's folder and parallelism)")
    parser.add_argument("--max-tokens", type=int, default=tables.LARGEST_STEP, help="the largest step measured")
    parser.add_argument("--grouped-max", type=int, default=256, help="the grouped op is timed up to this M")
    parser.add_argument("--budget-s", type=float, default=130.0, help="seconds for the config search (with the "
                        "measurement and --refine-budget-s, about 5 minutes a shape on an H100)")
    parser.add_argument("--compile-workers", type=int, default=0,
                        help="compile the search's candidates in this many processes first (each its own CUDA "
                             "context and one layer of weights), within --budget-s; default 0: each compiles at its "
                             "first timing, one after another")
    parser.add_argument("--reps", type=int, default=20, help="CUDA-graph replays per timing (the median is kept)")
    parser.add_argument("--large-layers", type=int, default=8, help="layers rotated where every expert is read")
    parser.add_argument("--refine-budget-s", type=float, default=45.0, help="seconds for the prefill route's "
                        "search again at counts with thin margins (step 3)")
    parser.add_argument("--no-refine", action="store_true", help="no extra counts between thin neighbours, no "
                        "search again there")
    parser.add_argument("--vllm-sources", default=".vllm_moe_src", help="vLLM's fetched sources (where vLLM itself "
                        "is not installed with its CUDA ops)")
    parser.add_argument("--coserve-tokens", type=_counts, default=COSERVE_TOKENS,
                        help="token counts of the co-serving table, comma separated ('' for none; default "
                             f"{','.join(map(str, COSERVE_TOKENS))})")
    parser.add_argument("--coserve-only", action="store_true", help="measure the co-serving table alone and "
                        "write the shape's existing table (shipped, or the cache's) with it, to the cache, or with "
                        "--ship to the package's tables/")
    parser.add_argument("--ship", action="store_true", help="write to the package's tables/ (the project's own runs)")
    parser.add_argument("--report-dir", default="artifacts/tune", help="JSON, Markdown and plot")
    args = parser.parse_args(argv)
    args.argv = argv
    if bool(args.checkpoint) == bool(args.shape):
        parser.error("give a checkpoint directory or --shape E,k,K,N,G (one of them)")
    if args.coserve_only and not args.coserve_tokens:
        parser.error("--coserve-only needs --coserve-tokens")
    try:
        spec = (spec_from_shape(args.shape, args.dtype or "fp16", args.name) if args.shape else
                spec_from_checkpoint(Path(args.checkpoint), args.tensor_parallel_size, args.enable_expert_parallel,
                                     args.dtype))
        if args.name:
            spec = dataclasses.replace(spec, name=args.name)
        check_spec(spec)
    except ValueError as error:
        print(f"python -m moe_grouped_decode tune: {error}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"python -m moe_grouped_decode tune: {spec.name} {spec.shape} {spec.dtype}: needs a CUDA GPU (none "
              "visible): a table is measured on the GPU model it is for", file=sys.stderr)
        return 2
    return run(args, spec)
