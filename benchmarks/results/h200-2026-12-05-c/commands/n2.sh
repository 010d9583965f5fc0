#!/usr/bin/env bash
# Run N2: the ping-pong forward with its turns and slot releases through hardware named barriers (NAMED_BARRIERS,
# 4f66b81). First the Gluon forward's float64 GPU tests of every listed config and the ping-pong consumers with
# unequal work (a deadlock would show as the tests stopped by TESTS_LIMIT, and then nothing is timed); only if they
# pass, the A/B at cases 3, 6, 12, D=64 and 128 (-k named_barriers): the named-barrier config against the same
# tiles with mbarriers, against the dispatched config and against SDPA.
# Needs carry: .commit, .gpu_deps. About 6 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=180 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_gpu.py" bash scripts/gpu_check.sh tests -k "every_listed_config or unequal_work" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  OUT=$O/ab AB_LIMIT=$(( 540 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k "named_barriers" > $O/ab_run.log 2>&1
  echo "A/B done at $(( $(date +%s) - start )) s"
fi
for d in tests ab; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== A/B"; grep -E "^\| fwd" $O/ab/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,4,5,8,10 | head -40
grep -E "passed|failed" $O/ab/results/ab.log 2>/dev/null | tail -2
