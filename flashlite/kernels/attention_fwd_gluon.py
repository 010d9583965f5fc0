"""Hopper (sm_90) attention forward in Gluon: TMA copies, an mbarrier-guarded ring of key/value tiles, async wgmma.

The same arithmetic as ``attention_fwd`` (online softmax over key blocks in float32, base-2 scores with
``qk_scale = scale * log2(e)`` folded in, one normalisation at the end, the base-2 log-sum-exp kept for the
backward), scheduled with the pieces ``tl.dot`` loops do not reach:

* Q, K, V and Out are reached through 4-D TMA descriptors over their [B, heads, S, D] views, with tiles of
  [1, 1, rows, D]. The copy engine clips every tile to its own (batch, head) slice: rows past S load as zeros and
  are not stored, so a partial last block never reads or writes the next head's rows, and no address arithmetic or
  mask sits on the load path.
* Key and value tiles stream through a ring of ``STAGES`` shared-memory slots; each slot has a "ready" mbarrier per
  operand, which the copy engine completes when the tile's bytes have landed.
* S = Q K^T and O += P V are asynchronous warpgroup MMAs (``wgmma``): Q and K are read straight from shared
  memory, P from registers (as bf16/fp16), V from shared memory.

One kernel, ``_attn_fwd`` (step 1 of issue 17), runs the block loop (``_attend_blocks``) in one group of warps that
does everything. The copies of block j + STAGES - 1 are issued once block j's S is computed (its slot's previous
tenant, block j - 1, is then finished: waiting for S also retires the P V of block j - 1, since wgmma groups complete
in order), so STAGES - 1 blocks are in flight while block j's softmax and P V run. Block j's P V stays in flight
until block j + 1's S has been issued. (Two schedules that lost their A/Bs were deleted: step 2, a warp-specialized
producer warp, and step 4, a persistent grid; their numbers stay in BENCHMARKS.md's history, their code in git.)

It takes the constexpr OVERLAP (FlashAttention-3's overlap inside a warpgroup): block j's S and block j - 1's P V
are issued together and only S is waited for, so that block j's softmax runs on the CUDA cores while the tensor
cores do block j - 1's P V (one more block of probabilities held in registers).

A second kernel, ``_attn_fwd_pingpong`` (step 3), runs the same arithmetic in three partitions: a TMA producer warp
and two consumer warpgroups, each on its own BLOCK_M rows of a 2 x BLOCK_M program, which take turns at the tensor
cores so that one's softmax runs while the other's wgmmas do (FlashAttention-3's ping-pong); OVERLAP adds the
overlap inside each warpgroup. Its protocol (turns, a slot released only once both consumers are done with it,
why it cannot deadlock) is described above its partitions.

Rows are split across warps as wgmma wants it: ``num_warps`` warps stacked along M (warps_per_cta [num_warps, 1]),
so with BLOCK_M=128 and 8 warps each warpgroup owns 64 query rows and holds BLOCK_N / 2 float32 scores and
HEAD_DIM / 2 accumulator values per thread.

Masks: key blocks that every real row of the query block sees whole (below the causal diagonal, inside the key
length) run without any mask; the others (the diagonal blocks, the last partial key block) mask with ``where``.
Blocks above the diagonal are never loaded. A row that sees no key (bottom-right causal with S_q > S_k) gets
output 0 and lse -inf, as in the pointer kernel.

``CAUSAL``: 0 none; 1 top-left (key j visible to query i when j <= i); 2 bottom-right (j <= i + S_k - S_q).
``WINDOW`` (``_attn_fwd``, steps 1 and 2, with CAUSAL != 0): a causal sliding window, key j also hidden from query
i when j < i' - window_left (i' the row on the diagonal). A program's key blocks then start at the first block its
rows see (``kv_lo``), never loading the ones before; the ring counts its slots and barrier phases from there. The
blocks the window's left edge cuts take the masks like the diagonal ones.
``qk_scale`` must be positive (the unmasked path takes the row maximum of the raw scores and scales it once).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from flashlite.kernels.gluon_tiles import as_tma_tile as _as_tma_tile
from flashlite.kernels.gluon_tiles import consumer_key_blocks as _consumer_key_blocks
from flashlite.kernels.gluon_tiles import key_blocks as _key_blocks
from flashlite.kernels.gluon_tiles import mma_layout as _mma_layout
from flashlite.kernels.gluon_tiles import tile_layout as _tile_layout
from flashlite.kernels.gluon_tiles import thread_barrier, tma_load, tma_store

# ----------------------------------------------------------------------------------------------------------------
# Configs: (BLOCK_M, BLOCK_N, STAGES, num_warps, OVERLAP[, NAMED_BARRIERS]) per head dim and kernel variant (the
# sixth, step 3 only, defaults to False). The first entry of each list is what the launcher uses; the others are
# there to be A/B'd and are compiled by CPU CI all the same.
#
# Shared memory (16-bit operands): Q BLOCK_M x D once, K and V BLOCK_N x D per stage each, plus < 1 KB of barriers.
# D=64, 128 x 128 x 3 stages: 16 KB + 3 x 32 KB = 112 KB. D=128, 128 x 128 x 2 stages: 32 KB + 2 x 64 KB = 160 KB
# (3 stages would be 224 KB, inside 227 KB, but leave no room for anything else). Register use, as wgmma lays it
# out: per thread BLOCK_N / 2 scores + BLOCK_N / 4 packed probabilities + D / 2 accumulators at 8 warps x 128 rows
# (OVERLAP keeps a second block's probabilities live: BLOCK_N / 4 more).
#
# D=64 candidates beside the measured 128 x 128 (ptxas: 163 registers x 256 threads, so one program per SM): one
# warpgroup on 64 rows, 161-163 registers x 128 threads, 3 programs per SM with 2 stages (72 KB each) or 2 with 3
# (104 KB), so that one program's softmax can run while another's wgmma does. (128 x 256 at 8 warps needs 255
# registers; 128 x 128 at 8 warps under a 128-register cap, for two programs per SM, spills.)
#
# "pingpong" (step 3): BLOCK_M is the rows of ONE consumer warpgroup (num_warps = 4, the default partition's); a
# program covers 2 x BLOCK_M rows with two of them and keeps two Q tiles. Shared memory: D=128, 64 x 128: 32 KB of Q
# + 64 KB per stage, 160 KB with 2 stages, 224 KB with 3 (229,768 bytes in all, under the 232,448 limit); D=64,
# 64 x 128 x 3 stages: 16 + 96 = 112 KB; 128 x 64 x 4: 32 + 64 = 96 KB. Registers: 240 per consumer thread
# (setmaxnreg), of which the consumers use up to 187 at D=128 64 x 128 (218 with OVERLAP), 152-163 at D=64 64 x 128
# and 195 at D=64 128 x 64 (SASS); one program per SM (12 warps x 168). D=64 64 x 256 would need more and spills.
GLUON_FWD_CONFIGS = {
    "pipelined": {64: [(128, 128, 3, 8, False), (128, 64, 3, 4, False), (128, 128, 3, 8, True),
                       (64, 128, 2, 4, False), (64, 128, 3, 4, False)],
                  128: [(128, 128, 2, 8, False), (128, 64, 3, 8, False), (128, 128, 2, 8, True)]},
    "pingpong": {64: [(64, 128, 3, 4, False), (64, 128, 3, 4, True), (128, 64, 4, 4, False),
                      (64, 128, 3, 4, False, True)],
                 128: [(64, 128, 2, 4, False), (64, 128, 2, 4, True), (64, 128, 3, 4, False),
                       (64, 128, 3, 4, False, True), (64, 128, 2, 4, True, True)]},
}
# Registers of the producer partition: it only issues copies and waits on barriers (24 is the minimum a warp can
# be given; the compute warps receive what the other warps give back).
PRODUCER_REGS = gl.constexpr(24)
# Shared memory per thread block on H100/H200 (what Triton reports as the limit).
SHARED_MEMORY_LIMIT = 232448
HEAD_DIMS = (64, 128)
CAUSAL_MODES = (0, 1, 2)


def shared_memory_bytes(block_m: int, block_n: int, stages: int, head_dim: int, elem: int = 2) -> int:
    """Bytes of operand tiles a config keeps in shared memory (barriers not included).

    Example:
        >>> shared_memory_bytes(128, 128, 3, 64)
        114688
    """
    return (block_m + 2 * stages * block_n) * head_dim * elem


@gluon.jit
def _zero_scores(BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    # The zero accumulator each block's S = Q K^T starts from (use_acc=False ignores its values; wgmma takes its
    # layout from it).
    return gl.zeros([BLOCK_M, BLOCK_N], gl.float32, _mma_layout(num_warps, BLOCK_N))


@gluon.jit
def _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, j, kv_lo, n_blocks,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr):
    """Start the copies of key/value block j into slot (j - kv_lo) % STAGES, each completing its slot's ready
    barrier; nothing when j >= n_blocks (the predicate keeps the prologue and the loop's look-ahead branch-free).
    ``kv_lo`` is the program's first key block (0 without a window): the ring counts from it, so that a program
    whose keys start past block 0 uses its slots and barrier phases from the first."""
    slot = (j - kv_lo) % STAGES
    pred = j < n_blocks
    k_bar = k_ready.index(slot)
    v_bar = v_ready.index(slot)
    mbarrier.expect(k_bar, k_desc.block_type.nbytes, pred=pred)
    tma_load(k_desc, [b, kv_h, j * BLOCK_N, 0], k_bar,
                                    _as_tma_tile(k_bufs.index(slot), BLOCK_N, HEAD_DIM), pred=pred)
    mbarrier.expect(v_bar, v_desc.block_type.nbytes, pred=pred)
    tma_load(v_desc, [b, kv_h, j * BLOCK_N, 0], v_bar,
                                    _as_tma_tile(v_bufs.index(slot), BLOCK_N, HEAD_DIM), pred=pred)


@gluon.jit
def _softmax_step(s, m_i, l_i, j, start_m, seq_k, diag_shift, qk_scale, window_left,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, MASK: gl.constexpr,
                  WINDOW: gl.constexpr):
    """Fold the raw scores ``s`` of key block j into the running (m, l): returns (p, alpha, m_new, l_new), p the
    unnormalised probabilities in base 2 and alpha the factor that rescales what was accumulated before. WINDOW
    (causal only): key c is also hidden from row r when c < r + diag_shift - window_left."""
    s_layout: gl.constexpr = s.type.layout
    if MASK:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = gl.expand_dims(cols < seq_k, 0)
        if CAUSAL != 0:
            rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
            visible = visible & (gl.expand_dims(cols, 0) <= gl.expand_dims(rows + diag_shift, 1))
            if WINDOW:
                visible = visible & (gl.expand_dims(cols, 0) >= gl.expand_dims(rows + diag_shift - window_left, 1))
        # `where`, not an added -inf: keys past S_k load as zeros, but a mask must never rely on what it hides.
        qk = gl.where(visible, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(qk, 1))
        # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(qk - gl.expand_dims(m_ref, 1))
    else:
        # Every score is finite and visible: the row maximum of the raw scores, scaled once per row (qk_scale > 0),
        # and one fused multiply-add per score before exp2.
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_ref = m_new
        p = gl.exp2(s * qk_scale - gl.expand_dims(m_ref, 1))
    alpha = gl.exp2(m_i - m_ref)
    l_new = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_new


@gluon.jit
def _ring(dtype: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
          STAGES: gl.constexpr):
    """One program's shared memory: Q's tile (later the output's), STAGES slots of key and value tiles, and their
    barriers, initialised: q_ready, and per slot k_ready, v_ready (the copy engine completes them) and kv_empty
    (the compute warps complete it when the slot may be refilled; used by the warp-specialized schedule only)."""
    tile: gl.constexpr = _tile_layout()
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], tile)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()  # the barriers' initialisation, visible to the copy engine before it signals them
    return q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty


@gluon.jit
def _invalidate_ring(q_ready, k_ready, v_ready, kv_empty, STAGES: gl.constexpr):
    mbarrier.invalidate(q_ready)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
        mbarrier.invalidate(kv_empty.index(i))


@gluon.jit
def _free_slot(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, b, kv_h, j, kv_lo, n_blocks,
               BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, PRODUCER: gl.constexpr):
    """Block j - 1's wgmmas have all completed in this warpgroup: its slot takes block j - 1 + STAGES (no PRODUCER
    partition: these warps issue the copies) or goes back to the producer through kv_empty (nothing for the
    program's first block, j = kv_lo).

    Each warpgroup waits for its own wgmmas only, and both refills are one thread's, so every warpgroup must be past
    its wait first: the compiler puts a CTA barrier before the copies (it orders the wgmma's reads of the slot
    before the copy's write; checked in the PTX), and the hand-back gets an explicit one."""
    if PRODUCER:
        thread_barrier()
        mbarrier.arrive(kv_empty.index((j - kv_lo + STAGES - 1) % STAGES), pred=j > kv_lo)
    else:
        _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, j + STAGES - 1, kv_lo, n_blocks,
                  BLOCK_N, HEAD_DIM, STAGES)


@gluon.jit
def _attend_blocks(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, acc, p_prev, m_i, l_i,
                   k_desc, v_desc, b, kv_h, lo, hi, kv_lo, n_blocks, start_m, seq_k, diag_shift, qk_scale,
                   window_left,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                   CAUSAL: gl.constexpr, MASK: gl.constexpr, PRODUCER: gl.constexpr, OVERLAP: gl.constexpr,
                   WINDOW: gl.constexpr, num_warps: gl.constexpr):
    """Key blocks [lo, hi), MASK and WINDOW as in ``_softmax_step``, the ring counted from block ``kv_lo``; ``p_prev``: the probabilities of the block before, in
    registers, which its P V reads (kept alive until that wgmma's wait).

    Without OVERLAP, block j's S is issued and waited for (which also retires block j - 1's P V: wgmma groups
    complete in order), then block j's softmax, then its P V is issued and left in flight; ``acc`` enters and
    leaves as an in-flight accumulator. With OVERLAP (FlashAttention-3's intra-warpgroup overlap), block j's S and
    block j - 1's P V are issued together and only S is waited for, so that block j's softmax runs while the
    tensor cores do block j - 1's P V; ``acc`` enters and leaves as registers, without block j - 1's P V (the
    caller peels block ``lo - 1``'s softmax off before and adds the last P V after)."""
    o_layout: gl.constexpr = _mma_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = _zero_scores(BLOCK_M, BLOCK_N, num_warps)
    for j in range(lo, hi):
        ring = j - kv_lo  # the block's position in this program's stream of key blocks
        slot = ring % STAGES
        phase = (ring // STAGES) & 1
        mbarrier.wait(k_ready.index(slot), phase)
        s = warpgroup_mma(q_smem, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        if OVERLAP:
            prev = (ring + STAGES - 1) % STAGES
            mbarrier.wait(v_ready.index(prev), ((ring - 1) // STAGES) & 1)
            acc = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s, ))
        else:
            s, acc, p_prev = warpgroup_mma_wait(0, deps=(s, acc, p_prev))
            _free_slot(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, b, kv_h, j, kv_lo, n_blocks,
                       BLOCK_N, HEAD_DIM, STAGES, PRODUCER)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, start_m, seq_k, diag_shift, qk_scale, window_left,
                                           BLOCK_M, BLOCK_N, CAUSAL, MASK, WINDOW)
        if OVERLAP:
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
            _free_slot(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, b, kv_h, j, kv_lo, n_blocks,
                       BLOCK_N, HEAD_DIM, STAGES, PRODUCER)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_prev = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        if not OVERLAP:
            mbarrier.wait(v_ready.index(slot), phase)
            acc = warpgroup_mma(p_prev, v_bufs.index(slot), acc, is_async=True)
    return acc, p_prev, m_i, l_i


@gluon.jit
def _attend(q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, k_desc, v_desc, b, kv_h,
            start_m, seq_k, diag_shift, kv_lo, n_lead, n_full, n_blocks, qk_scale, window_left, ring_origin, q_phase,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
            CAUSAL: gl.constexpr, PRODUCER: gl.constexpr, OVERLAP: gl.constexpr, WINDOW: gl.constexpr,
            num_warps: gl.constexpr):
    """(acc, m, l) of one query block after every key block it sees, blocks [kv_lo, n_blocks): with a WINDOW the
    blocks [kv_lo, n_lead) that its left edge cuts (masked), then the unmasked blocks up to n_full, then the masked
    ones (diagonal, key length). Without a window kv_lo = n_lead = 0. Block j sits at position j - ring_origin of
    the program's stream of key blocks (ring_origin = kv_lo for a program of one query block), and Q's barrier
    completes its phase ``q_phase`` for this block.
    OVERLAP needs ring_origin = kv_lo (its first block is peeled off at stream position 0)."""
    s_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(num_warps, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p_prev = gl.zeros([BLOCK_M, BLOCK_N], q_smem.dtype, p_layout)
    mbarrier.wait(q_ready, q_phase)
    if OVERLAP:
        # The first block's softmax, peeled off: the loop below starts with its P V. It takes the masks whichever
        # kind of block it is (a block every row sees whole is unchanged by them).
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        if n_blocks > kv_lo:
            mbarrier.wait(k_ready.index(0), 0)
            s = warpgroup_mma(q_smem, k_bufs.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32,
                                                                               s_layout),
                              use_acc=False, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s, ))
            _free_slot(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, kv_empty, b, kv_h, kv_lo, ring_origin,
                       n_blocks, BLOCK_N, HEAD_DIM, STAGES, PRODUCER)
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, kv_lo, start_m, seq_k, diag_shift, qk_scale,
                                               window_left, BLOCK_M, BLOCK_N, CAUSAL, True, WINDOW)
            p_prev = gl.convert_layout(p.to(q_smem.dtype), p_layout)
        first = kv_lo + 1
    else:
        acc = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout))
        first = kv_lo
    unmasked_lo = first
    if WINDOW:
        # The blocks the window's left edge cuts: each needs the window mask.
        unmasked_lo = gl.maximum(gl.minimum(n_lead, n_blocks), first)
        acc, p_prev, m_i, l_i = _attend_blocks(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, acc, p_prev,
                                               m_i, l_i, k_desc, v_desc, b, kv_h, first, unmasked_lo, ring_origin,
                                               n_blocks, start_m, seq_k, diag_shift, qk_scale, window_left,
                                               BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, True, PRODUCER, OVERLAP,
                                               WINDOW, num_warps)
    masked_lo = gl.maximum(n_full, unmasked_lo)
    acc, p_prev, m_i, l_i = _attend_blocks(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, acc, p_prev, m_i,
                                           l_i, k_desc, v_desc, b, kv_h, unmasked_lo, masked_lo, ring_origin, n_blocks,
                                           start_m, seq_k, diag_shift, qk_scale, window_left, BLOCK_M, BLOCK_N,
                                           HEAD_DIM, STAGES, CAUSAL, False, PRODUCER, OVERLAP, WINDOW, num_warps)
    acc, p_prev, m_i, l_i = _attend_blocks(q_smem, k_bufs, v_bufs, k_ready, v_ready, kv_empty, acc, p_prev, m_i,
                                           l_i, k_desc, v_desc, b, kv_h, masked_lo, n_blocks, ring_origin, n_blocks,
                                           start_m, seq_k, diag_shift, qk_scale, window_left, BLOCK_M, BLOCK_N,
                                           HEAD_DIM, STAGES, CAUSAL, True, PRODUCER, OVERLAP, WINDOW, num_warps)
    if OVERLAP:
        if n_blocks > kv_lo:  # the last block's P V
            last = n_blocks - 1 - ring_origin
            mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
            acc = warpgroup_mma(p_prev, v_bufs.index(last % STAGES), acc)
    else:
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
    return acc, m_i, l_i


