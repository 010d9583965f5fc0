#!/usr/bin/env bash
# The GPU side of the project in one command: environment record, then the stages asked for.
# Usage: tools/gpu_check.sh [tests|ab|scaling|all] [extra pytest args for the test and A/B stages, e.g. -k "fp16"]
#   tests    tests/flashlite and tests/kernelcheck on the GPU (one config per kernel: FLASHLITE_AUTOTUNE=0 unless the
#            caller sets FLASHLITE_AUTOTUNE=1, which autotunes every shape class the tests touch);
#            TEST_PATHS="a.py b/" runs those paths instead (extra arguments are for options such as -k); a pass
#            stopped by its time limit lists the selected tests it did not reach (<pass>_not_reached.txt)
#   ab       the A/B suite, tests/perf --kernel-ab: report JSON (every sample), markdown, plots (speedup, roofline,
#            trend over saved runs); with "all", the dispatch table flashlite/dispatch_tables/<gpu>.json is
#            regenerated from that report. Every A/B run is saved (--kernel-ab-autosave: named by commit and time)
#            in the run storage AB_STORAGE (default .kernelcheck, git-ignored: saved runs are this machine's
#            history, not repository content); when OUT is set the storage folder is copied to
#            $OUT/results/kernelcheck/, to be copied back into .kernelcheck/ for the next run's history
#   scaling  benchmarks/scaling.py (time and memory as S and B grow; SCALING_ARGS, default --quick for a single
#            stage and the full sweep for "all")
#   all      all of the above (about 30-40 minutes on an H200)
# Results go to benchmarks/results/<gpu>-<date>-<stage>/ (RESULTS_DIR overrides); commit only the files a document
# cites, in a folder named <gpu>-<date>-<what ran> (benchmarks/results/README.md lists each one). When OUT is set (a remote runner that
# returns files from $OUT), they go to $OUT/results and are also packed into $OUT/results.tar.gz. A short summary
# is printed last.
set -uo pipefail
stage=${1:-all}; shift || true
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n ${OUT:-} ]]; then
  R=$OUT/results
else
  gpu=$(python3 -c "import torch; from flashlite.dispatch import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))" 2>/dev/null || echo gpu)
  R=${RESULTS_DIR:-benchmarks/results/$gpu-$(date -u +%F)-$stage}
fi
mkdir -p "$R"
if [[ $stage == all ]]; then SCALING_ARGS=${SCALING_ARGS:- }; fi
# Per-stage time limits (TESTS_LIMIT, AB_LIMIT, SCALING_LIMIT, seconds; 0 = none): none on a machine of one's own,
# and within a remote runner's per-call limit when OUT is set.
remote() { [[ -n ${OUT:-} ]] && echo "$1" || echo 0; }
# The plugin registers through its entry point, so install into the interpreter that runs pytest (python3 -m pip:
# a bare pip may belong to another Python). No network there: no build isolation, no dependencies.
python3 -m pip install --no-deps --no-build-isolation -e . > "$R/install.log" 2>&1 || echo "install failed: see install.log"

{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  # .commit (git-ignored) is written before a remote run whose copy of the tree has no reliable history.
  echo "commit: $(cat .commit 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader 2>&1
  python3 -c "import sys, torch, triton; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda, '| cudnn', torch.backends.cudnn.version())"
} > "$R/env.txt" 2>&1
cat "$R/env.txt"

# Pure-Python test helpers the GPU machine lacks (pytest-xdist), copied from a local install into .gpu_deps/ and
# carried with the checkout, since the machine has no network. To make it:
#   sp=$(python -c 'import xdist, os; print(os.path.dirname(os.path.dirname(xdist.__file__)))')
#   mkdir -p .gpu_deps && cp -r "$sp"/{xdist,execnet,pytest_xdist-*.dist-info,execnet-*.dist-info} .gpu_deps/
# With several GPUs (counted as the plugin counts them: CUDA_VISIBLE_DEVICES, else NVML), the stages spread their
# xdist workers over all of them with --kernel-gpus all: each worker is pinned to one GPU, round-robin by worker.
gpu_count=$(python3 -c "from pytest_kernelcheck.speed.gpus import visible_gpus; print(len(visible_gpus()))" 2>/dev/null || echo 1)
has_xdist=0
test_workers=()
if [[ -d .gpu_deps ]]; then
  export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_deps"
  python3 -c "import xdist" 2>/dev/null && has_xdist=1
