"""Summarize a bench --prefill-sweep (bench.json): per M the fastest configs, and per group size the
fastest W13 (sort + W13) and the fastest W2 (+ combine) variants, which combine independently."""
import json
import sys
from collections import defaultdict

rows = json.load(open(sys.argv[1]))["prefill_sweep"]
KEYS = ("kernel", "token_blocks", "block_rows", "w13_block_n", "w13_block_k", "w13_warps", "w13_stages", "w2_block_n", "w2_warps",
        "w2_stages")


def name(r, keys=KEYS):
    return ",".join(f"{k}={r[k]}" for k in keys)


by_m = defaultdict(list)
for r in rows:
    by_m[r["M"]].append(r)
for M, rs in sorted(by_m.items()):
    rs.sort(key=lambda r: r["us"])
    print(f"M={M}: best {rs[0]['us']:.1f} us ({name(rs[0])}) diff {rs[0]['scaled_diff_vs_prefill']:.1e}")
    groups = defaultdict(list)
    for r in rs:
        groups[(r["kernel"], r["block_rows"] if r["kernel"] == "dot" else 8 * r["token_blocks"])].append(r)
    for (kernel, size), g in sorted(groups.items()):
        w13 = min(g, key=lambda r: r["through_w13_us"])
        w2 = min(g, key=lambda r: r["us"] - r["through_w13_us"])
        print(f"  {kernel} rows={size:<4} total best {min(r['us'] for r in g):8.1f} | sort+W13 {w13['through_w13_us']:8.1f}"
              f" ({name(w13, ('w13_block_n', 'w13_block_k', 'w13_warps', 'w13_stages'))}) | W2+combine "
              f"{w2['us'] - w2['through_w13_us']:8.1f} ({name(w2, ('w2_block_n', 'w2_warps', 'w2_stages'))})"
              f" | max diff {max(r['scaled_diff_vs_prefill'] for r in g):.1e}")
