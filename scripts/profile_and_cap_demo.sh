#!/usr/bin/env bash
# On a CUDA machine: show --kernel-ab-profile's NVTX ranges in an Nsight Systems trace, --kernel-ab-trace's Chrome
# traces with CUDA kernels in them, and --kernel-device-memory 4GiB skipping a marked test and turning a real
# out-of-memory error into a skip that names the cap. Writes everything under $OUT (default kernelcheck-demo/) and
# prints PASS/FAIL per check; exits 1 if any check failed.
#
#   bash scripts/profile_and_cap_demo.sh
set -u
OUT="${OUT:-kernelcheck-demo}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
status=0
check() {  # check NAME COMMAND...: PASS when the command succeeds
    local name="$1"; shift
    if "$@" >/dev/null 2>&1; then echo "PASS $name"; else echo "FAIL $name"; status=1; fi
}

demo="$OUT/demo_tests"
mkdir -p "$demo"
cat >"$demo/test_demo.py" <<'EOF'
import pytest
import torch

def test_matmul_pair(kernel_ab):
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kernel_ab.compare(lambda: x @ x, lambda: torch.mm(x, x), name="mm vs torch.mm")

@pytest.mark.memory(5 * 2**30)
def test_marked_past_the_cap():
    torch.empty(5 * 2**30, dtype=torch.uint8, device="cuda")

def test_allocates_past_the_cap():
    torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")

def test_fits_the_cap():
    torch.empty(2**30, dtype=torch.uint8, device="cuda")
EOF

# 1. NVTX ranges in an nsys trace, and the GPU time projected onto them. Nsight Systems is often installed off
# PATH (with the CUDA toolkit or under /opt/nvidia): look there too.
nsys=$(command -v nsys || ls /usr/local/cuda/bin/nsys /usr/local/cuda-*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys \
    /opt/nvidia/nsight-systems-cli/*/bin/nsys 2>/dev/null | head -n 1)
if [[ -n $nsys ]]; then
    echo "nsys: $nsys"
    "$nsys" profile --trace=cuda,nvtx --force-overwrite=true -o "$OUT/profile" \
        python -m pytest "$demo/test_demo.py" -k matmul_pair --kernel-ab-profile -p no:cacheprovider \
        >"$OUT/nsys_pytest.log" 2>&1
    "$nsys" stats --report nvtx_gpu_proj_sum "$OUT/profile.nsys-rep" >"$OUT/nvtx_gpu_proj_sum.txt" 2>&1
    check "nsys: the candidate's range has GPU time" grep -q "kernelcheck:.*mm vs torch.mm:candidate" "$OUT/nvtx_gpu_proj_sum.txt"
    check "nsys: the baseline's range has GPU time" grep -q "kernelcheck:.*mm vs torch.mm:baseline" "$OUT/nvtx_gpu_proj_sum.txt"
    check "summary: ranges emitted" grep -q "callables run inside NVTX ranges, nothing timed" "$OUT/nsys_pytest.log"
else
    echo "SKIP nsys checks: no nsys on PATH, in /usr/local/cuda*/bin or under /opt/nvidia"
fi

# 2. torch.profiler Chrome traces with CUDA kernels.
python -m pytest "$demo/test_demo.py" -k matmul_pair --kernel-ab-trace "$OUT/traces" -p no:cacheprovider \
    >"$OUT/trace_pytest.log" 2>&1
check "trace: one file written" test "$(ls "$OUT/traces" | wc -l)" -eq 1
check "trace: CUDA kernels in it" python -c "
import glob, json, sys
events = json.load(open(glob.glob(sys.argv[1] + '/*.json')[0]))['traceEvents']
sys.exit(0 if any(e.get('cat') == 'kernel' for e in events) else 1)" "$OUT/traces"

# 3. A 4 GiB GPU on this one.
python -m pytest "$demo/test_demo.py" -k "not matmul_pair" --kernel-device-memory 4GiB -rs -p no:cacheprovider \
    >"$OUT/cap_pytest.log" 2>&1
check "cap: header states it" grep -q "device memory capped at 4 GiB per CUDA device (cuda:0" "$OUT/cap_pytest.log"
check "cap: the marked test skips naming it" grep -q "more than the device memory cap of 4 GiB" "$OUT/cap_pytest.log"
check "cap: the real OOM skips naming it" grep -q "out of memory: .*(device memory capped at 4 GiB" "$OUT/cap_pytest.log"
check "cap: 1 GiB still fits" grep -q "1 passed, 2 skipped" "$OUT/cap_pytest.log"
echo "logs and traces: $OUT"
exit $status
