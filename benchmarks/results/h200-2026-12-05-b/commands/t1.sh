#!/usr/bin/env bash
# Run T1: (1) the replay test the two-launch backward changed (ff22951), after the project's install this time;
# (2) R2's kernel profiles: which kernels hold forward+backward's time, flashlite's against SDPA's, at D=64 and 128
# (scripts/attn_probe.py --backward --kernels), and the forward alone at D=128 cases 6, 3, 12; (3) the compiled
# layer's guard check on CUDA after 47bc93d (attention decided outside the trace), against S3's 16.72 us; (4) the
# code Inductor generates for both sides of case 1 (TORCH_LOGS=output_code), to read where the layer's wrapper
# spends its extra host time, with the host profile (now with cProfile of each side's Python functions). Needs carry: .commit.
set -u
export PYTHONPATH="$PWD"
O=$OUT; mkdir -p $O
start=$(date +%s)
{ date -u; echo "commit: $(cat .commit 2>/dev/null)"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cudnn', torch.backends.cudnn.version())"; } > $O/env.txt 2>&1
python3 -m pip install --no-deps --no-build-isolation -e . > $O/install.log 2>&1; echo "install rc $?"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/flashlite/test_attention_gpu.py -k "recorded_launches or two_launches" > $O/replay_test.log 2>&1
echo "replay test rc $? at $(( $(date +%s) - start )) s"
for D in 64 128; do
  timeout 120 python3 scripts/attn_probe.py --backward --kernels --D $D --cases 1,3,6,7,10,12 > $O/bwd_kernels_d$D.txt 2>&1
  echo "D=$D rc $? at $(( $(date +%s) - start )) s"
done
timeout 60 python3 scripts/attn_probe.py --kernels --D 128 --cases 6,3,12 > $O/fwd_kernels_d128.txt 2>&1
echo "forward D=128 rc $? at $(( $(date +%s) - start )) s"
timeout 80 python3 scripts/guard_cost_probe.py --device cuda --dump $O/guards > $O/guard_cost.txt 2>&1
echo "guard probe rc $? at $(( $(date +%s) - start )) s"
TORCH_LOGS=output_code timeout $(( 560 - ($(date +%s) - start) )) python3 scripts/layer_profile.py --cases 1 --modes host > $O/layer_host_output_code.txt 2>&1
echo "host profile rc $? at $(( $(date +%s) - start )) s"
echo "=== env"; cat $O/env.txt
echo "=== replay test"; tail -3 $O/replay_test.log
echo "=== guards"; grep -E "guard check" $O/guard_cost.txt | cut -c1-300
echo "=== host"; grep -E "host .*: wall|plain/layer|^case" $O/layer_host_output_code.txt | head; grep -A 12 "Python functions" $O/layer_host_output_code.txt | cut -c1-150 | head -28
echo "=== kernels"; for f in bwd_kernels_d64 bwd_kernels_d128 fwd_kernels_d128; do echo "--- $f"; grep -E "^ +[0-9]+ |GPU time per call|^ +[0-9.]+ us +[0-9.]+%" $O/$f.txt | head -30; done
