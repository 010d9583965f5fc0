#!/usr/bin/env bash
# Run O1: fwd+bwd triton vs sdpa at cases 1-13, D=64 and 128 (the table's new entries); the compiled layer's
# training step "mixed" at cases 1-13 before (flashlite of 6342337) and after (38dec74: training calls on SDPA
# where no fwd+bwd entry says otherwise), one machine session.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
# before
rm -rf /tmp/b && mkdir -p /tmp/b && cp -r . /tmp/b/ && rm -rf /tmp/b/flashlite && cp -r .ab_before/6342337/flashlite /tmp/b/flashlite && echo 6342337 > /tmp/b/.commit
(cd /tmp/b && OUT=$O/before AB_LIMIT=170 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_training_step_vs_compiled_plain_block and mixed and not residual" > $O/before_run.log 2>&1)
echo "before done at $(( $(date +%s) - start )) s"
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
OUT=$O/after AB_LIMIT=170 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "test_compiled_layer_training_step_vs_compiled_plain_block and mixed and not residual" > $O/after_run.log 2>&1
echo "after done at $(( $(date +%s) - start )) s"
OUT=$O/fwdbwd AB_LIMIT=200 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa" > $O/fwdbwd_run.log 2>&1
echo "fwdbwd done at $(( $(date +%s) - start )) s"
python3 scripts/ab_before_after.py $O/before/results/ab_report.json $O/after/results/ab_report.json > $O/before_after.txt 2>&1
tar -czf $O/o1.tar.gz -C $O before after fwdbwd before_after.txt before_run.log after_run.log fwdbwd_run.log
rm -rf $O/before $O/after $O/fwdbwd
echo "=== before/after"; tail -30 $O/before_after.txt
echo "=== fwdbwd"; sed -n '/kernel A\/B comparisons/,$p' $O/fwdbwd_run.log | grep -v "^$" | tail -40
