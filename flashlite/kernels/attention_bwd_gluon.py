"""Hopper (sm_90) attention backward in Gluon, dK/dV and dQ: TMA copies, mbarrier-guarded rings, async wgmma.

The same arithmetic as ``attention_bwd`` (dS = P * (dP - delta), delta = rowsum(dO * O) from its delta kernel, the
forward's base-2 log-sum-exp giving P = exp2(S * qk_scale - lse)), in two kernels.

``_attn_bwd_dkdv``: one program owns BLOCK_N keys of one (batch, key/value head), transposed so that every product
is a wgmma whose first operand is a key-block tile (shared memory or registers) and whose accumulator rows are keys:

    S^T  = K Q^T                      [BLOCK_N, BLOCK_M], K from shared memory, Q^T a permuted view of Q's tile
    P^T  = exp2(S^T * qk_scale - lse)  (one lse per query column)
    dV  += P^T dO                     P^T from registers (16-bit), dO from shared memory
    dP^T = V dO^T                     V from shared memory, dO^T a permuted view of dO's tile
    dS^T = P^T * (dP^T - delta)        (one delta per query column)
    dK  += dS^T Q                     then dK *= scale at the end

Its K and V tiles stay in shared memory, and the query blocks of every query head of the group (grouped-query
attention) stream past them through a ring of ``STAGES`` slots of Q and dO tiles, each slot with a "ready"
mbarrier the copy engine completes. The copies of iteration t + STAGES are issued once every wgmma of iteration t
has completed (its slot is then free), so STAGES - 1 iterations are in flight while one computes. dK and dV stay
in float32 registers and are stored once, through the K and V tiles' shared memory and a TMA store clipped to the
head's S_k rows.

``_attn_bwd_dq_ws``: dQ, warp-specialized (step 2 of the forward's plan, applied to the backward). One program owns
2 x BLOCK_M query rows of one (batch, head): a one-warp producer partition issues every copy, and two consumer
warpgroups, each its own partition with its own query rows, Q and dO tiles and hand-back barriers, stream the
key/value tiles through a ring and run the per-block arithmetic (``_dq_block``: S = Q K^T and dP = dO V^T from
shared memory, P and dS = P * (dP - delta) in registers, dQ += dS K) without meeting at a barrier of the whole
program, so that one's exponentials can run while the other's wgmmas do; dQ *= scale at the end, stored through
Q's tile. Its protocol is described above it. (A single-partition dQ kernel, which no default dispatch ran and
which measured slower than this one at D=64 and D=128 in an 8ca4529 run, was deleted; git keeps its code.)

Bounds need no masks on the load path: the copy engine clips every [1, 1, rows, D] tile to its own (batch, head),
so rows past S_q or S_k load as zeros. In dK/dV, their lse is read as +inf, which makes their P^T exactly 0, and
key rows past S_k give rows that the store clips; in dQ, keys past S_k are masked with the causal ones.
``CAUSAL`` (0 none; 1 top-left, key j visible to query i when j <= i; 2 bottom-right, j <= i + S_k - S_q) masks
with ``where`` in the blocks that hold the diagonal and skips the blocks that see nothing. A query row that sees no
key at all has lse -inf and is masked in every block it meets.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from flashlite.kernels.attention_fwd_gluon import PRODUCER_REGS
from flashlite.kernels.gluon_tiles import (as_tma_tile, consumer_key_blocks, key_blocks, mma_layout, tile_layout,
                                           thread_barrier, tma_load, tma_store)

# dK/dV: (BLOCK_N, BLOCK_M, STAGES, num_warps) per head dim; the first is the launcher's. num_warps warps stack
# along the keys (each warpgroup 64 key rows), so per thread: dK and dV hold 2 x HEAD_DIM / 2 float32, S^T and dP^T
# BLOCK_M / 2 each. Shared memory: K and V BLOCK_N x D once, Q and dO BLOCK_M x D per stage: D=128, 128 x 64 x 2
# stages: 64 KB + 2 x 32 KB = 128 KB; D=64, 128 x 64 x 3: 32 + 3 x 16 = 80 KB. ptxas (CPU CI): 177-202 registers
# at D=64, 197-255 at D=128, no spills. At D=128 the first config's 8 warps of 255 registers fill an SM's registers
# alone; the others fit two programs per SM, as the pointer dK/dV kernel's chosen (32, 64, 4, 3) does: 64 x 64 in
# 98 KB, and 64 x 32 x 3 in 82 KB with 197-222 registers, the warp-specialized kernel's first tile per consumer
# (cpu-host-2026-12-05-b/backward_sass_mix/). Timed alone (H100, cases 3, 6, 12): 64 x 64 is 1.19-1.20x
# the 128 x 64 config at D=128 and 1.11-1.12x at D=64, so it is listed first; 64 x 32 x 3 is 0.89-0.95x.
GLUON_BWD_CONFIGS = {
    64: [(64, 64, 3, 4), (128, 64, 3, 8)],
    128: [(64, 64, 2, 4), (128, 64, 2, 8), (64, 32, 3, 4)],
}
HEAD_DIMS = (64, 128)


def shared_memory_bytes(block_n: int, block_m: int, stages: int, head_dim: int, elem: int = 2) -> int:
    """Bytes of operand tiles a dK/dV config keeps in shared memory (barriers not included); a dQ config's are the
    same with the roles of the blocks swapped: ``shared_memory_bytes(2 * block_m, block_n, stages, head_dim)`` (two
    consumers' rows).

    Example:
        >>> shared_memory_bytes(128, 64, 2, 128)
        131072
    """
    return (2 * block_n + 2 * stages * block_m) * head_dim * elem


@gluon.jit
def _program_tiles(dtype: gl.constexpr, OWN_ROWS: gl.constexpr, STREAMED_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   STAGES: gl.constexpr):
    """A dK/dV program's shared memory, initialised: the two tiles it holds throughout (K and V: OWN_ROWS x D each),
    STAGES slots of the two tiles streamed past them (Q and dO: STREAMED_ROWS x D each), the held pair's barrier and
    one per slot (the copy engine completes them)."""
    tile: gl.constexpr = tile_layout()
    own_a = gl.allocate_shared_memory(dtype, [OWN_ROWS, HEAD_DIM], tile)
    own_b = gl.allocate_shared_memory(dtype, [OWN_ROWS, HEAD_DIM], tile)
    bufs_a = gl.allocate_shared_memory(dtype, [STAGES, STREAMED_ROWS, HEAD_DIM], tile)
    bufs_b = gl.allocate_shared_memory(dtype, [STAGES, STREAMED_ROWS, HEAD_DIM], tile)
    own_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(own_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation, visible to the copy engine before it signals them
    return own_a, own_b, bufs_a, bufs_b, own_ready, ready


@gluon.jit
def _invalidate(own_ready, ready, STAGES: gl.constexpr):
    mbarrier.invalidate(own_ready)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


@gluon.jit
def _issue_pair(desc_a, desc_b, bufs_a, bufs_b, ready, slot, b, h, row, pred,
                ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Start the copies of the [ROWS, D] tiles at (b, h, row) of ``desc_a`` and ``desc_b`` into slot ``slot`` of
    ``bufs_a`` and ``bufs_b``, both completing the slot's ready barrier; nothing unless ``pred``."""
    bar = ready.index(slot)
    mbarrier.expect(bar, desc_a.block_type.nbytes + desc_b.block_type.nbytes, pred=pred)
    tma_load(desc_a, [b, h, row, 0], bar, as_tma_tile(bufs_a.index(slot), ROWS, HEAD_DIM),
                                    pred=pred)
    tma_load(desc_b, [b, h, row, 0], bar, as_tma_tile(bufs_b.index(slot), ROWS, HEAD_DIM),
                                    pred=pred)


@gluon.jit
def _issue_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, t, n_iters, n_m, lo_m, b, kv_h, group,
                BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Start the copies of iteration t's Q and dO tiles (query head kv_h * group + t // n_m, query block
    lo_m + t % n_m) into slot t % STAGES; nothing when t >= n_iters."""
    per_head = gl.maximum(n_m, 1)  # n_m = 0 (no query sees these keys) issues nothing, but must not divide by 0
    _issue_pair(q_desc, do_desc, q_bufs, do_bufs, ready, t % STAGES, b, kv_h * group + t // per_head,
                (lo_m + t % per_head) * BLOCK_M, t < n_iters, BLOCK_M, HEAD_DIM)


@gluon.jit
def _query_blocks(start_n, seq_q, seq_k, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    """(diag_shift, lo_m, m_full, n_q_blocks) of the BLOCK_N keys from ``start_n``: query blocks before lo_m see none
    of them, blocks [lo_m, m_full) hold the diagonal (masked), the rest up to n_q_blocks see every one."""
    # Query i sees key j when j <= i + diag_shift (causal), so the first block is the one holding row
    # start_n - diag_shift.
    if CAUSAL == 2:
        diag_shift = seq_k - seq_q
    else:
        diag_shift = 0
    n_q_blocks = gl.cdiv(seq_q, BLOCK_M)
    if CAUSAL != 0:
        lo_m = gl.minimum(gl.maximum(start_n - diag_shift, 0) // BLOCK_M, n_q_blocks)
        m_full = gl.minimum(gl.cdiv(gl.maximum(start_n + BLOCK_N - 1 - diag_shift, 0), BLOCK_M), n_q_blocks)
    else:
        lo_m = 0
        m_full = 0
    return diag_shift, lo_m, m_full, n_q_blocks


@gluon.jit
def _column_statistics(Lse, Delta, stats, m_block, seq_q, BLOCK_M: gl.constexpr, st_layout: gl.constexpr):
    """(cols, lse, delta) of query block ``m_block``'s columns, one per column of a [keys, BLOCK_M] tile of
    ``st_layout``; columns past S_q read lse +inf (P^T = 0 there) and delta 0."""
    cols = m_block * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, st_layout))
    in_q = cols < seq_q
    lse = gl.load(Lse + stats + cols, mask=in_q, other=float("inf"))
    delta = gl.load(Delta + stats + cols, mask=in_q, other=0.0)
    return cols, lse, delta


@gluon.jit
def _probabilities_t(st, lse, cols, keys, m_block, m_full, diag_shift, qk_scale, CAUSAL: gl.constexpr):
    """P^T = exp2(S^T * qk_scale - lse) of the key rows ``keys``, masked in the query blocks before ``m_full`` (they
    hold the diagonal)."""
    pt = gl.exp2(st * qk_scale - gl.expand_dims(lse, 0))
    if CAUSAL != 0:
        if m_block < m_full:
            visible = gl.expand_dims(keys, 1) <= gl.expand_dims(cols + diag_shift, 0)
            pt = gl.where(visible, pt, 0.0)
    return pt


@gluon.jit
def _dkdv_block(dk, dv, k_tile, v_tile, q_tile, do_tile, Lse, Delta, keys, stats, m_block, m_full, seq_q, diag_shift,
                qk_scale, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr):
    """dK and dV (float32 registers, [BLOCK_N, D]) of the key rows ``keys`` with query block ``m_block`` of one head
    added in: its Q and dO tiles in shared memory, its rows' lse and delta at ``Lse + stats`` and ``Delta + stats``.
    Query blocks before ``m_full`` hold the diagonal (masked). Returns once every wgmma has completed, so that the
    caller may hand the Q and dO tiles back. dP^T = V dO^T is issued with S^T and runs under the exponentials."""
    dtype: gl.constexpr = k_tile.dtype
    st_layout: gl.constexpr = mma_layout(WARPS, BLOCK_M)  # S^T, P^T, dP^T, dS^T: [BLOCK_N, BLOCK_M]
    pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk.type.layout, k_width=2)
    st_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, st_layout)
    st = warpgroup_mma(k_tile, q_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    dpt = warpgroup_mma(v_tile, do_tile.permute((1, 0)), st_zero, use_acc=False, is_async=True)
    # The statistics of the block's query columns, read while the products run.
    cols, lse, delta = _column_statistics(Lse, Delta, stats, m_block, seq_q, BLOCK_M, st_layout)
    st = warpgroup_mma_wait(1, deps=(st, ))
    pt = _probabilities_t(st, lse, cols, keys, m_block, m_full, diag_shift, qk_scale, CAUSAL)
    pt_op = gl.convert_layout(pt.to(dtype), pt_layout)
    dv = warpgroup_mma(pt_op, do_tile, dv, is_async=True)
    dpt = warpgroup_mma_wait(1, deps=(dpt, ))
    dst = pt * (dpt - gl.expand_dims(delta, 0))
    dst_op = gl.convert_layout(dst.to(dtype), pt_layout)
    dk = warpgroup_mma(dst_op, q_tile, dk, is_async=True)
    dv, dk, pt_op, dst_op = warpgroup_mma_wait(0, deps=(dv, dk, pt_op, dst_op))
    return dk, dv


# The integers are not specialized: the copy engine handles every bound, so one compile per config, dtype and mode.
@gluon.jit(do_not_specialize=["num_heads", "group_size", "seq_q", "seq_k"])
def _attn_bwd_dkdv(q_desc,  # [B, H, S_q, D] 16-bit, tiles [1, 1, BLOCK_M, D]
                   k_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                   v_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                   do_desc,  # [B, H, S_q, D] the output's gradient, q's dtype, tiles [1, 1, BLOCK_M, D]
                   dk_desc,  # [B, H_kv, S_k, D] k's dtype, tiles [1, 1, BLOCK_N, D]
                   dv_desc,  # [B, H_kv, S_k, D] v's dtype, tiles [1, 1, BLOCK_N, D]
                   Lse,  # [B, H, S_q] float32, contiguous: the forward's base-2 log-sum-exp of the scaled scores
                   Delta,  # [B, H, S_q] float32, contiguous: rowsum(dO * O)
                   num_heads, group_size, seq_q, seq_k, qk_scale, sm_scale,  # group_size = H // H_kv
                   HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """dK and dV of one key block of one (batch, key/value head), over every query head of its group.

    Grid: (cdiv(S_k, BLOCK_N), B * H_kv)."""
    dtype: gl.constexpr = k_desc.dtype
    kv_layout: gl.constexpr = mma_layout(num_warps, HEAD_DIM)  # dK, dV: [BLOCK_N, HEAD_DIM]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout(num_warps, BLOCK_M))  # one value per key row

    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    kv_heads = num_heads // group_size
    b = pid_bh // kv_heads
    kv_h = pid_bh % kv_heads
    start_n = pid_n * BLOCK_N

    k_smem, v_smem, q_bufs, do_bufs, kv_ready, ready = _program_tiles(dtype, BLOCK_N, BLOCK_M, HEAD_DIM, STAGES)

    mbarrier.expect(kv_ready, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma_load(k_desc, [b, kv_h, start_n, 0], kv_ready, as_tma_tile(k_smem, BLOCK_N, HEAD_DIM))
    tma_load(v_desc, [b, kv_h, start_n, 0], kv_ready, as_tma_tile(v_smem, BLOCK_N, HEAD_DIM))

    diag_shift, lo_m, m_full, n_q_blocks = _query_blocks(start_n, seq_q, seq_k, BLOCK_N, BLOCK_M, CAUSAL)
    n_m = n_q_blocks - lo_m
    n_iters = group_size * n_m

    for t in gl.static_range(STAGES):
        _issue_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, t, n_iters, n_m, lo_m, b, kv_h, group_size,
                    BLOCK_M, HEAD_DIM, STAGES)

    dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    dv = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, kv_layout)
    keys = start_n + gl.arange(0, BLOCK_N, layout=row_layout)
    mbarrier.wait(kv_ready, 0)
    for t in range(n_iters):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), (t // STAGES) & 1)
        dk, dv = _dkdv_block(dk, dv, k_smem, v_smem, q_bufs.index(slot), do_bufs.index(slot), Lse, Delta, keys,
                             (b * num_heads + kv_h * group_size + t // n_m).to(gl.int64) * seq_q, lo_m + t % n_m,
                             m_full, seq_q, diag_shift, qk_scale, BLOCK_N, BLOCK_M, CAUSAL, num_warps)
        # Every wgmma of this iteration has completed in this warpgroup; once all warpgroups are past theirs, the
        # slot takes iteration t + STAGES.
        thread_barrier()
        _issue_q_do(q_desc, do_desc, q_bufs, do_bufs, ready, t + STAGES, n_iters, n_m, lo_m, b, kv_h, group_size,
                    BLOCK_M, HEAD_DIM, STAGES)

    _invalidate(kv_ready, ready, STAGES)
    # K's and V's tiles take the results: every wgmma that read them has completed.
    k_smem.store((dk * sm_scale).to(dtype))
    v_smem.store(dv.to(dtype))
    fence_async_shared()
    tma_store(dk_desc, [b, kv_h, start_n, 0], as_tma_tile(k_smem, BLOCK_N, HEAD_DIM))
    tma_store(dv_desc, [b, kv_h, start_n, 0], as_tma_tile(v_smem, BLOCK_N, HEAD_DIM))
    tma.store_wait(0)


# ----------------------------------------------------------------------------------------------------------------
# The warp-specialized backward's shared pieces (``_attn_bwd_dq_ws`` below): a one-warp producer partition and two
# consumer warpgroups, each with its own rows, tiles and "empty" hand-back mbarriers (index c * STAGES + slot).
# (A warp-specialized dK/dV kernel on the same pieces, never on by default and slower than the single-partition one
# at D=128 in an 8ca4529 run, was deleted; BENCHMARKS.md keeps its numbers, git its code.)
BWD_CONSUMER_WARPS = gl.constexpr(4)
# Registers per consumer thread (setmaxnreg): 2 x 128 x 240 + 128 x 24 (the producer's warpgroup) fit an SM's 64 K;
# the kernel is launched with maxnreg BWD_WS_MAXNREG (12 warps x 32 threads x 168 registers).
BWD_CONSUMER_REGS = gl.constexpr(240)
BWD_WS_MAXNREG = 168


@gluon.jit
def _two_consumer_tiles(dtype: gl.constexpr, OWN_ROWS: gl.constexpr, STREAMED_ROWS: gl.constexpr,
                        HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """A two-consumer program's shared memory, initialised: the two tiles each consumer holds throughout (K and V,
    or Q and dO: [2, OWN_ROWS, D] each, index c), STAGES slots of the two tiles streamed past them, and the
    barriers: each consumer's held pair's (own_ready), each slot's (ready; the copy engine completes them) and each
    consumer's hand-back of each slot (empty, index c * STAGES + slot)."""
    tile: gl.constexpr = tile_layout()
    own_a = gl.allocate_shared_memory(dtype, [2, OWN_ROWS, HEAD_DIM], tile)
    own_b = gl.allocate_shared_memory(dtype, [2, OWN_ROWS, HEAD_DIM], tile)
    bufs_a = gl.allocate_shared_memory(dtype, [STAGES, STREAMED_ROWS, HEAD_DIM], tile)
    bufs_b = gl.allocate_shared_memory(dtype, [STAGES, STREAMED_ROWS, HEAD_DIM], tile)
    own_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(own_ready.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(empty.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation, visible to the copy engine before it signals them
    return own_a, own_b, bufs_a, bufs_b, own_ready, ready, empty


@gluon.jit
def _invalidate_consumer_barriers(own_ready, ready, empty, STAGES: gl.constexpr):
    for c in gl.static_range(2):
        mbarrier.invalidate(own_ready.index(c))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
    for i in gl.static_range(2 * STAGES):
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _hand_back(empty, C: gl.constexpr, t, STAGES: gl.constexpr):
    """Consumer C is done with iteration t's slot: its empty barrier, once every warp of the warpgroup is past its
    wgmma waits (the partition's own barrier; each warp waits for its own wgmma groups, and one thread arrives)."""
    thread_barrier()
    mbarrier.arrive(empty.index(C * STAGES + t % STAGES))


@gluon.jit
def _row_statistics(Lse, Delta, pid_bh, start_m, seq_q, BLOCK_M: gl.constexpr, row_layout: gl.constexpr):
    """(rows, lse, delta) of the BLOCK_M query rows from ``start_m`` of (batch, head) ``pid_bh``, one per row in
    ``row_layout``. Rows past S_q read lse +inf (P = 0 there) and delta 0; their dQ rows are clipped by the store."""
    rows = start_m + gl.arange(0, BLOCK_M, layout=row_layout)
    in_q = rows < seq_q
    stats = pid_bh.to(gl.int64) * seq_q
    lse = gl.load(Lse + stats + rows, mask=in_q, other=float("inf"))
    delta = gl.load(Delta + stats + rows, mask=in_q, other=0.0)
    return rows, lse, delta


@gluon.jit
def _dq_block(dq, q_tile, do_tile, k_tile, v_tile, lse, delta, rows, j, n_full, seq_k, diag_shift, qk_scale,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, WARPS: gl.constexpr):
    """dQ (float32 registers, [BLOCK_M, D]) of the query rows ``rows`` with key block j added in, its K and V tiles
    in shared memory; ``lse`` and ``delta`` the rows' statistics. Blocks from ``n_full`` on take the causal and
    key-length masks. Returns once every wgmma has completed, so that the caller may hand the K and V tiles back."""
    dtype: gl.constexpr = q_tile.dtype
    s_layout: gl.constexpr = mma_layout(WARPS, BLOCK_N)  # S, P, dP, dS: [BLOCK_M, BLOCK_N]
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq.type.layout, k_width=2)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s, ))
    p = gl.exp2(s * qk_scale - gl.expand_dims(lse, 1))
    if j >= n_full:  # the diagonal's blocks and the last partial one: causal and key-length masks
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < seq_k, 0)
        if CAUSAL != 0:
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diag_shift, 1))
        p = gl.where(visible, p, 0.0)
    dp = warpgroup_mma_wait(0, deps=(dp, ))
    ds = p * (dp - gl.expand_dims(delta, 1))
    ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
    dq = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
    dq, ds_op = warpgroup_mma_wait(0, deps=(dq, ds_op))
    return dq


