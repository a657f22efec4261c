"""The co-serving tables of a tune: the plugin's grouped decode over vLLM's Marlin tensors, and
over its Humming tensors, against vLLM's own backends at the first token counts
(``tables.CoserveTable``).

On the tune's rotated layers converted to vLLM's Marlin layout (``marlin_layout.awq_to_marlin``,
what vLLM's load step makes of them bit for bit), at each count of ``tokens``: each launch
config of ``candidates`` that tiles the layer's K and N is checked against the float64
reference (a wrong one is dropped, said why) and timed; the fastest is the count's entry, and
its time is taken again for the table; then vLLM's backends on the same inputs, in the same
process. Counts past the first where vLLM is as fast or faster are still measured (the table
says where the kernel stops winning; the verdict keeps the window from 1), up to the first where
the route table, measured before, has vLLM's faster backend under ``COSERVE_STOP_BELOW`` times the
kernel's time: no window can reach past that count, so the counts above it are not measured
(at a shape whose kernel loses from one token on, that saves the step's time but the first count).

Over Humming's tensors (``humming_layout.awq_to_humming``, what vLLM 0.32+'s load step makes of
the layers; the GPU tests hold it to humming's own repack) the kernel is the same but for its
strides, so only the configs the Marlin table picked are tried, at the counts it measured, and
vLLM's times are that table's, taken in the same process on the same inputs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable, Dict, List, Optional, Sequence

from .. import tables

# where decode batches live; the kernel reads an expert per routed row, so its gain ends well before 16
COSERVE_TOKENS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
# w13 warps x w13 chunks x w2 warps, then "rR": R row warps per W2 column warp, "nS": W2 in S
# programs over N / S rows each, "a": the activations in a launch of their own, and a trailing
# "s": the combine as a launch of its own. The row-warp and N-split configs are there for one to
# few tokens, where W2 has only R x K / 128 programs, each walking all of N in turn (a split that
# does not tile a shape's N is skipped); with "a" no W2 program reduces the K splits' partials
# again for its own column tile (at large N they outweigh its weights; no "a" config is a
# candidate before its GPU tests have passed); the one-warp W13s add their warps' partials in
# registers, not through shared memory as two or more warps do
COSERVE_CANDIDATES = ("4x4x2", "4x2x1", "4x4x1", "4x2x2", "8x2x2", "2x4x2", "4x4x4", "4x2x1s", "2x4x2r2", "2x4x2r4",
                      "2x4x1r4", "4x4x1r4", "1x8x2", "1x4x2", "1x8x2n2", "1x8x2n4", "1x8x2n8", "1x8x2n16", "1x8x4n4",
                      "1x8x4n8")
# the co-served kernel's output against the float64 reference, max |diff| / max |reference|: the
# bounds the GPU tests hold the plugin's ops to (tests/test_cuda_ops.py)
SCALED_DIFF_BOUND = {"fp16": 2e-3, "bf16": 16e-3}
# vLLM's faster backend over the kernel, by the route table, under which a count ends the step: the
# window needs tables.COSERVE_MARGIN by the step's own timing of vLLM, and two timings of vLLM's
# kernels in one process (or two runs on one GPU) differ by far less than this gap
COSERVE_STOP_BELOW = 0.85
_CONFIG_TEXT = re.compile(r"(\d+)x(\d+)x(\d+)(?:r(\d+))?(?:n(\d+))?(a?)(s?)")


def parse_config(text: str):
    """A candidate's text (``COSERVE_CANDIDATES``) -> ``MarlinGroupedConfig``; ValueError for another."""
    from ..kernels.marlin_grouped import MarlinGroupedConfig

    match = _CONFIG_TEXT.fullmatch(text)
    if match is None:
        raise ValueError(f"co-serving config {text!r}: expected W13WARPSxCHUNKSxW2WARPS[rROWWARPS][nNSPLITS][a][s], "
                         "e.g. 2x4x2r4 or 1x8x2n4a")
    w13_warps, w13_chunks, w2_warps, row_warps, n_splits, act_launch, separate = match.groups()
    return MarlinGroupedConfig(int(w13_warps), int(w13_chunks), int(w2_warps), fused_combine=not separate,
                               w2_row_warps=int(row_warps or 1), w2_n_splits=int(n_splits or 1),
                               act_launch=bool(act_launch))


