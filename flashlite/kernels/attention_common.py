"""Triton helpers shared by the attention kernels: tile loads, dot products, casts, program ids, key ranges.

``attention_fwd`` and ``attention_bwd`` build their kernels from these ``@triton.jit`` functions (inlined when a
kernel compiles). Conventions of the kernels' parameters, which the helpers follow:

* ``CAUSAL``: 0 none; 1 top-left (query i sees keys j <= i, like SDPA's ``is_causal``); 2 bottom-right
  (j <= i + seq_k - seq_q); 3 bottom-right of each batch entry's key length (j <= i + n_len - seq_q, with
  ``KEY_MASK == "lengths"``: decoding against a KV cache filled to a different length per entry; forward only).
* ``KEY_MASK``: "none"; "lengths" (``KeyLen`` is int [B], keys j >= length are masked, the length clamped to
  [0, seq_k]); "bool" (``KeyMask`` is uint8 [B, seq_k], nonzero = attend; the forward and dQ kernels also take
  ``KeyStart``, int [B]: the first key each entry's mask shows, or 0 where it shows none, and start their key loops
  at that key's block: ``skip_hidden_prefix``).
* ``DOT``: operand precision of every ``tl.dot``: "fp16", "bf16", "ieee" (true fp32), "tf32", or
  "bf16_emulated" (operands rounded to bf16 then multiplied in fp32: the interpreter's stand-in for bf16 dots,
  whose interpreted ``tl.dot`` is broken). Accumulation is always fp32.
* Batch and head offsets are 64-bit (B*H*S*D passes 2**31 at B=32, S=100,000, H=16, D=64); offsets inside
  one (batch, head) are 32-bit, which the launcher checks.
* ``SEQ_Q_BUCKET``/``SEQ_K_BUCKET``/``BATCH_HEADS_BUCKET`` are powers of two of the sequence lengths and of
  batch * heads, passed only as autotuning keys: the sizes themselves are runtime integers, so a new size reuses
  the compiled kernels and tuned config of its bucket (``tuning.tuning_buckets``).

Variants (constexpr flags, all False by default so that a dense launch compiles exactly as it did without them):

* ``i'``: query row i aligned to the causal diagonal, ``i + diag_shift`` (diag_shift = seq_k - seq_q for CAUSAL 2,
  else 0; CAUSAL 0 aligns top-left like 1).
* ``WINDOW``: query i sees keys ``i' - window_left <= j <= i' + window_right``. The kernels take both sides as
  non-negative integers (the launcher turns "unbounded" into a side no key lies beyond); causal still hides
  j > i', so with CAUSAL != 0 only the left side matters.
* ``SOFTCAP``: scores s = scale * q.k become ``softcap * tanh(s / softcap)`` (``softcap`` in natural units).
* ``ALIBI``: then ``-slope[b, h] * |i' - j|`` is added (``Alibi`` float32, batch stride 0 for [H] slopes).
* Masks (causal, window, key length, key mask) apply last, always with ``where``.

Packed variable-length batches (constexpr ``VARLEN``, False by default): the sequences lie end to end on the
token axis of q [total_q, H, D] and k, v [total_k, H_kv, D], which the launcher passes as [B, H, total, D] views
with batch stride 0; ``CuSeqQ`` / ``CuSeqK`` are int32 [B + 1] starts (``cu_seqlens``). The runtime ``seq_q`` and
``seq_k`` are then the longest sequence's lengths: they size the grid and the padded [B, H, seq_q] rows of the
log-sum-exp and delta, and each program replaces them with its own sequence's lengths (``varlen_sequence``), so
every mask, loop bound and causal alignment is per sequence. Programs past their sequence's end compute nothing
and store nothing (EVEN_M is off for VARLEN).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to_bf16(x):
    """float32 -> nearest bfloat16 value (ties to even), kept in float32. The interpreter's own float32 -> bf16
    cast truncates, and truncation's bias accumulates in long sums; this is what a GPU's cast does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mma(a, b, acc, DOT: tl.constexpr):
    """acc + a @ b with the operand precision DOT names; a may be a float32 tile (probabilities, dS)."""
    if DOT == "fp16":
        acc = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
    elif DOT == "bf16":
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    elif DOT == "ieee":
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif DOT == "tf32":
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="tf32")
    else:  # "bf16_emulated"
        acc = tl.dot(round_to_bf16(a.to(tl.float32)), round_to_bf16(b.to(tl.float32)), acc,
                     input_precision="ieee")
    return acc


@triton.jit
def cast_out(x, dtype: tl.constexpr, DOT: tl.constexpr):
    """Cast a float32 result to the output dtype, rounding to nearest under the interpreter too."""
    if DOT == "bf16_emulated":
        if dtype == tl.bfloat16:
            x = round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def load_rows(ptrs, rows, n_rows, cols, n_cols: tl.constexpr, BLOCK_COLS: tl.constexpr,
              CHECK_ROWS: tl.constexpr):
    """Load a [rows, cols] tile, masking rows >= n_rows when CHECK_ROWS and padded columns >= n_cols."""
    if CHECK_ROWS:
        if BLOCK_COLS != n_cols:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if BLOCK_COLS != n_cols:
            tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


