"""The Triton kernels under TRITON_INTERPRET=1 on the CPU (tiny shapes, against the reference).

TRITON_INTERPRET must be set before triton is imported, and this pytest process
may already have imported it, so the checks run in a fresh interpreter:
interpret_kernels_check.py beside this file, and interpret_shapes_check.py (the edges of the
shapes the product serves: the kernels' chunk loops over a large N or K), and interpret_marlin_check.py
(the grouped decode over vLLM's Marlin tensors).
"""

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _run_interpreted(script: str, passed: str, timeout: int, *args: str) -> None:
    """Run ``script`` beside this file (with ``args``) under the interpreter; it must exit 0 and
    print ``passed``."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(HERE.parent))
    result = subprocess.run([sys.executable, str(HERE / script), *args], env=env, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert passed in result.stdout


def test_kernels_match_reference_under_interpreter():
    _run_interpreted("interpret_kernels_check.py", "all interpreter checks passed", 600)


def test_kernels_match_reference_at_shape_edges_under_interpreter():
    _run_interpreted("interpret_shapes_check.py", "all interpreter shape checks passed", 900)


def test_marlin_grouped_kernels_match_reference_under_interpreter():
    _run_interpreted("interpret_marlin_check.py", "all interpreter marlin kernel checks passed", 600, "kernels")


def test_marlin_grouped_ops_and_humming_tensors_under_interpreter():
    _run_interpreted("interpret_marlin_check.py", "all interpreter marlin layout and op checks passed", 600, "ops")
