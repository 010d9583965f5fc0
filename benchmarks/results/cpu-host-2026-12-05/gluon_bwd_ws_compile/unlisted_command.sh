# The warp-specialized dK/dV configs left out of the list, compiled for sm_90 as the listed ones are: at D=128 dP^T
# issued with S^T over 64-row query tiles, and a third stage without it; at D=64 dP^T issued with S^T over 128-row
# query tiles. ptxas's spill report per causal mode.
export TRITON_CACHE_DIR=$(mktemp -d)
python - <<'PY'
from tests.flashlite.sm90 import GLUON_COMPILER, run_script
print(run_script(GLUON_COMPILER + r"""
import json, torch
from flashlite._attention import launch_gluon_bwd as L
for head_dim, blocks in ((128, (64, 64, 2, 4, "ws", True)), (128, (64, 64, 3, 4, "ws", False)),
                         (64, (64, 128, 2, 4, "ws", True))):
    config = L.GluonBwdConfig("dkdv", *blocks)
    for causal in (0, 1, 2):
        q = torch.empty(2, 4, 300, head_dim, dtype=torch.bfloat16)
        k = torch.empty(2, 2, 300, head_dim, dtype=torch.bfloat16)
        lse = torch.empty(2, 4, 300)
        args, meta = L.dkdv_kernel_arguments(q, k, k, q, k, k, lse, lse, causal, 0.125, config)
        options = {"num_warps": config.num_warps, "maxnreg": meta["maxnreg"]}
        kernel, registers, spills = compile_gluon(L.dkdv_kernel_for(config), args, meta, options)
        print(json.dumps({"head_dim": head_dim, "config": str(config), "causal": causal, "shared": kernel.metadata.shared,
                          "registers": registers, "spill_bytes (stores, loads)": spills}))
"""))
PY