def config_text(fields: dict) -> str:
    """A launch-table entry's config fields as ``parse_config`` reads them."""
    text = "x".join(str(fields.get(f, "?")) for f in ("w13_warps", "w13_chunks", "w2_warps"))
    row_warps, n_splits = fields.get("w2_row_warps", 1), fields.get("w2_n_splits", 1)
    return (text + ("" if row_warps == 1 else f"r{row_warps}") + ("" if n_splits == 1 else f"n{n_splits}")
            + ("a" if fields.get("act_launch", False) else "") + ("" if fields.get("fused_combine", True) else "s"))


def launch_entries(best: Dict[int, dict]) -> tuple:
    """{M: config fields} -> the launch table: one entry per run of equal configs, at its last M."""
    counts = sorted(best)
    return tuple({"M": m, "config": best[m]} for i, m in enumerate(counts)
                 if i + 1 == len(counts) or best[counts[i + 1]] != best[m])


def measure_coserve(measure, tokens: Sequence[int] = COSERVE_TOKENS, candidates: Sequence[str] = COSERVE_CANDIDATES,
                    step: Callable[[str], None] = lambda what: None, log=print, generator: str = "",
                    vllm_best_us: Optional[Dict[int, float]] = None, layout: str = "marlin",
                    vllm_us: Optional[Dict[str, tuple]] = None) -> tables.CoserveTable:
    """The co-serving table of ``measure``'s shape (a ``tune.Measurement``: its layers, inputs,
    clock and vLLM timer) over vLLM's ``layout`` ("marlin"/"humming") tensors; ``step`` is called
    once per count and, unless ``vllm_us`` gives vLLM's times at ``tokens`` already, once for
    vLLM's backends. ``vllm_best_us``: vLLM's faster backend per count from the shape's route
    table, where known; the counts past the first it puts out of reach are skipped (module
    docstring)."""
    import torch

    from ..humming_layout import awq_to_humming
    from ..kernels import device_facts
    from ..kernels.marlin_grouped import launch_humming_grouped, launch_marlin_grouped
    from ..kernels.pdl import pdl_supported
    from ..marlin_layout import awq_to_marlin
    from ..ops import reference_moe

    E, k, K, N, G = measure.spec.shape
    configs = []
    for text in candidates:
        config = parse_config(text)
        try:
            config.splits(K, N)
        except ValueError as error:
            log(f"[coserve] {text}: {error}")
            continue
        configs.append((text, config))
    if not configs:
        raise ValueError(f"no co-serving candidate tiles K = {K}, N = {N}")
    bound = SCALED_DIFF_BOUND[measure.spec.dtype]
    use_pdl = pdl_supported(device_facts(measure.device).capability)
    if layout == "marlin":
        marlin = [awq_to_marlin(layer) for layer in measure.layers]

        def run(config, i, ids, tws, xs):
            w = marlin[i]
            return launch_marlin_grouped(xs[i], tws[i], ids[i], *w.tensors(), N, G, w.scales_grouped, config,
                                         use_pdl=use_pdl)
    elif layout == "humming":
        humming = [awq_to_humming(layer) for layer in measure.layers]

        def run(config, i, ids, tws, xs):
            return launch_humming_grouped(xs[i], tws[i], ids[i], *humming[i].tensors(), N, G, config,
                                          use_pdl=use_pdl)
    else:
        raise ValueError(f"layout {layout!r}: expected 'marlin' or 'humming'")

    coserved_us: List[float] = []
    best: Dict[int, dict] = {}
    inputs = {}
    measured: List[int] = []
    for n, M in enumerate(tokens):
        ids, tws, xs = inputs[M] = measure.inputs(M)
        want = reference_moe(xs[0], tws[0], ids[0], measure.layers[0]).to(torch.float64)
        times = {}
        for text, config in configs:
            got = run(config, 0, ids, tws, xs).to(torch.float64).cpu()
            diff = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
            if not diff <= bound:  # NaN too
                log(f"[coserve] M={M} {text}: scaled error {diff:.3g} over {bound:g}, dropped")
                continue
            times[text] = measure.clock(lambda i, c=config: run(c, i, ids, tws, xs), measure.count(M), ("coserve", M, text))
        if not times:
            raise RuntimeError(f"co-serving at M={M}: every candidate missed the float64 reference")
        fastest = min(times, key=times.get)
        # timed once more: the fastest of several noisy timings is biased low against vLLM's one
        again = measure.clock(lambda i, c=dict(configs)[fastest]: run(c, i, ids, tws, xs), measure.count(M),
                              ("coserve", M, fastest, "again"))
        coserved_us.append(again)
        measured.append(M)
        best[M] = dataclasses.asdict(dict(configs)[fastest])
        step(f"co-served ({layout}) M={M}: {again:.1f} us ({fastest})")
        vllm = (vllm_best_us or {}).get(M)
        if vllm is not None and vllm < COSERVE_STOP_BELOW * again and n + 1 < len(tokens):
            log(f"[coserve] M={M}: vLLM's route-table time {vllm:.1f} us is {vllm / again:.2f}x the kernel's, "
                f"past any window: M={', '.join(map(str, tokens[n + 1:]))} not measured")
            for skipped in tokens[n + 1:]:
                step(f"co-served M={skipped}: not measured")
            break
    if vllm_us is not None:
        given = {M: i for i, M in enumerate(tokens)}
        vllm_us = {b: tuple(times[given[M]] for M in measured) for b, times in vllm_us.items()}
    else:
        vllm_us = {}
        for backend, times in measure.vllm_timer({M: inputs[M] for M in measured}).items():
            if not isinstance(times, dict):
                log(f"[coserve] vLLM's {backend}: {times}")
                times = {}
            vllm_us[backend] = tuple(times.get(M) for M in measured)
        step(f"vLLM's backends at {len(measured)} counts")
    return tables.CoserveTable(tokens=tuple(measured), coserved_us=tuple(coserved_us), vllm_us=vllm_us,
                               launch=launch_entries(best), generator=generator)


