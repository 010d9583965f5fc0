#!/usr/bin/env bash
# Run N4 (plan): Nsight Compute on the D=128 forward at case 6 (B=8, H=16, S=4096, bf16 causal) after the ping-pong
# kernel moved its turns and slot releases to named barriers (dispatched since 91da93a), flashlite's kernel against
# SDPA's cuDNN kernel, as run N1 read them before (h100-2026-12-05/n1_ncu/: barrier stalls 3.64 per instruction
# against cuDNN's 1.59). Tells how much of the barrier stall went and what holds the kernel now. One call per side
# after warm-up (scripts/ncu_attention.py); ncu's raw and details pages and scripts/ncu_summary.py's lines.
# --clock-control none: the clocks as the A/B sees them. Needs carry: .commit. About 1 minute.
set -u
O=$OUT; mkdir -p $O
start=$(date +%s)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{ python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  cat .commit 2>/dev/null; date -u; echo "ncu: $NCU"; $NCU --version; } > $O/env.txt 2>&1
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats"
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active'
name=fwd_d128_named
timeout 200 $NCU --profile-from-start off --clock-control none --target-processes all $SECTIONS --metrics "$METRICS" \
  -f -o $O/$name python3 scripts/ncu_attention.py --D 128 --case 6 > $O/${name}_run.log 2>&1
echo "$name: rc $? at $(( $(date +%s) - start )) s"
$NCU --import $O/$name.ncu-rep --csv --page raw > $O/${name}_raw.csv 2> $O/${name}_import.log
$NCU --import $O/$name.ncu-rep --csv --page details > $O/${name}_details.csv 2>> $O/${name}_import.log
python3 scripts/ncu_summary.py $O/${name}_raw.csv > $O/${name}_summary.txt 2>&1
echo "=== $name"; tail -3 $O/${name}_run.log | cut -c1-200; cut -c1-220 $O/${name}_summary.txt
