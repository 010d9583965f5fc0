#!/usr/bin/env bash
# Run Q4: scripts/dq_reduce_probe.py on the GPU. First its float64 check of every config and mode (the TMA
# reduction mode runs only on a GPU); then do_bench medians of flashlite's backward and of the one-kernel probe in
# each mode ("none": dK/dV alone; "atomic": P2's per-element adds; "tma": the descriptor's bulk reduction), D=128
# first (the unmet target), then D=64. Needs carry: .commit. About 8 minutes.
set -u
O=$OUT; mkdir -p $O
start=$(date +%s)
python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())" > $O/env.txt 2>&1
cat .commit >> $O/env.txt 2>/dev/null; date -u >> $O/env.txt
timeout 150 python3 scripts/dq_reduce_probe.py check > $O/check.txt 2>&1
echo "check rc $? at $(( $(date +%s) - start )) s"
timeout $(( 330 - ($(date +%s) - start) )) python3 scripts/dq_reduce_probe.py time --D 128 --shapes 1x8192,8x4096,16x1024 > $O/time_d128.txt 2>&1
echo "D=128 done at $(( $(date +%s) - start )) s"
timeout $(( 540 - ($(date +%s) - start) )) python3 scripts/dq_reduce_probe.py time --D 64 --shapes 1x8192,8x4096,16x1024 > $O/time_d64.txt 2>&1
echo "D=64 done at $(( $(date +%s) - start )) s"
echo "=== check"; grep -c " ok" $O/check.txt; grep FAILED $O/check.txt | head -5
echo "=== time"; grep -hE "^time|best" $O/time_d128.txt $O/time_d64.txt
