"""Whether a Gluon kernel can add a register tile into global memory with a TMA bulk reduction on sm_90 (what a
one-kernel Gluon backward would need for dQ), compiled on a machine without a GPU.

Gluon 3.6's Hopper module has no reduction copy, but its compile pipeline runs the TMA lowering that turns Triton's
``tt.descriptor_reduce`` (what ``tl``'s ``desc.atomic_add`` emits) into a shared-memory staging buffer and
``cp.reduce.async.bulk.tensor``. A ``@builtin`` helper emits that op from Gluon code. Printed: registers, spills,
and the PTX lines of the bulk reduction. Run from the repository root: python <this file>.
"""
import os
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import GLUON_COMPILER  # noqa: E402

exec(GLUON_COMPILER)  # compile_gluon
import torch  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.experimental import gluon  # noqa: E402
from triton.experimental.gluon import language as gl  # noqa: E402
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: E402
from triton.language.core import builtin  # noqa: E402


@builtin
def tma_reduce_add(desc, coord, value, _semantic=None):
    """Add ``value`` (a register tile of the descriptor's block shape) into ``desc`` at ``coord``."""
    offsets = [_semantic.to_tensor(c).handle for c in coord]
    _semantic.builder.create_descriptor_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, value.handle, offsets)


@gluon.jit
def add_rows(desc, src, BM: gl.constexpr, BN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1, 4], [4, 8], [4, 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, BN, layout=gl.SliceLayout(0, layout))
    tile = gl.load(src + rows[:, None] * BN + cols[None, :])
    tma_reduce_add(desc, [gl.program_id(0) * BM, 0], tile)


target = torch.empty(128, 64, dtype=torch.float32)
desc = TensorDescriptor.from_tensor(target, [64, 64], gl.NVMMASharedLayout.get_default_for([64, 64], gl.float32))
kernel, registers, spills, serialized = compile_gluon(add_rows, [desc, target, 64, 64],  # noqa: F821
                                                      {"BM": 64, "BN": 64}, {"num_warps": 4})
print(f"registers {registers}, spills {spills}, shared {kernel.metadata.shared} B")
for line in kernel.asm["ptx"].split("\n"):
    if "cp.reduce" in line or "cp.async.bulk" in line:
        print("  " + line.strip())
