#!/usr/bin/env bash
# Run N3: FLASHLITE_GLUON_BWD=mixed (dK/dV on the single-partition Gluon kernel, its 64x64 config now first, dQ on
# the warp-specialized one; 91da93a) and the D=128 forward dispatched on named barriers. First the float64 GPU tests of
# flashlite.attention's backward with the switch at "mixed" (-k "switch_on and mixed"; every listed config ran in
# T3, where the reordered ones were already listed); only if they pass, forward+backward
# of flashlite.attention with "mixed" against ws_dq, the pointer backward and SDPA at cases 3, 6, 12, D=64 and 128
# (-k mixed).
# Needs carry: .commit, .gpu_deps. About 2 minutes (the A/B stops at 125 s from the start).
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=50 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py" bash scripts/gpu_check.sh tests -k "switch_on and mixed" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  OUT=$O/ab AB_LIMIT=$(( 125 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k "mixed" > $O/ab_run.log 2>&1
  echo "A/B done at $(( $(date +%s) - start )) s"
fi
for d in tests ab; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== A/B"; grep -E "^\| fwd" $O/ab/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,4,5,8,10 | head -20
grep -E "passed|failed" $O/ab/results/ab.log 2>/dev/null | tail -2