@gluon.jit
def _store_outputs(acc, m_i, l_i, o_smem, o_desc, Lse, b, h, pid_bh, start_m, seq_q,
                   BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr):
    """Normalise and store one query block: out through shared memory and a TMA store (clipped to the head's S_q
    rows), the base-2 lse with a row mask. Rows that saw no key: out 0, lse -inf."""
    o_layout: gl.constexpr = acc.type.layout
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    lse = gl.where(empty, float("-inf"), m_i + gl.log2(l_safe))
    rows = start_m + gl.arange(0, BLOCK_M, layout=lse.type.layout)
    gl.store(Lse + pid_bh.to(gl.int64) * seq_q + rows, lse, mask=rows < seq_q)
    out = acc * gl.expand_dims(gl.convert_layout(1.0 / l_safe, gl.SliceLayout(1, o_layout)), 1)
    # o_smem is Q's tile: every wgmma that read Q has completed, so it can take the output.
    o_smem.store(out.to(o_smem.dtype))
    fence_async_shared()
    tma_store(o_desc, [b, h, start_m, 0], _as_tma_tile(o_smem, BLOCK_M, HEAD_DIM))
    tma.store_wait(0)


@gluon.jit
def _window_blocks(start_m, seq_q, diag_shift, window_left, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   WINDOW: gl.constexpr):
    """(kv_lo, n_lead) of the query block starting at row ``start_m`` under a causal window (row r sees keys from
    r + diag_shift - window_left): no row sees a key block before kv_lo, and from block n_lead on every real row
    sees each block whole as far as the window goes (the blocks between need the window mask). (0, 0) without."""
    if WINDOW:
        last_row = gl.minimum(start_m + BLOCK_M, seq_q) - 1
        kv_lo = gl.maximum(start_m + diag_shift - window_left, 0) // BLOCK_N
        n_lead = gl.cdiv(gl.maximum(last_row + diag_shift - window_left, 0), BLOCK_N)
    else:
        kv_lo = 0
        n_lead = 0
    return kv_lo, n_lead


