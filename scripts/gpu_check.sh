#!/usr/bin/env bash
# The one device script: GPU tests, benchmark (+ optional config sweep), single-GPU TP4 check.
# Installs nothing (but the Humming wheel of .anchors into /tmp/site when .anchors is carried:
# then the benchmark has vLLM's own backends beside the plugin). Writes logs/JSON/Markdown/PNG
# under $OUT (default artifacts/gpu_check) and prints a short table last.
#   scripts/gpu_check.sh [--sweep 2,4,8] [--breakdown 2,8] [--variants 2,8] [--timeline 2,4,8] [--skip-tests] [--skip-bench]
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-artifacts/gpu_check}
mkdir -p "$OUT"
SWEEP=""; BREAKDOWN=""; VARIANTS=""; TIMELINE=""; TESTS=1; BENCH=1
while [ $# -gt 0 ]; do
  case "$1" in
    --sweep) SWEEP="$2"; shift 2 ;;
    --breakdown) BREAKDOWN="$2"; shift 2 ;;
    --variants) VARIANTS="$2"; shift 2 ;;
    --timeline) TIMELINE="$2"; shift 2 ;;
    --skip-tests) TESTS=0; shift ;;
    --skip-bench) BENCH=0; shift ;;
    *) echo "unknown argument $1"; exit 2 ;;
  esac
done
exec > >(tee "$OUT/gpu_check.log") 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
python3 -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
status=0
if [ "$TESTS" = 1 ]; then
  MOE_GD_STATS="$OUT/cuda_stats.json" timeout 540 python3 -m pytest -q -rs --maxfail=8 -p no:cacheprovider \
    tests/test_cuda_ops.py tests/test_lowering_cuda_graphs.py tests/test_cuda_prefill.py tests/test_cuda_sync_free.py \
    > "$OUT/gpu_tests.log" 2>&1 || status=1
  tail -3 "$OUT/gpu_tests.log"
fi
ANCHORS=""
if [ -d .anchors ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .anchors/humming_whl/*.whl \
    && export PYTHONPATH=.:/tmp/site && ANCHORS=.anchors
fi
[ "$BENCH" = 0 ] || timeout $([ -n "$SWEEP" ] && echo 600 || echo 400) python3 -m moe_grouped_decode bench --out "$OUT" \
  ${ANCHORS:+--anchors "$ANCHORS"} ${SWEEP:+--sweep "$SWEEP"} ${BREAKDOWN:+--breakdown "$BREAKDOWN"} || status=1
if [ -n "$VARIANTS" ]; then
  timeout 150 python3 benchmarks/launch_variants.py all "$VARIANTS" | tee "$OUT/launch_variants.md" || status=1
fi
if [ -n "$TIMELINE" ]; then
  timeout 120 python3 benchmarks/timeline.py "$TIMELINE" --out "$OUT/timeline.md" || status=1
fi
# the opt-in autotune path, end to end, for one token count (cache in a scratch dir)
MOE_GROUPED_DECODE_CACHE=/tmp/moe_gd_tune MOE_GROUPED_DECODE_TUNE=1 timeout 90 python3 - <<'PY' || status=1
import glob, time, torch
from moe_grouped_decode.awq import synthetic_for_contract
from moe_grouped_decode.contract import QWEN38_TP4 as c
from moe_grouped_decode.ops import cuda
w = synthetic_for_contract(c, device="cuda")
t0 = time.time()
cuda.warmup(w, c.top_k, grouped_token_counts=[2], dense_token_counts=[1, 16])
print(f"[tune] warmup with tune took {time.time() - t0:.0f}s;", open(glob.glob("/tmp/moe_gd_tune/*.json")[0]).read())
PY
timeout 70 python3 benchmarks/tp4_check.py --single-gpu --out "$OUT" || status=1
if [ -f "$OUT/cuda_stats.json" ]; then
  python3 - "$OUT/cuda_stats.json" <<'PY'
import json, sys
stats = json.load(open(sys.argv[1]))
worst = {}
for s in stats:
    key = " ".join(s["case"].split()[:2])
    if key not in worst or s["scaled_max_abs"] > worst[key]["scaled_max_abs"]:
        worst[key] = s
print(f"accuracy: {len(stats)} cases; worst per op/dtype (max_abs / max|ref|, max ULP):")
for key, s in sorted(worst.items()):
    print(f"  {key:<28} scaled={s['scaled_max_abs']:.2e} max_abs={s['max_abs']:.2e} ulp={s['max_ulp']}  ({s['case']})")
PY
fi
[ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
echo "gpu_check status=$status"
exit $status