@triton.jit
def load_rows_where(ptrs, row_ok, cols, n_cols: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """Load a [rows, cols] tile with zeros in the rows where ``row_ok`` is False and in padded columns: the copy
    itself fills them, so the tile still goes straight to the tensor cores."""
    if BLOCK_COLS != n_cols:
        return tl.load(ptrs, mask=row_ok[:, None] & (cols[None, :] < n_cols), other=0.0)
    return tl.load(ptrs, mask=row_ok[:, None], other=0.0)


@triton.jit
def load_cols_where(ptrs, rows, n_rows: tl.constexpr, BLOCK_ROWS: tl.constexpr, col_ok):
    """The transposed mirror of ``load_rows_where``: zeros in the columns where ``col_ok`` is False."""
    if BLOCK_ROWS != n_rows:
        return tl.load(ptrs, mask=(rows[:, None] < n_rows) & col_ok[None, :], other=0.0)
    return tl.load(ptrs, mask=col_ok[None, :], other=0.0)


@triton.jit
def load_cols(ptrs, rows, n_rows: tl.constexpr, BLOCK_ROWS: tl.constexpr, cols, n_cols,
              CHECK_COLS: tl.constexpr):
    """Load a transposed [rows=head dim, cols=sequence] tile; the mirror of ``load_rows``."""
    if CHECK_COLS:
        if BLOCK_ROWS != n_rows:
            tile = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            tile = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
    else:
        if BLOCK_ROWS != n_rows:
            tile = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            tile = tl.load(ptrs)
    return tile


# log2(e): the kernels keep scores in base 2 (see attention_fwd), so natural-unit constants are scaled by it.
LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def tanh(x):
    """tanh(x) from exp2, so that one definition runs under the interpreter and compiles for sm_90 alike:
    tanh(|x|) = (1 - t) / (1 + t) with t = e^(-2|x|) = 2^(-2|x| log2 e) in (0, 1], which never overflows (large
    |x| gives t = 0 and exactly 1), and the sign is restored afterwards.

    Below |x| = 1/8 the odd series x - x^3/3 + 2x^5/15 - 17x^7/315 is used instead: there 1 - t cancels, and its
    relative error grows as 1/|x| (with softcap 1e5 the scores came out 2.6e-3 off in float32). The series'
    first omitted term, 62x^9/2835, is below 2e-10 there; the exp2 form's error at 1/8 is a few float32 ulps."""
    # The tensor goes on the left: from Triton 3.9 the interpreter evaluates ``constexpr * tensor`` as a constexpr
    # holding a tensor, which exp2 then rejects; ``tensor * constexpr`` means the same under every version.
    t = tl.math.exp2(tl.abs(x) * (-2.0 * LOG2E))
    r = (1.0 - t) / (1.0 + t)
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return tl.where(tl.abs(x) < 0.125, series, tl.where(x < 0, -r, r))


@triton.jit
def varlen_sequence(CuSeqQ, CuSeqK, b):
    """(q start, k start, S_q, S_k) of packed sequence b, from the int32 [B + 1] starts of q's and k's tokens."""
    q_start = tl.load(CuSeqQ + b)
    k_start = tl.load(CuSeqK + b)
    return q_start, k_start, tl.load(CuSeqQ + b + 1) - q_start, tl.load(CuSeqK + b + 1) - k_start


@triton.jit
def program_ids(num_seq_blocks, FLAT_GRID: tl.constexpr):
    """(sequence block, batch * head) of this program. The launchers put sequence blocks on grid axis 0 and
    batch * heads on axis 1, or flatten both into axis 0 when batch * heads passes axis 1's limit of 65,535."""
    if FLAT_GRID:
        pid = tl.program_id(0)
        return pid % num_seq_blocks, pid // num_seq_blocks
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def window_shift_and_right(seq_q, seq_k, window_right, CAUSAL: tl.constexpr):
    """(diag_shift, right side) of a windowed kernel: with causal the diagonal is the tighter right side."""
    if CAUSAL == 2:
        diag_shift = seq_k - seq_q
    else:
        diag_shift = 0
    if CAUSAL != 0:
        right = 0
    else:
        right = window_right
    return diag_shift, right


@triton.jit
def variant_scalars(Alibi, b, h, stride_alibi_b, stride_alibi_h, softcap, placeholder, SOFTCAP: tl.constexpr,
                    ALIBI: tl.constexpr):
    """(softcap, ALiBi slope of (b, h)), both in base 2 (times log2 e, as the scores). A variant that is off gets
    ``placeholder``, a scalar the kernel has anyway and never reads then: a literal would be a new constant, and a
    dense kernel would no longer compile to exactly the IR it did before the variants existed."""
    softcap2 = placeholder
    if SOFTCAP:
        softcap2 = softcap * LOG2E
    slope2 = placeholder
    if ALIBI:
        slope2 = tl.load(Alibi + b.to(tl.int64) * stride_alibi_b + h * stride_alibi_h) * LOG2E
    return softcap2, slope2


@triton.jit
def key_range(KeyLen,  # [B] int32/int64 when KEY_MASK == "lengths" (else unused)
              b, start_m, seq_q, seq_k, window_left, window_right, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr, WINDOW: tl.constexpr):
    """The keys a block of query rows [start_m, start_m + BLOCK_M) visits, shared by the forward and dQ kernels:
    (n_len: keys that exist for batch b, diag_shift: causal offset, first, lo, full_start, full_end, hi): key
    blocks [lo, full_start) and [full_end, hi) need the causal/window/length masks, keys [full_start, full_end)
    need none, and keys outside [first, hi) are invisible to every row (first <= lo + BLOCK_N: the first key any
    row's window reaches). lo, full_start and full_end are multiples of BLOCK_N. Without WINDOW, first = lo =
    full_start = 0 (the left side is unbounded), and the ranges are computed as before the window existed."""
    if KEY_MASK == "lengths":
        n_len = tl.minimum(tl.maximum(tl.load(KeyLen + b), 0), seq_k).to(tl.int32)
    else:
        n_len = seq_k
    if WINDOW:
        diag_shift, right = window_shift_and_right(seq_q, seq_k, window_right, CAUSAL)
        if CAUSAL == 3:
            diag_shift = n_len - seq_q
        first_row = start_m + diag_shift  # i' of the block's first row and of its last real row
        last_row = tl.minimum(start_m + BLOCK_M, seq_q) - 1 + diag_shift
        # Keys some row sees: from the first row's left edge to the last row's right edge. Keys every row sees:
        # from the last row's left edge to the first row's right edge (empty when the block is taller than the
        # window is wide).
        seen_lo = tl.maximum(first_row - window_left, 0)
        hi = tl.minimum(tl.maximum(last_row + right + 1, 0), n_len)
        all_lo = tl.maximum(last_row - window_left, 0)
        all_hi = tl.minimum(tl.maximum(first_row + right + 1, 0), n_len)
        lo = (seen_lo // BLOCK_N) * BLOCK_N
        full_start = tl.cdiv(all_lo, BLOCK_N) * BLOCK_N
        full_end = (all_hi // BLOCK_N) * BLOCK_N
        # No whole block every row sees: the masked loop alone covers [lo, hi).
        no_full = full_start >= full_end
        full_start = tl.where(no_full, lo, full_start)
        full_end = tl.where(no_full, lo, full_end)
        return n_len, diag_shift, seen_lo, lo, full_start, full_end, hi
    else:
        if CAUSAL != 0:
            if CAUSAL == 1:
                diag_shift = 0
            elif CAUSAL == 3:
                diag_shift = n_len - seq_q
            else:
                diag_shift = seq_k - seq_q
            # Keys below every row's diagonal need no mask; keys up to the last real row's diagonal need one.
            full_lim = tl.minimum(tl.maximum(start_m + diag_shift + 1, 0), n_len)
            hi = tl.minimum(tl.maximum(tl.minimum(start_m + BLOCK_M, seq_q) + diag_shift, 0), n_len)
        else:
            diag_shift = 0
            full_lim = n_len
            hi = n_len
        full_end = (full_lim // BLOCK_N) * BLOCK_N
        return n_len, diag_shift, 0, 0, 0, full_end, hi


@triton.jit
def skip_hidden_prefix(KeyStart,  # [B] int32/int64: first nonzero of each row of the boolean key mask (or 0)
                       b, lo, full_start, full_end, hi, BLOCK_N: tl.constexpr):
    """``key_range``'s (lo, full_start, full_end, hi) with the key blocks wholly before entry b's first visible key
    dropped: the mask hides those keys from every row (a left-padded batch's padding), so they add nothing to any
    row's softmax and the loops may start at the block holding that key. The order lo <= full_start <= full_end
    <= hi is kept (an empty range where the block lies past hi), and lo stays a multiple of BLOCK_N for split-KV
    shares. An entry whose mask shows no key has KeyStart 0 and skips nothing: its rows see no key as before."""
    start = (tl.load(KeyStart + b).to(tl.int32) // BLOCK_N) * BLOCK_N
    lo = tl.maximum(lo, start)
    hi = tl.maximum(hi, lo)
    full_start = tl.maximum(full_start, lo)
    full_end = tl.maximum(full_end, full_start)
    return lo, full_start, full_end, hi
