"""Static issue model of the pointer dK/dV kernel's inner loop without and with DQ_REDUCE, sm_90 machine code
(compiled on a machine without a GPU): per 1,024 scores of one query block against one key block, in SM cycles,
issue (warp instructions / 4 schedulers) against the tensor cores (the products at 2,048 bf16 multiply-adds per SM
per cycle: four without, five with). A loop is the span from a backward branch's target to the branch; the
innermost ones holding HGMMA are the query-block loops. Counts are static, so the figures are lower bounds.
Run from the repository root: python <this file>.
"""
import contextlib
import io
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # compile_for_sm90, attention_bwd
import triton  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def sass(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([os.path.join(BIN, "nvdisasm"), "-c", f.name], capture_output=True, text=True).stdout


def inner_loops(code):
    lines = code.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [re.match(r"^\.(L_x_\d+):", line.strip())] if m}
    spans = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA (?:`\()?\.(L_x_\d+)", line)
        if target and labels.get(target.group(1), len(lines)) < i:
            body = [x for x in lines[labels[target.group(1)]:i + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
            if any("HGMMA" in x for x in body):
                spans.append((labels[target.group(1)], i, body))
    return [s for s in spans if not any(o[:2] != s[:2] and s[0] <= o[0] and o[1] <= s[1] for o in spans)]


for head_dim in (128, 64):
    for block_m, block_n, warps, stages in [(32, 64, 8, 3), (16, 128, 8, 3), (32, 128, 8, 2), (32, 64, 4, 3)]:
        for reduce in (False, True):
            types = {"DqDesc": f"tensordesc<fp32[1,{block_m},{head_dim}]>"} if reduce else None
            with contextlib.redirect_stdout(io.StringIO()):
                kernel = compile_for_sm90(attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=block_m, BLOCK_N=block_n),  # noqa: F821
                                          head_dim=head_dim, block_d=head_dim, causal=1, key_mask="none",
                                          warps=warps, stages=stages, flags=dict(DQ_REDUCE=reduce), types=types)
            products = 5 if reduce else 4
            tensor = products * 1024 * head_dim / 2048
            for start, end, body in inner_loops(sass(kernel.asm["cubin"])):
                per = len(body) * warps * 1024 / (block_m * block_n)
                hgmma = sum("HGMMA" in x for x in body)
                bulk = sum("UBLKRED" in x or "UTMAREDG" in x or "REDG" in x for x in body)
                print(f"D={head_dim} {(block_m, block_n, warps, stages)} DQ_REDUCE={reduce} loop {start}-{end}: "
                      f"{len(body)} instructions ({hgmma} HGMMA, {bulk} reductions), per 1,024 scores {per:.0f}: "
                      f"issue {per / 4:.0f} cycles, tensor {tensor:.0f}", flush=True)
