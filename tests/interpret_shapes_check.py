"""Both routes under TRITON_INTERPRET=1 at reduced versions of the edges of the shapes the product serves.

Launched by test_kernels_interpret.py in a subprocess (the variable must be set before triton is
imported). The shapes are small enough for the interpreter yet past the sizes where the kernels
stop unrolling a whole N or K (``awq_mma.UNROLLED_CHUNKS``, ``w2_tl.HELD_CHUNKS`` and
``w2_tl.ACT_BLOCK``): E = 8, k = 2, G = 32, 64 and 128, N a large multiple of K, N and K not
multiples of the tiles. Each case is checked against the float64 reference, and where a kernel
runs its chunk loop, against the same kernel unrolled (those limits raised): the same bits.
Prints one line per case and exits non-zero on the first failure.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import dataclasses  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interpret_kernels_check import (check, check_over_groups, check_row_outputs, output_buffer, routing,  # noqa: E402
                                     run_grouped)

from moe_grouped_decode.awq import synthetic_moe_weights  # noqa: E402
from moe_grouped_decode.kernels import prefill, w2_tl  # noqa: E402
from moe_grouped_decode.kernels.awq_mma import UNROLLED_CHUNKS  # noqa: E402
from moe_grouped_decode.kernels.config import GroupedConfig, PrefillConfig  # noqa: E402
from moe_grouped_decode.ops import launch_prefill  # noqa: E402
from moe_grouped_decode.ops.reference import reference_moe  # noqa: E402


class Unrolled:
    """Within: every chunk loop unrolled and W2's activations in one tile, whatever the shape (the
    interpreter reads the kernels' globals at each call)."""

    LIMITS = ((w2_tl, "HELD_CHUNKS"), (w2_tl, "ACT_BLOCK"), (prefill, "UNROLLED_CHUNKS"))

    def __enter__(self):
        self.saved = [getattr(module, name) for module, name in self.LIMITS]
        for module, name in self.LIMITS:
            setattr(module, name, tl.constexpr(1 << 20))

    def __exit__(self, *exc):
        for (module, name), value in zip(self.LIMITS, self.saved):
            setattr(module, name, value)


def same_bits(name: str, a: torch.Tensor, b: torch.Tensor) -> None:
    ok = torch.equal(a.view(-1).view(torch.int8), b.view(-1).view(torch.int8))
    print(f"{'ok  ' if ok else 'FAIL'} {name}: looped and unrolled, the same bits", flush=True)
    if not ok:
        sys.exit(1)


def main() -> None:
    gen = torch.Generator().manual_seed(5)
    assert w2_tl.HELD_CHUNKS < 7 and w2_tl.ACT_BLOCK < 768 and UNROLLED_CHUNKS < 22, "the cases below loop"
    base = GroupedConfig(w13_kernel="tl", w13_block_k=64, w13_warps=1, w2_warps=1)
    grouped_cases = [
        # (E, k, K, N, G, M, pattern, dtype, config): why
        # N = 6 K: W2's 24 chunks loop (held in registers up to HELD_CHUNKS; over groups, the prefill
        # W2's loop past UNROLLED_CHUNKS), its activations in two tiles (the second half masked); G = 128
        (8, 2, 128, 768, 128, 3, "random", torch.float16, base),
        # 7 chunks, one past the held ones; K = 96: the 2-warp tile half masked; bf16
        (8, 2, 96, 224, 32, 4, "round_robin", torch.bfloat16, dataclasses.replace(base, w13_block_k=32, w2_warps=2)),
        # 22 chunks (the loop's last pass short of the compiler's unroll), G = 64, multi-row segments,
        # the combine as its own launch
        (8, 2, 192, 704, 64, 5, "single_hot", torch.float16, dataclasses.replace(base, fused_combine=False)),
    ]
    for E, k, K, N, G, M, pattern, dtype, config in grouped_cases:
        weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=E + K + N + M)
        x = torch.randn(M, K, generator=gen).to(dtype)
        tw = torch.rand(M, k, generator=gen)
        ids = routing(pattern, M, k, E, gen)
        name = f"grouped E={E} k={k} K={K} N={N} G={G} M={M} {pattern} {dtype} {config}"
        out, views = run_grouped(weights, x, tw, ids, config)
        check(name, out, reference_moe(x, tw, ids, weights), dtype)
        check_row_outputs(name, weights, x, ids, views, config.w2_act_split)
        check_over_groups(name, weights, x, tw, ids, config, out, views)
        with Unrolled():
            unrolled, unrolled_views = run_grouped(weights, x, tw, ids, config)
        same_bits(name, out, unrolled)
        same_bits(name + " row outputs", views.row_outputs, unrolled_views.row_outputs)

    prefill_cases = [
        # (E, k, K, N, G, M, pattern, dtype, config): why
        # K = 24 chunks for W13's one warp: its loop; G = 128; 20 rows per expert in 8-row groups
        (8, 2, 768, 128, 128, 20, "single_hot", torch.float16, PrefillConfig(w13_warps=1, w2_warps=1)),
        # K = 85 chunks over 4 warps: 22 each, the last warp's last three past K (masked in the loop)
        (8, 2, 2720, 64, 32, 9, "random", torch.bfloat16, PrefillConfig(w13_warps=4, w2_warps=2)),
        # N = 24 chunks of W2 (its loop) over 16-row groups (two B operands), G = 64, N = 6 K
        (8, 2, 128, 768, 64, 20, "single_hot", torch.float16, PrefillConfig(token_blocks=2, w13_warps=2)),
        # the dot kernels at G = 64 with N and K not multiples of their column tiles (128: 2.5 W13
        # tiles of N = 320, 1.5 W2 tiles of K = 192)
        (8, 2, 192, 320, 64, 11, "random", torch.float16,
         PrefillConfig(kernel="dot", block_rows=16, w13_block_n=128, w13_block_k=64, w2_block_n=128)),
    ]
    for E, k, K, N, G, M, pattern, dtype, config in prefill_cases:
        weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=E + K + N + M + 1)
        x = torch.randn(M, K, generator=gen).to(dtype)
        tw = torch.rand(M, k, generator=gen)
        ids = routing(pattern, M, k, E, gen)
        name = f"prefill E={E} k={k} K={K} N={N} G={G} M={M} {pattern} {dtype} {config}"
        out = output_buffer(x)
        launch_prefill(x, tw, ids, weights, out, config)
        check(name, out, reference_moe(x, tw, ids, weights), dtype)
        if config.kernel == "mma":
            unrolled = output_buffer(x)
            with Unrolled():
                launch_prefill(x, tw, ids, weights, unrolled, config)
            same_bits(name, out, unrolled)

    print("all interpreter shape checks passed", flush=True)


if __name__ == "__main__":
    main()
