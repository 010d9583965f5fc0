#!/usr/bin/env bash
# Run Q4 (planned for the next GPU session; not run in this one): the dQ-reduction probe's float64 check on the GPU
# (every config, modes "none", "atomic" and "tma"), then its timing against flashlite's backward (do_bench medians,
# D=64 and 128, five shapes); then the compiled layer's kernels at cases 1 and 5 in inference, to see the heads'
# merge copy (triton_poi_fused_clone_transpose in N1's profile) gone since attention()'s output is laid out like q.
set -u
export PYTHONPATH="$PWD:$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation -e . > $O/install.log 2>&1
{ date -u; cat .commit 2>/dev/null; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__)"; } > $O/env.txt 2>&1
timeout 180 python3 scripts/dq_reduce_probe.py check > $O/probe_check.txt 2>&1
echo "check rc $? at $(( $(date +%s) - start )) s"
timeout $(( 450 - ($(date +%s) - start) )) python3 scripts/dq_reduce_probe.py time > $O/probe_time.txt 2>&1
echo "time rc $? at $(( $(date +%s) - start )) s"
timeout $(( 560 - ($(date +%s) - start) )) python3 scripts/layer_profile.py --cases 1,5 --modes inference --top 12 > $O/layer_profile.txt 2>&1
echo "profile rc $? at $(( $(date +%s) - start )) s"
echo "=== check"; grep -c " ok$" $O/probe_check.txt; grep FAILED $O/probe_check.txt | head
echo "=== time"; grep -E "^time|best" $O/probe_time.txt
echo "=== profile"; grep -E "case|of GPU time|clone" $O/layer_profile.txt
