#!/usr/bin/env bash
# Run Q1: forward+backward against SDPA at cases 1-13, D=128, before (flashlite of ef08a6a) and after (d723351:
# four 8-warp dK/dV autotuning candidates that compile without register spills), one machine session. Both sides
# print the autotuner's choice per shape (TRITON_PRINT_AUTOTUNING=1, pytest -s).
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && rm -rf /tmp/b/flashlite && cp -r .ab_before/ef08a6a/flashlite /tmp/b/flashlite && echo ef08a6a > /tmp/b/.commit
(cd /tmp/b && TRITON_PRINT_AUTOTUNING=1 OUT=$O/before AB_LIMIT=245 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and D128" -s > $O/before_run.log 2>&1)
echo "before done at $(( $(date +%s) - start )) s"
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
TRITON_PRINT_AUTOTUNING=1 OUT=$O/after AB_LIMIT=$(( 565 - ($(date +%s) - start) )) AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and D128" -s > $O/after_run.log 2>&1
echo "after done at $(( $(date +%s) - start )) s"
python3 scripts/ab_before_after.py $O/before/results/ab_report.json $O/after/results/ab_report.json > $O/before_after.txt 2>&1
grep -h -B3 "best config selected" $O/before/results/ab.log | sed 's/^/before: /' > $O/autotune_choices.txt
grep -h -B3 "best config selected" $O/after/results/ab.log | sed 's/^/after: /' >> $O/autotune_choices.txt
tar -czf $O/q1.tar.gz -C $O before after before_after.txt before_run.log after_run.log
rm -rf $O/before $O/after
echo "=== autotune choices"; grep -c "best config" $O/autotune_choices.txt; grep -A3 "function _.*\(dkdv\|dq\)" $O/autotune_choices.txt | grep "function\|best" | cut -c1-200 | head -60
echo "=== before/after"; tail -20 $O/before_after.txt
