#!/usr/bin/env bash
# Run H3: the GPU suite (scripts/gpu_check.sh tests) at the commit H1 and H2 tested, for the first time as a whole
# since run P3 (c257b08), less the Gluon backward's file, which H1 and H2 ran whole. Limits 220 s, 130 s and 35 s for
# the three passes (14 workers, then the real-size files on 4, then the timing tests alone). Needs carry: .commit,
# .gpu_deps. About 7 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
OUT=$O TEST_WORKERS=14 TESTS_LIMIT=220 LARGE_TESTS_LIMIT=130 TIMING_TESTS_LIMIT=35 bash scripts/gpu_check.sh tests --ignore=tests/flashlite/test_attention_gluon_bwd_gpu.py > $O/suite_run.log 2>&1
rm -f $O/results.tar.gz
for f in gpu_tests gpu_tests_large gpu_timing_tests; do
  echo "=== $f"; grep -E "^(FAILED|ERROR)|passed|failed" $O/results/$f.log 2>/dev/null | tail -8
done
