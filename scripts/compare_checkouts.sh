#!/usr/bin/env bash
# Before/after on one GPU in one call: the same output bits and the same speed as an older checkout.
#   scripts/compare_checkouts.sh BASELINE_DIR [TOKENS] [ROUNDS]
# BASELINE_DIR holds the older moe_grouped_decode package (e.g. a copy of it carried with the
# device call). Saves the ops' outputs with it (scripts/bits_snapshot.py), compares the current
# tree's bit for bit, then times `python -m moe_grouped_decode bench --tokens TOKENS` (default
# 1,2,4,8) alternately with the old and the new code, ROUNDS times each (default 2), and prints
# the grouped column side by side. Writes $OUT/compare_checkouts.md (default artifacts/).
set -uo pipefail
cd "$(dirname "$0")/.."
base=$(cd "${1:?usage: scripts/compare_checkouts.sh BASELINE_DIR [TOKENS] [ROUNDS]}" && pwd)
tokens=${2:-1,2,4,8}
rounds=${3:-2}
OUT=${OUT:-artifacts}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
work=$(mktemp -d)
(cd "$base" && PYTHONPATH="$base" python3 "$OLDPWD/scripts/bits_snapshot.py" save "$work/bits.pt") || status=1
PYTHONPATH=. python3 scripts/bits_snapshot.py compare "$work/bits.pt" | tail -4 || status=1
for round in $(seq "$rounds"); do
  for side in old new; do
    dir=$([ "$side" = old ] && echo "$base" || pwd)
    (cd "$dir" && PYTHONPATH="$dir" python3 -m moe_grouped_decode bench --tokens "$tokens" \
      --out "$work/$side$round" | grep -E "^\[bench\] M=.* grouped ") || status=1
  done
done
python3 - "$work" "$rounds" "$OUT/compare_checkouts.md" <<'PY'
import json, sys
work, rounds, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
runs = {(side, r): json.load(open(f"{work}/{side}{r}/bench.json")) for side in ("old", "new") for r in range(1, rounds + 1)}
# each side's grouped column by M (an older bench may time other columns at more counts)
grouped = {key: {row["M"]: row["grouped_us"] for row in run["rows"] if row.get("grouped_us") is not None}
           for key, run in runs.items()}
Ms = sorted(set.intersection(*(set(g) for g in grouped.values())))
lines = ["| M | " + " | ".join(f"{side} {r}" for r in range(1, rounds + 1) for side in ("old", "new")) + " | new - old (mean) |",
         "| --- |" + " --- |" * (2 * rounds + 1)]
for M in Ms:
    cells = {(s, r): grouped[s, r][M] for s in ("old", "new") for r in range(1, rounds + 1)}
    mean = lambda s: sum(cells[s, r] for r in range(1, rounds + 1)) / rounds  # noqa: E731
    lines.append(f"| {M} | " + " | ".join(f"{cells[s, r]:.2f}" for r in range(1, rounds + 1) for s in ("old", "new"))
                 + f" | {mean('new') - mean('old'):+.2f} |")
table = "grouped op, us per layer (bench, fp16, " + runs["new", 1]["gpu"] + "), old and new alternating:\n\n" + "\n".join(lines)
print(table)
open(out, "w").write(table + "\n")
PY
rm -rf "$work"
echo "compare_checkouts status=$status"
exit $status
