#!/usr/bin/env bash
# Run T3: the Gluon backward after b6bcb14 (no config left with its wgmmas serialized by ptxas; the overlapped
# dK/dV schedule rebuilt) and FLASHLITE_GLUON_BWD=ws_dq. First the Gluon backward's float64 GPU tests, every listed
# config of both schedules and every switch setting (a deadlock in the rebuilt schedule would show as the tests
# stopped by TESTS_LIMIT, and then nothing is timed); only if they all pass, the A/B at cases 3, 6, 12, D=64 and
# 128: each kernel's configs alone against the single-partition kernel's first (-k backward_kernels), forward+
# backward of the ws schedule against the pointer backward, the single-partition schedule and SDPA
# (-k gluon_backward_ab), and of ws_dq against the pointer backward and SDPA (-k ws_dq); then each schedule's
# kernels per call at D=128, case 6 (scripts/attn_probe.py --kernels).
# Needs carry: .commit, .gpu_deps. About 9 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=200 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  OUT=$O/ab AB_LIMIT=$(( 470 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k "gluon_backward or ws_dq" > $O/ab_run.log 2>&1
  echo "A/B done at $(( $(date +%s) - start )) s"
  # Each schedule's kernels per call at D=128, case 6 (GPU time per kernel, torch.profiler).
  for schedule in ws 1 ws_dq; do
    FLASHLITE_GLUON_BWD=$schedule timeout 20 python3 scripts/attn_probe.py --backward --kernels --cases 6 --D 128 > $O/kernels_D128_gluon_bwd_$schedule.txt 2>&1
  done
fi
for d in tests ab; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== A/B"; grep -E "^\| (fwd|dkdv|dq)" $O/ab/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,4,5,8,10 | head -60
grep -E "passed|failed" $O/ab/results/ab.log 2>/dev/null | tail -2
echo "=== kernels, D=128 case 6"; grep -hE "^ +[0-9.]+ us" $O/kernels_D128_gluon_bwd_*.txt 2>/dev/null | head -30