# ----------------------------------------------------------------------------------------------------------------
# Step 2 of the backward: dQ with a TMA producer warp and two consumer warpgroups (``_attn_bwd_dq_ws``).
#
# A program owns 2 x BLOCK_M query rows of one (batch, head); consumer c holds rows start_m + c * BLOCK_M onwards
# (its own Q and dO tiles, dQ registers) and reads key/value blocks 0 to n_blocks_c - 1 of the stream the producer
# warp copies into a ring of STAGES slots (with causal masking consumer 1's later rows see more blocks). It hands
# each slot back through its own "empty" mbarrier, and the producer refills slot j % STAGES with block j once each
# consumer that read block j - STAGES has handed it back: the forward's ping-pong protocol (attention_fwd_gluon,
# "Why this cannot deadlock") without the turns, so the consumers run apart.
# First the fastest in an 8ca4529 run against the (since deleted) single-partition dQ kernel: at D=64 64 x 128, 2
# stages (1.014-1.141x; 64 x 64 tied or lost, 0.899-0.999x); at D=128 64 x 64, 3 stages (1.241-1.257x; 2 stages
# 1.196-1.236x).
GLUON_DQ_WS_CONFIGS = {
    64: [(64, 128, 2, 4), (64, 64, 3, 4)],
    128: [(64, 64, 3, 4), (64, 64, 2, 4)],
}


