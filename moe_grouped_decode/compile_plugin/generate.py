"""Greedy generation through ``vllm.LLM`` in this process, reported as one JSON line.

The end-to-end tests and the demo run it once per configuration, each in a
fresh process (vLLM's engine state is per process)::

    python -m moe_grouped_decode.compile_plugin.generate --model DIR [--requests 8]

The engine runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so the
plugin's rewrite counts can be read back, and with vLLM's and Inductor's
compile caches off so every run compiles, i.e. runs the passes (a cache hit
would skip them and report 0 rewrites); the result also carries the plugin's
INFO log lines. Request ``i`` asks for
``min_tokens + i`` new tokens, so as requests finish the decode batch shrinks
through every size from ``requests`` down to 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import time

from ..env import FORCE_ENV, GROUPED_DECODE_ENV, WINDOW_ENV, without_switches
from .contracts_env import CONTRACTS_ENV, contracts_to_json

RESULT_PREFIX = "MOE_GROUPED_DECODE_RESULT "


def run_in_subprocess(model_dir, switch: str, requests: int, min_tokens: int, contracts=(), force: bool = False,
                      window: str = "", timeout_s: int = 600) -> dict:
    """Run :func:`main` in a fresh process with ``MOE_GROUPED_DECODE=switch`` ("" for unset),
    ``MOE_GROUPED_DECODE_FORCE`` set as ``force``, ``MOE_GROUPED_DECODE_WINDOW=window`` ("" for
    unset) and ``contracts`` registered there; return its result (RuntimeError with the output
    tail on failure)."""
    # the switch's old name is dropped from the child's environment: it would disagree with ``switch``
    env = {
        **without_switches(dict(os.environ), (GROUPED_DECODE_ENV,)),
        GROUPED_DECODE_ENV: switch,
        FORCE_ENV: "1" if force else "",
        WINDOW_ENV: window,
        CONTRACTS_ENV: contracts_to_json(contracts),
    }
    command = [
        sys.executable, "-m", "moe_grouped_decode.compile_plugin.generate",
        "--model", str(model_dir), "--requests", str(requests), "--min-tokens", str(min_tokens),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(command)} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


def prompts(num_requests: int, prompt_len: int, vocab_size: int) -> list:
    """Deterministic, distinct prompt token ids (no tokenizer needed)."""
    return [[(7 * i + 3 * j + 1) % vocab_size for j in range(prompt_len)] for i in range(num_requests)]


def _record_plugin_log() -> list:
    """The package's log lines at INFO and above from now on (the engine runs in this process)."""
    lines: list = []

    class Recorder(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("moe_grouped_decode").addHandler(Recorder(level=logging.INFO))
    return lines


def _usage_error(message: str) -> int:
    print(f"python -m moe_grouped_decode.compile_plugin.generate: {message}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode.compile_plugin.generate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (moe_grouped_decode.checkpoints)")
    parser.add_argument("--requests", type=int, default=4, help="concurrent requests (decode batch sizes 1..N)")
    parser.add_argument("--prompt-len", type=int, default=5)
    parser.add_argument("--min-tokens", type=int, default=4, help="new tokens of request 0; request i gets i more")
    args = parser.parse_args(argv)
    # checked before vLLM's slow import, each as one line rather than a traceback from deep inside
    from . import vllm_missing

    config_path = os.path.join(args.model, "config.json")
    if not os.path.isfile(config_path):
        what = "no such directory" if not os.path.isdir(args.model) else "no config.json in it"
        return _usage_error(f"--model {args.model}: {what}; pass a Hugging Face checkpoint directory "
                            "(`python -m moe_grouped_decode demo` builds a tiny one)")
    missing = vllm_missing()
    if missing:
        return _usage_error(missing)

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # torch read TORCHINDUCTOR_FORCE_DISABLE_CACHES when it was imported: set the config itself
    import torch._inductor.config

    torch._inductor.config.force_disable_caches = True

    from vllm import LLM, SamplingParams

    from .passes import REWRITES
    from .startup import LAYER_DECISIONS

    plugin_log = _record_plugin_log()
    with open(config_path) as f:
        vocab_size = json.load(f)["vocab_size"]
    started = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        max_model_len=128,
        max_num_seqs=max(args.requests, 1),
        enforce_eager=False,  # compile, so the rewrite runs
        seed=0,
    )
    startup_s = time.perf_counter() - started
    requests = [{"prompt_token_ids": ids} for ids in prompts(args.requests, args.prompt_len, vocab_size)]
    sampling = [
        SamplingParams(temperature=0.0, max_tokens=args.min_tokens + i, ignore_eos=True) for i in range(args.requests)
    ]
    started = time.perf_counter()
    outputs = llm.generate(requests, sampling, use_tqdm=False)
    generate_s = time.perf_counter() - started

    result = {
        "token_ids": [list(out.outputs[0].token_ids) for out in outputs],
        "rewrites": dict(REWRITES),
        "layers": {
            name: {
                "contract": decision.admission.contract.name if decision.admission else None,
                "served_by_plugin": decision.served_by_plugin,
                "route": decision.choice.route,  # "grouped", "dense" (the plugin's), "coserved" or "vllm"
                "vllm_backend": decision.vllm_backend,  # what vLLM's own selection answered (None: none here)
                "reason": decision.choice.reason,
                "admission": decision.admission.reason,
            }
            for name, decision in LAYER_DECISIONS.items()
        },
        "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        "plugin_log": plugin_log,
        "startup_s": round(startup_s, 2),
        "generate_s": round(generate_s, 3),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