@gluon.jit
def _program_block(seq_q, num_heads, group_size, BLOCK_M: gl.constexpr, CAUSAL: gl.constexpr):
    # Grid: axis 0 query blocks, axis 1 batch * heads. Neighbouring programs share a head's keys in L2. With causal
    # masking later query blocks see more keys: they start first so that the short ones fill the tail.
    pid_m = gl.program_id(0)
    pid_bh = gl.program_id(1)
    if CAUSAL != 0:
        pid_m = gl.cdiv(seq_q, BLOCK_M) - 1 - pid_m
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    return pid_m * BLOCK_M, pid_bh, b, h, h // group_size


@gluon.jit
def _step1_tile(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                b, h, kv_h, pid_bh, start_m, seq_q, seq_k, diag_shift, kv_lo, n_lead, n_full, n_blocks, qk_scale,
                window_left, ring_origin, q_phase,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, WINDOW: gl.constexpr, num_warps: gl.constexpr):
    """Step 1's schedule for one query block (these warps issue the copies too): its Q copy, the ring's first
    STAGES - 1 key blocks, every key block it sees (``_attend``), then its outputs."""
    mbarrier.expect(q_ready, q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, start_m, 0], q_ready, _as_tma_tile(q_smem, BLOCK_M, HEAD_DIM))
    for i in gl.static_range(STAGES - 1):
        _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, kv_lo + i, ring_origin, n_blocks,
                  BLOCK_N, HEAD_DIM, STAGES)
    acc, m_i, l_i = _attend(q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, k_desc, v_desc, b, kv_h,
                            start_m, seq_k, diag_shift, kv_lo, n_lead, n_full, n_blocks, qk_scale, window_left,
                            ring_origin, q_phase, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False, OVERLAP, WINDOW,
                            num_warps)
    _store_outputs(acc, m_i, l_i, q_smem, o_desc, Lse, b, h, pid_bh, start_m, seq_q, BLOCK_M, HEAD_DIM)


