#!/usr/bin/env bash
# Run N1: Nsight Compute on the kernels whose time no throughput limit explains (the forward's issue model,
# benchmarks/results/cpu-host-2026-12-05-c/forward_issue_model/: at case 6 the kernels take 2.1-2.5x their bound by
# instruction issue, exponentials or tensor cores, cuDNN's too). One call per side after warm-up
# (scripts/ncu_attention.py), bf16 causal, case 6 (B=8, H=16, S=4096): D=128 forward, D=64 forward, D=128
# forward+backward (the pointer backward and cuDNN's), each flashlite against SDPA's cuDNN kernels, and the D=128
# forward+backward with FLASHLITE_DQ_REDUCE=1 (flashlite alone); ncu's raw page
# and details page of each, and scripts/ncu_summary.py's per-kernel lines (time, throughput, pipes, issue, stall
# reasons). --clock-control none: the clocks as the A/B sees them (METHOD.md). Needs carry: .commit. About 5 minutes.
set -u
O=$OUT; mkdir -p $O
start=$(date +%s)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
{ python3 -c "import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())"
  cat .commit 2>/dev/null; date -u; echo "ncu: $NCU"; $NCU --version; } > $O/env.txt 2>&1
SECTIONS="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats --section InstructionStats"
METRICS='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,regex:sm__inst_executed_pipe_.*\.avg\.pct_of_peak_sustained_active'
profile() {  # name, then the driver's arguments
  local name=$1; shift
  timeout $(( 280 - ($(date +%s) - start) > 20 ? 280 - ($(date +%s) - start) : 20 )) \
    $NCU --profile-from-start off --clock-control none --target-processes all $SECTIONS --metrics "$METRICS" \
    -f -o $O/$name python3 scripts/ncu_attention.py "$@" > $O/${name}_run.log 2>&1
  echo "$name: rc $? at $(( $(date +%s) - start )) s"
  $NCU --import $O/$name.ncu-rep --csv --page raw > $O/${name}_raw.csv 2> $O/${name}_import.log
  $NCU --import $O/$name.ncu-rep --csv --page details > $O/${name}_details.csv 2>> $O/${name}_import.log
  python3 scripts/ncu_summary.py $O/${name}_raw.csv > $O/${name}_summary.txt 2>&1
}
profile fwd_d128 --D 128 --case 6
profile fwdbwd_d128 --D 128 --case 6 --backward
# The one-kernel backward (FLASHLITE_DQ_REDUCE=1), which lost 0.69-0.92x to the two kernels in run U1.
export FLASHLITE_DQ_REDUCE=1; profile fwdbwd_d128_dqreduce --D 128 --case 6 --backward --sides flashlite; unset FLASHLITE_DQ_REDUCE
profile fwd_d64 --D 64 --case 6
ls -la $O > $O/files.txt
for name in fwd_d128 fwdbwd_d128 fwdbwd_d128_dqreduce fwd_d64; do echo "=== $name"; tail -3 $O/${name}_run.log | cut -c1-200; cat $O/${name}_summary.txt | cut -c1-220; done
