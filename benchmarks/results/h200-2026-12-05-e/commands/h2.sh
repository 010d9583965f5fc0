#!/usr/bin/env bash
# Run H2: the seven GPU tests H1's test stage did not reach (its 130 s limit), then run Q4 (the dQ-reduction probe,
# ../../h200-2026-12-05-b/commands/q4.sh: float64 check, then do_bench of the one-kernel backward in modes none,
# atomic and tma against flashlite's backward, D=128 then D=64). Needs carry: .commit, .gpu_deps. About 10 minutes.
set -u
export PYTHONPATH="$PWD/.gpu_deps"
O=$OUT; mkdir -p $O
start=$(date +%s)
B=tests/flashlite/test_attention_gluon_bwd_gpu.py; F=tests/flashlite/test_attention_gluon_gpu.py
OUT=$O/tests TESTS_LIMIT=150 TEST_WORKERS=4 TEST_PATHS="$B::test_attention_backward_with_the_switch_on[lower_right-ws_dq] $F::test_dispatched_gluon_forward_end_to_end $F::test_dispatched_gluon_window_end_to_end $F::test_dispatched_gluon_forward_under_torch_compile" bash scripts/gpu_check.sh tests > $O/tests_run.log 2>&1
rm -f $O/tests/results.tar.gz
echo "tests done at $(( $(date +%s) - start )) s"
OUT=$O/q4 bash benchmarks/results/h200-2026-12-05-b/commands/q4.sh > $O/q4_run.log 2>&1
echo "q4 done at $(( $(date +%s) - start )) s"
echo "=== tests"; grep -E "^(FAILED|ERROR)|passed|failed" $O/tests/results/gpu_tests.log 2>/dev/null | tail -6
echo "=== q4"; tail -30 $O/q4_run.log
