#!/usr/bin/env bash
# Run T3: the compiled layer "mixed" against the compiled plain block at cases 1-13, inference and the training
# step, after the attention decided outside the trace (47bc93d), for the targets' geometric means. Needs carry:
# .commit, .gpu_deps.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
ROWS="(test_compiled_layer_vs_compiled_plain_block or test_compiled_layer_training_step_vs_compiled_plain_block) and mixed and not bf16_residual and not option and not dynamic"
OUT=$O/ab AB_LIMIT=500 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$ROWS" > $O/ab_run.log 2>&1
echo "A/B done at $(( $(date +%s) - start )) s"
tar -czf $O/t3.tar.gz -C $O ab ab_run.log
rm -rf $O/ab
echo "=== A/B"; tar -xzOf $O/t3.tar.gz ab/results/ab_report.md 2>/dev/null | grep -E "^\| compiled" | cut -d'|' -f2,3,8,10 | head -30
tar -xzOf $O/t3.tar.gz ab/results/ab.log 2>/dev/null | grep -E "geometric|passed|failed" | tail -3
