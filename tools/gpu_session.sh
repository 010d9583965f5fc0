#!/usr/bin/env bash
# One device call's worth of GPU checks for the decoding kernel and the model-level A/B, each step under its own
# time limit, a short summary printed last. A remote call returns at most 8 files from $OUT, and the A/B reports
# alone write three files each, so every output goes to $OUT/session/ and is packed into $OUT/gpu_session.tar.gz
# after each step (a call stopped by its limit keeps the steps that finished); only the archive is left in $OUT.
# Usage: OUT=<dir> tools/gpu_session.sh [suite] [decode] [kvtests] [cost] [models] [hf]   (run in the order given;
# default: all but suite, in that order). suite: the whole GPU test suite (tools/gpu_check.sh tests) with its passes'
# limits SUITE_LIMIT, SUITE_LARGE_LIMIT, SUITE_TIMING_LIMIT; its results under session/suite/.
set -uo pipefail
export PYTHONPATH="$PWD:$PWD/.gpu_deps${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
ARCHIVE_DIR=${OUT:-/tmp/gpu_session}; export OUT=$ARCHIVE_DIR/session; mkdir -p "$OUT"
pack() { tar -czf "$ARCHIVE_DIR/gpu_session.tar.gz.part" -C "$ARCHIVE_DIR" session \
  && mv "$ARCHIVE_DIR/gpu_session.tar.gz.part" "$ARCHIVE_DIR/gpu_session.tar.gz"; }
steps=${*:-decode kvtests cost models hf}
python3 -m pip install --no-deps --no-build-isolation -e . > /dev/null 2>&1
{ echo "commit $(cat .commit 2>/dev/null || git rev-parse --short HEAD)"; date -u +%FT%TZ
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__, '| transformers', transformers.__version__)"
} > "$OUT/env.txt" 2>&1
step_decode() { timeout "${DECODE_LIMIT:-260}" python3 tools/decode_bench.py --flex --rounds 20 \
  --budget "${DECODE_BUDGET:-190}" > "$OUT/decode_bench.log" 2>&1; }
step_kvtests() { timeout -s INT -k 10 "${KVTESTS_LIMIT:-100}" python3 -m pytest -q -n 8 -p no:cacheprovider \
  tests/flashlite/attn/test_attention_kvcache.py tests/flashlite/kernels/test_attention_decode_kernel.py \
  tests/flashlite/attn/test_attention_gpu.py::test_recorded_launches_replay_forward_and_backward_exactly \
  > "$OUT/kvcache_gpu_tests.txt" 2>&1; }
step_cost() { timeout -s INT -k 10 "${COST_LIMIT:-60}" python3 -m pytest -q -p no:cacheprovider \
  tests/perf/test_decode_cost_ab.py --kernel-ab --kernel-ab-report "$OUT/decode_cost_ab.json" \
  > "$OUT/decode_cost_ab.txt" 2>&1; }
step_models() { timeout -s INT -k 10 "${MODELS_LIMIT:-150}" python3 -m pytest -q -s -p no:cacheprovider \
  tests/perf/test_models_ab.py --kernel-ab --kernel-ab-max-time 1 --tb=short \
  -k "${MODELS_K:-gemma2_prefill_softcap and flex and 128 or mistral_prefill_sliding_window and flex}" \
  --kernel-ab-report "$OUT/models_ab.json" > "$OUT/models_ab.txt" 2>&1; }
step_suite() { OUT="$OUT/suite" TESTS_LIMIT="${SUITE_LIMIT:-240}" LARGE_TESTS_LIMIT="${SUITE_LARGE_LIMIT:-200}" \
  TIMING_TESTS_LIMIT="${SUITE_TIMING_LIMIT:-30}" bash tools/gpu_check.sh tests > "$OUT/suite_summary.txt" 2>&1
  rm -f "$OUT/suite/results.tar.gz"; }
step_hf() { timeout -s INT -k 10 "${HF_LIMIT:-120}" python3 -m pytest -q -p no:cacheprovider --tb=short \
  tests/flashlite/test_transformers_integration.py -k bf16 > "$OUT/hf_bf16_tests.txt" 2>&1; }
for step in $steps; do "step_$step"; pack; done
echo "===== summary"; cat "$OUT/env.txt"
[[ -f $OUT/kvcache_gpu_tests.txt ]] && { echo "--- kv-cache GPU tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/kvcache_gpu_tests.txt" | tail -8; }
[[ -f $OUT/suite_summary.txt ]] && { echo "--- GPU test suite"; sed -n '/===== summary/,$p' "$OUT/suite_summary.txt" | tail -12; }
[[ -f $OUT/hf_bf16_tests.txt ]] && { echo "--- transformers bf16 tests"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/hf_bf16_tests.txt" | tail -8; }
for f in decode_cost_ab models_ab; do [[ -f $OUT/$f.txt ]] && { echo "--- $f"; sed -n '/kernel A\/B comparisons/,$p' "$OUT/$f.txt" | tail -14; }; done
[[ -f $OUT/decode_bench.log ]] && { echo "--- decode bench"; grep -E "copy:|host |FAIL" "$OUT/decode_bench.log"; sed -n '/SUMMARY/,$p' "$OUT/decode_bench.log"; }
pack && rm -rf "$OUT"  # the archive holds it all
exit 0
