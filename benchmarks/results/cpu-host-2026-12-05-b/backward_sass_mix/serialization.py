"""Which Gluon kernel configs ptxas compiles with their wgmma instructions serialized, and their spills: every listed
config of the backward's dK/dV and dQ kernels (both schedules) and of the forward's variants, compiled for sm_90 on
a machine without a GPU (bf16, GQA 4 query heads on 2 key/value heads, 300 rows; the backward causal top-left, the
forward bottom-right). ptxas reports a serialized kernel with a note "(C751x) Potential Performance Loss:
wgmma.mma_async instructions are serialized due to ...", and then waits for every wgmma before the next
instruction. Run from the repository root: python <this file> [backward|forward].
"""
import os
import re
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile (and ptxas's report)
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import GLUON_COMPILER  # noqa: E402

# The report itself, for the note's full text (the tests' compile_gluon keeps the codes only).
exec(GLUON_COMPILER.replace("return kernel, registers, spills, serialized",
                            "return kernel, registers, spills, serialized, report"))
import torch  # noqa: E402
from flashlite._attention import launch_gluon, launch_gluon_bwd  # noqa: E402

which = sys.argv[1:] or ["backward", "forward"]


def show(name, compiled):
    kernel, registers, spills, serialized, report = compiled
    notes = sorted(set(re.findall(r"\(C751\d\) Potential Performance Loss: [^']*", report)))
    print(f"{name}: registers {registers}, spill bytes {spills}, serialized {serialized or 'no'}")
    for note in notes:
        print(f"    {note.strip()}")


for D in (64, 128):
    q = torch.empty(2, 4, 300, D, dtype=torch.bfloat16)
    k = torch.empty(2, 2, 300, D, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    if "backward" in which:
        for kind in ("dkdv", "dq"):
            for variant in launch_gluon_bwd.BWD_VARIANTS[kind]:
                for config in launch_gluon_bwd.bwd_configs_for(D, kind, variant):
                    if kind == "dq":
                        args, meta = launch_gluon_bwd.dq_kernel_arguments(q, k, k, q, q, lse, lse, 1, 0.125, config)
                        fn = launch_gluon_bwd.dq_kernel_for(config)
                    else:
                        args, meta = launch_gluon_bwd.dkdv_kernel_arguments(q, k, k, q, k, k, lse, lse, 1, 0.125,
                                                                            config)
                        fn = launch_gluon_bwd.dkdv_kernel_for(config)
                    options = {"num_warps": config.num_warps, **({"maxnreg": meta["maxnreg"]} if "maxnreg" in meta
                                                                else {})}
                    show(f"D={D} {config}", compile_gluon(fn, args, meta, options))  # noqa: F821
    if "forward" in which:
        out = torch.empty_like(q)
        for variant in ("pipelined", "ws", "pingpong", "persistent"):
            for config in launch_gluon.configs_for(D, variant):
                args, meta = launch_gluon.kernel_arguments(q, k, k, out, lse, 2, 0.125, config, -1)
                options = {"num_warps": config.num_warps, **({"maxnreg": meta["maxnreg"]} if "maxnreg" in meta
                                                            else {})}
                show(f"D={D} {config}", compile_gluon(launch_gluon.kernel_for(config), args, meta, options))  # noqa: F821
