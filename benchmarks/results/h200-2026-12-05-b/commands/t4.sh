#!/usr/bin/env bash
# Run T4: the compiled layer "mixed" against the compiled plain block at cases 1-13, inference then the training
# step (forward, backward, fused AdamW), after 47bc93d (the attention decided outside dynamo's trace); then, in the
# time left, the same inference rows with both sides compiled once with dynamic=True (Q3's row, never timed).
# Needs carry: .commit, .gpu_deps. About 9 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/inference AB_LIMIT=230 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_vs_compiled_plain_block and mixed and not residual and not option" > $O/inference_run.log 2>&1
echo "inference done at $(( $(date +%s) - start )) s"
OUT=$O/training AB_LIMIT=$(( 470 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_training_step_vs_compiled_plain_block and mixed and not residual" > $O/training_run.log 2>&1
echo "training done at $(( $(date +%s) - start )) s"
OUT=$O/dynamic AB_LIMIT=$(( 560 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_dynamic_compiled_layer_vs_dynamic_compiled_plain_block" > $O/dynamic_run.log 2>&1
echo "dynamic done at $(( $(date +%s) - start )) s"
for d in inference training dynamic; do rm -f $O/$d/results.tar.gz; done
for d in inference training dynamic; do
  echo "=== $d"; sed -n '/kernel A\/B comparisons/,$p' $O/$d/results/ab.log 2>/dev/null | grep -v "^$" | cut -c1-200 | tail -18
done
