"""Forward kernel of flashlite's attention: online softmax over key blocks, scores never leave the chip.

One program computes a block of BLOCK_M query rows of one (batch, head) pair, or of BH_PER_PROGRAM pairs one after
another (a tuning choice for short sequences, where one block is little work): the query tile stays in registers
while key and value tiles of BLOCK_N rows stream through, with a running row maximum ``m``, running sum ``l``
and unnormalised accumulator ``acc`` in float32. Scores are kept in base 2: ``qk_scale = scale * log2(e)`` is
folded into the dot product so the softmax uses ``exp2``. The output is normalised once at the end, and the
log-sum-exp is stored for the backward pass, also in base 2:

    lse[b, h, i] = log2(sum_j 2 ** (scale * log2(e) * q_i . k_j))      (= natural log-sum-exp * log2(e))

A row that sees no key (everything masked) has l = 0: its output is 0 and its lse is -inf. With SOFTCAP or ALIBI the
lse is that of the transformed scores (capped, biased), which is what the backward recomputes P from.

Parameter conventions (``CAUSAL``, ``KEY_MASK``, ``DOT``, offsets, bucket keys, the ``WINDOW``, ``SOFTCAP`` and
``ALIBI`` variants): see ``attention_common``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashlite import _runtime
from flashlite.kernels.attention_common import (cast_out, key_range, load_cols, load_rows, load_rows_where, mma,
                                                program_ids, skip_hidden_prefix, tanh, variant_scalars,
                                                varlen_sequence)
from flashlite.kernels.tuning import AUTOTUNE_KEY, SCRATCH_BYTES, even_m, make_configs, prune_by_resources


@triton.jit
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,  # k_base, v_base: one (b, kv head); mask_row: [S_k]
                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                    offs_m, offs_d, start, end, n_len, diag_shift, qk_scale,
                    first, window_left, window_right, softcap2, slope2,
                    table_row, stride_kb, stride_vb,  # PAGE_SIZE: the batch entry's row of the block table
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr, DOT: tl.constexpr, BOUNDARY: tl.constexpr,
                    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Fold key blocks [start, end) into the running softmax. BOUNDARY: the blocks may cross the causal diagonal,
    a window edge or the key length, so apply those masks; blocks outside that need no mask at all. ``first``: the
    first key any row of the block sees (WINDOW); ``softcap2``, ``slope2``: softcap and ALiBi slope in base 2."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        if KEY_MASK == "bool":
            keep = tl.load(mask_row + offs_n * stride_mask_n, mask=offs_n < n_len, other=0) != 0
        if PAGE_SIZE != 0:
            # A paged cache: key j lives at row j % PAGE_SIZE of block table_row[j // PAGE_SIZE].
            page = tl.load(table_row + offs_n // PAGE_SIZE, mask=offs_n < n_len, other=0).to(tl.int64)
            k_rows = page * stride_kb + (offs_n % PAGE_SIZE) * stride_kn
            v_rows = page * stride_vb + (offs_n % PAGE_SIZE) * stride_vn
            kt = load_cols(k_base + k_rows[None, :] + offs_d[:, None] * stride_kd,
                           offs_d, HEAD_DIM, BLOCK_D, offs_n, n_len, BOUNDARY)
        else:
            kt = load_cols(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                           offs_d, HEAD_DIM, BLOCK_D, offs_n, n_len, BOUNDARY)
        scores = mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
        if BOUNDARY or KEY_MASK == "bool" or SOFTCAP or ALIBI:
            qk = scores * qk_scale
            # The score transforms come before every mask, as the semantics order them. In base 2 the cap is
            # softcap * log2(e): c * tanh(s / c) * log2(e) = c2 * tanh(qk / c2) with qk = s * log2(e).
            if SOFTCAP:
                qk = softcap2 * tanh(qk * (1.0 / softcap2))
            if ALIBI:
                qk = qk - slope2 * tl.abs(offs_m[:, None] + diag_shift - offs_n[None, :]).to(tl.float32)
            # Masks are applied with `where`, never added: a hidden key may hold NaN or inf (a cache filled past
            # its end), and NaN + -inf is NaN. A hidden key's score only ever reaches its own column.
            if BOUNDARY:
                visible = offs_n[None, :] < n_len
                if CAUSAL != 0:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift)
                if WINDOW:
                    visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_shift - window_left)
                    if CAUSAL == 0:  # with causal, the diagonal is the tighter right side
                        visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift + window_right)
                qk = tl.where(visible, qk, float("-inf"))
            if KEY_MASK == "bool":
                qk = tl.where(keep[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            # A row that has seen only masked keys keeps m = -inf; subtracting 0 instead avoids inf - inf = NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(qk - m_ref[:, None])
        else:
            # Unmasked block: every score is finite. The row maximum is taken on the raw scores and scaled once per
            # row, so each element costs one fused multiply-add before exp2 instead of a multiply and a subtract.
            if qk_scale >= 0:
                block_max = tl.max(scores, 1) * qk_scale
            else:
                block_max = tl.min(scores, 1) * qk_scale
            m_new = tl.maximum(m_i, block_max)
            m_ref = m_new
            p = tl.math.exp2(scores * qk_scale - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        # Values, unlike scores, are summed across keys: p = 0 times a NaN value is NaN in every row of the tile.
        # So the values of keys no row of this block may see load as zeros (the copy fills them, which costs
        # nothing): keys past `end` (the key length, or the causal frontier of the block's last row in the
        # boundary loop), keys before `first` (left of every row's window) and keys the boolean mask hides.
        if PAGE_SIZE != 0:
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :] * stride_vd
        else:
            v_ptrs = v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd
        if KEY_MASK == "bool":
            if WINDOW and BOUNDARY:
                v = load_rows_where(v_ptrs, keep & (offs_n < end) & (offs_n >= first), offs_d, HEAD_DIM, BLOCK_D)
            else:
                v = load_rows_where(v_ptrs, keep & (offs_n < end), offs_d, HEAD_DIM, BLOCK_D)
        else:
            if WINDOW and BOUNDARY:
                v = load_rows_where(v_ptrs, (offs_n < end) & (offs_n >= first), offs_d, HEAD_DIM, BLOCK_D)
            else:
                v = load_rows(v_ptrs, offs_n, end, offs_d, HEAD_DIM, BLOCK_D, BOUNDARY)
        acc = mma(p, v, acc * alpha[:, None], DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd(Q,  # [B, H, S_q, D], any strides
              K,  # [B, H_kv, S_k, D], any strides
              V,  # [B, H_kv, S_k, D], any strides
              Out,  # [B, H, S_q, D], dtype of Q
              Lse,  # [B, H, S_q] float32, contiguous; base-2 log-sum-exp of the scaled scores (unused: STORE_LSE off)
              KeyMask,  # [B, S_k] uint8 when KEY_MASK == "bool" (else unused)
              KeyLen,  # [B] int32/int64 when KEY_MASK == "lengths" (else unused)
              KeyStart,  # [B] int32/int64 when KEY_MASK == "bool": first nonzero of each KeyMask row, 0 if none
              Alibi,  # [B, H] or [H] float32 slopes when ALIBI (else unused); [H]: stride_alibi_b = 0
              CuSeqQ,  # [B + 1] int32 starts of the packed sequences in q's token axis when VARLEN (else unused)
              CuSeqK,  # [B + 1] int32 starts of the packed sequences in k's and v's token axis when VARLEN
              BlockTable,  # [B, max blocks] int32 when PAGE_SIZE: K, V are [blocks, H_kv, PAGE_SIZE, D] caches
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_mask_b, stride_mask_n,
              stride_alibi_b, stride_alibi_h, stride_table_b,
              num_heads, group_size, seq_q, seq_k, qk_scale, batch_heads,
              window_left, window_right,  # >= 0 when WINDOW (the launcher turns -1 into a side past every key)
              softcap,  # c > 0 when SOFTCAP, natural units
              SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET,  # autotuning keys only
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
              DOT: tl.constexpr, FLAT_GRID: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, BH_PER_PROGRAM: tl.constexpr = 1,
              STORE_LSE: tl.constexpr = True, WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False,
              ALIBI: tl.constexpr = False, VARLEN: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 0,
              NUM_SPLITS: tl.constexpr = 1):
    # Grid: axis 0 query blocks, axis 1 groups of BH_PER_PROGRAM (batch, head) pairs; flattened into axis 0 when
    # the groups exceed axis 1's limit. Several pairs per program give short sequences, whose programs are tiny,
    # more work per launch slot; the autotuner decides where that pays.
    # Split-KV (NUM_SPLITS > 1, decoding): axis 0 holds NUM_SPLITS programs per query block, each folding one
    # contiguous share of the block's keys; Out and Lse are then float32 partials [NUM_SPLITS, B, H, S_q, D] and
    # [NUM_SPLITS, B, H, S_q] (contiguous), merged by _attn_fwd_combine.
    num_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m, pid_group = program_ids(num_m_blocks * NUM_SPLITS, FLAT_GRID)
    if NUM_SPLITS > 1:  # (the share itself: _attn_fwd_block reads it from the program id)
        split = pid_m % NUM_SPLITS
        pid_m = pid_m // NUM_SPLITS
        Out += split.to(tl.int64) * (batch_heads // num_heads) * stride_ob
        Lse += split.to(tl.int64) * batch_heads * seq_q
    if CAUSAL != 0:
        # Later query blocks see more keys; launch them first so the short ones fill the tail.
        pid_m = num_m_blocks - 1 - pid_m
    if BH_PER_PROGRAM == 1:
        _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen, KeyStart, Alibi, CuSeqQ, CuSeqK, BlockTable,
                        stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                        stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                        stride_mask_b, stride_mask_n, stride_alibi_b, stride_alibi_h, stride_table_b, num_heads,
                        group_size, seq_q,
                        seq_k, qk_scale, window_left, window_right, softcap,
                        pid_m, pid_group, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, BLOCK_M, BLOCK_N, EVEN_M,
                        STORE_LSE, WINDOW, SOFTCAP, ALIBI, VARLEN, PAGE_SIZE, NUM_SPLITS, FLAT_GRID)
    else:
        for i in tl.static_range(BH_PER_PROGRAM):
            pid_bh = pid_group * BH_PER_PROGRAM + i
            if pid_bh < batch_heads:
                _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen, KeyStart, Alibi, CuSeqQ, CuSeqK, BlockTable,
                                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                                stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh,
                                stride_om, stride_od, stride_mask_b, stride_mask_n, stride_alibi_b, stride_alibi_h,
                                stride_table_b,
                                num_heads, group_size, seq_q, seq_k, qk_scale, window_left, window_right, softcap,
                                pid_m, pid_bh, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, BLOCK_M,
                                BLOCK_N, EVEN_M, STORE_LSE, WINDOW, SOFTCAP, ALIBI, VARLEN, PAGE_SIZE, NUM_SPLITS,
                                FLAT_GRID)


@triton.jit
def _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen, KeyStart, Alibi, CuSeqQ, CuSeqK, BlockTable,  # as in _attn_fwd
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_mask_b, stride_mask_n, stride_alibi_b, stride_alibi_h, stride_table_b,
                    num_heads, group_size, seq_q, seq_k, qk_scale, window_left, window_right, softcap, pid_m, pid_bh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
                    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                    STORE_LSE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                    VARLEN: tl.constexpr, PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr = 1,
                    FLAT_GRID: tl.constexpr = False):
    """Query block ``pid_m`` of the (batch, head) pair ``pid_bh``: output rows and, with STORE_LSE (needed only
    for a backward pass, and for split-KV partials), their log-sum-exp. With VARLEN, b is a packed sequence (see
    ``varlen_sequence``). With NUM_SPLITS > 1, only this program's share of the key blocks the rows visit (the
    share's index comes from the program id as _attn_fwd lays it out), each share a whole number of blocks, so
    that the unmasked blocks stay unmasked."""
    if NUM_SPLITS > 1:
        split = program_ids(tl.cdiv(seq_q, BLOCK_M) * NUM_SPLITS, FLAT_GRID)[0] % NUM_SPLITS
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size
    start_m = pid_m * BLOCK_M
    lse_row_len = seq_q  # the lse's rows are seq_q long; for packed sequences the padded maximum
    if VARLEN:
        q_start, k_start, seq_q, seq_k = varlen_sequence(CuSeqQ, CuSeqK, b)
        Q, Out = Q + q_start.to(tl.int64) * stride_qm, Out + q_start.to(tl.int64) * stride_om
        K, V = K + k_start.to(tl.int64) * stride_kn, V + k_start.to(tl.int64) * stride_vn
        seq_k = tl.where(start_m < seq_q, seq_k, 0)  # a query block past its sequence's end visits no key

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    mask_row = KeyMask + b.to(tl.int64) * stride_mask_b
    table_row = BlockTable
    if PAGE_SIZE != 0:  # the batch stride of K and V is their block stride: blocks are found through the table
        k_base = K + kv_h.to(tl.int64) * stride_kh
        v_base = V + kv_h.to(tl.int64) * stride_vh
        table_row = BlockTable + b.to(tl.int64) * stride_table_b

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)

    n_len, diag_shift, first, lo, full_start, full_end, hi = key_range(
        KeyLen, b, start_m, seq_q, seq_k, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, KEY_MASK, WINDOW)
    if KEY_MASK == "bool":
        lo, full_start, full_end, hi = skip_hidden_prefix(KeyStart, b, lo, full_start, full_end, hi, BLOCK_N)
    softcap2, slope2 = variant_scalars(Alibi, b, h, stride_alibi_b, stride_alibi_h, softcap, qk_scale, SOFTCAP,
                                       ALIBI)
    if NUM_SPLITS > 1:
        # The visited keys [lo, hi) in NUM_SPLITS shares of whole blocks (lo is a block multiple); every range
        # clipped to this program's share keeps its order, and only the last nonempty share ends off a block.
        share = tl.cdiv(tl.cdiv(hi - lo, BLOCK_N), NUM_SPLITS) * BLOCK_N
        share_lo = lo + split * share
        share_hi = tl.maximum(tl.minimum(share_lo + share, hi), share_lo)
        full_start = tl.minimum(tl.maximum(full_start, share_lo), share_hi)
        full_end = tl.minimum(tl.maximum(full_end, share_lo), share_hi)
        lo, hi = share_lo, share_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:
        # Blocks that cross the window's left edge (for some rows), before the ones every row sees whole.
        acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,
                                        stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                        offs_m, offs_d, lo, full_start, n_len, diag_shift, qk_scale,
                                        first, window_left, window_right, softcap2, slope2,
                                        table_row, stride_kb, stride_vb,
                                        BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, True,
                                        WINDOW, SOFTCAP, ALIBI, PAGE_SIZE)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,
                                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                    offs_m, offs_d, full_start, full_end, n_len, diag_shift, qk_scale,
                                    first, window_left, window_right, softcap2, slope2,
                                    table_row, stride_kb, stride_vb,
                                    BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, False,
                                    WINDOW, SOFTCAP, ALIBI, PAGE_SIZE)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,
                                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                    offs_m, offs_d, full_end, hi, n_len, diag_shift, qk_scale,
                                    first, window_left, window_right, softcap2, slope2,
                                    table_row, stride_kb, stride_vb,
                                    BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, True,
                                    WINDOW, SOFTCAP, ALIBI, PAGE_SIZE)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))

    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    lse_ptrs = Lse + pid_bh.to(tl.int64) * lse_row_len + offs_m
    out = cast_out(out, Out.dtype.element_ty, DOT)
    if EVEN_M:
        if STORE_LSE:
            tl.store(lse_ptrs, lse)
        if BLOCK_D == HEAD_DIM:
            tl.store(o_ptrs, out)
        else:
            tl.store(o_ptrs, out, mask=offs_d[None, :] < HEAD_DIM)
    else:
        if STORE_LSE:
            tl.store(lse_ptrs, lse, mask=offs_m < seq_q)
        tl.store(o_ptrs, out, mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _attn_fwd_combine(OutPart,  # [NUM_SPLITS, rows, HEAD_DIM] float32, contiguous: split-KV partial outputs
                      LsePart,  # [NUM_SPLITS, rows] float32: their base-2 log-sum-exps (-inf: a share saw no key)
                      Out,  # [rows, HEAD_DIM], rows contiguous (an [B, H, S_q, D] contiguous output), dtype of q
                      Lse,  # [rows] float32 when STORE_LSE (else unused)
                      rows,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
                      NUM_SPLITS: tl.constexpr, STORE_LSE: tl.constexpr, DOT: tl.constexpr):
    """Merge split-KV partials: each share's output is normalised by its own sum, so the row's output is their
    average weighted by 2 ** lse_s, and its lse the base-2 log of the summed weights. A row no share saw stays
    0 with lse -inf."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    in_rows = offs_r < rows
    tile = in_rows[:, None] & (offs_d[None, :] < HEAD_DIM)
    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        m = tl.maximum(m, tl.load(LsePart + s * rows + offs_r, mask=in_rows, other=float("-inf")))
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    weights = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        weight = tl.math.exp2(tl.load(LsePart + s * rows + offs_r, mask=in_rows, other=float("-inf")) - m_safe)
        part = tl.load(OutPart + (s * rows + offs_r[:, None]).to(tl.int64) * HEAD_DIM + offs_d[None, :],
                       mask=tile, other=0.0)
        acc += weight[:, None] * part
        weights += weight
    empty = weights == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, weights))[:, None]
    tl.store(Out + offs_r[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
             cast_out(out, Out.dtype.element_ty, DOT), mask=tile)
    if STORE_LSE:
        tl.store(Lse + offs_r, tl.where(empty, float("-inf"), m_safe + tl.math.log2(tl.where(empty, 1.0, weights))),
                 mask=in_rows)


# ----------------------------------------------------------------------------------------------------------------
# Autotuning: the forward's configurations, its pruning, and the tuned entry point.

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on a GPU, most promising first: with autotuning off
# (FLASHLITE_AUTOTUNE=0) the first one that fits is used. Large tiles suit D <= 128; the pruning below drops what
# cannot fit shared memory or registers at large head dims, and the last entry fits everything up to D=256 fp32.
FWD_GPU_BLOCKS = [
    (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 4), (64, 128, 4, 3),
    (64, 32, 4, 2),
    # Two stages leave room for 128-row key tiles at D=128 (three stages of them do not fit shared memory).
    (128, 128, 8, 2), (128, 64, 8, 2),
    # A fifth entry: (batch, head) pairs per program (BH_PER_PROGRAM), tried for short sequences only.
    (128, 64, 4, 3, 2), (64, 64, 4, 3, 2), (128, 64, 4, 3, 4), (64, 64, 4, 3, 4),
]
# Sequences (bucketed) up to this length also try several (batch, head) pairs per program.
MULTI_PAIR_MAX_SEQ = 256
# Decoding: a handful of query rows (one per head of a grouped-query group, or a short chunk) against a long cache.
# The rows fill at most 16 of a block, so the usual 64- and 128-row blocks would spend 4-8x the tensor-core work of
# the cache's bytes; 16-row blocks keep such calls memory-bound. Tried only, and first, where SEQ_Q_BUCKET <= 16.
# The last fits every head dim and dtype (D=256 float32 included), as the pruning's fallback.
FWD_DECODE_BLOCKS = [(16, 128, 4, 3), (16, 64, 4, 4), (16, 256, 8, 2), (16, 128, 4, 4), (16, 32, 4, 2)]
DECODE_MAX_SEQ = 16
# Under the interpreter autotuning would only cost time; one small config, with unequal blocks on purpose so that
# CPU tests exercise the diagonal logic where BLOCK_M != BLOCK_N.
FWD_INTERPRETER_BLOCKS = [(32, 16, 4, 1)]


def fwd_configs() -> list[triton.Config]:
    """Forward configs for where the kernels run: the GPU lists, or the single interpreter config."""
    return make_configs(FWD_INTERPRETER_BLOCKS if _runtime.interpreting() else FWD_DECODE_BLOCKS + FWD_GPU_BLOCKS)


def prune_fwd_configs(configs, named_args, **kwargs):
    seq_q_bucket = named_args.get("SEQ_Q_BUCKET", MULTI_PAIR_MAX_SEQ + 1)
    # Decoding blocks only for decoding-sized queries, and there only them (the first is what autotuning-off takes).
    decode = {tuple(block) for block in FWD_DECODE_BLOCKS}
    is_decode = ["BH_PER_PROGRAM" not in c.kwargs
                 and (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in decode for c in configs]
    if seq_q_bucket <= DECODE_MAX_SEQ and any(is_decode):
        configs = [c for c, decoding in zip(configs, is_decode) if decoding]
    else:
        configs = [c for c, decoding in zip(configs, is_decode) if not decoding]
    # Several (batch, head) pairs per program only where a sequence gives each program little work.
    short = seq_q_bucket <= MULTI_PAIR_MAX_SEQ
    configs = [c for c in configs if short or c.kwargs.get("BH_PER_PROGRAM", 1) == 1]
    return prune_by_resources(configs, named_args, streamed=("BLOCK_N", "BLOCK_M"), resident="BLOCK_M",
                              scratch=SCRATCH_BYTES, **kwargs)


# The kernel with EVEN_M derived from the block size; launch it directly to force a config.
attn_fwd_fixed = even_m(_attn_fwd)
# The autotuned entry point the launcher uses. Tensor dtypes join the key automatically.
attn_fwd = triton.autotune(configs=fwd_configs(), key=AUTOTUNE_KEY,
                           prune_configs_by={"early_config_prune": prune_fwd_configs})(attn_fwd_fixed)
