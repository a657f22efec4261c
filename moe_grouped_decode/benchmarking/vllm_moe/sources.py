"""``python -m moe_grouped_decode vllm-moe-fetch [DEST] [--force]``: fetch what the vLLM MoE timers
build or install, into a git-ignored folder of the checkout (default ``.vllm_moe_src``), ready to be
named in one device call's ``carry``.

  DEST/vllm_src/csrc/...       the vLLM 0.32.0 CUDA sources the Marlin timer builds (and vLLM's
                               Marlin kernel generator, which the tests compare with)
  DEST/vllm_src/py/moe_fused_mul_sum.py   vLLM's Triton top-k sum, which the Humming path calls
  DEST/humming_whl/            the humming-kernels wheel vLLM 0.32.0 pins (cp310-abi3)
  DEST/SOURCE.txt              what came from where

vLLM's source comes from its PyPI sdist through pip's own finder and network layer, as the shared
anchors' fetch_sources.py does it (``pip download --no-binary`` would try to build vLLM's
metadata): the 0.32.0 .tar.gz, its sha256 checked against the index's, only the files above kept,
the sdist (~45 MB) deleted. ~1 MiB in all. Rerunning skips what DEST already has.
On the device, install the wheel where Python finds it:

    python3 -m pip install -q --no-index --no-deps --target /tmp/site DEST/humming_whl/*.whl
    export PYTHONPATH=/tmp/site:$PYTHONPATH
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
HUMMING_REQUIREMENT = "humming-kernels==0.1.17"  # vLLM 0.32.0's pin
MUL_SUM_PY = "vllm/model_executor/layers/fused_moe/moe_fused_mul_sum.py"
GENERATOR = "quantization/marlin/generate_kernels.py"
CSRC_FILES = (
    "core/scalar_type.hpp", "core/cuda_compat.h", "core/utils.hpp", "torch_utils.h", "dispatch_utils.h",
    "async_util.cuh", "cuda_vec_utils.cuh", "activation_kernels.cu", "quantization/vectorization.cuh",
    "quantization/marlin/marlin.cuh", "quantization/marlin/marlin_dtypes.cuh", "quantization/marlin/dequant.h",
    "quantization/marlin/marlin_mma.h", "quantization/marlin/awq_marlin_repack.cu", GENERATOR, "moe/moe_ops.h",
    "moe/moe_align_sum_kernels.cu", "moe/marlin_moe_wna16/ops.cu", "moe/marlin_moe_wna16/kernel.h",
    "moe/marlin_moe_wna16/marlin_template.h",
)
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
DEFAULT_DEST = ".vllm_moe_src"
SOURCE_ENV = "MOE_GROUPED_DECODE_VLLM_MOE_SRC"


def default_sources_dir() -> Path:
    """$MOE_GROUPED_DECODE_VLLM_MOE_SRC, else .vllm_moe_src in the checkout this package sits in."""
    if os.environ.get(SOURCE_ENV):
        return Path(os.environ[SOURCE_ENV])
    return Path(__file__).resolve().parents[3] / DEFAULT_DEST


def vllm_src_complete(dest: Path) -> bool:
    root = dest / "vllm_src"
    return all((root / "csrc" / rel).exists() for rel in CSRC_FILES) and (root / "py" / Path(MUL_SUM_PY).name).exists()


def humming_wheels(dest: Path):
    name, version = HUMMING_REQUIREMENT.split("==")
    prefix = f"{name.replace('-', '_')}-{version}-"
    folder = dest / "humming_whl"
    return sorted(p for p in folder.glob("*.whl") if p.name.startswith(prefix)) if folder.is_dir() else []


def _log(t0, *parts):
    print(f"[vllm-moe-fetch {time.time() - t0:5.1f}s]", *parts, flush=True)


def fetch_sdist(name: str, version: str, out_dir: str, t0: float) -> str:
    """NAME==VERSION's sdist (.tar.gz) through pip's finder and session (pip.conf and PIP_* apply,
    as for ``pip download``), sha256 checked against the index's; returns its path."""
    from pip._internal.commands import create_command
    cmd = create_command("download")
    options, _ = cmd.parse_args([])
    with cmd.main_context():
        session = cmd.get_default_session(options)
        finder = cmd._build_package_finder(options=options, session=session)
        candidates = [c for c in finder.find_all_candidates(name)
                      if str(c.version) == version and c.link.filename.endswith(".tar.gz")]
        if not candidates:
            raise SystemExit(f"vllm-moe-fetch: no sdist of {name}=={version} on the configured indexes")
        link = candidates[0].link
        path = os.path.join(out_dir, link.filename)
        digest = hashlib.sha256()
        with session.get(link.url_without_fragment, stream=True) as response:
            response.raise_for_status()
            with open(path, "wb") as f:
                for chunk in response.iter_content(1 << 20):
                    f.write(chunk)
                    digest.update(chunk)
    want = link.hash if getattr(link, "hash_name", None) == "sha256" else None
    if want and want != digest.hexdigest():
        raise SystemExit(f"vllm-moe-fetch: sha256 mismatch for {link.filename}: index {want}, got {digest.hexdigest()}")
    _log(t0, f"{link.filename}: {os.path.getsize(path) / 2**20:.1f} MiB, sha256 {digest.hexdigest()}"
         + (" (matches the index)" if want else " (the index gave none)"))
    return path


