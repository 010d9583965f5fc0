"""The pointer dK/dV kernel compiled for sm_90 without and with DQ_REDUCE (dQ added in through a TMA descriptor): for
every config of the DQ_REDUCE list (the plain list after three 8-warp tiles) and the 8-warp 32 x 64 tile, at D=64
and 128, bf16, causal top-left, no key mask, shared memory, ptxas's registers and spill stores, its wgmma
serialization notes (C751x), and whether the PTX holds the bulk reduction (``cp.reduce.async.bulk.tensor``). Run
from the repository root: python <this file>.
"""
import contextlib
import io
import os
import re
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips ptxas and its report
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # compile_for_sm90, attention_bwd
from triton import knobs  # noqa: E402

knobs.nvidia.dump_ptxas_log = True
for head_dim in (64, 128):
    # The DQ_REDUCE list, and the 8-warp 32 x 64 tile that sass_mix.py's issue count kept out of it.
    for block_m, block_n, warps, stages in [(32, 64, 8, 3)] + attention_bwd.DKDV_DQ_GPU_BLOCKS:  # noqa: F821
        for reduce in (False, True):
            log = io.StringIO()
            types = {"DqDesc": f"tensordesc<fp32[1,{block_m},{head_dim}]>"} if reduce else None
            with contextlib.redirect_stdout(log):
                kernel = compile_for_sm90(attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=block_m, BLOCK_N=block_n),  # noqa: F821
                                          head_dim=head_dim, block_d=head_dim, causal=1, key_mask="none",
                                          warps=warps, stages=stages, flags=dict(DQ_REDUCE=reduce), types=types)
            report = log.getvalue()
            registers = re.findall(r"Used (\d+) registers", report)
            spills = re.findall(r"(\d+) bytes spill stores", report)
            serialized = sorted(set(re.findall(r"\((C751\d)\) Potential Performance Loss: wgmma", report)))
            bulk = "cp.reduce.async.bulk.tensor" in kernel.asm["ptx"]
            print(f"D={head_dim} {(block_m, block_n, warps, stages)} DQ_REDUCE={reduce}: shared "
                  f"{kernel.metadata.shared} B, registers {registers}, spill stores {spills} B, serialized "
                  f"{serialized}, bulk reduction {bulk}", flush=True)
