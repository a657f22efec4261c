"""Command line: ``python -m moe_grouped_decode {demo,tune,tables,bench,vllm-moe-fetch} [options]``
(``COMMAND --help`` lists them)."""

from __future__ import annotations

import argparse
import sys

COMMANDS = {
    "demo": "the main job: operator check, then vLLM with the plugin on and off",
    "tune": "measure a layer shape on this GPU against vLLM's own backends; write its table and verdict",
    "tables": "the measured tables' verdicts: which shapes the plugin serves on which GPU, and why",
    "bench": "CUDA benchmark at every token count: the plugin's routes beside vLLM's own backends and the floors",
    "vllm-moe-fetch": "fetch the vLLM 0.32 sources and Humming wheel that time vLLM's MoE backends (.vllm_moe_src)",
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in COMMANDS:
        if argv[0] == "demo":
            from .demo import main as command_main
        elif argv[0] == "tune":
            from .benchmarking.tune import main as command_main
        elif argv[0] == "tables":
            from .benchmarking.supported import main as command_main
        elif argv[0] == "vllm-moe-fetch":
            from .benchmarking.vllm_moe.sources import main as command_main
        else:
            from .benchmarking.bench import main as command_main
        return command_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in COMMANDS.items():
        sub.add_parser(name, help=text, add_help=False)
    parser.parse_args(argv)  # prints the usage (or the error) and exits
    return 2


if __name__ == "__main__":
    sys.exit(main())
