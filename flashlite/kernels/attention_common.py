"""Triton helpers shared by the attention kernels: tile loads, dot products, casts, program ids, key ranges.

``attention_fwd`` and ``attention_bwd`` build their kernels from these ``@triton.jit`` functions (inlined when a
kernel compiles). Conventions of the kernels' parameters, which the helpers follow:

* ``CAUSAL``: 0 none; 1 top-left (query i sees keys j <= i, like SDPA's ``is_causal``); 2 bottom-right
  (j <= i + seq_k - seq_q).
* ``KEY_MASK``: "none"; "lengths" (``KeyLen`` is int [B], keys j >= length are masked, the length clamped to
  [0, seq_k]); "bool" (``KeyMask`` is uint8 [B, seq_k], nonzero = attend).
* ``DOT``: operand precision of every ``tl.dot``: "fp16", "bf16", "ieee" (true fp32), "tf32", or
  "bf16_emulated" (operands rounded to bf16 then multiplied in fp32: the interpreter's stand-in for bf16 dots,
  whose interpreted ``tl.dot`` is broken). Accumulation is always fp32.
* Batch and head offsets are 64-bit (B*H*S*D passes 2**31 at B=32, S=100,000, H=16, D=64); offsets inside
  one (batch, head) are 32-bit, which the launcher checks.
* ``SEQ_Q_BUCKET``/``SEQ_K_BUCKET``/``BATCH_HEADS_BUCKET`` are powers of two of the sequence lengths and of
  batch * heads, passed only as autotuning keys: the sizes themselves are runtime integers, so a new size reuses
  the compiled kernels and tuned config of its bucket (``tuning.tuning_buckets``).
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


@triton.jit
def program_ids(num_seq_blocks, FLAT_GRID: tl.constexpr):
    """(sequence block, batch * head) of this program. The launchers put sequence blocks on grid axis 0 and
    batch * heads on axis 1, or flatten both into axis 0 when batch * heads passes axis 1's limit of 65,535."""
    if FLAT_GRID:
        pid = tl.program_id(0)
        return pid % num_seq_blocks, pid // num_seq_blocks
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def key_range(KeyLen,  # [B] int32/int64 when KEY_MASK == "lengths" (else unused)
              b, start_m, seq_q, seq_k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
              KEY_MASK: tl.constexpr):
    """The keys a block of query rows [start_m, start_m + BLOCK_M) visits, shared by the forward and dQ kernels:
    (n_len: keys that exist for batch b, diag_shift: causal offset, full_end: keys [0, full_end) need no mask,
    hi: keys [full_end, hi) need the causal/length mask; keys past hi are invisible to every row)."""
    if KEY_MASK == "lengths":
        n_len = tl.minimum(tl.maximum(tl.load(KeyLen + b), 0), seq_k).to(tl.int32)
    else:
        n_len = seq_k
    if CAUSAL != 0:
        if CAUSAL == 1:
            diag_shift = 0
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
    return n_len, diag_shift, full_end, hi