def humming_refusal(shape) -> Optional[str]:
    """Why the kernel cannot read Humming's tensors of ``shape`` (E, k, K, N, G), or None."""
    from ..kernels.marlin_grouped import MARLIN_TILE_COLUMNS

    E, k, K, N, G = shape
    if N % MARLIN_TILE_COLUMNS.value or 128 % G:
        return f"N = {N} is not a multiple of {MARLIN_TILE_COLUMNS.value} or G = {G} does not divide 128"
    return None


def measure_coserve_humming(measure, marlin: tables.CoserveTable, step: Callable[[str], None] = lambda what: None,
                            log=print, generator: str = "") -> tables.CoserveTable:
    """The co-serving table over Humming's tensors, from the Marlin one just measured in this
    process: its counts, its picked configs and its vLLM times (module docstring)."""
    picked = sorted({config_text(entry["config"]) for entry in marlin.launch})
    return measure_coserve(measure, marlin.tokens, picked, step=step, log=log, generator=generator,
                           layout="humming", vllm_us=dict(marlin.vllm_us))


def markdown(table: tables.MeasuredTable, verdict: tables.CoserveVerdict, vllm_backend: str) -> str:
    """The co-serving verdict where vLLM would pick ``vllm_backend``, above the table it read (where
    it gives no window: over Humming's tensors where vLLM picks Humming and the table has them)."""
    layout = verdict.layout if verdict.window is not None else (
        "humming" if vllm_backend.lower() == "humming" and table.coserve_humming is not None else "marlin")
    c = table.coserve_table(layout)
    backends = sorted(c.vllm_us)
    lines = [f"## Co-serving where vLLM would pick {vllm_backend}", "",
             f"{table.name} ({'x'.join(map(str, table.shape))}, {table.dtype}) on {table.gpu}: the plugin's kernel on "
             f"vLLM's {layout.title()} tensors beside vLLM's backends (us per layer)", "",
             "| M | co-served | " + " | ".join(backends) + " | vLLM's best / co-served | config |",
             "| ---: | ---: | " + " | ".join("---:" for _ in backends) + " | ---: | --- |"]
    entries = sorted(c.launch, key=lambda e: e["M"])
    for i, m in enumerate(c.tokens):
        best = c.vllm_best_us(i)
        cfg = next((e for e in entries if m <= e["M"]), entries[-1])["config"] if entries else {}
        label = config_text(cfg)
        cells = " | ".join("-" if c.vllm_us[b][i] is None else f"{c.vllm_us[b][i]:.1f}" for b in backends)
        ratio = "-" if best is None else f"{best / c.coserved_us[i]:.2f}x"
        lines.append(f"| {m} | {c.coserved_us[i]:.1f} | {cells} | {ratio} | {label} |")
    window = "none" if verdict.window is None else f"{verdict.window[0]}..{verdict.window[1]} tokens"
    lines += ["", f"Window: {window}. {verdict.reason}.", "", f"Measured by `{c.generator}`." if c.generator else ""]
    return "\n".join(lines).rstrip() + "\n"