# The integers are not specialized (no recompile for a length that happens to be 1 or a multiple of 16: the copy
# engine handles every bound, so nothing would gain from it), which keeps one compile per config, dtype and mode.
@gluon.jit(do_not_specialize=["num_heads", "group_size", "seq_q", "seq_k"])
def _attn_fwd(q_desc,  # [B, H, S_q, D] 16-bit, tiles [1, 1, BLOCK_M, D]
              k_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
              v_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
              o_desc,  # [B, H, S_q, D] dtype of q, tiles [1, 1, BLOCK_M, D]
              Lse,  # [B, H, S_q] float32, contiguous: base-2 log-sum-exp of the scaled scores
              num_heads, group_size, seq_q, seq_k, qk_scale,  # group_size = H // H_kv
              window_left,  # WINDOW: row i sees keys from i' - window_left (i' = i + diag_shift), >= 0
              HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, WINDOW: gl.constexpr, num_warps: gl.constexpr):
    """One query block of one (batch, head), step 1: one partition that also issues the copies. OVERLAP: block
    j's softmax overlaps block j - 1's P V (``_attend_blocks``). WINDOW (with CAUSAL != 0): a causal sliding window,
    whose key blocks before the window are never loaded."""
    gl.static_assert(CAUSAL != 0 or not WINDOW, "the window is a causal one (its right side is the diagonal)")
    start_m, pid_bh, b, h, kv_h = _program_block(seq_q, num_heads, group_size, BLOCK_M, CAUSAL)
    q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty = _ring(q_desc.dtype, BLOCK_M, BLOCK_N, HEAD_DIM,
                                                                        STAGES)
    diag_shift, n_full, n_blocks = _key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    kv_lo, n_lead = _window_blocks(start_m, seq_q, diag_shift, window_left, BLOCK_M, BLOCK_N, WINDOW)
    _step1_tile(q_desc, k_desc, v_desc, o_desc, Lse, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                b, h, kv_h, pid_bh, start_m, seq_q, seq_k, diag_shift, kv_lo, n_lead, n_full, n_blocks, qk_scale,
                window_left, kv_lo, 0, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, WINDOW, num_warps)
    _invalidate_ring(q_ready, k_ready, v_ready, kv_empty, STAGES)


