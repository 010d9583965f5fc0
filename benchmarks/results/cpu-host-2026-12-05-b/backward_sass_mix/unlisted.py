"""The dK/dV configs that the wgmma fix (b6bcb14) took off the lists, and the new single-partition 64 x 32 x 3,
compiled for sm_90 on a machine without a GPU in each causal mode (bf16, GQA 4 query heads on 2 key/value heads):
ptxas's registers, spill bytes (stores, loads) and serialization notes. Run from the repository root:
python <this file>.
"""
import os
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile (and ptxas's report)
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import GLUON_COMPILER  # noqa: E402

exec(GLUON_COMPILER)  # compile_gluon
import torch  # noqa: E402
from flashlite._attention import launch_gluon_bwd  # noqa: E402
from flashlite._attention.launch_gluon_bwd import GluonBwdConfig  # noqa: E402

CONFIGS = [  # (head dim, config, why)
    (64, GluonBwdConfig("dkdv", 64, 128, 3, 4, "ws", False, False), "unlisted: dP^T late, 128-row query tiles"),
    (128, GluonBwdConfig("dkdv", 64, 64, 2, 4, "ws", False, False), "unlisted: dP^T late, 64-row query tiles"),
    (128, GluonBwdConfig("dkdv", 64, 64, 2, 4, "ws", True, True), "never listed: overlapped, 64-row query tiles"),
    (128, GluonBwdConfig("dkdv", 64, 32, 3, 4), "listed: single partition, two programs per SM"),
]
for head_dim, config, why in CONFIGS:
    q = torch.empty(2, 4, 300, head_dim, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 300, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    for causal in (0, 1, 2):
        args, meta = launch_gluon_bwd.dkdv_kernel_arguments(q, k, k, q, k, k, lse, lse, causal, 0.125, config)
        options = {"num_warps": config.num_warps, **({"maxnreg": meta["maxnreg"]} if "maxnreg" in meta else {})}
        fn = launch_gluon_bwd.dkdv_kernel_for(config)
        kernel, registers, spills, serialized = compile_gluon(fn, args, meta, options)  # noqa: F821
        print(f"D={head_dim} {config} causal={causal} ({why}): registers {registers}, spill bytes {spills}, "
              f"shared {kernel.metadata.shared} B, serialized {serialized or 'no'}")
