"""Build vLLM 0.32.0's Marlin MoE ops from its fetched sources, one extension per group size.

Extensions (each a torch extension under its own op namespace, so that they load beside
vLLM's own ``_moe_C`` / ``_C`` ops or the shared anchors' builds of the same names):

  vllm032_moe_ops        moe_align_block_size, moe_sum (csrc/moe/moe_align_sum_kernels.cu),
                         silu_and_mul (csrc/activation_kernels.cu), awq_marlin_repack
                         (csrc/quantization/marlin/awq_marlin_repack.cu)
  vllm032_marlin_g32     moe_wna16_marlin_gemm (csrc/moe/marlin_moe_wna16/ops.cu) with the
  vllm032_marlin_g64     Marlin MoE kernel instantiations vLLM's generator
  vllm032_marlin_g128    (csrc/quantization/marlin/generate_kernels.py) emits for uint4 with zero
  vllm032_marlin_gchannel points (AWQ), fp16 and bf16, on sm80+, at group_blocks G/16 (or -1:
                         per-channel scales, which ops.cu picks for a GEMM whose K is one group)

Per group_blocks: 2 dtypes x 5 m-blocks (8, 16, 32, 48, 64 rows) x the 3 thread configs the
generator keeps for that m-block (which are exactly those ops.cu may pick) = 30 instantiations,
each in its own file so the build spreads over every core; all four extensions hold 120.
vLLM's ops.cu and awq_marlin_repack.cu are compiled from copies whose one op-registration line
names the extension's namespace instead of ``_moe_C`` / ``_C`` (nothing else differs).
Flags are the shared anchor's (vLLM's CMake for these sources): stable ABI for torch 2.11,
-DENABLE_FP8, half/bf16 operators on, -static-global-template-stub=false, -O3, for the GPU's
own architecture only (sm_90 on an H100 / H200).

Standalone (no package imports), so a child process can build while its parent works:

    python moe_grouped_decode/benchmarking/vllm_moe/marlin_build.py --src SRC [--build-root DIR] EXT...

SRC is the fetch step's folder holding ``vllm_src/csrc`` (``python -m moe_grouped_decode
vllm-moe-fetch``).
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

COMMON_EXTENSION = "vllm032_moe_ops"
DTYPES = ("kFloat16", "kBFloat16")
B_TYPE = "kU4"  # uint4 with runtime zero points: AutoAWQ
STAGES = 4  # the sm80+ pipeline depth
M_BLOCKS = (0.5, 1, 2, 3, 4)  # moe_block_size 8 (m_block_size_8), 16, 32, 48, 64
# generate_kernels.py THREAD_CONFIGS (thread_k, thread_n, threads), as its 256-thread filter keeps
# them, which are ops.cu's small_batch_thread_configs / large_batch_thread_configs
SMALL_BATCH_THREAD_CONFIGS = ((128, 128, 256), (64, 128, 128), (128, 64, 128))  # m_blocks <= 1
LARGE_BATCH_THREAD_CONFIGS = ((64, 256, 256), (64, 128, 128), (128, 64, 128))  # m_blocks > 1
TORCH_TARGET = "0x020B000000000000ULL"  # the stable ABI of torch 2.11, as vLLM 0.32's wheels

COMMON_FILES = ("moe/moe_align_sum_kernels.cu", "activation_kernels.cu")
RENAMED_FILES = {  # vLLM file -> the registration line it carries, renamed in the copy
    "quantization/marlin/awq_marlin_repack.cu": "STABLE_TORCH_LIBRARY_IMPL(_C, CUDA, m)",
    "moe/marlin_moe_wna16/ops.cu": "STABLE_TORCH_LIBRARY_IMPL(_moe_C, CUDA, m)",
}


def group_blocks_of(group_size: int) -> int:
    """ops.cu: group_blocks = group_size / 16, -1 for per-channel scales."""
    return -1 if group_size == -1 else group_size // 16


def marlin_extension(group_blocks: int) -> str:
    return "vllm032_marlin_gchannel" if group_blocks == -1 else f"vllm032_marlin_g{group_blocks * 16}"


def marlin_instantiations(group_blocks: int) -> List[Dict]:
    """The template arguments of every Marlin<...> instantiation for ``group_blocks``, in the
    generator's order, as dicts of generate_kernels.py's config keys plus the type names."""
    out = []
    for dtype in DTYPES:
        for m_blocks in M_BLOCKS:
            for thread_k, thread_n, threads in (SMALL_BATCH_THREAD_CONFIGS if m_blocks <= 1
                                                else LARGE_BATCH_THREAD_CONFIGS):
                out.append({
                    "a_type": dtype, "b_type": B_TYPE, "c_type": dtype, "s_type": dtype, "threads": threads,
                    "thread_m_blocks": max(m_blocks, 1), "thread_n_blocks": thread_n // 16,
                    "thread_k_blocks": thread_k // 16, "m_block_size_8": "true" if m_blocks == 0.5 else "false",
                    "stages": STAGES, "group_blocks": group_blocks, "is_zp_float": "false"})
    return out


def template_args(c: Dict) -> str:
    return (f"vllm::{c['a_type']}.id(), vllm::{c['b_type']}.id(), vllm::{c['c_type']}.id(), "
            f"vllm::{c['s_type']}.id(), {c['threads']}, {c['thread_m_blocks']}, {c['thread_n_blocks']}, "
            f"{c['thread_k_blocks']}, {c['m_block_size_8']}, {c['stages']}, {c['group_blocks']}, {c['is_zp_float']}")


def _selector_condition(c: Dict) -> str:
    return " && ".join([
        f"a_type == vllm::{c['a_type']}", f"b_type == vllm::{c['b_type']}", f"c_type == vllm::{c['c_type']}",
        f"s_type == vllm::{c['s_type']}", f"threads == {c['threads']}", f"thread_m_blocks == {c['thread_m_blocks']}",
        f"thread_n_blocks == {c['thread_n_blocks']}", f"thread_k_blocks == {c['thread_k_blocks']}",
        f"m_block_size_8 == {c['m_block_size_8']}", f"stages == {c['stages']}",
        f"group_blocks == {c['group_blocks']}", f"is_zp_float == {c['is_zp_float']}"])


def generated_sources(group_blocks: int) -> Dict[str, str]:
    """{file name: text}: one instantiation per .cu file plus kernel_selector.h (included by
    ops.cu's get_marlin_kernel), as generate_kernels.py writes them for these configs."""
    files, selector = {}, []
    for c in marlin_instantiations(group_blocks):
        name = (f"sm80_kernel_{c['a_type'][1:].lower()}_u4_gb{group_blocks}_m{c['thread_m_blocks']}"
                f"{'x8' if c['m_block_size_8'] == 'true' else ''}_n{c['thread_n_blocks']}k{c['thread_k_blocks']}"
                f"t{c['threads']}.cu").replace("-", "n")
        files[name] = ("// generated by moe_grouped_decode (vLLM 0.32.0 generate_kernels.py's configs)\n"
                       "// clang-format off\n#include \"kernel.h\"\n#include \"marlin_template.h\"\n\n"
                       "namespace MARLIN_NAMESPACE_NAME {\n\n"
                       f"template __global__ void Marlin<{template_args(c)}>( MARLIN_KERNEL_PARAMS );\n\n}}\n")
        selector.append(("if" if not selector else "else if")
                        + f" ({_selector_condition(c)})\n  kernel = Marlin<{template_args(c)}>;\n")
    files["kernel_selector.h"] = "// generated by moe_grouped_decode\n// clang-format off\n" + "".join(selector)
    return files


# vLLM 0.32.0's schemas (csrc/moe/torch_bindings.cpp, csrc/torch_bindings.cpp), under our namespaces
_SCHEMAS = {
    "moe_sum": "moe_sum(Tensor input, Tensor! output, Tensor? topk_ids=None, Tensor? expert_map=None) -> ()",
    "moe_align_block_size": (
        "moe_align_block_size(Tensor topk_ids, int num_experts, int block_size, Tensor! sorted_token_ids, "
        "Tensor! experts_ids, Tensor! num_tokens_post_pad, Tensor? maybe_expert_map, "
        "Tensor(a!)? scatter_idx=None) -> ()"),
    "awq_marlin_repack": (
        "awq_marlin_repack(Tensor b_q_weight, SymInt size_k, SymInt size_n, int num_bits, bool is_a_8bit) -> Tensor"),
    "silu_and_mul": "silu_and_mul(Tensor! result, Tensor input) -> ()",
    "moe_wna16_marlin_gemm": (
        "moe_wna16_marlin_gemm(Tensor! a, Tensor? c_or_none, Tensor! b_q_weight, Tensor? b_bias_or_none, "
        "Tensor! b_scales, Tensor? a_scales, Tensor? global_scale, Tensor? b_zeros_or_none, Tensor! workspace, "
        "Tensor sorted_token_ids, Tensor! expert_ids, Tensor! num_tokens_past_padded, Tensor! topk_weights, "
        "int moe_block_size, int top_k, bool mul_topk_weights, int b_type_id, int size_m, int size_n, "
        "int size_k, bool use_atomic_add, bool use_fp32_reduce, bool is_zp_float, int thread_k, int thread_n, "
        "int blocks_per_sm) -> Tensor"),
}
_BINDINGS_HEAD = ("// generated by moe_grouped_decode: op registration (vLLM 0.32.0's schemas, our namespace)\n"
                  "#include <torch/csrc/stable/library.h>\n#include <torch/csrc/stable/tensor.h>\n\n"
                  "#include <optional>\n\n#include \"moe/moe_ops.h\"\n\n")


def bindings_source(ext: str) -> str:
    if ext == COMMON_EXTENSION:
        defs = "".join(f'  m.def("{_SCHEMAS[op]}");\n'
                       for op in ("moe_sum", "moe_align_block_size", "awq_marlin_repack", "silu_and_mul"))
        return (_BINDINGS_HEAD + "void silu_and_mul(torch::stable::Tensor& out, torch::stable::Tensor& input);\n\n"
                f"STABLE_TORCH_LIBRARY_FRAGMENT({ext}, m) {{\n{defs}}}\n\n"
                f"STABLE_TORCH_LIBRARY_IMPL({ext}, CUDA, m) {{\n"
                '  m.impl("moe_sum", TORCH_BOX(&moe_sum));\n'
                '  m.impl("moe_align_block_size", TORCH_BOX(&moe_align_block_size));\n'
                '  m.impl("silu_and_mul", TORCH_BOX(&silu_and_mul));\n}\n')
    return (_BINDINGS_HEAD + f"STABLE_TORCH_LIBRARY_FRAGMENT({ext}, m) {{\n"
            f'  m.def("{_SCHEMAS["moe_wna16_marlin_gemm"]}");\n}}\n')


def renamed_copy(csrc: str, rel: str, ext: str) -> str:
    """vLLM's ``rel`` with its one op-registration line naming ``ext``'s namespace."""
    with open(os.path.join(csrc, rel)) as f:
        text = f.read()
    line = RENAMED_FILES[rel]
    if text.count(line) != 1:
        raise RuntimeError(f"{rel}: expected exactly one '{line}' in vLLM's source")
    return text.replace(line, f"STABLE_TORCH_LIBRARY_IMPL({ext}, CUDA, m)")


def _write_if_changed(path: str, text: str) -> None:
    """Keep the mtime of an unchanged file, so ninja does not rebuild it."""
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return
    with open(path, "w") as f:
        f.write(text)


def extension_sources(ext: str, src: str, gen_dir: str) -> List[str]:
    """Write ``ext``'s generated files into gen_dir; return its sources."""
    csrc = os.path.join(src, "vllm_src", "csrc")
    os.makedirs(gen_dir, exist_ok=True)
    files = {f"{ext}_bindings.cpp": bindings_source(ext)}
    if ext == COMMON_EXTENSION:
        files["awq_marlin_repack.cu"] = renamed_copy(csrc, "quantization/marlin/awq_marlin_repack.cu", ext)
        extra = [os.path.join(csrc, rel) for rel in COMMON_FILES]
    else:
        group_blocks = {marlin_extension(gb): gb for gb in (-1, 2, 4, 8)}.get(ext)
        if group_blocks is None:
            raise ValueError(f"unknown extension {ext!r}")
        files["ops.cu"] = renamed_copy(csrc, "moe/marlin_moe_wna16/ops.cu", ext)
        files.update(generated_sources(group_blocks))
        extra = []
    for stale in glob.glob(os.path.join(gen_dir, "*")):
        if os.path.basename(stale) not in files:
            os.remove(stale)
    for name, text in files.items():
        _write_if_changed(os.path.join(gen_dir, name), text)
    return sorted(os.path.join(gen_dir, name) for name in files if not name.endswith(".h")) + extra


def _cublas_include(build_dir: str):
    """vLLM's torch_utils.h includes <cublas_v2.h> only for the cublasHandle_t type: use the
    toolkit's or a pip nvidia package's header, else a one-line stand-in."""
    from torch.utils.cpp_extension import CUDA_HOME
    candidates = [os.path.join(CUDA_HOME or "/usr/local/cuda", "include")]
    try:
        import nvidia
        for p in nvidia.__path__:
            candidates += glob.glob(os.path.join(p, "*", "include")) + glob.glob(os.path.join(p, "*", "*", "include"))
    except ImportError:
        pass
    for c in candidates:
        if os.path.exists(os.path.join(c, "cublas_v2.h")):
            return c
    shim = os.path.join(build_dir, "cublas_shim")
    os.makedirs(shim, exist_ok=True)
    _write_if_changed(os.path.join(shim, "cublas_v2.h"),
                      "#pragma once\nstruct cublasContext;\ntypedef struct cublasContext* cublasHandle_t;\n")
    return shim


def cuda_arch() -> str:
    """The GPU's compute capability ("9.0" on an H100 / H200), 9.0 without one."""
    import torch
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"{major}.{minor}"
    return "9.0"


def default_build_root() -> str:
    return os.path.join(os.environ.get("TMPDIR", "/tmp"), "vllm032_moe_build")


def build_extension(ext: str, src: str, build_root: Optional[str] = None, verbose: bool = False,
                    max_jobs: Optional[int] = None) -> Dict:
    """Compile (ninja; what is up to date is kept) and load ``ext`` into this process; returns
    what it took."""
    csrc = os.path.join(src, "vllm_src", "csrc")
    if not os.path.isdir(csrc):
        raise FileNotFoundError(f"no vllm_src/csrc under {src}: run `python -m moe_grouped_decode vllm-moe-fetch`")
    build_dir = os.path.join(build_root or default_build_root(), ext)
    sources = extension_sources(ext, src, os.path.join(build_dir, "gen"))
    os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_arch()
    os.environ["CCACHE_DISABLE"] = "1"
    if max_jobs:
        os.environ["MAX_JOBS"] = str(max_jobs)
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 8))
    from torch.utils import cpp_extension
    defs = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET}", "-DUSE_CUDA", "-DENABLE_FP8", "-DNDEBUG"]
    cuda_flags = ["-O3", "-static-global-template-stub=false", "-U__CUDA_NO_HALF_OPERATORS__",
                  "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                  "-U__CUDA_NO_HALF2_OPERATORS__"] + defs
    includes = [csrc, os.path.join(csrc, "moe", "marlin_moe_wna16"), os.path.join(csrc, "quantization", "marlin"),
                _cublas_include(build_dir)]
    t0 = time.time()
    cpp_extension.load(name=ext, sources=sources, extra_include_paths=includes, extra_cflags=["-O3"] + defs,
                       extra_cuda_cflags=cuda_flags, build_directory=build_dir, is_python_module=False,
                       verbose=verbose)
    return {"extension": ext, "seconds": round(time.time() - t0, 1), "sources": len(sources),
            "max_jobs": os.environ["MAX_JOBS"], "build_dir": build_dir}


def start_children(exts: Sequence[str], src: str, build_root: Optional[str] = None,
                   max_jobs: Optional[int] = None) -> List[Tuple]:
    """Start compiling ``exts``, one child process each (this file run as a script); without
    ``max_jobs`` the cores are shared in proportion to their sources. wait_children() then
    waits; build_extension() loads a finished one (ninja finds it up to date)."""
    build_root = build_root or default_build_root()
    cores = os.cpu_count() or 8
    weights = {ext: (3 if ext == COMMON_EXTENSION else 31) for ext in exts}
    total = sum(weights.values()) or 1
    children = []
    for ext in exts:
        os.makedirs(os.path.join(build_root, ext), exist_ok=True)
        log_path = os.path.join(build_root, ext, "child_build.log")
        jobs = max_jobs or max(2, round(cores * weights[ext] / total) + 1)
        log = open(log_path, "w")
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--src", src, "--build-root", build_root,
                                 "--max-jobs", str(jobs), ext], stdout=log, stderr=subprocess.STDOUT)
        children.append((ext, proc, log, log_path, time.time()))
    return children


def wait_children(children: List[Tuple]) -> Dict[str, Dict]:
    """{ext: {seconds, log}} once every child is done; raises with a failed one's log tail."""
    out = {}
    for ext, proc, log, log_path, t0 in children:
        rc = proc.wait()
        log.close()
        if rc:
            with open(log_path) as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"building {ext} failed (rc={rc}), {log_path}:\n{tail}")
        out[ext] = {"seconds": round(time.time() - t0, 1), "log": log_path}
    return out


def build_in_children(exts: Sequence[str], src: str, build_root: Optional[str] = None) -> Dict[str, Dict]:
    """Compile several extensions at once (start_children + wait_children)."""
    return wait_children(start_children(exts, src, build_root))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--src", required=True, help="the fetch step's folder (holds vllm_src/csrc)")
    parser.add_argument("--build-root", default=None)
    parser.add_argument("--max-jobs", type=int, default=None)
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("extensions", nargs="+")
    args = parser.parse_args(argv)
    for ext in args.extensions:
        print(build_extension(ext, args.src, args.build_root, args.verbose, args.max_jobs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
