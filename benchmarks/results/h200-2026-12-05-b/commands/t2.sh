#!/usr/bin/env bash
# Run T2: the compiled attention decided outside the trace (47bc93d). (1) Its correctness on the GPU: the compile
# tests of attention and of the layer (float64 references), with the replay tests T1 ran out of time for. (2) The compiled layer "mixed" against the compiled
# plain block, inference and the training step at cases 1, 2, 5 and 10, before (flashlite of 29aa6d6) and after in
# one machine session. (3) S2's A/B rows, both sides compiled with Inductor's C++ wrapper, in the time left.
# Needs carry: .commit, .gpu_deps, .ab_before (29aa6d6 exported there).
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=200 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_compile.py tests/flashlite/test_layer_gpu.py tests/flashlite/test_attention_gpu.py" bash scripts/gpu_check.sh tests -k "compile or recorded_launches or two_launches" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
ROWS="(test_compiled_layer_vs_compiled_plain_block or test_compiled_layer_training_step_vs_compiled_plain_block) and (case1- or case2- or case5- or case10-) and mixed and not bf16_residual and not option and not dynamic"
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && rm -rf /tmp/b/flashlite && cp -r .ab_before/29aa6d6/flashlite /tmp/b/flashlite && echo 29aa6d6 > /tmp/b/.commit
(cd /tmp/b && OUT=$O/before AB_LIMIT=150 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$ROWS" > $O/before_run.log 2>&1)
echo "before done at $(( $(date +%s) - start )) s"
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
OUT=$O/after AB_LIMIT=150 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$ROWS" > $O/after_run.log 2>&1
echo "after done at $(( $(date +%s) - start )) s"
python3 scripts/ab_before_after.py $O/before/results/ab_report.json $O/after/results/ab_report.json > $O/before_after.txt 2>&1
left=$(( 560 - ($(date +%s) - start) ))
if (( left > 90 )); then
  OUT=$O/cpp AB_LIMIT=$left AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "with_inductor_option and cpp_wrapper" > $O/cpp_run.log 2>&1
fi
echo "cpp_wrapper rows done at $(( $(date +%s) - start )) s"
tar -czf $O/t2.tar.gz -C $O tests before after cpp before_after.txt tests_run.log before_run.log after_run.log cpp_run.log 2>/dev/null
rm -rf $O/tests $O/before $O/after $O/cpp
echo "=== tests"; tar -xzOf $O/t2.tar.gz tests/results/gpu_tests.log 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
echo "=== before/after"; tail -14 $O/before_after.txt
echo "=== cpp_wrapper"; tar -xzOf $O/t2.tar.gz cpp/results/ab_report.md 2>/dev/null | grep -E "cpp" | cut -d'|' -f2,3,4,5,8,10 | head -8
