#!/usr/bin/env bash
# Run Q3: the automatic-dynamic compile test after its fix (it failed in Q2 for its own fault); the compiled layer
# "mixed" against the compiled plain block at cases 1-13, inference, with static graphs (one per case) and with both
# sides compiled once with dynamic=True; then the compiled layer's training step "mixed" at cases 1-13 with the rest
# of the time.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/tests TESTS_LIMIT=60 TEST_WORKERS=1 TEST_PATHS="tests/flashlite/test_attention_compile.py" bash scripts/gpu_check.sh tests -k "automatic_dynamic or one_graph_for_every" > $O/tests_run.log 2>&1
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/inference AB_LIMIT=280 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_dynamic_compiled_layer_vs_dynamic_compiled_plain_block or (test_compiled_layer_vs_compiled_plain_block and mixed and not residual)" > $O/inference_run.log 2>&1
echo "inference done at $(( $(date +%s) - start )) s"
OUT=$O/training AB_LIMIT=$(( 530 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_training_step_vs_compiled_plain_block and mixed and not residual" > $O/training_run.log 2>&1
echo "training done at $(( $(date +%s) - start )) s"
tar -czf $O/q3.tar.gz -C $O tests inference training tests_run.log inference_run.log training_run.log
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log | tail -4
echo "=== inference"; sed -n '/kernel A\/B comparisons/,$p' $O/inference/results/ab.log | grep -v "^$" | cut -c1-210 | tail -34
echo "=== training"; sed -n '/kernel A\/B comparisons/,$p' $O/training/results/ab.log | grep -v "^$" | cut -c1-210 | tail -20
rm -rf $O/tests $O/inference $O/training
