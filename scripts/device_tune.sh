#!/usr/bin/env bash
# On a lent GPU machine (no network): `tune` one or more shapes into the package's tables/, with
# vLLM's kernels built from the fetched sources (carry [".vllm_moe_src"]; made here by
# `python -m moe_grouped_decode vllm-moe-fetch`). Each shape's table, report and log land in
# $OUT/tune-<name>.tar.gz as soon as it is done.
#   bash scripts/device_tune.sh E,k,K,N,G:DTYPE:NAME [...] [-- extra tune options]
set -uo pipefail
out=${OUT:-/tmp/out}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .vllm_moe_src/humming_whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
shapes=() extra=()
while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; extra=("$@"); break; fi
    shapes+=("$1"); shift
done
for item in "${shapes[@]}"; do
    IFS=: read -r shape dtype name <<< "$item"
    dir="$out/tune-$name-$dtype"
    mkdir -p "$dir"
    python3 -m moe_grouped_decode tune --shape "$shape" --dtype "$dtype" --name "$name" --ship \
        --report-dir "$dir" "${extra[@]}" 2>&1 | tee "$dir/log.txt"
    cp moe_grouped_decode/tables/*"_${shape//,/-}_${dtype}.json" "$dir/" 2>/dev/null
    tar czf "$dir.tar.gz" -C "$out" "$(basename "$dir")" && rm -rf "$dir"
done
