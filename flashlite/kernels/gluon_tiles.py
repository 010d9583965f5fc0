"""What the Gluon attention kernels share (Hopper, 16-bit operands): wgmma's accumulator layout, the 128-byte-swizzled
shared tile, a 2-D shared tile seen as the 4-D box the [B, heads, S, D] descriptors copy, and the key blocks a
query block sees.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# TMA copies between global and shared memory. Triton 3.9 renamed them (async_load, async_store) and made the old
# names (async_copy_global_to_shared, async_copy_shared_to_global, all 3.6 has) raise; both take the same arguments.
# The kernels call these two names, so the version shows here only.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
# A barrier of every thread of the block: Triton 3.9 renamed gl.thread_barrier (all 3.6 has) to gl.barrier.
thread_barrier = getattr(gl, "barrier", None) or gl.thread_barrier


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


@gluon.jit
def key_blocks(start_m, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(diag_shift, n_full, n_blocks) of the query block starting at row ``start_m``: key blocks [0, n_full) are seen
    whole by every real row of the block (no mask), blocks [n_full, n_blocks) need the causal and key-length masks,
    blocks from n_blocks on are seen by no row and never loaded."""
    if CAUSAL == 2:
        diag_shift = seq_k - seq_q
    else:
        diag_shift = 0
    if CAUSAL != 0:
        # Keys up to the first row's diagonal are seen by every row; keys up to the last real row's by some.
        full_lim = gl.minimum(gl.maximum(start_m + diag_shift + 1, 0), seq_k)
        hi = gl.minimum(gl.maximum(gl.minimum(start_m + BLOCK_M, seq_q) + diag_shift, 0), seq_k)
    else:
        full_lim = seq_k
        hi = seq_k
    return diag_shift, full_lim // BLOCK_N, gl.cdiv(hi, BLOCK_N)


@gluon.jit
def consumer_key_blocks(start_m, seq_q, seq_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr):
    """(n_full, n_blocks) of the rows one consumer warpgroup owns (``key_blocks``), (0, 0) when they all lie past
    S_q."""
    diag_shift, n_full, n_blocks = key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    n_blocks = gl.where(start_m < seq_q, n_blocks, 0)
    return gl.minimum(n_full, n_blocks), n_blocks
