#!/usr/bin/env bash
# Run O4: the final table (8e28fee) at the cases whose training decision it changed from d87b80a's: the compiled
# layer's training step "mixed" at cases 7, 9, 10, 11 before (flashlite of 6342337) and after, one machine
# session; auto forward+backward against SDPA at those four shapes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
SEL='test_compiled_layer_training_step_vs_compiled_plain_block and mixed and not residual and (case7- or case9- or case10- or case11-)'
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && rm -rf /tmp/b/flashlite && cp -r .ab_before/6342337/flashlite /tmp/b/flashlite && echo 6342337 > /tmp/b/.commit
(cd /tmp/b && OUT=$O/before AB_LIMIT=90 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$SEL" > $O/before_run.log 2>&1)
echo "before done at $(( $(date +%s) - start )) s"
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
OUT=$O/after AB_LIMIT=90 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$SEL" > $O/after_run.log 2>&1
echo "after done at $(( $(date +%s) - start )) s"
OUT=$O/auto AB_LIMIT=60 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_auto_never_slower_than_sdpa and D64 and (B16-S1024 or B64-S256 or B128-S128 or B256-S64)" > $O/auto_run.log 2>&1
echo "auto done at $(( $(date +%s) - start )) s"
python3 scripts/ab_before_after.py $O/before/results/ab_report.json $O/after/results/ab_report.json > $O/before_after.txt 2>&1
tar -czf $O/o4.tar.gz -C $O before after auto before_after.txt before_run.log after_run.log auto_run.log
rm -rf $O/before $O/after $O/auto
echo "=== before/after"; tail -8 $O/before_after.txt | cut -c1-260
echo "=== auto"; sed -n '/kernel A\/B comparisons/,$p' $O/auto_run.log | grep -v "^$" | cut -c1-190 | tail -12
