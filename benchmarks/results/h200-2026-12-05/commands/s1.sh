#!/usr/bin/env bash
# Run S1 (planned; not run yet): the warp-specialized Gluon backward (0241ae8, FLASHLITE_GLUON_BWD=ws). First its
# float64 GPU tests, both schedules ("pipelined" and "ws", every listed config, the case table, the switch through
# flashlite.attention); only if they all pass, forward+backward of flashlite.attention with the ws schedule against
# the pointer backward, the single-partition Gluon backward and SDPA, and each ws config of dK/dV and dQ against the
# single-partition kernel, the kernels alone (D=64 and 128, cases 3, 6, 12; -k gluon_backward selects both tests);
# then each schedule's kernels per call at D=64 and 128, case 6 (scripts/attn_probe.py --kernels). A deadlock in a new kernel
# would show as the tests stopped by TESTS_LIMIT, and then nothing is timed. Needs carry: .commit, .gpu_deps.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=200 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  OUT=$O/ab AB_LIMIT=$(( 460 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k gluon_backward > $O/ab_run.log 2>&1
  echo "A/B done at $(( $(date +%s) - start )) s"
  for D in 64 128; do for schedule in ws 1; do
    FLASHLITE_GLUON_BWD=$schedule timeout 20 python3 scripts/attn_probe.py --backward --kernels --cases 6 --D $D > $O/kernels_D${D}_gluon_bwd_$schedule.txt 2>&1
  done; done
else
  echo "tests did not all pass: nothing timed"
fi
tar -czf $O/s1.tar.gz -C $O tests tests_run.log $(cd $O && ls -d ab ab_run.log kernels_*.txt 2>/dev/null)
rm -rf $O/tests $O/ab
echo "=== tests"; tar -xzOf $O/s1.tar.gz tests/results/gpu_tests.log 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -8
echo "=== A/B"; tar -xzOf $O/s1.tar.gz ab/results/ab_report.md 2>/dev/null | grep -E "^\| (fwd\+bwd|dkdv|dq) |win,|loss," | cut -d'|' -f2,3,4,5,8,10 | head -50
echo "=== kernels"; for f in $(ls $O/kernels_*.txt 2>/dev/null); do echo "$f"; grep -E "GPU time|us +[0-9.]+%" "$f" | head -14; done
