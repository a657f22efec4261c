"""Save, then compare, the ops' output bits on fixed inputs: a refactor that must not change numerics.

    python scripts/bits_snapshot.py save FILE       # with the code before the change importable
    python scripts/bits_snapshot.py compare FILE    # with the code after it; exits 1 on any difference

On a CUDA GPU: the grouped and the dense op at every M in 1..8 (and 16), fp16 and bf16, on a
synthetic qwen3.8-tp4 layer and seeded random routing (tokens sharing experts included), the
outputs as raw 16-bit patterns. Uses only names both sides of a change keep (the torch.ops,
``ops.alloc_workspace``, ``awq.synthetic_moe_weights``), so the "before" side can be an older
checkout on PYTHONPATH.
"""

import sys

import torch

import moe_grouped_decode  # noqa: F401  (registers the ops)
from moe_grouped_decode.awq import synthetic_moe_weights
from moe_grouped_decode.ops import alloc_workspace

E, TOP_K, K, N, G = 512, 10, 2560, 160, 32
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def outputs() -> dict:
    results = {}
    workspace = alloc_workspace(max(TOKENS), TOP_K, K, N, "cuda")
    for dtype in (torch.float16, torch.bfloat16):
        weights = synthetic_moe_weights(E, K, N, G, dtype=dtype, seed=11, device="cuda")
        args = (weights.w13_qweight, weights.w13_scales, weights.w13_qzeros, weights.w2_qweight, weights.w2_scales,
                weights.w2_qzeros, G)
        for M in TOKENS:
            gen = torch.Generator().manual_seed(M)
            x = torch.randn(M, K, generator=gen).to(dtype).cuda()
            ids = torch.rand(M, E, generator=gen).topk(TOP_K, dim=1).indices
            ids[M // 2] = ids[0]  # a token sharing every expert with another: two-row segments
            ids = ids.to(torch.int32).cuda()
            tw = torch.rand(M, TOP_K, generator=gen)
            tw = (tw / tw.sum(1, keepdim=True)).cuda()
            workspace.fill_(-1)
            grouped = torch.ops.moe_grouped_decode.awq_moe_grouped_decode(x, tw, ids, *args, workspace)
            dense = torch.ops.moe_grouped_decode.awq_moe_dense(x, tw, ids, *args)
            name = str(dtype).removeprefix("torch.")
            results[f"grouped {name} M={M}"] = grouped.view(torch.int16).cpu()
            results[f"dense {name} M={M}"] = dense.view(torch.int16).cpu()
    return results


def main(argv) -> int:
    if len(argv) != 2 or argv[0] not in ("save", "compare"):
        sys.exit(__doc__)
    mode, path = argv
    got = outputs()
    if mode == "save":
        torch.save(got, path)
        print(f"[bits] saved {len(got)} outputs to {path}")
        return 0
    want = torch.load(path)
    differ = [name for name in want if name not in got or not torch.equal(got[name], want[name])]
    for name in want:
        print(f"[bits] {name}: {'DIFFERENT' if name in differ else 'same bits'}")
    print(f"[bits] {len(want) - len(differ)} of {len(want)} outputs bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