fi
spread=()  # --kernel-gpus all when there are GPUs to spread over
if (( has_xdist && gpu_count > 1 )); then spread=(--kernel-gpus all); fi
if (( has_xdist )); then
  # Compiles dominate the test stage, so it keeps at least 8 workers; with several GPUs, a multiple of their count
  # so that every GPU gets as many workers.
  workers=${TEST_WORKERS:-8}
  if [[ -z ${TEST_WORKERS:-} ]] && (( gpu_count > 1 )); then workers=$(( (8 + gpu_count - 1) / gpu_count * gpu_count )); fi
  test_workers=(-n "$workers" "${spread[@]}")
fi
echo "GPUs visible: $gpu_count${spread:+ (workers spread with ${spread[*]})}" | tee -a "$R/env.txt"

# A pass its time limit stopped (timeout's status 124, or 137 after SIGKILL): the selected tests it did not reach,
# one node id a line in $R/<pass>_not_reached.txt and counted per file in <pass>_not_reached_summary.txt, since the
# log's counts name only the tests that ran. Arguments: timeout's status, the pass's name, its paths and selection.
list_not_reached() {
  local status=$1 name=$2; shift 2
  (( status == 124 || status == 137 )) || return 0
  timeout 180 python3 tools/not_reached.py "$R/$name.xml" "$R/${name}_not_reached.txt" -- "$@" \
    > "$R/${name}_not_reached_summary.txt" 2>&1
}

