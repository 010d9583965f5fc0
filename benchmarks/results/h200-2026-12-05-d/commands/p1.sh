#!/usr/bin/env bash
# Run P1: where the compiled layer's training step loses at the many-short-sequence cases (T4: 0.828x at case 8,
# 0.853x at case 10). scripts/layer_profile.py's kernel listing (GPU time per kernel per step, wall time) of the
# compiled layer against the compiled plain block: "mixed" at cases 8 and 10, then the layer in "bf16" (bf16
# parameters and stream, the plain block's precision) at case 10, which separates what the precision policy costs
# from what the layer's own graph costs.
# Needs carry: .commit. At most about 5.5 minutes.
set -u
O=$OUT; mkdir -p $O
start=$(date +%s)
{ python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  cat .commit 2>/dev/null; date -u; } > $O/env.txt 2>&1
export PYTHONPATH="$PWD"
timeout 200 python3 scripts/layer_profile.py --cases 8,10 --modes training --top 40 > $O/mixed_training.log 2>&1
echo "mixed training done at $(( $(date +%s) - start )) s"
timeout 120 python3 scripts/layer_profile.py --cases 10 --modes training --top 40 --precision bf16 > $O/bf16_training.log 2>&1
echo "bf16 training done at $(( $(date +%s) - start )) s"
cat $O/env.txt
for f in mixed_training bf16_training; do echo "=== $f"; grep -E "^case|per call|plain/layer|Error|error" $O/$f.log | cut -c1-200 | tail -12; done
