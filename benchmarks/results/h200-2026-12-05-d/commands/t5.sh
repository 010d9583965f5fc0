#!/usr/bin/env bash
# Run T5: what each precision policy costs under torch.compile, from one machine session: the compiled layer in
# "mixed", "mixed_bf16_residual" and "bf16_fp32_residual" against the compiled plain bf16 block at cases 2, 5, 8,
# 10 and 12 (1,024 to 131,072 tokens), inference and then the training step (forward, backward, fused AdamW), for
# docs/precision.md's table of accuracy beside time.
# T5_CASES (a -k expression), T5_INFERENCE_LIMIT and T5_END (seconds) narrow it to the device time at hand.
# Needs carry: .commit, .gpu_deps. About 9 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
CASES=${T5_CASES:-"(case2- or case5- or case8- or case10- or case12-)"}
OUT=$O/inference AB_LIMIT=${T5_INFERENCE_LIMIT:-220} AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_vs_compiled_plain_block and not option and $CASES" > $O/inference_run.log 2>&1
echo "inference done at $(( $(date +%s) - start )) s"
OUT=$O/training AB_LIMIT=$(( ${T5_END:-560} - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_training_step_vs_compiled_plain_block and $CASES" > $O/training_run.log 2>&1
echo "training done at $(( $(date +%s) - start )) s"
for d in inference training; do rm -f $O/$d/results.tar.gz; done
for d in inference training; do
  echo "=== $d"; grep -E "^\| compiled" $O/$d/results/ab_report.md 2>/dev/null | cut -d'|' -f3,4,5,8,10 | cut -c1-160
  grep -E "passed|failed" $O/$d/results/ab.log 2>/dev/null | tail -2
done
