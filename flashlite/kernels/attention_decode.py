"""Decoding kernels: split-KV attention of a few query rows per (batch entry, kv head) against a KV cache.

Decoding reads the whole cache once per token, so its speed is the speed at which K and V stream from memory. The
general forward kernel (``attention_fwd``) runs one program per (query block, head): the heads of a grouped-query
group each re-read their kv head's cache, and one query fills a 16-row tile. Here one program owns one
(batch entry b, kv head g, share s) triple and loads each K and V tile of its share of the cache ONCE for every
query row that reads it: the ``GROUP`` query heads of the kv head times the ``SEQ_Q`` queries of the entry
(speculative decoding, a short chunk of prefill), ``ROWS = GROUP * SEQ_Q`` rows in all, padded to ``BLOCK_R``.

Row r of a program is query head ``g * GROUP + r // SEQ_Q`` and query ``i = r % SEQ_Q``. Entry b holds
``n_b = KeyLens[b]`` keys (a device tensor: lengths are data, a call with new lengths compiles nothing and reads
nothing back to the host); query i sits at position ``n_b - SEQ_Q + i`` and sees the keys up to it (causal, aligned
to the bottom right of each entry), and with ``WINDOW`` only those at most ``window_left`` before it. A query that
sees no key (``n_b`` below its row, an empty cache) gets 0 and a log-sum-exp of -inf.

The keys ``[lo, n_b)`` (``lo``: the first key-block any row's window reaches, else 0) are cut into shares
(``num_splits``, a runtime value: no compile per count) of whole ``BLOCK_N`` blocks, from the length itself, so every
share of an entry gets the same work whatever its length. With one share the program writes the output; with more
it writes its float32 output normalised by its own sum and its base-2 log-sum-exp, and ``_decode_merge`` averages
the shares weighted by 2 ** lse; or, with ``FUSED_MERGE``, the last share of each (entry, kv head) to finish does
(an arrival counter per pair), which saves the second launch.

The cache is either contiguous, [B, H_kv, S_max, D] with any strides, or paged (``PAGE_SIZE`` > 0),
[blocks, H_kv, PAGE_SIZE, D] with any strides and a block table [B, max blocks]: key j of entry b lives at row
j % PAGE_SIZE of block ``BlockTable[b, j // PAGE_SIZE]``. Pages at least a tile long that the tile divides are read
one page per tile (one table load, contiguous rows); smaller pages row by row through the table.

Scores are kept in base 2 as in ``attention_fwd``: ``qk_scale = scale * log2(e)``, softcap in base 2
(``softcap2 = softcap * log2(e)``). ``USE_DOT`` picks the tensor-core product (rows padded to 16) or a
broadcast-multiply and sum on the CUDA cores (rows padded to a power of two, for groups of a few rows).

``DEQUANT``: the cache holds fp8 (e4m3) values with a float32 scale per kv head (``KScale``, ``VScale``): each tile
is converted to q's dtype after its load (half the bytes read), K's scale multiplies the scores' scale and V's the
output, so nothing else changes.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashlite.kernels.attention_common import tanh


@triton.jit
def _table_entries(table_row, stride_tn, start_n, end, offs_n0, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The blocks holding keys [start_n, start_n + BLOCK_N) of a paged entry (int64): one block (a scalar) when
    PAGE_SIZE is a multiple of BLOCK_N, else one per key ([BLOCK_N]); 0 where the keys are at or past ``end`` (table
    entries past the length are never read). Contiguous caches (PAGE_SIZE 0): 0."""
    if PAGE_SIZE == 0:
        return 0
    elif PAGE_SIZE % BLOCK_N == 0:
        return tl.load(table_row + (start_n // PAGE_SIZE) * stride_tn, mask=start_n < end, other=0).to(tl.int64)
    else:
        offs_n = start_n + offs_n0
        return tl.load(table_row + (offs_n // PAGE_SIZE) * stride_tn, mask=offs_n < end, other=0).to(tl.int64)


@triton.jit
def _decode_split(Q,  # [B, H, S_q, D], any strides (H = H_kv * GROUP, S_q = SEQ_Q)
                  K,  # [B, H_kv, S_max, D], or paged [blocks, H_kv, PAGE_SIZE, D]; any strides
                  V,  # as K
                  KeyLens,  # [B] int32: the keys entry b holds (positions 0 .. KeyLens[b] - 1)
                  BlockTable,  # [B, max blocks] int32, any strides, when PAGE_SIZE > 0 (else unused)
                  KScale,  # [H_kv] float32 when DEQUANT: K's stored value times KScale[g] is the key (else unused)
                  VScale,  # [H_kv] float32 when DEQUANT: as KScale, for V
                  Out,  # [B, H, S_q, D], any strides, q's dtype: written when not SPLIT (num_splits == 1)
                  Lse,  # [B, H, S_q] float32 contiguous, base 2: written when not SPLIT and STORE_LSE
                  Parts,  # [num_splits * B * H_kv * ROWS * (D + 1)] float32 when SPLIT: the shares' outputs
                  #         [num_splits, B * H_kv * ROWS, D], then their base-2 lse [num_splits, B * H_kv * ROWS]
                  Arrivals,  # [B * H_kv] int32, zero before the launch and left zero, when FUSED_MERGE (else unused)
                  stride_qb, stride_qh, stride_qs, stride_qd,
                  stride_kb, stride_kh, stride_kn, stride_kd,  # stride_kb: per entry, or per block when paged
                  stride_vb, stride_vh, stride_vn, stride_vd,
                  stride_ob, stride_oh, stride_os, stride_od,
                  stride_tb, stride_tn,
                  kv_heads, num_splits, qk_scale, softcap2, window_left,
                  SEQ_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PAGE_SIZE: tl.constexpr, SPLIT: tl.constexpr,
                  USE_DOT: tl.constexpr, IEEE: tl.constexpr, SOFTCAP: tl.constexpr, WINDOW: tl.constexpr,
                  STORE_LSE: tl.constexpr, DEQUANT: tl.constexpr, FUSED_MERGE: tl.constexpr):
    pair = tl.program_id(0)  # b * H_kv + g
    split = tl.program_id(1)
    b = pair // kv_heads
    g = pair % kv_heads
    ROWS: tl.constexpr = GROUP * SEQ_Q
    # One buffer for both partials: a call allocates one tensor for them, not two (host time per decoding step).
    OutPart = Parts
    LsePart = Parts + (tl.num_programs(0) * num_splits).to(tl.int64) * (ROWS * HEAD_DIM)
    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    row_ok = offs_r < ROWS
    d_ok = offs_d < HEAD_DIM
    head = (g * GROUP + offs_r // SEQ_Q).to(tl.int64)
    qi = offs_r % SEQ_Q
    q = tl.load(Q + b.to(tl.int64) * stride_qb + head[:, None] * stride_qh + qi[:, None] * stride_qs
                + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    n = tl.load(KeyLens + b)
    last = n - SEQ_Q + qi  # [BLOCK_R]: the last key each row sees (below 0: none)
    if DEQUANT:  # a quantized cache (fp8): K's scale folds into the scores', V's into the output
        qk_scale = qk_scale * tl.load(KScale + g)

    # This share's keys: whole BLOCK_N blocks of [lo, n), the same count for every share but the last.
    if WINDOW:
        first_seen = tl.maximum(n - SEQ_Q - window_left, 0)  # row 0's first key: no row sees a key before it
        lo = (first_seen // BLOCK_N) * BLOCK_N  # the block it starts
    else:
        first_seen = n * 0
        lo = n * 0
    per_split = tl.cdiv(tl.cdiv(n - lo, BLOCK_N), num_splits) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, n)

    if PAGE_SIZE == 0:
        k_base = K + b.to(tl.int64) * stride_kb + g.to(tl.int64) * stride_kh
        v_base = V + b.to(tl.int64) * stride_vb + g.to(tl.int64) * stride_vh
    else:
        k_base = K + g.to(tl.int64) * stride_kh
        v_base = V + g.to(tl.int64) * stride_vh
    table_row = BlockTable + b.to(tl.int64) * stride_tb

    m_i = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    offs_n0 = tl.arange(0, BLOCK_N)
    # Paged: the tile's table entries are loaded one tile ahead (``pages``), so that the loads of K and V do not wait
    # on a table load of their own iteration; the compiler's pipeliner spent one of its stages on that wait, which
    # left one buffer of K and V where a contiguous cache gets num_stages - 1.
    pages = _table_entries(table_row, stride_tn, start, end, offs_n0, PAGE_SIZE, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        # Keys no row sees (past the share's end, before every row's window) load as zeros: a cache filled past
        # its end, or a window's left-behind keys, may hold NaN, and a value's NaN would reach every row through
        # p = 0 times it.
        in_range = (offs_n < end) & (offs_n >= first_seen)
        # Where the tile's rows are: k_rows, v_rows [BLOCK_N] element offsets from k_base, v_base.
        if PAGE_SIZE == 0:
            k_rows = offs_n.to(tl.int64) * stride_kn
            v_rows = offs_n.to(tl.int64) * stride_vn
        elif PAGE_SIZE % BLOCK_N == 0:  # the tile lies in one page: one table entry, contiguous rows
            within = start_n % PAGE_SIZE + offs_n0
            k_rows = pages * stride_kb + within * stride_kn
            v_rows = pages * stride_vb + within * stride_vn
        else:  # pages shorter than the tile: one table entry per row
            k_rows = pages * stride_kb + (offs_n % PAGE_SIZE) * stride_kn
            v_rows = pages * stride_vb + (offs_n % PAGE_SIZE) * stride_vn
        if PAGE_SIZE != 0:
            pages = _table_entries(table_row, stride_tn, start_n + BLOCK_N, end, offs_n0, PAGE_SIZE, BLOCK_N)
        tile_ok = in_range[:, None] & d_ok[None, :]
        k = tl.load(k_base + k_rows[:, None] + offs_d[None, :] * stride_kd, mask=tile_ok, other=0.0)
        if DEQUANT:
            k = k.to(Q.dtype.element_ty)
        if USE_DOT:
            if IEEE:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
        else:
            scores = tl.sum(q[:, None, :].to(tl.float32) * k[None, :, :].to(tl.float32), axis=2)
        qk = scores * qk_scale  # [BLOCK_R, BLOCK_N], base 2
        if SOFTCAP:
            qk = softcap2 * tanh(qk * (1.0 / softcap2))
        visible = in_range[None, :] & (offs_n[None, :] <= last[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] >= last[:, None] - window_left)
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet: no inf - inf
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + v_rows[:, None] + offs_d[None, :] * stride_vd, mask=tile_ok, other=0.0)
        if DEQUANT:
            v = v.to(Q.dtype.element_ty)
        if USE_DOT:
            if IEEE:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        else:
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :].to(tl.float32), axis=1)
        m_i = m_new

    empty = l_i == 0.0
    out = acc * (1.0 / tl.where(empty, 1.0, l_i))[:, None]
    if DEQUANT:
        out = out * tl.load(VScale + g)
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)))
    out_ptrs = (Out + b.to(tl.int64) * stride_ob + head[:, None] * stride_oh + qi[:, None] * stride_os
                + offs_d[None, :] * stride_od)
    lse_ptrs = Lse + (b.to(tl.int64) * kv_heads * GROUP + head) * SEQ_Q + qi
    if not SPLIT:
        tl.store(out_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if STORE_LSE:
            tl.store(lse_ptrs, lse, mask=row_ok)
    else:
        part = (split.to(tl.int64) * tl.num_programs(0) + pair) * ROWS + offs_r  # [BLOCK_R]
        tl.store(OutPart + part[:, None] * HEAD_DIM + offs_d[None, :], out, mask=row_ok[:, None] & d_ok[None, :])
        tl.store(LsePart + part, lse, mask=row_ok)
        if FUSED_MERGE:
            # The pair's last share to finish merges (no second kernel): every thread's stores above happen before
            # the barrier, the barrier before the counter's release; the last share's acquire makes the other
            # shares' partials visible, read past L1 (".cg": a line this SM cached in an earlier call is stale).
            tl.debug_barrier()
            arrived = tl.atomic_add(Arrivals + pair, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.store(Arrivals + pair, 0)  # zero again for the next call (a replayed graph reuses the buffer)
                m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
                total = tl.zeros([BLOCK_R], dtype=tl.float32)
                merged = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
                for s in range(num_splits):
                    part = (s * tl.num_programs(0) + pair).to(tl.int64) * ROWS + offs_r
                    lse_s = tl.load(LsePart + part, mask=row_ok, other=float("-inf"), cache_modifier=".cg")
                    out_s = tl.load(OutPart + part[:, None] * HEAD_DIM + offs_d[None, :],
                                    mask=row_ok[:, None] & d_ok[None, :], other=0.0, cache_modifier=".cg")
                    m_new = tl.maximum(m, lse_s)
                    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                    rescale = tl.math.exp2(m - m_ref)
                    weight = tl.math.exp2(lse_s - m_ref)
                    merged = merged * rescale[:, None] + weight[:, None] * out_s
                    total = total * rescale + weight
                    m = m_new
                none = total == 0.0
                merged = merged * (1.0 / tl.where(none, 1.0, total))[:, None]
                tl.store(out_ptrs, merged.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
                if STORE_LSE:
                    m_ref = tl.where(m == float("-inf"), 0.0, m)
                    tl.store(lse_ptrs, tl.where(none, float("-inf"), m_ref + tl.math.log2(tl.where(none, 1.0, total))),
                             mask=row_ok)


@triton.jit
def _decode_merge(Parts,  # [num_splits * rows_total * (D + 1)] float32: the shares' normalised outputs
                  #         [num_splits, rows_total, D], then their base-2 lse [num_splits, rows_total] (-inf: no key)
                  Out,  # [B, H, S_q, D], any strides, q's dtype
                  Lse,  # [B, H, S_q] float32 contiguous, base 2, when STORE_LSE (else unused)
                  stride_ob, stride_oh, stride_os, stride_od,
                  kv_heads, rows_total, num_splits,
                  SEQ_Q: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr, STORE_LSE: tl.constexpr):
    """One program per query row: the row's output is the shares' outputs averaged with weights 2 ** lse_s (all
    shares loaded at once, so the merge is one round trip to memory); a row no share saw stays 0 with lse -inf."""
    ROWS: tl.constexpr = GROUP * SEQ_Q
    OutPart = Parts
    LsePart = Parts + (num_splits * rows_total).to(tl.int64) * HEAD_DIM
    row = tl.program_id(0)  # (b * H_kv + g) * ROWS + r
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_ok = offs_s < num_splits
    d_ok = offs_d < HEAD_DIM
    lse_s = tl.load(LsePart + offs_s.to(tl.int64) * rows_total + row, mask=s_ok, other=float("-inf"))
    parts = tl.load(OutPart + (offs_s.to(tl.int64) * rows_total + row)[:, None] * HEAD_DIM + offs_d[None, :],
                    mask=s_ok[:, None] & d_ok[None, :], other=0.0)
    m = tl.max(lse_s, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    weights = tl.math.exp2(lse_s - m_ref)  # [BLOCK_S]: 0 for shares that saw no key
    total = tl.sum(weights, 0)
    empty = total == 0.0
    out = tl.sum(weights[:, None] * parts, 0) * (1.0 / tl.where(empty, 1.0, total))
    pair = row // ROWS
    r = row % ROWS
    b = pair // kv_heads
    head = (pair % kv_heads) * GROUP + r // SEQ_Q
    qi = r % SEQ_Q
    tl.store(Out + b.to(tl.int64) * stride_ob + head.to(tl.int64) * stride_oh + qi * stride_os + offs_d * stride_od,
             out.to(Out.dtype.element_ty), mask=d_ok)
    if STORE_LSE:
        tl.store(Lse + (b.to(tl.int64) * kv_heads * GROUP + head) * SEQ_Q + qi,
                 tl.where(empty, float("-inf"), m_ref + tl.math.log2(tl.where(empty, 1.0, total))))
