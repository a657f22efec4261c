"""Command line: ``python -m moe_grouped_decode {demo,bench}``."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="the main job: operator check, then vLLM with the plugin on and off")
    sub.add_parser("bench", help="CUDA benchmark: grouped vs dense vs the memory-read floor")
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as command_main
    else:
        from .bench import main as command_main
    return command_main(rest)


if __name__ == "__main__":
    sys.exit(main())