# ----------------------------------------------------------------------------------------------------------------
# Step 3's partitions: two consumer warpgroups in ping-pong and a producer warp.
#
# A program covers 2 x BLOCK_M query rows of one (batch, head): consumer c (c = 0, 1; 4 warps each) owns rows
# [start_m + c * BLOCK_M, start_m + (c + 1) * BLOCK_M) with its own Q tile, accumulator and softmax state; both read
# the same key/value ring, which one producer warp fills. Consumer 0 is the default partition (the kernel's 4
# warps), consumer 1 and the producer are worker partitions; Triton pads the workers to two warpgroups (12 warps in
# all) and gives each consumer PINGPONG_CONSUMER_REGS registers per thread, the producer PRODUCER_REGS.
#
# Turns. Each consumer issues its wgmmas in turns: turn j (1 <= j < n) issues block j's S = Q K^T and block j - 1's
# O += P V together, turn 0 block 0's S alone, turn n block n - 1's P V alone (n = the consumer's key blocks;
# no turn at all when n = 0). The turns alternate, consumer 0 first: 0's turn k waits for 1's turn k - 1, 1's turn k
# waits for 0's turn k, so that while one warpgroup's wgmmas run on the tensor cores the other does its softmax.
# ``turns`` holds one mbarrier per consumer (count 1): after issuing a turn, consumer c arrives on the other's
# barrier; consumer 0's turn k waits for the k-th completion of its barrier, consumer 1's turn k for the
# (k + 1)-th. A consumer with more turns than the other stops waiting once the other has none left (it would
# never arrive): consumer 0 waits only for k <= T_1, consumer 1 only for k + 1 <= T_0 (T_c = consumer c's turns).
#
# Ring. Every slot has one "kv_empty" barrier per consumer (count 1): consumer c arrives on its own once its
# wgmmas have finished reading the block in the slot (for every block it reads, the last one included). Before
# filling slot j % STAGES with block j >= STAGES, the producer waits for the release of block j - STAGES by each
# consumer that reads it (c with j - STAGES < n_c), so a slot is refilled only after BOTH consumers are done with
# it, and a consumer that reads fewer blocks (the upper rows of a causal program read fewer keys; a warpgroup whose
# rows all lie past S_q reads none) holds nothing up.
#
# Why this cannot deadlock (STAGES >= 2): turn k of a consumer needs blocks k and k - 1 loaded and releases block
# k - 1 after it, so the producer, at block j, waits only for turns <= j - STAGES + 1 < j, whose loads it has
# issued; the consumers wait on each other only through the turns, and a cycle there would need 0 at turn k
# waiting for 1 to finish turn k - 1 while 1 is at turn k' <= k - 1 waiting for 0 to finish turn k' <= k - 1 < k,
# which 0 already has. The mbarrier parities are unambiguous because neither side of any barrier can run more
# than one phase ahead of the other (the producer waits on kv_empty before the load that the consumer's next
# arrival on it needs; each consumer's next turn needs the other's arrival).
#
# NAMED_BARRIERS (a constexpr of the kernel): the same turns and releases through the SM's hardware barriers
# (``bar.sync`` / ``bar.arrive``, inline PTX) instead of mbarriers. Why: Triton 3.6 puts a barrier of the whole
# partition (``bar.sync``) before every mbarrier arrive (one thread arrives, so its shared-memory analysis orders
# every thread's earlier accesses before it), and one before each block's first wait (after the previous block's
# wgmma wait). With a turn hand-over and a release per block that made three partition-wide barriers per block on
# top of the turn's own wait (the PTX shows them), and the warps stalled on them (Nsight Compute at case 6, D=128:
# 3.64 cycles of barrier stall per instruction, cuDNN's kernel 1.59). A hardware barrier touches no shared memory,
# so with them the PTX keeps the one barrier before each block's first wait.
# * Turns: consumer c's turn barrier is TURN_BARRIER + c, for 256 threads: its own 128 wait there (bar.sync), the
#   other's 128 arrive (bar.arrive, which does not block). Consumer 0 waits before turn k for 1 <= k <= T_1 and
#   consumer 1 arrives after its turn k - 1 exactly when consumer 0 will wait for turn k (k < T_0); consumer 1 waits
#   before turn k for k < T_0 and consumer 0 arrives after its turn k exactly then (k < T_1). Every arrival so has
#   its waiter and a barrier never holds two generations: an arrival for turn k + 1 comes after the other consumer's
#   turn k + 1, which waited for this one's wait for turn k to complete.
# * Releases: slot s's barrier is SLOT_BARRIER + s. Before loading block j >= STAGES the producer warp waits there
#   (bar.sync, 32 threads) with every warp of each consumer that reads block j - STAGES arriving (128 threads each,
#   each warp once it is past its own wgmma wait: no partition barrier needed); all agree on the count, 32 + 128 per
#   reading consumer. A consumer arrives for block b only when the producer will load block b + STAGES (b + STAGES
#   < max(n_0, n_1)), so no arrival is left over at the end, and it cannot arrive for block b + STAGES before the
#   generation of block b completed (block b + STAGES is loaded only after it).
# Ids: Triton's partitions use low ids for their own barriers (0 to 2 in this kernel's PTX; the compile test reads
# them and checks they stay below SLOT_BARRIER); these take 8 on.
PINGPONG_CONSUMER_REGS = gl.constexpr(240)
# maxnreg of the ping-pong kernel: 12 warps x 32 threads x 168 registers fit the 64 K registers of an SM; the
# default partition (consumer 0) gets what consumer 1's 240 and the producer group's 24 leave: 240.
PINGPONG_MAXNREG = 168
CONSUMER_WARPS = gl.constexpr(4)
SLOT_BARRIER = gl.constexpr(8)  # slot s: SLOT_BARRIER + s (STAGES <= 4)
TURN_BARRIER = gl.constexpr(14)  # consumer c's turns: TURN_BARRIER + c


