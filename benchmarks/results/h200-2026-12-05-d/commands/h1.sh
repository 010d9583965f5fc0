#!/usr/bin/env bash
# Run H1 (plan, for an H200): the Gluon backward's default (c72cda4) and the D=128 rows, in one machine call.
# 1. The Gluon backward's float64 GPU tests (the default switch end to end included) and the Gluon forward's
#    dispatched end-to-end tests, whose backward the default now picks at D=128.
# 2. Forward+backward of flashlite.attention(backend="triton") against SDPA at D=128, cases 1-13 (the rows the
#    dispatch table's forward+backward entries come from; they predate the default).
# 3. The forward against SDPA at D=128, cases 1-13 (N5's rows were an H100's).
# Needs carry: .commit, .gpu_deps. About 9 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=130 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py tests/flashlite/test_attention_gluon_gpu.py" bash scripts/gpu_check.sh tests -k "not test_attention_gluon_gpu or dispatched" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/fwdbwd128 AB_LIMIT=$(( 420 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and D128" > $O/fwdbwd128_run.log 2>&1
echo "fwd+bwd A/B done at $(( $(date +%s) - start )) s"
OUT=$O/fwd128 AB_LIMIT=$(( 560 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_d128_triton_vs_sdpa" > $O/fwd128_run.log 2>&1
echo "fwd A/B done at $(( $(date +%s) - start )) s"
for d in tests fwdbwd128 fwd128; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
for d in fwdbwd128 fwd128; do
  echo "=== $d"; grep -E "^\| fwd" $O/$d/results/ab_report.md 2>/dev/null | awk -F'|' '$5 ~ /[0-9]/' | cut -d'|' -f3,4,5,8,10 | head -14
  grep -E "win,|passed|failed" $O/$d/results/ab.log 2>/dev/null | tail -3
done
