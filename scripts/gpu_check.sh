#!/usr/bin/env bash
# One call on a CUDA machine: environment record, then the stages asked for.
# Usage: scripts/gpu_check.sh [tests|ab|scaling|all] [extra pytest args for the test and A/B stages, e.g. -k "fp16"]
#   tests    tests/flashlite and tests/kernelcheck on the GPU (one config per kernel: FLASHLITE_AUTOTUNE=0)
#   ab       the A/B suite, tests/perf --kernel-ab, report JSON/markdown/plot
#   scaling  benchmarks/scaling.py (time and memory as S and B grow; SCALING_ARGS, default --quick)
# Writes logs and reports under $OUT/results (default .gpu_out/results), packs them into $OUT/results.tar.gz (the
# device tool returns at most 8 files) and prints a short summary last.
set -uo pipefail
stage=${1:-all}; shift || true
OUT=${OUT:-$PWD/.gpu_out}; R=$OUT/results
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The plugin registers through its entry point, so install into the interpreter that runs pytest (python3 -m pip:
# a bare pip may belong to another Python). No network there: no build isolation, no dependencies.
python3 -m pip install --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || echo "install failed: see install.log"

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  echo "commit: $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"  # .commit: carried by the device tool, whose copy has no history of its own
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| cudnn', torch.backends.cudnn.version())"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

# Pure-Python test helpers the GPU machine lacks (pytest-xdist), copied from a local install into .gpu_deps/ and
# carried with the checkout, since the machine has no network. To make it:
#   sp=$(python -c 'import xdist, os; print(os.path.dirname(os.path.dirname(xdist.__file__)))')
#   mkdir -p .gpu_deps && cp -r "$sp"/{xdist,execnet,pytest_xdist-*.dist-info,execnet-*.dist-info} .gpu_deps/
test_workers=()
if [[ -d .gpu_deps ]]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_deps"
  python3 -c "import xdist" 2>/dev/null && test_workers=(-n "${TEST_WORKERS:-8}")
fi

if [[ $stage == tests || $stage == all ]]; then
  # One config per kernel instead of autotuning every shape class the tests touch: the tests check results, and
  # tuning each of their tiny shapes would cost minutes of compile and benchmark time. Kernel compiles dominate
  # the run (about 20 min serially), so it is spread over test_workers processes when xdist is available.
  # SIGINT at the limit makes pytest print what passed and failed so far (the device tool stops a call at 600 s).
  FLASHLITE_AUTOTUNE=0 timeout -s INT -k 20 "${TESTS_LIMIT:-540}" python3 -m pytest tests/flashlite tests/kernelcheck \
    -q --maxfail=20 --durations=15 -p no:cacheprovider "${test_workers[@]}" "$@" > "$R/gpu_tests.log" 2>&1
fi
if [[ $stage == ab || $stage == all ]]; then
  # SIGINT at the limit lets pytest write the report of what finished.
  # AB_PATHS picks the files (and their order) when one call cannot hold the whole suite.
  timeout -s INT -k 20 "${AB_LIMIT:-420}" python3 -m pytest ${AB_PATHS:-tests/perf} --kernel-ab \
    --kernel-ab-report "$R/ab_report.json" -q -p no:cacheprovider "$@" > "$R/ab.log" 2>&1
fi
if [[ $stage == scaling || $stage == all ]]; then
  # scaling.json is rewritten after every point, so a run stopped at SCALING_LIMIT keeps what it measured.
  timeout -s INT -k 20 "${SCALING_LIMIT:-420}" python3 benchmarks/scaling.py "$R" ${SCALING_ARGS:---quick} \
    > "$R/scaling.log" 2>&1
fi
tar -czf "$OUT/results.tar.gz" -C "$OUT" results

echo "===== summary ($stage) ====="
[[ -f $R/gpu_tests.log ]] && { echo "--- gpu tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu_tests.log" | tail -25; }
[[ -f $R/ab.log ]] && { echo "--- A/B"; sed -n '/kernel A\/B comparisons/,$p' "$R/ab.log" | tail -60; }
[[ -f $R/scaling.log ]] && { echo "--- scaling"; tail -30 "$R/scaling.log"; }
exit 0
