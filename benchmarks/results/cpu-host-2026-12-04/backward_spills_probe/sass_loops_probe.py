"""Where the pointer dK/dV kernel's register spills sit: local-memory stores (STL) and loads (LDL) per loop of its
SASS, compiled for sm_90 on a machine without a GPU (bf16, causal top-left, no key mask, D=128).

A loop is a backward branch; the kernel has two inner loops over query blocks (the diagonal blocks, then the rest:
the hot code, with the HGMMA instructions) inside the loop over the query heads of a key/value head (once per head
without grouped-query attention). Run from the repository root: python <this file>.
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # defines compile_for_sm90 and imports attention_bwd
import triton  # noqa: E402

NVDISASM = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")

for block_m, block_n, warps, stages in [(32, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 4, 3),
                                        (64, 64, 4, 3)]:
    kernel = compile_for_sm90(attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=block_m, BLOCK_N=block_n),  # noqa: F821
                              head_dim=128, block_d=128, causal=1, key_mask="none", warps=warps, stages=stages)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        lines = subprocess.run([NVDISASM, "-c", cubin.name], capture_output=True, text=True).stdout.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [re.match(r"^\.(L_x_\d+):", line.strip())] if m}
    print(f"dK/dV {(block_m, block_n, warps, stages)}: STL {sum('STL' in x for x in lines)}, "
          f"LDL {sum('LDL' in x for x in lines)} in the whole kernel")
    for i, line in enumerate(lines):
        target = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if target and labels.get(target.group(1), len(lines)) < i:
            body = lines[labels[target.group(1)]:i]
            if any("HGMMA" in x for x in body):
                print(f"  loop of SASS lines {labels[target.group(1)]}-{i}: HGMMA {sum('HGMMA' in x for x in body)}, "
                      f"STL {sum('STL' in x for x in body)}, LDL {sum('LDL' in x for x in body)}")
