#!/usr/bin/env bash
# Run N5: N3 and the D=128 forward against SDPA over cases 1-13 in one machine call, within about 7 minutes (what
# the session's device time left after failed starts; N4, ../h200-2026-12-05-c/commands/ncu2.sh, left out).
# 1. The whole Gluon backward test file in float64 (every listed config, the "mixed" switch included).
# 2. Only if they pass: FLASHLITE_GLUON_BWD=mixed forward+backward against ws_dq, the pointer backward and SDPA at
#    cases 3, 6, 12, D=64 and 128 (tests/perf/test_gluon_ab.py -k mixed).
# 3. flashlite's forward (backend="triton": the Gluon forward where dispatched, named barriers at D=128 since
#    91da93a) against SDPA at D=128, cases 1-13 (tests/perf/test_attention_ab.py, the targets table's rows).
# Needs carry: .commit, .gpu_deps. About 7 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=100 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  OUT=$O/mixed AB_LIMIT=100 AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k "mixed" > $O/mixed_run.log 2>&1
  echo "mixed A/B done at $(( $(date +%s) - start )) s"
fi
OUT=$O/fwd128 AB_LIMIT=$(( 400 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_d128_triton_vs_sdpa" > $O/fwd128_run.log 2>&1
echo "fwd128 A/B done at $(( $(date +%s) - start )) s"
for d in tests mixed fwd128; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
for d in mixed fwd128; do
  echo "=== $d"; grep -E "^\| fwd" $O/$d/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,4,5,8,10 | head -20
  grep -E "passed|failed" $O/$d/results/ab.log 2>/dev/null | tail -2
done
