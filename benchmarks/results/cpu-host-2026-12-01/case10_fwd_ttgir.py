"""The forward's sm_90 TTGIR at every tiling the autotuner tries at S=128 (case 10), for two exports of flashlite.

Usage (repository root): python benchmarks/results/cpu-host-2026-12-01/case10_fwd_ttgir.py OLD_TREE NEW_TREE
(each a folder holding an exported ``flashlite/``, e.g. ``git archive 5d406a8 flashlite | tar -x -C /tmp/d4``).
Prints the lines that differ per tiling, as in case10_fwd_ttgir_d4_vs_now.txt. The compile script is
tests/flashlite/test_attention_variants_kernel.py's dense-TTGIR script with its jobs replaced.
"""
import difflib
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.getcwd())
from tests.flashlite import test_attention_variants_kernel as variants  # noqa: E402

TILINGS = [(m, p) for m in (64, 128) for p in (1, 2, 4)]
JOBS = '''JOBS = [("fwd", attention_fwd._attn_fwd, dict(BLOCK_M=m, BLOCK_N=64, BH_PER_PROGRAM=p), 1, "none")
        for m in (64, 128) for p in (1, 2, 4)]
'''


def ttgir(tree: str) -> list:
    script = variants._DENSE_TTGIR
    start = script.index("JOBS = [")
    script = script[:start] + JOBS + script[script.index("]\n", script.index('"bool")]', start)) + 2:]
    done = subprocess.run([sys.executable, "-c", script], cwd=tree, capture_output=True, text=True, check=True,
                          env={**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp()})  # fresh: a hit skips the TTGIR
    return json.loads(done.stdout)


old, new = (ttgir(tree) for tree in sys.argv[1:3])
for (m, p), x, y in zip(TILINGS, old, new):
    lines = [line for line in difflib.unified_diff(x["body"], y["body"], lineterm="", n=0)
             if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    print(f"\nBLOCK_M={m} BH_PER_PROGRAM={p}: {len(x['body'])} vs {len(y['body'])} lines, {len(lines)} differing")
    print("\n".join(lines))
