"""Backward kernels of flashlite's attention, recomputing probabilities from the forward's base-2 log-sum-exp.

With P = softmax(scale * Q K^T) recomputed tile by tile as ``exp2(qk_scale * q.k - lse)``:

    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - delta),   dQ = scale * dS K,   dK = scale * dS^T Q,
    where delta_i = sum_d dO_id * O_id.

``_attn_bwd_dq`` runs first: one program per query block per (batch, head), which computes its rows' delta from
the resident dO and the forward's output, stores it, and loops over key blocks. ``_attn_bwd_dkdv`` then runs one
program per key block per (batch, kv head) and loops over the query blocks of every query head of its group
(reading their delta), so grouped-query attention needs no atomics. ``_attn_bwd_delta`` computes delta alone, for
the Gluon backward kernels (``attention_bwd_gluon``), whose dQ kernel does not. Masked keys and rows that see no
key (lse = -inf, read as +inf so that P = 0) get exactly zero gradient. Mask, causal, variant and precision
conventions: see ``attention_common``.

Variants: P is recomputed from the same transformed scores as the forward's (capped, then ALiBi-biased), so the
forward's lse normalises it. ALiBi adds a constant per (row, key), which has no derivative; the softcap's does:
d(c tanh(s / c))/ds = 1 - tanh^2, so dS = P * (dP - delta) * (1 - tanh^2). Windows mask like causal.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashlite import _runtime
from flashlite.kernels.attention_common import (cast_out, key_range, load_cols, load_cols_where, load_rows,
                                                load_rows_where, mma, program_ids, skip_hidden_prefix, tanh,
                                                variant_scalars, varlen_sequence, window_shift_and_right)
from flashlite.kernels.tuning import AUTOTUNE_KEY_BACKWARD, SCRATCH_BYTES, even_m, make_configs, prune_by_resources


@triton.jit
def _attn_bwd_delta(Out,  # [B, H, S_q, D]
                    dOut,  # [B, H, S_q, D]
                    Delta,  # [B, H, S_q] float32, contiguous
                    CuSeqQ,  # [B + 1] int32 starts of the packed sequences when VARLEN (else unused)
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_dob, stride_doh, stride_dom, stride_dod,
                    num_heads, seq_q,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, FLAT_GRID: tl.constexpr,
                    BLOCK_M: tl.constexpr, VARLEN: tl.constexpr = False):
    num_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m, pid_bh = program_ids(num_m_blocks, FLAT_GRID)
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    row_len = seq_q  # rows of Delta: the padded maximum for packed sequences
    if VARLEN:
        q_start, _, seq_q, _ = varlen_sequence(CuSeqQ, CuSeqQ, b)
        Out, dOut = Out + q_start.to(tl.int64) * stride_om, dOut + q_start.to(tl.int64) * stride_dom
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o = load_rows(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                  offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_rows(dOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                   + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + pid_bh.to(tl.int64) * row_len + offs_m, delta, mask=offs_m < seq_q)


@triton.jit
def _load_lse(Lse, offs_m, seq_q, CHECK_ROWS: tl.constexpr):
    """Base-2 lse of a query block; rows past seq_q and rows that saw no key read +inf so that exp2(s - lse) = 0."""
    if CHECK_ROWS:
        lse = tl.load(Lse + offs_m, mask=offs_m < seq_q, other=float("inf"))
    else:
        lse = tl.load(Lse + offs_m)
    return tl.where(lse == float("-inf"), float("inf"), lse)


@triton.jit
def _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, lse_row, delta_row,  # *_row: [S_q] of one (b, h)
                         stride_qm, stride_qd, stride_dom, stride_dod,
                         offs_n, offs_d, start, end, seq_q, diag_shift, qk_scale,
                         window_left, window_right, softcap2, slope2,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr, CAUSAL_BLOCKS: tl.constexpr, KEY_MASK: tl.constexpr,
                         DOT: tl.constexpr, EVEN_M: tl.constexpr, CAUSAL: tl.constexpr = 0,
                         WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False):
    """Accumulate dK, dV of one key block over query blocks [start, end). CAUSAL_BLOCKS: they cross the diagonal
    (or, with WINDOW, a window edge), so mask; ``softcap2``, ``slope2`` in base 2 as in the forward."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        q = load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                      offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
        do = load_rows(do_base + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                       offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
        lse = _load_lse(lse_row, offs_m, seq_q, not EVEN_M)
        if EVEN_M:
            delta = tl.load(delta_row + offs_m)
        else:
            delta = tl.load(delta_row + offs_m, mask=offs_m < seq_q, other=0.0)
        qk_t = mma(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT) * qk_scale
        if SOFTCAP:
            tanh_t = tanh(qk_t * (1.0 / softcap2))
            qk_t = softcap2 * tanh_t
        if ALIBI:
            qk_t = qk_t - slope2 * tl.abs(offs_m[None, :] + diag_shift - offs_n[:, None]).to(tl.float32)
        p_t = tl.math.exp2(qk_t - lse[None, :])
        if CAUSAL_BLOCKS:
            if WINDOW:
                visible = offs_n[:, None] >= offs_m[None, :] + diag_shift - window_left
                if CAUSAL != 0:
                    visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag_shift)
                else:
                    visible = visible & (offs_n[:, None] <= offs_m[None, :] + diag_shift + window_right)
                p_t = tl.where(visible, p_t, 0.0)
            else:
                p_t = tl.where(offs_n[:, None] <= offs_m[None, :] + diag_shift, p_t, 0.0)
        if KEY_MASK != "none":
            p_t = tl.where(key_ok[:, None], p_t, 0.0)
        dv = mma(p_t, do, dv, DOT)
        dp_t = mma(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), DOT)
        ds_t = p_t * (dp_t - delta[None, :])
        if SOFTCAP:
            ds_t = ds_t * (1.0 - tanh_t * tanh_t)
        dk = mma(ds_t, q, dk, DOT)
    return dk, dv


