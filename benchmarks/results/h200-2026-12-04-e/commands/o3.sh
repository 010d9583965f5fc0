#!/usr/bin/env bash
# Run O3: forward+backward triton vs sdpa at the D=128 shapes O1's limit cut off and again at the small D=64 shapes
# (host-bound, whose verdicts O1 and O2 disagree on); auto forward+backward at the small D=64 shapes; the host
# probe of a training call.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
OUT=$O/fwdbwd AB_LIMIT=200 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_triton_vs_sdpa and ((D128 and (B16-S1024 or B16-S8192 or B256-S64 or B32-S512 or B4-S32768 or B64-S256 or B128-S128)) or (D64 and (B1-S128- or B1-S1024- or B16-S1024 or B32-S512 or B64-S256 or B128-S128 or B256-S64)))" > $O/fwdbwd_run.log 2>&1
echo "fwdbwd done at $(( $(date +%s) - start )) s"
OUT=$O/auto AB_LIMIT=100 AB_PATHS=tests/perf/test_attention_ab.py bash scripts/gpu_check.sh ab -k "test_forward_backward_auto_never_slower_than_sdpa and D64 and (B1-S128- or B1-S1024- or B16-S1024 or B32-S512 or B64-S256 or B128-S128 or B256-S64)" > $O/auto_run.log 2>&1
echo "auto done at $(( $(date +%s) - start )) s"
timeout 120 python3 scripts/gradient_call_host_probe.py 1 128 16 64 1 1024 16 64 64 256 16 64 128 128 16 64 > $O/host_probe.txt 2>&1
echo "probe done at $(( $(date +%s) - start )) s"
tar -czf $O/o3.tar.gz -C $O fwdbwd auto fwdbwd_run.log auto_run.log host_probe.txt
rm -rf $O/fwdbwd $O/auto
for f in fwdbwd auto; do echo "=== $f"; sed -n '/kernel A\/B comparisons/,$p' $O/${f}_run.log | grep -v "^$" | cut -c1-190 | tail -18; done
echo "=== probe"; cat $O/host_probe.txt
