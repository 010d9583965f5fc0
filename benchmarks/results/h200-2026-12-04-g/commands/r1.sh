#!/usr/bin/env bash
# Run R1 (planned; not run yet): the pointer backward in two launches (7ea953c: the dQ kernel computes delta, no
# preprocessing kernel; 2593f0a: a replayed backward builds no launch arguments). First its correctness on the GPU
# (every backward and gradient test of the attention files, float64 references); then forward+backward against
# SDPA at D=64 (the long shapes, where the 0.95x target is 1-2% away, and the short ones, where a launch less is
# most of the change), before (flashlite of c4a68f2) and after in one machine session; then where the compiled
# layer's host time goes at cases 1 and 2 (scripts/layer_profile.py --modes host). Needs carry: .commit,
# .gpu_deps, .ab_before (c4a68f2 exported there).
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=120 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_backward.py tests/flashlite/test_attention_varlen.py tests/flashlite/test_attention_variants.py tests/flashlite/test_attention_gpu.py" bash scripts/gpu_check.sh tests -k "backward or gradient or grad" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
SHAPES="(S8192 or S32768 or S4096 or B1-S128- or B1-S1024-) and D64"
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && rm -rf /tmp/b/flashlite && cp -r .ab_before/c4a68f2/flashlite /tmp/b/flashlite && echo c4a68f2 > /tmp/b/.commit
(cd /tmp/b && OUT=$O/before AB_LIMIT=160 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and $SHAPES" > $O/before_run.log 2>&1)
echo "before done at $(( $(date +%s) - start )) s"
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
OUT=$O/after AB_LIMIT=160 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and $SHAPES" > $O/after_run.log 2>&1
echo "after done at $(( $(date +%s) - start )) s"
python3 scripts/ab_before_after.py $O/before/results/ab_report.json $O/after/results/ab_report.json > $O/before_after.txt 2>&1
timeout $(( 570 - ($(date +%s) - start) )) python3 scripts/layer_profile.py --cases 1,2 --modes host > $O/layer_host.txt 2>&1
echo "host profile rc $? at $(( $(date +%s) - start )) s"
tar -czf $O/r1.tar.gz -C $O tests before after before_after.txt tests_run.log before_run.log after_run.log
rm -rf $O/tests $O/before $O/after
echo "=== tests"; tar -xzOf $O/r1.tar.gz tests/results/gpu_tests.log 2>/dev/null | grep -E "^(FAILED|ERROR)|passed|failed" | tail -6
echo "=== before/after"; tail -16 $O/before_after.txt
echo "=== host"; grep -E "host .*: wall|plain/layer|^case" $O/layer_host.txt