@triton.jit
def _attn_bwd_dkdv(Q,  # [B, H, S_q, D]
                   K,  # [B, H_kv, S_k, D]
                   V,  # [B, H_kv, S_k, D]
                   dOut,  # [B, H, S_q, D]
                   Lse,  # [B, H, S_q] float32, contiguous (forward's base-2 lse)
                   Delta,  # [B, H, S_q] float32, contiguous
                   dK,  # [B, H_kv, S_k, D], dtype of K
                   dV,  # [B, H_kv, S_k, D], dtype of V
                   KeyMask,  # [B, S_k] uint8 when KEY_MASK == "bool"
                   KeyLen,  # [B] int when KEY_MASK == "lengths"
                   Alibi,  # [B, H] or [H] float32 slopes when ALIBI (else unused); [H]: stride_alibi_b = 0
                   CuSeqQ,  # [B + 1] int32 starts of the packed sequences in q's tokens when VARLEN (else unused)
                   CuSeqK,  # [B + 1] int32 starts of the packed sequences in k's and v's tokens when VARLEN
                   stride_qb, stride_qh, stride_qm, stride_qd,
                   stride_kb, stride_kh, stride_kn, stride_kd,
                   stride_vb, stride_vh, stride_vn, stride_vd,
                   stride_dob, stride_doh, stride_dom, stride_dod,
                   stride_dkb, stride_dkh, stride_dkn, stride_dkd,
                   stride_dvb, stride_dvh, stride_dvn, stride_dvd,
                   stride_mask_b, stride_mask_n,
                   stride_alibi_b, stride_alibi_h,
                   num_heads, num_kv_heads, group_size, seq_q, seq_k, qk_scale, sm_scale,
                   window_left, window_right,  # >= 0 when WINDOW, as in the forward
                   softcap,  # c > 0 when SOFTCAP, natural units
                   SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET,  # autotuning keys only
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
                   DOT: tl.constexpr, FLAT_GRID: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                   WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                   VARLEN: tl.constexpr = False):
    num_n_blocks = tl.cdiv(seq_k, BLOCK_N)
    pid_n, pid_bkv = program_ids(num_n_blocks, FLAT_GRID)
    b = pid_bkv // num_kv_heads
    kv_h = pid_bkv % num_kv_heads
    start_n = pid_n * BLOCK_N
    row_len = seq_q  # rows of Lse and Delta: the padded maximum for packed sequences
    if VARLEN:
        q_start, k_start, seq_q, seq_k = varlen_sequence(CuSeqQ, CuSeqK, b)
        Q, dOut = Q + q_start.to(tl.int64) * stride_qm, dOut + q_start.to(tl.int64) * stride_dom
        K, V = K + k_start.to(tl.int64) * stride_kn, V + k_start.to(tl.int64) * stride_vn
        dK, dV = dK + k_start.to(tl.int64) * stride_dkn, dV + k_start.to(tl.int64) * stride_dvn
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)

    # Keys past seq_k are never stored, so only padding needs a per-key mask.
    q_end = seq_q
    if VARLEN:
        q_end = tl.where(start_n < seq_k, seq_q, 0)  # a key block past its sequence's end: nothing to do
    if KEY_MASK == "lengths":
        n_len = tl.minimum(tl.maximum(tl.load(KeyLen + b), 0), seq_k).to(tl.int32)
        key_ok = offs_n < n_len
        q_end = tl.where(start_n < n_len, seq_q, 0)  # a block of padding only: its gradients are zero
    elif KEY_MASK == "bool":
        key_ok = tl.load(KeyMask + b.to(tl.int64) * stride_mask_b + offs_n * stride_mask_n,
                         mask=offs_n < seq_k, other=0) != 0
    else:
        key_ok = offs_n < seq_k

    if WINDOW:
        diag_shift, right = window_shift_and_right(seq_q, seq_k, window_right, CAUSAL)
        # Query i sees key j when j - right <= i' <= j + left (i' = i + diag_shift). Rows some key of the block
        # sees: from its first key's lowest row to its last real key's highest; rows that see every key: from the
        # last key's lowest row to the first key's highest (none when the block is wider than the window).
        last_key = tl.minimum(start_n + BLOCK_N, seq_k) - 1
        seen_lo = tl.minimum(tl.maximum(start_n - right - diag_shift, 0), q_end)
        seen_hi = tl.minimum(tl.maximum(last_key + window_left - diag_shift + 1, 0), q_end)
        all_lo = tl.minimum(tl.maximum(last_key - right - diag_shift, 0), q_end)
        all_hi = tl.minimum(tl.maximum(start_n + window_left - diag_shift + 1, 0), q_end)
        lo = (seen_lo // BLOCK_M) * BLOCK_M
        full_from = tl.cdiv(all_lo, BLOCK_M) * BLOCK_M
        full_to = (all_hi // BLOCK_M) * BLOCK_M
        no_full = full_from >= full_to
        full_from = tl.where(no_full, lo, full_from)
        full_to = tl.where(no_full, lo, full_to)
        seen_by_some_row = (key_ok & (offs_n >= diag_shift - window_left)
                            & (offs_n <= seq_q - 1 + diag_shift + right))
    elif CAUSAL != 0:
        if CAUSAL == 1:
            diag_shift = 0
        else:
            diag_shift = seq_k - seq_q
        # Query i sees key j when i >= j - diag_shift: rows before `lo` see none of this block, rows from
        # `full_from` on see all of it, and the query blocks in between need the diagonal mask.
        lo = tl.minimum(tl.maximum(start_n - diag_shift, 0), q_end)
        lo = (lo // BLOCK_M) * BLOCK_M
        full_from = tl.minimum(tl.maximum(start_n + BLOCK_N - 1 - diag_shift, 0), q_end)
        mid = tl.cdiv(full_from, BLOCK_M) * BLOCK_M
        seen_by_some_row = key_ok & (offs_n <= seq_q - 1 + diag_shift)
    else:
        diag_shift = 0
        lo = 0
        mid = 0
        seen_by_some_row = key_ok

    # Keys no query row may see (padding, past the last row's causal frontier) may hold anything, NaN included:
    # they load as zeros, so their dP is finite and their dS = 0 * dP exactly zero.
    k = load_rows_where(K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
                        + offs_n[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                        seen_by_some_row, offs_d, HEAD_DIM, BLOCK_D)
    v = load_rows_where(V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
                        + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                        seen_by_some_row, offs_d, HEAD_DIM, BLOCK_D)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    heads_seen = group_size
    if KEY_MASK == "bool":
        # A key block the mask hides whole (left padding, a hole) has zero gradients: no head's rows are visited.
        # (Emptying the head loop, not the query range: the latter cost sm_90 spills in the causal kernel.)
        heads_seen = tl.where(tl.max(key_ok.to(tl.int32), 0) != 0, group_size, 0)
    for g in range(0, heads_seen):
        h = kv_h * group_size + g
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = dOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        row = (b * num_heads + h).to(tl.int64) * row_len
        softcap2, slope2 = variant_scalars(Alibi, b, h, stride_alibi_b, stride_alibi_h, softcap, qk_scale, SOFTCAP,
                                           ALIBI)
        if WINDOW:
            # Query blocks crossing the window's lower edge, those that see the whole key block, and those
            # crossing its upper edge.
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, Lse + row, Delta + row,
                                          stride_qm, stride_qd, stride_dom, stride_dod,
                                          offs_n, offs_d, lo, full_from, seq_q, diag_shift, qk_scale,
                                          window_left, window_right, softcap2, slope2,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, True, KEY_MASK, DOT, EVEN_M,
                                          CAUSAL, WINDOW, SOFTCAP, ALIBI)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, Lse + row, Delta + row,
                                          stride_qm, stride_qd, stride_dom, stride_dod,
                                          offs_n, offs_d, full_from, full_to, seq_q, diag_shift, qk_scale,
                                          window_left, window_right, softcap2, slope2,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, False, KEY_MASK, DOT, EVEN_M,
                                          CAUSAL, WINDOW, SOFTCAP, ALIBI)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, Lse + row, Delta + row,
                                          stride_qm, stride_qd, stride_dom, stride_dod,
                                          offs_n, offs_d, full_to, seen_hi, seq_q, diag_shift, qk_scale,
                                          window_left, window_right, softcap2, slope2,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, True, KEY_MASK, DOT, EVEN_M,
                                          CAUSAL, WINDOW, SOFTCAP, ALIBI)
        else:
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, Lse + row, Delta + row,
                                          stride_qm, stride_qd, stride_dom, stride_dod,
                                          offs_n, offs_d, lo, tl.minimum(mid, q_end), seq_q, diag_shift,
                                          qk_scale, window_left, window_right, softcap2, slope2,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL != 0, KEY_MASK, DOT, EVEN_M,
                                          CAUSAL, WINDOW, SOFTCAP, ALIBI)
            dk, dv = _attn_bwd_dkdv_inner(dk, dv, k, v, key_ok, q_base, do_base, Lse + row, Delta + row,
                                          stride_qm, stride_qd, stride_dom, stride_dod,
                                          offs_n, offs_d, mid, q_end, seq_q, diag_shift, qk_scale,
                                          window_left, window_right, softcap2, slope2,
                                          BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, False, KEY_MASK, DOT, EVEN_M,
                                          CAUSAL, WINDOW, SOFTCAP, ALIBI)
    dk = dk * sm_scale

    store_mask = (offs_n[:, None] < seq_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dK + b.to(tl.int64) * stride_dkb + kv_h.to(tl.int64) * stride_dkh
             + offs_n[:, None] * stride_dkn + offs_d[None, :] * stride_dkd,
             cast_out(dk, dK.dtype.element_ty, DOT), mask=store_mask)
    tl.store(dV + b.to(tl.int64) * stride_dvb + kv_h.to(tl.int64) * stride_dvh
             + offs_n[:, None] * stride_dvn + offs_d[None, :] * stride_dvd,
             cast_out(dv, dV.dtype.element_ty, DOT), mask=store_mask)


