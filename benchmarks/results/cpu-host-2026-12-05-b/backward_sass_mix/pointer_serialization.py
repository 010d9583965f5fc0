"""The pointer (tl) attention kernels' autotuning configs at D=64 and 128, compiled for sm_90 on a machine without
a GPU (bf16, causal top-left, no key mask): whether ptxas serialized their wgmmas ("(C751x) Potential Performance
Loss"), and their spill stores. Run from the repository root: python <this file>.
"""
import contextlib
import io
import os
import re
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile (and ptxas's report)
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # compile_for_sm90
from triton import knobs  # noqa: E402

from flashlite.kernels import attention_bwd, attention_fwd  # noqa: E402

knobs.nvidia.dump_ptxas_log = True


def report(fn, configs, head_dim):
    for blocks in configs:
        names = dict(BLOCK_M=blocks[0], BLOCK_N=blocks[1], **({"BH_PER_PROGRAM": blocks[4]} if len(blocks) > 4 else {}))
        log = io.StringIO()
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            compile_for_sm90(fn, names, head_dim=head_dim, block_d=head_dim, causal=1,  # noqa: F821
                             key_mask="none", warps=blocks[2], stages=blocks[3])
        text = log.getvalue()
        serialized = sorted(set(re.findall(r"\((C751\d)\) Potential Performance Loss", text)))
        spills = re.findall(r"(\d+) bytes spill stores", text)
        print(f"{fn.__name__} D={head_dim} {blocks}: serialized {serialized or 'no'}, spill stores {spills} bytes")


for head_dim in (64, 128):
    report(attention_bwd._attn_bwd_dkdv, attention_bwd.DKDV_GPU_BLOCKS, head_dim)
    report(attention_bwd._attn_bwd_dq, attention_bwd.DQ_GPU_BLOCKS, head_dim)
    report(attention_fwd._attn_fwd, attention_fwd.FWD_GPU_BLOCKS, head_dim)
