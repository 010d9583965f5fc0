#!/usr/bin/env bash
# Run P1: the pointer backward with dQ added in by atomics from the dK/dV kernel (FLASHLITE_DQ_ATOMICS): its GPU
# tests against float64, then the A/B head to head against the dQ kernel at cases 1-13 x D 64/128, then
# forward+backward against SDPA with atomics forced on.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=100 TEST_WORKERS=6 TEST_PATHS="tests/flashlite/test_attention_dq_atomics.py tests/flashlite/test_attention_backward.py tests/flashlite/test_attention_variants_kernel.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/h2h AB_LIMIT=250 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_dq_atomics_vs_dq_kernel" > $O/h2h_run.log 2>&1
echo "h2h done at $(( $(date +%s) - start )) s"
left=$(( 560 - ($(date +%s) - start) ))
FLASHLITE_DQ_ATOMICS=1 OUT=$O/sdpa AB_LIMIT=$left AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa" > $O/sdpa_run.log 2>&1
echo "sdpa done at $(( $(date +%s) - start )) s"
tar -czf $O/p1.tar.gz -C $O tests h2h sdpa tests_run.log h2h_run.log sdpa_run.log
echo "=== tests"; grep -h "passed\|failed\|FAILED\|Error" $O/tests/results/gpu_tests.log | tail -8
echo "=== h2h"; sed -n '/kernel A\/B comparisons/,$p' $O/h2h/results/ab.log | grep -v "^$" | tail -32
echo "=== sdpa"; sed -n '/kernel A\/B comparisons/,$p' $O/sdpa/results/ab.log | grep -v "^$" | tail -32
rm -rf $O/tests $O/h2h $O/sdpa
