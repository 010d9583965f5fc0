#!/usr/bin/env bash
# Run U1: the pointer backward as one kernel with dQ added in by TMA bulk reductions (FLASHLITE_DQ_REDUCE=1, built
# after 90cd007; five products per tile pair where the dQ kernel makes it seven). First its float64 GPU tests and
# the backward's (tests/flashlite/test_attention_dq_reduce.py: every variant case with the switch on, autotuned at
# D=64 and 128; tests/flashlite/test_attention_backward.py: the two-kernel path it sits beside); only if they all
# pass, each kernel's time per call at D=128 (cases 3 and 6), then the A/B: forward+backward with the reduction
# against the dQ kernel, then against SDPA, at B=1 S=8192, B=8 S=4096, B=16 S=8192 and B=4 S=2048, D=64 and 128.
# Needs carry: .commit, .gpu_deps. About 9 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=240 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_dq_reduce.py tests/flashlite/test_attention_backward.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
if grep -qE "[0-9]+ passed" $O/tests/results/gpu_tests.log && ! grep -qE "[0-9]+ (failed|error)|Timeout|KeyboardInterrupt|Interrupted" $O/tests/results/gpu_tests.log; then
  # The one kernel's GPU time per call beside cuDNN's backward kernel (torch.profiler), D=128 cases 3 and 6; run T1
  # has the two-kernel backward's at the same points.
  FLASHLITE_DQ_REDUCE=1 timeout 60 python3 scripts/attn_probe.py --backward --kernels --cases 3,6 --D 128 > $O/kernels_D128_dq_reduce.txt 2>&1
  echo "kernels done at $(( $(date +%s) - start )) s"
  OUT=$O/ab AB_LIMIT=$(( 540 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "(dq_reduce_vs_dq_kernel or dq_reduce_vs_sdpa) and (B1-S8192 or B8-S4096 or B16-S8192 or B4-S2048)" > $O/ab_run.log 2>&1
  echo "A/B done at $(( $(date +%s) - start )) s"
fi
for d in tests ab; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== kernels, D=128"; grep -E "^ +[0-9]+ +[0-9]+ +[0-9]+ |^ +[0-9.]+ us" $O/kernels_D128_dq_reduce.txt 2>/dev/null | head -16
echo "=== A/B"; sed -n '/kernel A\/B comparisons/,$p' $O/ab/results/ab.log 2>/dev/null | grep -v "^$" | cut -c1-200 | tail -20
