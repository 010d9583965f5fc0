"""Layouts and tile views the Gluon attention kernels share (Hopper, 16-bit operands): wgmma's accumulator layout,
the 128-byte-swizzled shared tile, and a 2-D shared tile seen as the 4-D box the [B, heads, S, D] descriptors copy.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.constexpr_function
def mma_layout(num_warps, n):
    # wgmma's accumulator layout for [rows, n] tiles: warps stacked along M, one instruction covering n columns
    # (n <= 256), k = 16 for 16-bit operands.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def tile_layout():
    # 2-D view of a [rows, D] tile of 16-bit values with D * 2 >= 128 bytes: the 128-byte swizzle, the same bytes
    # as the descriptors' [1, 1, rows, D] layout (the leading unit dimensions add nothing).
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


@gluon.jit
def as_tma_tile(buf, ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    # A [ROWS, D] shared tile as the [1, 1, ROWS, D] box the 4-D descriptors copy.
    return buf.reshape([1, 1, ROWS, HEAD_DIM])