@gluon.jit
def _dq_ws_producer(q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty,
                    b, h, kv_h, start_m, n_blocks_0, n_blocks_1,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """One warp: each consumer's Q and dO tiles (only for a consumer with key blocks to read), then every key/value
    block either consumer reads, block j into slot j % STAGES once each consumer that read block j - STAGES has
    handed it back."""
    for c in gl.static_range(2):
        pred = (n_blocks_1 if c == 1 else n_blocks_0) > 0
        row = start_m + c * BLOCK_M
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=pred)
        tma_load(q_desc, [b, h, row, 0], q_ready.index(c),
                                        as_tma_tile(q_smem.index(c), BLOCK_M, HEAD_DIM), pred=pred)
        tma_load(do_desc, [b, h, row, 0], q_ready.index(c),
                                        as_tma_tile(do_smem.index(c), BLOCK_M, HEAD_DIM), pred=pred)
    for j in range(gl.maximum(n_blocks_0, n_blocks_1)):
        slot = j % STAGES
        # Round 0 passes at once (a fresh mbarrier counts as having completed the phase before its first).
        phase = ((j // STAGES) & 1) ^ 1
        mbarrier.wait(empty.index(slot), phase, pred=j - STAGES < n_blocks_0)
        mbarrier.wait(empty.index(STAGES + slot), phase, pred=j - STAGES < n_blocks_1)
        _issue_pair(k_desc, v_desc, k_bufs, v_bufs, ready, slot, b, kv_h, j * BLOCK_N, True, BLOCK_N, HEAD_DIM)


@gluon.jit
def _dq_ws_consumer(C: gl.constexpr, q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty, dq_desc, Lse, Delta,
                    b, h, pid_bh, start_m, seq_q, seq_k, diag_shift, n_full, n_blocks, qk_scale, sm_scale,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr):
    """Consumer C: dQ of its rows (``start_m``, ``n_full`` and ``n_blocks`` are its own) over key blocks
    [0, n_blocks), then its store. Rows that see no key get dQ = 0."""
    q_layout: gl.constexpr = mma_layout(BWD_CONSUMER_WARPS, HEAD_DIM)  # dQ: [BLOCK_M, HEAD_DIM]
    row_layout: gl.constexpr = gl.SliceLayout(1, mma_layout(BWD_CONSUMER_WARPS, BLOCK_N))  # one value per row
    q_tile = q_smem.index(C)
    do_tile = do_smem.index(C)
    rows, lse, delta = _row_statistics(Lse, Delta, pid_bh, start_m, seq_q, BLOCK_M, row_layout)
    dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, q_layout)
    mbarrier.wait(q_ready.index(C), 0, pred=n_blocks > 0)
    for j in range(n_blocks):
        slot = j % STAGES
        mbarrier.wait(ready.index(slot), (j // STAGES) & 1)
        dq = _dq_block(dq, q_tile, do_tile, k_bufs.index(slot), v_bufs.index(slot), lse, delta, rows, j, n_full,
                       seq_k, diag_shift, qk_scale, BLOCK_M, BLOCK_N, CAUSAL, BWD_CONSUMER_WARPS)
        _hand_back(empty, C, j, STAGES)
    if start_m < seq_q:
        # Q's tile takes the result: every wgmma that read it has completed (or none was issued).
        q_tile.store((dq * sm_scale).to(q_smem.dtype))
        fence_async_shared()
        tma_store(dq_desc, [b, h, start_m, 0], as_tma_tile(q_tile, BLOCK_M, HEAD_DIM))
        tma.store_wait(0)


@gluon.jit(do_not_specialize=["num_heads", "group_size", "seq_q", "seq_k"])
def _attn_bwd_dq_ws(q_desc,  # [B, H, S_q, D] 16-bit, tiles [1, 1, BLOCK_M, D] (one consumer's rows)
                    k_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                    v_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                    do_desc,  # [B, H, S_q, D] the output's gradient, q's dtype, tiles [1, 1, BLOCK_M, D]
                    dq_desc,  # [B, H, S_q, D] q's dtype, tiles [1, 1, BLOCK_M, D]
                    Lse,  # [B, H, S_q] float32, contiguous: the forward's base-2 log-sum-exp of the scaled scores
                    Delta,  # [B, H, S_q] float32, contiguous: rowsum(dO * O)
                    num_heads, group_size, seq_q, seq_k, qk_scale, sm_scale,  # group_size = H // H_kv
                    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                    CAUSAL: gl.constexpr, num_warps: gl.constexpr):
    """dQ of 2 x BLOCK_M query rows of one (batch, head): two consumer warpgroups and a TMA producer warp (launch
    with num_warps = 4 and maxnreg = BWD_WS_MAXNREG).

    Grid: (cdiv(S_q, 2 * BLOCK_M), B * H)."""
    gl.static_assert(num_warps == BWD_CONSUMER_WARPS, "the default partition is one consumer warpgroup")
    dtype: gl.constexpr = q_desc.dtype
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if CAUSAL != 0:  # later query blocks see more keys: they start first, so that the short ones fill the tail
        pid_m = gl.cdiv(seq_q, 2 * BLOCK_M) - 1 - pid_m
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size
    start_m = pid_m * 2 * BLOCK_M

    q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty = _two_consumer_tiles(dtype, BLOCK_M, BLOCK_N, HEAD_DIM,
                                                                                 STAGES)

    diag_shift, _, _ = key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    start_1 = start_m + BLOCK_M
    n_full_0, n_blocks_0 = consumer_key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    n_full_1, n_blocks_1 = consumer_key_blocks(start_1, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    gl.warp_specialize([
        (_dq_ws_consumer, (0, q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty, dq_desc, Lse, Delta, b, h,
                           pid_bh, start_m, seq_q, seq_k, diag_shift, n_full_0, n_blocks_0, qk_scale, sm_scale,
                           BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_dq_ws_consumer, (1, q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty, dq_desc, Lse, Delta, b, h,
                           pid_bh, start_1, seq_q, seq_k, diag_shift, n_full_1, n_blocks_1, qk_scale, sm_scale,
                           BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL)),
        (_dq_ws_producer, (q_desc, k_desc, v_desc, do_desc, q_smem, do_smem, k_bufs, v_bufs, q_ready, ready, empty,
                           b, h, kv_h, start_m, n_blocks_0, n_blocks_1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES)),
    ], [BWD_CONSUMER_WARPS, 1], [BWD_CONSUMER_REGS, PRODUCER_REGS])
    _invalidate_consumer_barriers(q_ready, ready, empty, STAGES)