def extract_vllm_src(sdist: str, dest: Path) -> None:
    """Only CSRC_FILES and moe_fused_mul_sum.py of the sdist, into dest/vllm_src."""
    out = dest / "vllm_src"
    if out.exists():
        shutil.rmtree(out)
    with tarfile.open(sdist, "r:gz") as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        wanted = {f"{top}/csrc/{rel}": out / "csrc" / rel for rel in CSRC_FILES}
        wanted[f"{top}/{MUL_SUM_PY}"] = out / "py" / Path(MUL_SUM_PY).name
        found = set()
        for member in tar.getmembers():
            target = wanted.get(member.name)
            if target is None or not member.isfile():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as dst:
                shutil.copyfileobj(src, dst)
            found.add(member.name)
    missing = sorted(set(wanted) - found)
    if missing:
        raise SystemExit(f"vllm-moe-fetch: the sdist lacks {missing}")


def fetch_humming_wheel(dest: Path) -> None:
    folder = dest / "humming_whl"
    if folder.exists():
        shutil.rmtree(folder)
    platforms = [arg for p in WHEEL_PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder),
                    HUMMING_REQUIREMENT], check=True)


def fetch(dest: Path, force: bool = False) -> Path:
    t0 = time.time()
    dest = dest.resolve()
    dest.mkdir(parents=True, exist_ok=True)
    if force or not vllm_src_complete(dest):
        with tempfile.TemporaryDirectory(prefix="vllm_moe_sdist_") as tmp:
            sdist = fetch_sdist("vllm", VLLM_VERSION, tmp, t0)
            extract_vllm_src(sdist, dest)
        _log(t0, f"kept {len(CSRC_FILES)} csrc files and {Path(MUL_SUM_PY).name} in {dest / 'vllm_src'}")
    else:
        _log(t0, "vllm_src/ already complete (--force to fetch again)")
    if force or not humming_wheels(dest):
        fetch_humming_wheel(dest)
    wheels = humming_wheels(dest)
    if not wheels:
        raise SystemExit(f"vllm-moe-fetch: no {HUMMING_REQUIREMENT} wheel landed in {dest / 'humming_whl'}")
    (dest / "SOURCE.txt").write_text(
        f"vllm_src/: vllm-{VLLM_VERSION} sdist from PyPI (csrc subset, {MUL_SUM_PY})\n"
        f"humming_whl/: {', '.join(w.name for w in wheels)}\n")
    total = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    _log(t0, f"done: {dest} holds {total / 2**20:.1f} MiB; name it in the device call's carry")
    return dest


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_grouped_decode vllm-moe-fetch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", nargs="?", default=None, help=f"target folder (default: {DEFAULT_DEST} in the checkout)")
    parser.add_argument("--force", action="store_true", help="fetch again")
    args = parser.parse_args(argv)
    fetch(Path(args.dest) if args.dest else default_sources_dir(), args.force)
    return 0