@gluon.jit
def _pp_ring(dtype: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
             STAGES: gl.constexpr):
    """Shared memory of a ping-pong program: one Q tile per consumer (later its output tile), STAGES slots of key
    and value tiles, and their barriers, initialised: q_ready per consumer and k_ready, v_ready per slot (the copy
    engine completes them), kv_empty per consumer and slot (index c * STAGES + slot) and turns per consumer."""
    tile: gl.constexpr = _tile_layout()
    q_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_M, HEAD_DIM], tile)
    k_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile)
    v_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], tile)
    q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(2):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(turns.index(c), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
    for i in gl.static_range(2 * STAGES):
        mbarrier.init(kv_empty.index(i), count=1)
    fence_async_shared()
    return q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns


@gluon.jit
def _pp_invalidate(q_ready, k_ready, v_ready, kv_empty, turns, STAGES: gl.constexpr):
    for c in gl.static_range(2):
        mbarrier.invalidate(q_ready.index(c))
        mbarrier.invalidate(turns.index(c))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_ready.index(i))
        mbarrier.invalidate(v_ready.index(i))
    for i in gl.static_range(2 * STAGES):
        mbarrier.invalidate(kv_empty.index(i))


@gluon.jit
def _named_barrier(SYNC: gl.constexpr, barrier, threads, pred, WARPS: gl.constexpr):
    """Every thread of the calling WARPS warps executes ``bar.sync barrier, threads`` (SYNC) or ``bar.arrive``
    where ``pred`` holds (uniform across them). Gluon has no op for a hardware barrier, so this is inline PTX over
    a tensor of one element per thread."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    op: gl.constexpr = "bar.sync" if SYNC else "bar.arrive"
    zero = gl.full([32 * WARPS], 0, gl.int32, layout)
    operands = [zero + pred.to(gl.int32), zero + barrier, zero + threads]
    gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $1, 0; @p " + op + " $2, $3; mov.b32 $0, 0; }",
                              "=r,r,r,r", operands, dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _take_turn(turns, C: gl.constexpr, k, other_turns, NAMED: gl.constexpr):
    """Wait until consumer C may issue its turn k (see "Turns" above)."""
    if NAMED:
        if C == 0:
            _named_barrier(True, TURN_BARRIER, 256, (k >= 1) & (k <= other_turns), CONSUMER_WARPS)
        else:
            _named_barrier(True, TURN_BARRIER + 1, 256, k < other_turns, CONSUMER_WARPS)
    elif C == 0:
        mbarrier.wait(turns.index(0), (k & 1) ^ 1, pred=k <= other_turns)
    else:
        mbarrier.wait(turns.index(1), k & 1, pred=k < other_turns)


@gluon.jit
def _pass_turn(turns, C: gl.constexpr, k, other_turns, NAMED: gl.constexpr):
    """Consumer C has issued its turn k."""
    if NAMED:
        if C == 0:
            _named_barrier(False, TURN_BARRIER + 1, 256, k < other_turns, CONSUMER_WARPS)
        else:
            _named_barrier(False, TURN_BARRIER, 256, k + 1 < other_turns, CONSUMER_WARPS)
    else:
        mbarrier.arrive(turns.index(1 - C))


@gluon.jit
def _release(kv_empty, C: gl.constexpr, j, other_turns, n_blocks, STAGES: gl.constexpr, NAMED: gl.constexpr):
    """Consumer C is done with block j's slot (``n_blocks`` its own key blocks, ``other_turns`` the other's
    turns). With mbarriers every warp of the warpgroup must be past its wgmma wait before the one arriving thread
    signals (the partition's own barrier; each warp waits for its own wgmma groups); with named barriers every
    warp arrives for itself."""
    if NAMED:
        n_other = gl.maximum(other_turns - 1, 0)
        readers = gl.where(j < n_other, 2, 1)
        _named_barrier(False, SLOT_BARRIER + j % STAGES, 32 + 128 * readers,
                       j + STAGES < gl.maximum(n_blocks, n_other), CONSUMER_WARPS)
    else:
        thread_barrier()
        mbarrier.arrive(kv_empty.index(C * STAGES + j % STAGES))


@gluon.jit
def _pp_blocks(C: gl.constexpr, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, acc, p_prev, m_i, l_i,
               lo, hi, other_turns, start_m, seq_k, diag_shift, qk_scale,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
               CAUSAL: gl.constexpr, MASK: gl.constexpr, OVERLAP: gl.constexpr, NAMED: gl.constexpr, n_blocks):
    """Turns [lo, hi) of consumer C (lo >= 1): block j's S and block j - 1's P V issued in one turn, then block j's
    softmax. OVERLAP: only S is waited for before the softmax, block j - 1's P V runs under it (and then under the
    other consumer's turn too); without it both are waited for first. ``acc`` enters and leaves as registers
    without block hi - 1's P V, whose probabilities are ``p_prev``."""
    o_layout: gl.constexpr = _mma_layout(CONSUMER_WARPS, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    s_zero = _zero_scores(BLOCK_M, BLOCK_N, CONSUMER_WARPS)
    for j in range(lo, hi):
        slot = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(k_ready.index(slot), (j // STAGES) & 1)
        mbarrier.wait(v_ready.index(prev), ((j - 1) // STAGES) & 1)
        _take_turn(turns, C, j, other_turns, NAMED)
        s = warpgroup_mma(q_tile, k_bufs.index(slot).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        acc = warpgroup_mma(p_prev, v_bufs.index(prev), acc, is_async=True)
        _pass_turn(turns, C, j, other_turns, NAMED)
        if OVERLAP:
            s = warpgroup_mma_wait(1, deps=(s, ))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, start_m, seq_k, diag_shift, qk_scale, 0,
                                               BLOCK_M, BLOCK_N, CAUSAL, MASK, False)
            acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        else:
            s, acc, p_prev = warpgroup_mma_wait(0, deps=(s, acc, p_prev))
            p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, j, start_m, seq_k, diag_shift, qk_scale, 0,
                                               BLOCK_M, BLOCK_N, CAUSAL, MASK, False)
        _release(kv_empty, C, j - 1, other_turns, n_blocks, STAGES, NAMED)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
        p_prev = gl.convert_layout(p.to(q_tile.dtype), p_layout)
    return acc, p_prev, m_i, l_i


@gluon.jit
def _pp_consumer(C: gl.constexpr, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns, o_desc, Lse,
                 b, h, pid_bh, start_m, seq_q, seq_k, diag_shift, n_full, n_blocks, other_turns, qk_scale,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, NAMED: gl.constexpr):
    """Consumer C: every key block its rows see, in turns, then its output tile. ``start_m``, ``n_full`` and
    ``n_blocks`` are its own rows'; ``other_turns`` the number of turns the other consumer takes."""
    s_layout: gl.constexpr = _mma_layout(CONSUMER_WARPS, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(CONSUMER_WARPS, HEAD_DIM)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_tile = q_smem.index(C)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    if n_blocks > 0:
        mbarrier.wait(q_ready.index(C), 0)
        # Turn 0: block 0's S alone; its softmax takes the masks whichever kind of block it is.
        mbarrier.wait(k_ready.index(0), 0)
        _take_turn(turns, C, 0, other_turns, NAMED)
        s = warpgroup_mma(q_tile, k_bufs.index(0).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        _pass_turn(turns, C, 0, other_turns, NAMED)
        s = warpgroup_mma_wait(0, deps=(s, ))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, 0, start_m, seq_k, diag_shift, qk_scale, 0,
                                           BLOCK_M, BLOCK_N, CAUSAL, True, False)
        p_prev = gl.convert_layout(p.to(q_tile.dtype), p_layout)
        acc, p_prev, m_i, l_i = _pp_blocks(C, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, acc,
                                           p_prev, m_i, l_i, 1, n_full, other_turns, start_m, seq_k, diag_shift,
                                           qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, False, OVERLAP,
                                           NAMED, n_blocks)
        acc, p_prev, m_i, l_i = _pp_blocks(C, q_tile, k_bufs, v_bufs, k_ready, v_ready, kv_empty, turns, acc,
                                           p_prev, m_i, l_i, gl.maximum(n_full, 1), n_blocks, other_turns, start_m,
                                           seq_k, diag_shift, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL,
                                           True, OVERLAP, NAMED, n_blocks)
        # Turn n_blocks: the last block's P V alone.
        last = n_blocks - 1
        mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
        _take_turn(turns, C, n_blocks, other_turns, NAMED)
        acc = warpgroup_mma(p_prev, v_bufs.index(last % STAGES), acc, is_async=True)
        _pass_turn(turns, C, n_blocks, other_turns, NAMED)
        acc, p_prev = warpgroup_mma_wait(0, deps=(acc, p_prev))
        _release(kv_empty, C, last, other_turns, n_blocks, STAGES, NAMED)
    if start_m < seq_q:
        _store_outputs(acc, m_i, l_i, q_tile, o_desc, Lse, b, h, pid_bh, start_m, seq_q, BLOCK_M, HEAD_DIM)


@gluon.jit
def _pp_producer(q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                 b, h, kv_h, start_m, n_blocks_0, n_blocks_1,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                 NAMED: gl.constexpr):
    """One warp: each consumer's Q tile (only for a consumer with key blocks to read: one whose rows all lie past
    S_q never waits for it), then every key/value block either consumer reads, block j into slot j % STAGES once
    each consumer that read block j - STAGES has released it."""
    for c in gl.static_range(2):
        pred = (n_blocks_1 if c == 1 else n_blocks_0) > 0
        mbarrier.expect(q_ready.index(c), q_desc.block_type.nbytes, pred=pred)
        tma_load(q_desc, [b, h, start_m + c * BLOCK_M, 0], q_ready.index(c),
                                        _as_tma_tile(q_smem.index(c), BLOCK_M, HEAD_DIM), pred=pred)
    n_blocks = gl.maximum(n_blocks_0, n_blocks_1)
    for j in range(n_blocks):
        slot = j % STAGES
        if NAMED:
            # The release of block j - STAGES by every consumer that read it (none to wait for in round 0).
            readers = (j - STAGES < n_blocks_0).to(gl.int32) + (j - STAGES < n_blocks_1).to(gl.int32)
            _named_barrier(True, SLOT_BARRIER + slot, 32 + 128 * readers, (j >= STAGES) & (readers > 0), 1)
        else:
            # Round 0 passes at once (a fresh mbarrier counts as having completed the phase before its first).
            phase = ((j // STAGES) & 1) ^ 1
            mbarrier.wait(kv_empty.index(slot), phase, pred=j - STAGES < n_blocks_0)
            mbarrier.wait(kv_empty.index(STAGES + slot), phase, pred=j - STAGES < n_blocks_1)
        _issue_kv(k_desc, v_desc, k_bufs, v_bufs, k_ready, v_ready, b, kv_h, j, 0, n_blocks, BLOCK_N, HEAD_DIM,
                  STAGES)


@gluon.jit(do_not_specialize=["num_heads", "group_size", "seq_q", "seq_k"])
def _attn_fwd_pingpong(q_desc,  # [B, H, S_q, D] 16-bit, tiles [1, 1, BLOCK_M, D] (one consumer's rows)
                       k_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                       v_desc,  # [B, H_kv, S_k, D], tiles [1, 1, BLOCK_N, D]
                       o_desc,  # [B, H, S_q, D] dtype of q, tiles [1, 1, BLOCK_M, D]
                       Lse,  # [B, H, S_q] float32, contiguous: base-2 log-sum-exp of the scaled scores
                       num_heads, group_size, seq_q, seq_k, qk_scale,  # group_size = H // H_kv
                       HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                       CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, NAMED_BARRIERS: gl.constexpr,
                       num_warps: gl.constexpr):
    """Step 3: 2 x BLOCK_M query rows of one (batch, head) per program, two consumer warpgroups in ping-pong and a
    TMA producer warp (launch with num_warps = 4 and maxnreg = PINGPONG_MAXNREG; grid axis 0: cdiv(S_q,
    2 * BLOCK_M)). OVERLAP: inside each warpgroup too, block j's softmax overlaps block j - 1's P V.
    NAMED_BARRIERS: turns and slot releases through hardware named barriers instead of mbarriers (see above)."""
    gl.static_assert(num_warps == CONSUMER_WARPS, "the ping-pong kernel's default partition is one warpgroup")
    gl.static_assert(STAGES >= 2, "a turn holds two slots: block j's keys and block j - 1's values")
    gl.static_assert(STAGES <= TURN_BARRIER - SLOT_BARRIER, "one named barrier per slot, below the turns' ids")
    start_m, pid_bh, b, h, kv_h = _program_block(seq_q, num_heads, group_size, 2 * BLOCK_M, CAUSAL)
    q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns = _pp_ring(q_desc.dtype, BLOCK_M, BLOCK_N,
                                                                                  HEAD_DIM, STAGES)
    diag_shift, _, _ = _key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    start_1 = start_m + BLOCK_M
    n_full_0, n_blocks_0 = _consumer_key_blocks(start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    n_full_1, n_blocks_1 = _consumer_key_blocks(start_1, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL)
    # Turns per consumer: one per key block and one for the last P V (none without key blocks).
    turns_0 = gl.where(n_blocks_0 > 0, n_blocks_0 + 1, 0)
    turns_1 = gl.where(n_blocks_1 > 0, n_blocks_1 + 1, 0)
    gl.warp_specialize([
        (_pp_consumer, (0, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns, o_desc, Lse, b, h,
                        pid_bh, start_m, seq_q, seq_k, diag_shift, n_full_0, n_blocks_0, turns_1, qk_scale,
                        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, NAMED_BARRIERS)),
        (_pp_consumer, (1, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty, turns, o_desc, Lse, b, h,
                        pid_bh, start_1, seq_q, seq_k, diag_shift, n_full_1, n_blocks_1, turns_0, qk_scale,
                        BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, CAUSAL, OVERLAP, NAMED_BARRIERS)),
        (_pp_producer, (q_desc, k_desc, v_desc, q_smem, k_bufs, v_bufs, q_ready, k_ready, v_ready, kv_empty,
                        b, h, kv_h, start_m, n_blocks_0, n_blocks_1, BLOCK_M, BLOCK_N, HEAD_DIM, STAGES,
                        NAMED_BARRIERS)),
    ], [CONSUMER_WARPS, 1], [PINGPONG_CONSUMER_REGS, PRODUCER_REGS])
    _pp_invalidate(q_ready, k_ready, v_ready, kv_empty, turns, STAGES)
