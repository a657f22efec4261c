"""``python -m moe_grouped_decode tables``: the measured tables' verdicts, as the README's
"Supported models" table (generated here, checked against the README by the tests).

For every shipped table (one GPU model, layer shape and dtype): whether the plugin serves that
shape there and for which engines (the largest step, vLLM's ``max_num_batched_tokens``, up to
which it is faster than vLLM's Marlin and Humming at every measured token count), or co-serves
it (its kernel on vLLM's Marlin or Humming tensors at the first token counts,
``tables.coserve_verdict``),
and the range of its speedup. The shapes the project means to serve but has not measured yet are
listed too: their layers stay with vLLM until a table says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional, Tuple

from .. import tables

# one rank's MoE layer of the models the plugin is meant for: (label, (E, k, K, N, G))
MODELS: Tuple[Tuple[str, tables.Shape], ...] = (
    ("qwen3.8 at TP4", (512, 10, 2560, 160, 32)),
    ("qwen3.8 at TP1", (512, 10, 2560, 640, 32)),
    ("Qwen3-30B-A3B at TP1", (128, 8, 2048, 768, 128)),
    ("Qwen3-30B-A3B at TP2", (128, 8, 2048, 384, 128)),
    ("Qwen3-Next-80B-A3B at TP1", (512, 10, 2048, 512, 128)),
    ("Qwen3-235B-A22B at TP4", (128, 8, 4096, 384, 128)),
    ("GLM-4.5-Air at TP1", (128, 8, 4096, 1408, 128)),
    ("DeepSeek-V2-Lite at TP1", (64, 6, 2048, 1408, 128)),
    ("DeepSeek-V3 at TP8", (256, 8, 7168, 256, 128)),
    ("Mixtral-8x7B at TP2", (8, 2, 4096, 7168, 128)),
)
STEPS = (16384, 8192, 4096, 2048)  # engine step sizes the verdict is given for, largest first
BEGIN, END = "<!-- supported-models: begin -->", "<!-- supported-models: end -->"


def largest_admitted_step(table: tables.MeasuredTable) -> Optional[int]:
    return next((step for step in STEPS if tables.verdict(table, step).admitted), None)


def coserved(table: tables.MeasuredTable) -> Optional[Tuple[str, str]]:
    """(served, speedup span) where the table co-serves the shape: where vLLM's own pick is Marlin
    (vLLM 0.26 on every GPU) and where it is Humming (vLLM 0.32+ on Hopper), each over that
    backend's tensors (``tables.coserve_verdict``); the span covers both windows' tables."""
    marlin, humming = tables.coserve_verdict(table, "MARLIN"), tables.coserve_verdict(table, "HUMMING")
    main = marlin if marlin.window is not None else humming
    if main.window is None:
        return None
    lo, hi = main.window
    ratios = []
    for v in (marlin, humming):
        if v.window is not None:
            c = table.coserve_table(v.layout)
            ratios += [c.vllm_best_us(i) / c.coserved_us[i] for i, m in enumerate(c.tokens) if m <= v.window[1]]
    counts = f"{lo}" if lo == hi else f"{lo}..{hi}"
    served = f"no: stays with vLLM, **co-served at {counts} token{'s' if hi > 1 else ''}**"
    if marlin.window is None:
        served += (" where vLLM picks Humming (the plugin's kernel on vLLM's Humming tensors), vLLM's Humming above; "
                   "not where vLLM picks Marlin")
    elif humming.window == marlin.window and humming.layout == "humming":
        served += " (the plugin's kernel on vLLM's own tensors, Marlin's or Humming's), vLLM's backend above"
    else:
        served += " (the plugin's kernel on vLLM's Marlin tensors), vLLM's Marlin above"
        if humming.window is None:
            served += " (not where vLLM picks Humming)"
        else:
            over = "Humming's" if humming.layout == "humming" else "Marlin's"
            served += f" (1..{humming.window[1]} over {over} tensors where vLLM picks Humming)"
    span = f"{min(ratios):.2f}x" if len(ratios) == 1 else f"{min(ratios):.2f}-{max(ratios):.2f}x"
    reach = max(v.window[1] for v in (marlin, humming) if v.window is not None)  # the span's counts: both windows'
    return served, f"{span} at {lo if lo == reach else f'{lo}..{reach}'}"


def row(label: str, table: tables.MeasuredTable) -> str:
    shape = ",".join(map(str, table.shape))
    step = largest_admitted_step(table)
    speedups = [s for m, s in zip(table.routes.tokens, table.routes.speedups()) if s is not None and m <= (step or 16384)]
    span = f"{min(speedups):.2f}-{max(speedups):.2f}x" if speedups else "n/a"
    shared = coserved(table) if step is None else None
    if shared is not None:
        served, span = shared
        why = "whole: " + tables.verdict(table, 16384).reason.split(" (")[0]
    elif step is None:
        served = "no: stays with vLLM"
        why = tables.verdict(table, 16384).reason.split(" (")[0]
    elif step == STEPS[0]:
        served = "**yes**"
        why = f"faster at every measured M, 1..{table.routes.tokens[-1]}"
    else:
        served = f"**yes, for steps up to {step} tokens**"
        why = tables.verdict(table, STEPS[0]).reason.split(" (")[0]
    window = table.routes.grouped_tokens
    grouped = f"{window[0]}..{window[1]}" if window else "none"
    return f"| {label} | {shape} | {table.gpu} | {table.dtype} | {served} | {span} | {grouped} | {why} |"


def markdown() -> str:
    lines = ["| model (one rank's MoE layer) | E,k,K,N,G | GPU | dtype | served by the plugin | speedup over vLLM "
             "(where served; else overall) | grouped route | why |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    shipped = tables.shipped_tables()
    labels = dict((shape, label) for label, shape in MODELS)
    for table in sorted(shipped, key=lambda t: (list(labels).index(t.shape) if t.shape in labels else 99, t.gpu,
                                                t.dtype)):
        lines.append(row(labels.get(table.shape, table.name), table))
    measured = {t.shape for t in shipped}
    missing = [f"{label} ({','.join(map(str, shape))})" for label, shape in MODELS if shape not in measured]
    if missing:
        lines += ["", "Not measured yet (no table: their layers stay with vLLM; `python -m moe_grouped_decode tune "
                  "--shape E,k,K,N,G` measures one on your GPU): " + "; ".join(missing) + "."]
    return "\n".join(lines)


def readme_block() -> str:
    return f"{BEGIN}\n{markdown()}\n{END}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode tables", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--readme", action="store_true", help="print the README's block, with its markers")
    args = parser.parse_args(argv)
    print(readme_block() if args.readme else markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
