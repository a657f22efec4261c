"""The grouped decode over vLLM's Marlin tensors (kernels/marlin_grouped.py) under TRITON_INTERPRET=1.

Launched by test_kernels_interpret.py in a subprocess (the variable must be set before triton is
imported). Each case converts a synthetic AutoAWQ layer with marlin_layout.awq_to_marlin (bit-equal
to vLLM's load step, tests/test_marlin_layout.py) and checks the kernels' output against the float64
reference of the AutoAWQ layer. The cases cover: N padded to N_p (gate and up each: N = 96 and 160
at G = 32, the only padding vLLM makes, since N is a multiple of G), N == G (vLLM's channelwise
scale order; at G = 32 with padding too), G = 32 / 64 / 128, a W2 past
awq_mma.UNROLLED_CHUNKS (its chunk loop), several warps in both kernels, an id outside [0, E),
fp16 and bf16, the combine fused into W2 and as its own launch. Prints one line per case and exits non-zero on the first failure.
"""

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

from interpret_kernels_check import check, routing  # noqa: E402

from moe_grouped_decode.awq import synthetic_moe_weights  # noqa: E402
from moe_grouped_decode.kernels.awq_mma import UNROLLED_CHUNKS  # noqa: E402
from moe_grouped_decode.kernels.marlin_grouped import MarlinGroupedConfig, launch_marlin_grouped  # noqa: E402
from moe_grouped_decode.marlin_layout import awq_to_marlin  # noqa: E402
from moe_grouped_decode.ops.reference import reference_moe  # noqa: E402

F16, BF16 = torch.float16, torch.bfloat16
CASES = [
    # (E, k, K, N, G, M, pattern, dtype, MarlinGroupedConfig fields): why
    (4, 2, 128, 64, 32, 2, "random", F16, (1, 1, 1)),  # no padding, one warp everywhere
    (4, 2, 128, 96, 32, 3, "round_robin", F16, (2, 2, 2)),  # N_p = 128: a gate and an up tile half padding
    (4, 3, 192, 160, 32, 5, "single_hot", BF16, (1, 2, 1)),  # qwen3.8's N: N_p = 192; multi-row experts
    (4, 2, 256, 128, 128, 2, "random", BF16, (2, 1, 1)),  # N == G: the channelwise scale order
    (4, 2, 128, 32, 32, 2, "random", F16, (1, 2, 1)),  # N == G == 32: channelwise and N_p = 64
    (4, 2, 256, 256, 128, 2, "random", BF16, (1, 2, 2)),  # G = 128, grouped order, bf16
    (4, 2, 256, 192, 64, 3, "random", F16, (4, 1, 4)),  # G = 64, four warps each
    (2, 1, 128, 768, 128, 2, "invalid", F16, (1, 4, 2)),  # W2's 24 chunks loop; an id of -1
    (4, 2, 128, 64, 32, 3, "invalid", F16, (1, 1, 1)),  # the fused combine over a slot of id -1
    # the combine as a launch of its own (the rest fuse it into W2)
    (4, 3, 192, 160, 32, 5, "single_hot", F16, (1, 2, 1, False)),
    (4, 2, 256, 128, 128, 3, "invalid", BF16, (2, 1, 2, False)),
]


def main() -> None:
    assert 768 // 32 > UNROLLED_CHUNKS, "the last case loops"
    gen = torch.Generator().manual_seed(11)
    for E, k, K, N, G, M, pattern, dtype, config in CASES:
        awq = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=E + K + N + M)
        marlin = awq_to_marlin(awq)
        x = torch.randn(M, K, generator=gen).to(dtype)
        tw = torch.rand(M, k, generator=gen)
        if pattern == "invalid":
            ids = torch.randint(0, E, (M, k), generator=gen, dtype=torch.int32)
            ids[-1, -1] = -1
        else:
            ids = routing(pattern, M, k, E, gen)
        out = torch.full((M, K), float("nan"), dtype=dtype)
        launch_marlin_grouped(x, tw, ids, *marlin.tensors(), N, G, marlin.scales_grouped,
                              MarlinGroupedConfig(*config), out=out)
        name = (f"marlin grouped E={E} k={k} K={K} N={N} (N_p={marlin.padded_intermediate_size}) G={G} M={M} "
                f"{pattern} {dtype} scales_grouped={marlin.scales_grouped} config={config}")
        check(name, out, reference_moe(x, tw, ids, awq), dtype)
    # no tokens: an empty output, nothing launched (the fused combine's W13 has an extra program)
    awq = synthetic_moe_weights(4, 128, 64, 32, seed=1)
    marlin = awq_to_marlin(awq)
    empty = launch_marlin_grouped(torch.zeros(0, 128, dtype=F16), torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.int32),
                                  *marlin.tensors(), 64, 32, marlin.scales_grouped, MarlinGroupedConfig(1, 1, 1))
    if empty.shape != (0, 128):
        print(f"FAIL M = 0 gives {tuple(empty.shape)}", flush=True)
        sys.exit(1)
    print("ok   M = 0: an empty [0, K] output", flush=True)
    print("all interpreter marlin checks passed", flush=True)


if __name__ == "__main__":
    main()
