#!/usr/bin/env bash
# One call on a CUDA machine that does what a release needs: the GPU tests not yet seen passing, the attention
# A/B suite, a dispatch table generated from it, the backend="auto" A/B against SDPA with that table, and the
# layer A/B. Everything lands in $OUT/results.tar.gz (one file: the device tool returns at most 8).
# Usage: scripts/gpu_final.sh [max seconds per A/B comparison, default 0.5]
set -uo pipefail
OUT=${OUT:-$PWD/.gpu_out}; R=$OUT/results; mkdir -p "$R"
AB_TIME=${1:-0.5}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
python3 -m pip install --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1
{ date -u +"date: %Y-%m-%dT%H:%M:%SZ"; echo "commit: $(cat .commit 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cudnn', torch.backends.cudnn.version())"
} > "$R/env.txt" 2>&1
stop() { timeout -s INT -k 15 "$@"; }  # SIGINT lets pytest write its report before it exits
PT="python3 -m pytest -q -p no:cacheprovider"
FLASHLITE_AUTOTUNE=0 stop 110 $PT tests/flashlite/test_layer_gpu.py tests/flashlite/test_attention_compile.py \
  > "$R/tests_layer_compile.log" 2>&1
FLASHLITE_AUTOTUNE=0 stop 70 $PT tests/flashlite/test_attention_gpu.py -k "odd_head_dims or grid_axis or backward" \
  > "$R/tests_attention_rerun.log" 2>&1
AB="--kernel-ab --kernel-ab-max-time $AB_TIME"
stop 210 $PT tests/perf/test_attention_ab.py $AB --kernel-ab-report "$R/ab_attention.json" \
  -k "(test_forward_triton_vs_sdpa and bfloat16) or test_forward_fp32 or test_forward_d128 or test_forward_backward" \
  > "$R/ab_attention.log" 2>&1
python3 scripts/make_dispatch_table.py "$R/ab_attention.json" > "$R/dispatch.log" 2>&1 \
  && cp flashlite/dispatch_tables/*.json "$R/"
stop 60 $PT tests/perf/test_attention_ab.py $AB -k test_forward_auto --kernel-ab-report "$R/ab_auto.json" \
  > "$R/ab_auto.log" 2>&1
stop 90 $PT tests/perf/test_layer_ab.py $AB -k "compiled" --kernel-ab-report "$R/ab_layer.json" > "$R/ab_layer.log" 2>&1
tar -czf "$OUT/results.tar.gz" -C "$OUT" results
echo "===== summary ====="
cat "$R/env.txt"
for f in tests_layer_compile tests_attention_rerun; do echo "--- $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/$f.log" | tail -8; done
cat "$R/dispatch.log"
for f in ab_attention ab_auto ab_layer; do echo "--- $f"; grep -E "win, .* loss|^(FAILED|ERROR)|passed|failed" "$R/$f.log" | tail -6; done
