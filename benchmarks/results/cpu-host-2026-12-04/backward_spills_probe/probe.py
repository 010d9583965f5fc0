"""Registers, spill bytes and shared memory of the pointer backward kernels, compiled for sm_90 on a CPU machine.

Compiles the dK/dV and dQ kernels (bf16, causal top-left, no key mask, the dense training path) at head dims 64 and
128 for every config the pruning keeps at SEQ_Q_BUCKET 4096 and for extra dK/dV candidates, with ptxas's report
(registers per thread, bytes of spill stores per thread) and the compiled kernel's shared memory.

Usage (repository root; a fresh Triton cache, since a cached kernel skips ptxas and its report; ``dq`` or ``dkdv``
as an argument compiles that kernel alone):
    TRITON_INTERPRET=0 TRITON_CACHE_DIR=$(mktemp -d) python benchmarks/results/cpu-host-2026-12-04/backward_spills_probe/probe.py [dq]
"""
import contextlib
import io
import re
import sys

sys.path.insert(0, ".")
from tests.flashlite.sm90 import SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # defines compile_for_sm90
import torch  # noqa: E402
from triton import knobs  # noqa: E402

from flashlite.kernels import attention_bwd, tuning  # noqa: E402

EXTRA_DKDV = [(32, 128, 8, 2), (32, 128, 8, 3), (32, 128, 8, 4), (32, 64, 8, 3), (16, 64, 4, 2), (16, 64, 4, 3),
              (16, 128, 4, 3), (16, 128, 8, 2), (16, 128, 8, 3), (16, 128, 8, 4), (64, 64, 8, 3), (32, 64, 4, 2),
              (64, 128, 8, 1)]
knobs.nvidia.dump_ptxas_log = True


def report(name, fn, block_m, block_n, warps, stages, head_dim, origin):
    log = io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        kernel = compile_for_sm90(fn, dict(BLOCK_M=block_m, BLOCK_N=block_n), head_dim=head_dim,  # noqa: F821
                                  block_d=head_dim, causal=1, key_mask="none", warps=warps, stages=stages)
    text = log.getvalue()
    registers = ",".join(re.findall(r"Used (\d+) registers", text))
    spills = ",".join(re.findall(r"(\d+) bytes spill stores", text))
    print(f"{name:5} D={head_dim:<4} BLOCK_M={block_m:<4} BLOCK_N={block_n:<4} warps={warps} stages={stages} "
          f"registers={registers:4} spill_store_bytes={spills:5} shared={kernel.metadata.shared:7} ({origin})",
          flush=True)


KERNELS = (("dkdv", attention_bwd._attn_bwd_dkdv, attention_bwd.DKDV_GPU_BLOCKS, attention_bwd.prune_dkdv_configs),
           ("dq", attention_bwd._attn_bwd_dq, attention_bwd.DQ_GPU_BLOCKS, attention_bwd.prune_dq_configs))
for name, fn, blocks, prune in KERNELS:
    if len(sys.argv) > 1 and name not in sys.argv[1:]:
        continue
    for head_dim in (64, 128):
        kept = prune(tuning.make_configs(blocks), {"Q": torch.empty(0, dtype=torch.bfloat16), "SEQ_Q_BUCKET": 4096},
                     BLOCK_D=head_dim)
        seen = set()
        for c in kept:
            config = (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
            seen.add(config)
            report(name, fn, *config, head_dim, "kept by the pruning")
        if name == "dkdv":
            for config in EXTRA_DKDV:
                if config not in seen:
                    report(name, fn, *config, head_dim, "candidate")
