#!/usr/bin/env bash
# Run Q2 (37501d9): the four tests that failed for their own faults in run P3 (fixed in 5dda994), with the files they
# live in (the dynamic-size compile tests among them) and test_layer.py; then the real-size files
# test_attention_gpu.py and test_layer_gpu.py whole. FLASHLITE_AUTOTUNE=0 (one config per kernel), as always for tests.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=170 TEST_WORKERS=8 TEST_PATHS="tests/flashlite/test_attention_compile.py tests/flashlite/test_dispatch.py tests/kernelcheck/test_ab_plugin.py tests/flashlite/test_attention.py::test_auto_runs_calls_with_a_gradient_by_the_forward_backward_measurement tests/flashlite/test_layer.py" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/realsize TESTS_LIMIT=$(( 545 - ($(date +%s) - start) )) TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gpu.py tests/flashlite/test_layer_gpu.py" bash scripts/gpu_check.sh tests > $O/realsize_run.log 2>&1
echo "real-size done at $(( $(date +%s) - start )) s"
tar -czf $O/q2.tar.gz -C $O tests realsize tests_run.log realsize_run.log
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log | tail -12
grep -E "test_auto_runs_calls_with_a_gradient|test_compiled_calls_follow|test_compare_with_an_earlier_report_flags|test_compiled_calls_take_the_inference" $O/tests/results/gpu_tests.xml | grep -o 'name="[^"]*"' | head
echo "=== real-size"; grep -E "^(FAILED|ERROR)|passed|failed" $O/realsize/results/gpu_tests.log | tail -12
rm -rf $O/tests $O/realsize
