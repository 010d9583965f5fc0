#!/usr/bin/env bash
# Run S2 (planned; not run yet): Inductor's C++ wrapper for the compiled layer at the host-bound cases 1, 2 and 5
# (issue 19). In one session: the compiled layer "mixed" against the compiled plain block with the default Python
# wrapper, and both compiled with options={"cpp_wrapper": True}; then where each side's host time goes with the C++
# wrapper at case 1 (scripts/layer_profile.py --modes host: wall time, paired events, GPU time, CPU events). A
# compile that fails (the C++ wrapper needs the CUDA headers and a C++ compiler on the machine) is recorded as the
# test's error. Needs carry: .commit, .gpu_deps.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
K="(test_compiled_layer_vs_compiled_plain_block and (case1- or case2- or case5-) and mixed and not bf16_residual and not option and not dynamic) or (with_inductor_option and cpp_wrapper)"
OUT=$O/ab AB_LIMIT=420 AB_PATHS=tests/perf/test_layer_ab.py bash scripts/gpu_check.sh ab -k "$K" > $O/ab_run.log 2>&1
echo "A/B done at $(( $(date +%s) - start )) s"
timeout $(( 570 - ($(date +%s) - start) )) python3 scripts/layer_profile.py --cases 1 --modes host --inductor cpp_wrapper=True > $O/profile_cpp_wrapper.txt 2>&1
echo "profile rc $? at $(( $(date +%s) - start )) s"
tar -czf $O/s2.tar.gz -C $O ab ab_run.log profile_cpp_wrapper.txt
rm -rf $O/ab
echo "=== A/B"; tar -xzOf $O/s2.tar.gz ab/results/ab_report.md 2>/dev/null | grep -E "^\| compiled|win,|loss,|error" | cut -d'|' -f2,3,4,5,8,10 | head -12
echo "=== profile"; grep -E "host .*: wall|plain/layer" $O/profile_cpp_wrapper.txt | head -8