@triton.jit
def _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, mask_row,  # k_base, v_base: one (b, kv head)
                       stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                       offs_m, offs_d, start, end, n_len, diag_shift, qk_scale,
                       first, window_left, window_right, softcap2, slope2,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                       CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr, DOT: tl.constexpr, BOUNDARY: tl.constexpr,
                       WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr):
    """Accumulate dQ of one query block over key blocks [start, end); BOUNDARY, ``first`` and the variants as in
    the forward."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        # Keys no row of this block may see load as zeros, as in the forward: past `end` (the key length, or the
        # causal frontier of the block's last row in the boundary loop), before `first` (left of every row's
        # window) and those the boolean mask hides.
        k_ptrs = k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + offs_n[None, :] * stride_vn + offs_d[:, None] * stride_vd
        if KEY_MASK == "bool":
            keep = tl.load(mask_row + offs_n * stride_mask_n, mask=offs_n < n_len, other=0) != 0
            if WINDOW and BOUNDARY:
                seen = keep & (offs_n < end) & (offs_n >= first)
            else:
                seen = keep & (offs_n < end)
            kt = load_cols_where(k_ptrs, offs_d, HEAD_DIM, BLOCK_D, seen)
            vt = load_cols_where(v_ptrs, offs_d, HEAD_DIM, BLOCK_D, seen)
        elif WINDOW and BOUNDARY:
            seen = (offs_n < end) & (offs_n >= first)
            kt = load_cols_where(k_ptrs, offs_d, HEAD_DIM, BLOCK_D, seen)
            vt = load_cols_where(v_ptrs, offs_d, HEAD_DIM, BLOCK_D, seen)
        else:
            kt = load_cols(k_ptrs, offs_d, HEAD_DIM, BLOCK_D, offs_n, end, BOUNDARY)
            vt = load_cols(v_ptrs, offs_d, HEAD_DIM, BLOCK_D, offs_n, end, BOUNDARY)
        qk = mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT) * qk_scale
        if SOFTCAP:
            tanh_s = tanh(qk * (1.0 / softcap2))
            qk = softcap2 * tanh_s
        if ALIBI:
            qk = qk - slope2 * tl.abs(offs_m[:, None] + diag_shift - offs_n[None, :]).to(tl.float32)
        p = tl.math.exp2(qk - lse[:, None])
        if BOUNDARY:
            visible = offs_n[None, :] < n_len
            if CAUSAL != 0:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift)
            if WINDOW:
                visible = visible & (offs_n[None, :] >= offs_m[:, None] + diag_shift - window_left)
                if CAUSAL == 0:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift + window_right)
            p = tl.where(visible, p, 0.0)
        if KEY_MASK == "bool":
            p = tl.where(keep[None, :], p, 0.0)
        dp = mma(do, vt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
        ds = p * (dp - delta[:, None])
        if SOFTCAP:
            ds = ds * (1.0 - tanh_s * tanh_s)
        dq = mma(ds, tl.trans(kt), dq, DOT)
    return dq


@triton.jit
def _attn_bwd_dq(Q,  # [B, H, S_q, D]
                 K,  # [B, H_kv, S_k, D]
                 V,  # [B, H_kv, S_k, D]
                 dOut,  # [B, H, S_q, D]
                 Out,  # [B, H, S_q, D], the forward's output
                 Lse,  # [B, H, S_q] float32, contiguous
                 Delta,  # [B, H, S_q] float32, contiguous: written here, read by the dK/dV kernel launched after
                 dQ,  # [B, H, S_q, D], dtype of Q
                 KeyMask,  # [B, S_k] uint8 when KEY_MASK == "bool"
                 KeyLen,  # [B] int when KEY_MASK == "lengths"
                 KeyStart,  # [B] int when KEY_MASK == "bool": first nonzero of each KeyMask row, 0 if none
                 Alibi,  # [B, H] or [H] float32 slopes when ALIBI (else unused); [H]: stride_alibi_b = 0
                 CuSeqQ,  # [B + 1] int32 starts of the packed sequences in q's tokens when VARLEN (else unused)
                 CuSeqK,  # [B + 1] int32 starts of the packed sequences in k's and v's tokens when VARLEN
                 stride_qb, stride_qh, stride_qm, stride_qd,
                 stride_kb, stride_kh, stride_kn, stride_kd,
                 stride_vb, stride_vh, stride_vn, stride_vd,
                 stride_dob, stride_doh, stride_dom, stride_dod,
                 stride_ob, stride_oh, stride_om, stride_od,
                 stride_dqb, stride_dqh, stride_dqm, stride_dqd,
                 stride_mask_b, stride_mask_n,
                 stride_alibi_b, stride_alibi_h,
                 num_heads, group_size, seq_q, seq_k, qk_scale, sm_scale,
                 window_left, window_right,  # >= 0 when WINDOW, as in the forward
                 softcap,  # c > 0 when SOFTCAP, natural units
                 SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET,  # autotuning keys only
                 HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
                 DOT: tl.constexpr, FLAT_GRID: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                 WINDOW: tl.constexpr = False, SOFTCAP: tl.constexpr = False, ALIBI: tl.constexpr = False,
                 VARLEN: tl.constexpr = False):
    num_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m, pid_bh = program_ids(num_m_blocks, FLAT_GRID)
    if CAUSAL != 0:
        pid_m = num_m_blocks - 1 - pid_m  # longest rows first, as in the forward
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size
    start_m = pid_m * BLOCK_M
    row_len = seq_q  # rows of Lse and Delta: the padded maximum for packed sequences
    if VARLEN:
        q_start, k_start, seq_q, seq_k = varlen_sequence(CuSeqQ, CuSeqK, b)
        Q, dOut = Q + q_start.to(tl.int64) * stride_qm, dOut + q_start.to(tl.int64) * stride_dom
        Out, dQ = Out + q_start.to(tl.int64) * stride_om, dQ + q_start.to(tl.int64) * stride_dqm
        K, V = K + k_start.to(tl.int64) * stride_kn, V + k_start.to(tl.int64) * stride_vn
        seq_k = tl.where(start_m < seq_q, seq_k, 0)  # a query block past its sequence's end visits no key
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_rows(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
                  + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                  offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
    do = load_rows(dOut + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
                   + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod,
                   offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
    row = pid_bh.to(tl.int64) * row_len
    lse = _load_lse(Lse + row, offs_m, seq_q, not EVEN_M)
    # delta of this program's rows, from its resident dO and the forward's output, and stored for the dK/dV kernel:
    # no preprocessing kernel, so a backward is two launches and reads dO once less. Padded rows and columns load
    # as zeros, so their delta is 0 (and is not stored).
    o = load_rows(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od,
                  offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    if EVEN_M:
        tl.store(Delta + row + offs_m, delta)
    else:
        tl.store(Delta + row + offs_m, delta, mask=offs_m < seq_q)

    n_len, diag_shift, first, lo, full_start, full_end, hi = key_range(
        KeyLen, b, start_m, seq_q, seq_k, window_left, window_right, BLOCK_M, BLOCK_N, CAUSAL, KEY_MASK, WINDOW)
    if KEY_MASK == "bool":  # blocks before the first visible key add nothing, as in the forward
        lo, full_start, full_end, hi = skip_hidden_prefix(KeyStart, b, lo, full_start, full_end, hi, BLOCK_N)
    softcap2, slope2 = variant_scalars(Alibi, b, h, stride_alibi_b, stride_alibi_h, softcap, qk_scale, SOFTCAP,
                                       ALIBI)

    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    mask_row = KeyMask + b.to(tl.int64) * stride_mask_b
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if WINDOW:  # blocks crossing the window's left edge, as in the forward
        dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, mask_row,
                                stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                offs_m, offs_d, lo, full_start, n_len, diag_shift, qk_scale,
                                first, window_left, window_right, softcap2, slope2,
                                BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, True,
                                WINDOW, SOFTCAP, ALIBI)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, mask_row,
                            stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                            offs_m, offs_d, full_start, full_end, n_len, diag_shift, qk_scale,
                            first, window_left, window_right, softcap2, slope2,
                            BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, False,
                            WINDOW, SOFTCAP, ALIBI)
    dq = _attn_bwd_dq_inner(dq, q, do, lse, delta, k_base, v_base, mask_row,
                            stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                            offs_m, offs_d, full_end, hi, n_len, diag_shift, qk_scale,
                            first, window_left, window_right, softcap2, slope2,
                            BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, True,
                            WINDOW, SOFTCAP, ALIBI)
    dq = dq * sm_scale

    dq_ptrs = (dQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh
               + offs_m[:, None] * stride_dqm + offs_d[None, :] * stride_dqd)
    tl.store(dq_ptrs, cast_out(dq, dQ.dtype.element_ty, DOT),
             mask=(offs_m[:, None] < seq_q) & (offs_d[None, :] < HEAD_DIM))


# ----------------------------------------------------------------------------------------------------------------
# Autotuning.

# dK/dV: a key block (BLOCK_N rows, resident with its dK, dV accumulators) against streamed query blocks.
# Most promising first, as for the forward.
DKDV_GPU_BLOCKS = [(32, 128, 4, 3), (64, 128, 8, 2), (32, 64, 4, 3), (64, 64, 4, 3), (16, 32, 4, 2),
                   # Deeper pipelines of the streamed q/dO tiles, and 8 warps over 64 x 128: 129-161 KB at D=128
                   # (compiled for sm_90), candidates for the D=128 backward.
                   (32, 128, 4, 4), (32, 128, 4, 5), (64, 128, 8, 3)]
# Not in the list: 8-warp configs over 16 or 32 query rows and 128 keys, which compile without register spills where
# the 4-warp ones over 64 or 128 keys spill at D=128 (benchmarks/results/cpu-host-2026-12-04/backward_spills_probe/ at
# commit 8ca4529).
# On the H200 the autotuner chose none of them at any of the 13 forward+backward shapes at D=128
# (benchmarks/results/h200-2026-12-04-g/q1_dkdv_candidates_d128/autotune_choices.txt at commit 8ca4529): it keeps
# (32, 64, 4, 3) and (64, 128, 8, 2/3), whose spills sit outside the inner query-block loops (their SASS:
# benchmarks/results/cpu-host-2026-12-04/backward_spills_probe/ at commit 8ca4529).
# dQ: a query block (BLOCK_M rows, resident) against streamed key blocks.
DQ_GPU_BLOCKS = [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3), (64, 32, 4, 3), (32, 16, 4, 2),
                 # The mirror of the dK/dV additions: 128-160 KB at D=128.
                 (128, 32, 4, 4), (128, 32, 4, 5), (128, 64, 8, 3)]
# Interpreter: unequal blocks, the mirror of the forward's, so the diagonal logic is exercised both ways.
DKDV_INTERPRETER_BLOCKS = [(16, 32, 4, 1)]
DQ_INTERPRETER_BLOCKS = [(32, 16, 4, 1)]
# The delta preprocessing of the Gluon backward is a plain row reduction; one config suffices.
DELTA_BLOCK_M = 64


def dkdv_configs() -> list[triton.Config]:
    """dK/dV configs for where the kernels run."""
    return make_configs(DKDV_INTERPRETER_BLOCKS if _runtime.interpreting() else DKDV_GPU_BLOCKS)


def dq_configs() -> list[triton.Config]:
    """dQ configs for where the kernels run."""
    return make_configs(DQ_INTERPRETER_BLOCKS if _runtime.interpreting() else DQ_GPU_BLOCKS)


# The backward kernels hold two tiles for the whole program (k and v in dK/dV, q and dO in dQ) beside the pipelined
# ones (measured by compiling every config for sm_90).
BACKWARD_RESIDENT_TILES = 2


def prune_dkdv_configs(configs, named_args, **kwargs):
    return prune_by_resources(configs, named_args, streamed=("BLOCK_M", "BLOCK_N"), resident="BLOCK_N",
                              resident_tiles=BACKWARD_RESIDENT_TILES, scratch=SCRATCH_BYTES, **kwargs)


def prune_dq_configs(configs, named_args, **kwargs):
    # dS K^T reads the key tile transposed: with float32 operands (tf32 products) that is one more copy of it.
    return prune_by_resources(configs, named_args, streamed=("BLOCK_N", "BLOCK_M"), resident="BLOCK_M",
                              resident_tiles=BACKWARD_RESIDENT_TILES, transposed_fp32_tiles=1,
                              scratch=SCRATCH_BYTES, **kwargs)


attn_bwd_delta = _attn_bwd_delta
attn_bwd_dkdv_fixed = even_m(_attn_bwd_dkdv)
attn_bwd_dq_fixed = even_m(_attn_bwd_dq)
attn_bwd_dkdv = triton.autotune(configs=dkdv_configs(), key=AUTOTUNE_KEY_BACKWARD,
                                prune_configs_by={"early_config_prune": prune_dkdv_configs})(attn_bwd_dkdv_fixed)
attn_bwd_dq = triton.autotune(configs=dq_configs(), key=AUTOTUNE_KEY_BACKWARD,
                              prune_configs_by={"early_config_prune": prune_dq_configs})(attn_bwd_dq_fixed)
