#!/usr/bin/env bash
# Run T3: (1) FLASHLITE_GLUON_BWD=ws_dq (the warp-specialized Gluon dQ with the pointer dK/dV): the switch's GPU
# tests against float64 (every setting); (2) its forward+backward A/B against the pointer backward and SDPA at
# cases 3, 6, 12, D=64 and 128; (3) in the time left, the compiled layer "mixed" against the compiled plain block
# at cases 1-13, inference then the training step, after the attention decided outside the trace (47bc93d).
# Needs carry: .commit, .gpu_deps.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=90 TEST_WORKERS=4 TEST_PATHS="tests/flashlite/test_attention_gluon_bwd_gpu.py" bash scripts/gpu_check.sh tests -k "switch_on" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/ws_dq AB_LIMIT=120 AB_PATHS=tests/perf/test_gluon_ab.py bash scripts/gpu_check.sh ab -k "ws_dq" > $O/ws_dq_run.log 2>&1
echo "ws_dq A/B done at $(( $(date +%s) - start )) s"
ROWS="(test_compiled_layer_vs_compiled_plain_block or test_compiled_layer_training_step_vs_compiled_plain_block) and mixed and not bf16_residual and not option and not dynamic"
OUT=$O/layer AB_LIMIT=$(( 400 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$ROWS" > $O/layer_run.log 2>&1
echo "layer A/B done at $(( $(date +%s) - start )) s"
for d in tests ws_dq layer; do rm -f $O/$d/results.tar.gz; done
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== ws_dq"; grep -E "^\| fwd" $O/ws_dq/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,4,5,8,10 | head -12
echo "=== layer"; grep -E "^\| compiled" $O/layer/results/ab_report.md 2>/dev/null | cut -d'|' -f2,3,8,10 | head -28
grep -E "geometric|passed|failed" $O/layer/results/ab.log 2>/dev/null | tail -3