if [[ $stage == tests || $stage == all ]]; then
  # One config per kernel instead of autotuning every shape class the tests touch: the tests check results, and
  # tuning each of their tiny shapes would cost minutes of compile and benchmark time. Kernel compiles dominate
  # the run (about 20 min serially), so it is spread over test_workers processes when xdist is available.
  # SIGINT at the limit makes pytest print what passed and failed so far; the JUnit XML beside each log names
  # every test that ran (with its outcome), so a pass cut off by its limit shows which tests are left.
  # The timing engine's own tests assert on measured times, so they run afterwards, alone on the GPU (one process,
  # no workers, even with several GPUs): kernels of other workers would share the device with them.
  timing_tests=tests/kernelcheck/speed/test_timing.py
  read -r -a test_paths <<< "${TEST_PATHS:-tests/flashlite tests/kernelcheck}"
  run_timing=0  # the second pass runs only when the selected paths contain the timing tests
  for path in "${test_paths[@]}"; do [[ $timing_tests == "${path%/}"* ]] && run_timing=1; done
  # Memory markers skip a test when the GPU lacks the free memory it needs, and every worker's cached allocations
  # count against that: twelve workers once left under 1.5 GiB free and 26 real-size tests skipped. So with
  # several workers the real-size files (LARGE_TESTS) run in a second pass on LARGE_WORKERS workers (default 4 on
  # one GPU; with several, one per GPU, so each real-size test has a GPU's memory to itself).
  read -r -a large_tests <<< "${LARGE_TESTS-tests/flashlite/attn/test_attention_gpu.py tests/flashlite/test_layer_gpu.py}"
  ignore_large=()
  if (( ${#test_workers[@]} )) && [[ -z ${TEST_PATHS:-} ]]; then
    for path in "${large_tests[@]}"; do ignore_large+=(--ignore="$path"); done
  fi
  FLASHLITE_AUTOTUNE=${FLASHLITE_AUTOTUNE:-0} timeout -s INT -k 20 "${TESTS_LIMIT:-$(remote 240)}" python3 -m pytest "${test_paths[@]}" \
    --deselect "$timing_tests" "${ignore_large[@]}" -q --maxfail=20 --durations=15 -p no:cacheprovider \
    --junitxml="$R/gpu_tests.xml" "${test_workers[@]}" "$@" > "$R/gpu_tests.log" 2>&1
  list_not_reached $? gpu_tests "${test_paths[@]}" --deselect "$timing_tests" "${ignore_large[@]}" "$@"
  if (( ${#ignore_large[@]} )); then
    FLASHLITE_AUTOTUNE=${FLASHLITE_AUTOTUNE:-0} timeout -s INT -k 20 "${LARGE_TESTS_LIMIT:-$(remote 300)}" python3 -m pytest \
      "${large_tests[@]}" -q --maxfail=20 --durations=15 -p no:cacheprovider --junitxml="$R/gpu_tests_large.xml" \
      -n "${LARGE_WORKERS:-$(( gpu_count > 1 ? gpu_count : 4 ))}" "${spread[@]}" "$@" \
      > "$R/gpu_tests_large.log" 2>&1
    list_not_reached $? gpu_tests_large "${large_tests[@]}" "$@"
  fi
  if (( run_timing )); then
    timeout -s INT -k 20 "${TIMING_TESTS_LIMIT:-$(remote 50)}" python3 -m pytest "$timing_tests" -q -p no:cacheprovider \
      --junitxml="$R/gpu_timing_tests.xml" "$@" > "$R/gpu_timing_tests.log" 2>&1
    list_not_reached $? gpu_timing_tests "$timing_tests" "$@"
  fi
fi
if [[ $stage == ab || $stage == all ]]; then
  # SIGINT at the limit lets pytest write the report of what finished.
  # AB_PATHS picks the files (and their order) when one call cannot hold the whole suite.
  # The saved run is written at session finish, so a run stopped at AB_LIMIT is saved with what finished; the
  # JSON report is also rewritten while the run goes ("finished": false), so one that SIGINT cannot stop within
  # the 20 s before SIGKILL still leaves its finished comparisons in $R/ab_report.json.
  # One GPU: one process, comparisons one after another. Several: one worker per GPU (--kernel-gpus all), the
  # comparisons of different GPUs in parallel (each GPU's lock keeps its own timing alone), one merged report.
  ab_storage=${AB_STORAGE:-.kernelcheck}
  # Autosave names a run after git's HEAD. A remote copy of the tree can carry stale git metadata, so where .commit
  # (written before such a run) names a commit this git does not know, or one HEAD is an ancestor of, the run is
  # saved under that commit and the UTC time instead; a .commit older than HEAD (left from an earlier run) is
  # ignored.
  save_args=(--kernel-ab-autosave)
  if [[ -s .commit ]]; then
    noted=$(tr -cd 'A-Za-z0-9' < .commit)
    if ! git cat-file -e "$noted^{commit}" 2>/dev/null || git merge-base --is-ancestor HEAD "$noted" 2>/dev/null; then
      save_args=(--kernel-ab-save "${noted}_$(date -u +%Y%m%dT%H%M%SZ)")
    fi
  fi
  ab_workers=()
  if (( ${#spread[@]} )); then ab_workers=(-n "$gpu_count" "${spread[@]}"); fi
  timeout -s INT -k 20 "${AB_LIMIT:-$(remote 420)}" python3 -m pytest ${AB_PATHS:-tests/perf} --kernel-ab "${ab_workers[@]}" \
    --kernel-ab-report "$R/ab_report.json" "${save_args[@]}" --kernel-ab-storage "$ab_storage" \
    -q -p no:cacheprovider "$@" > "$R/ab.log" 2>&1
  if [[ -n ${OUT:-} && -d $ab_storage ]]; then
    mkdir -p "$R/kernelcheck" && cp -r "$ab_storage"/. "$R/kernelcheck/"
  fi
fi
if [[ $stage == scaling || $stage == all ]]; then
  # scaling.json is rewritten after every point, so a run stopped at SCALING_LIMIT keeps what it measured.
  timeout -s INT -k 20 "${SCALING_LIMIT:-$(remote 420)}" python3 benchmarks/scaling.py "$R" ${SCALING_ARGS:---quick} \
    > "$R/scaling.log" 2>&1
fi
if [[ $stage == all && -f $R/ab_report.json ]]; then
  python3 tools/make_dispatch_table.py "$R/ab_report.json" --commit "$(sed -n 's/^commit: //p' "$R/env.txt")" \
    > "$R/dispatch.log" 2>&1 && cp flashlite/dispatch_tables/*.json "$R/"
fi
[[ -n ${OUT:-} ]] && tar -czf "$OUT/results.tar.gz" -C "$OUT" results

echo "===== summary ($stage) ====="
[[ -f $R/gpu_tests.log ]] && { echo "--- gpu tests"; grep -E "^(FAILED|ERROR)|passed|failed|KeyboardInterrupt" "$R/gpu_tests.log" | tail -25; }
[[ -f $R/gpu_tests_large.log ]] && { echo "--- gpu tests, real sizes"; grep -E "^(FAILED|ERROR)|passed|failed|KeyboardInterrupt" "$R/gpu_tests_large.log" | tail -25; }
[[ -f $R/gpu_timing_tests.log ]] && { echo "--- timing tests (alone on the GPU)"; grep -E "^(FAILED|ERROR)|passed|failed" "$R/gpu_timing_tests.log" | tail -10; }
for f in "$R"/*_not_reached_summary.txt; do [[ -f $f ]] && { echo "--- $(basename "$f" _not_reached_summary.txt), stopped by its limit:"; head -4 "$f"; }; done
[[ -f $R/ab.log ]] && { echo "--- A/B"; sed -n '/kernel A\/B comparisons/,$p' "$R/ab.log" | tail -60; }
[[ -f $R/scaling.log ]] && { echo "--- scaling"; tail -30 "$R/scaling.log"; }
[[ -f $R/dispatch.log ]] && { echo "--- dispatch table"; cat "$R/dispatch.log"; }
echo "results: $R"
exit 0
