#!/usr/bin/env bash
# One call on a CUDA machine: environment record, GPU correctness tests, then the A/B suite.
# Usage: scripts/gpu_check.sh [tests|ab|all] [extra pytest args for the A/B stage...]
# Writes logs and reports under $OUT (default .gpu_out/) and prints a short summary last.
set -uo pipefail
stage=${1:-all}; shift || true
OUT=${OUT:-$PWD/.gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The plugin registers through its entry point, so install into the interpreter that runs pytest (python3 -m pip:
# a bare pip may belong to another Python). No network there: no build isolation, no dependencies.
python3 -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || echo "install failed: see install.log"

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo '+dirty')"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| cudnn', torch.backends.cudnn.version())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

tests_rc=-; ab_rc=-
if [[ $stage == tests || $stage == all ]]; then
  # One config per kernel instead of autotuning every shape class the tests touch: the tests check results, and
  # tuning each of their tiny shapes would cost minutes of compile and benchmark time.
  FLASHLITE_AUTOTUNE=0 python3 -m pytest tests/flashlite tests/kernelcheck -q --maxfail=20 --durations=15 \
    -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
  tests_rc=$?
fi
if [[ $stage == ab || $stage == all ]]; then
  python3 -m pytest tests/perf --kernel-ab --kernel-ab-report "$OUT/ab_report.json" -q -p no:cacheprovider "$@" \
    > "$OUT/ab.log" 2>&1
  ab_rc=$?
fi

echo "===== summary ($stage) ====="
[[ -f $OUT/gpu_tests.log ]] && { echo "--- gpu tests (rc=$tests_rc)"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/gpu_tests.log" | tail -25; }
[[ -f $OUT/ab.log ]] && { echo "--- A/B (rc=$ab_rc)"; sed -n '/kernel-ab/,$p' "$OUT/ab.log" | tail -80; }
exit 0
