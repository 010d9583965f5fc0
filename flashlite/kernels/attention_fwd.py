"""Forward kernel of flashlite's attention: online softmax over key blocks, scores never leave the chip.

One program computes a block of BLOCK_M query rows of one (batch, head) pair, or of BH_PER_PROGRAM pairs one after
another (a tuning choice for short sequences, where one block is little work): the query tile stays in registers
while key and value tiles of BLOCK_N rows stream through, with a running row maximum ``m``, running sum ``l``
and unnormalised accumulator ``acc`` in float32. Scores are kept in base 2: ``qk_scale = scale * log2(e)`` is
folded into the dot product so the softmax uses ``exp2``. The output is normalised once at the end, and the
log-sum-exp is stored for the backward pass, also in base 2:

    lse[b, h, i] = log2(sum_j 2 ** (scale * log2(e) * q_i . k_j))      (= natural log-sum-exp * log2(e))

A row that sees no key (everything masked) has l = 0: its output is 0 and its lse is -inf.

Conventions shared with ``attention_bwd``:

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
  the compiled kernels and tuned config of its bucket.
"""
from __future__ import annotations

import triton
import triton.language as tl

from flashlite import _runtime
from flashlite._intmath import next_power_of_2
from flashlite.dispatch import seq_bucket

# Shared memory per thread block on H100/H200: 227 KB (232,448 bytes, the limit Triton reports). The pruning keeps
# the configs whose estimate (``shared_memory_estimate``, fitted to what the compiler allocates) fits it; with
# autotuning off the first config of the list that fits is used, so a wrong estimate there is a crash.
SHARED_MEMORY_BUDGET = 227 * 1024
# Beside the tiles, the compiled kernels keep up to 1 KB of barriers and cross-warp reduction scratch (512 bytes
# measured for a 128-row block; the estimate keeps twice that).
SCRATCH_BYTES = 1024


@triton.jit
def _round_to_bf16(x):
    """float32 -> nearest bfloat16 value (ties to even), kept in float32. The interpreter's own float32 -> bf16
    cast truncates, and truncation's bias accumulates in long sums; this is what a GPU's cast does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mma(a, b, acc, DOT: tl.constexpr):
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
        acc = tl.dot(_round_to_bf16(a.to(tl.float32)), _round_to_bf16(b.to(tl.float32)), acc,
                     input_precision="ieee")
    return acc


@triton.jit
def _cast_out(x, dtype: tl.constexpr, DOT: tl.constexpr):
    """Cast a float32 result to the output dtype, rounding to nearest under the interpreter too."""
    if DOT == "bf16_emulated":
        if dtype == tl.bfloat16:
            x = _round_to_bf16(x)
    return x.to(dtype)


@triton.jit
def _load_rows(ptrs, rows, n_rows, cols, n_cols: tl.constexpr, BLOCK_COLS: tl.constexpr,
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
def _load_cols(ptrs, rows, n_rows: tl.constexpr, BLOCK_ROWS: tl.constexpr, cols, n_cols,
               CHECK_COLS: tl.constexpr):
    """Load a transposed [rows=head dim, cols=sequence] tile; the mirror of ``_load_rows``."""
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
def _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,  # k_base, v_base: one (b, kv head); mask_row: [S_k]
                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                    offs_m, offs_d, start, end, n_len, diag_shift, qk_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr, DOT: tl.constexpr, BOUNDARY: tl.constexpr):
    """Fold key blocks [start, end) into the running softmax. BOUNDARY: the blocks may cross the causal diagonal
    or the key length, so apply those masks; blocks outside that need no mask at all."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + offs_n0
        kt = _load_cols(k_base + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                        offs_d, HEAD_DIM, BLOCK_D, offs_n, n_len, BOUNDARY)
        scores = _mma(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT)
        if BOUNDARY or KEY_MASK == "bool":
            qk = scores * qk_scale
            # Masks are applied with `where`, never added: a hidden key may hold NaN or inf (a cache filled past
            # its end), and NaN + -inf is NaN. A hidden key's score only ever reaches its own column.
            if BOUNDARY:
                visible = offs_n[None, :] < n_len
                if CAUSAL != 0:
                    visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift)
                qk = tl.where(visible, qk, float("-inf"))
            if KEY_MASK == "bool":
                keep = tl.load(mask_row + offs_n * stride_mask_n, mask=offs_n < n_len, other=0) != 0
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
        v = _load_rows(v_base + offs_n[:, None] * stride_vn + offs_d[None, :] * stride_vd,
                       offs_n, n_len, offs_d, HEAD_DIM, BLOCK_D, BOUNDARY)
        # Values, unlike scores, are summed across keys: p = 0 times a NaN value is NaN in every row of the tile.
        # Values of keys that no row may see are zeroed; lengths and bounds already load them as zeros.
        if KEY_MASK == "bool":
            v = tl.where(keep[:, None], v, 0.0)
        if BOUNDARY and CAUSAL != 0:
            # A key on the diagonal is hidden from the rows above it and seen by the rows below. Its value is
            # zeroed for the product when it is not finite, and the rows that see it are set to NaN afterwards, as
            # the exact sum would be: hidden garbage stays out, a visible NaN or inf still shows.
            bad_key = tl.max(tl.where((v == v) & (tl.abs(v) < float("inf")), 0, 1), 1)  # [BLOCK_N]
            v = tl.where(bad_key[:, None] != 0, 0.0, v)
            sees_bad = tl.max(tl.where(visible & (bad_key[None, :] != 0), 1, 0), 1)  # [BLOCK_M]
            acc = _mma(p, v, acc * alpha[:, None], DOT)
            acc = tl.where(sees_bad[:, None] != 0, float("nan"), acc)
        else:
            acc = _mma(p, v, acc * alpha[:, None], DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _program_ids(num_seq_blocks, FLAT_GRID: tl.constexpr):
    """(sequence block, batch * head) of this program. The launchers put sequence blocks on grid axis 0 and
    batch * heads on axis 1, or flatten both into axis 0 when batch * heads passes axis 1's limit of 65,535."""
    if FLAT_GRID:
        pid = tl.program_id(0)
        return pid % num_seq_blocks, pid // num_seq_blocks
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def _key_range(KeyLen,  # [B] int32/int64 when KEY_MASK == "lengths" (else unused)
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


@triton.jit
def _attn_fwd(Q,  # [B, H, S_q, D], any strides
              K,  # [B, H_kv, S_k, D], any strides
              V,  # [B, H_kv, S_k, D], any strides
              Out,  # [B, H, S_q, D], dtype of Q
              Lse,  # [B, H, S_q] float32, contiguous; base-2 log-sum-exp of the scaled scores (unused: STORE_LSE off)
              KeyMask,  # [B, S_k] uint8 when KEY_MASK == "bool" (else unused)
              KeyLen,  # [B] int32/int64 when KEY_MASK == "lengths" (else unused)
              stride_qb, stride_qh, stride_qm, stride_qd,
              stride_kb, stride_kh, stride_kn, stride_kd,
              stride_vb, stride_vh, stride_vn, stride_vd,
              stride_ob, stride_oh, stride_om, stride_od,
              stride_mask_b, stride_mask_n,
              num_heads, group_size, seq_q, seq_k, qk_scale, batch_heads,
              SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET,  # autotuning keys only
              HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
              DOT: tl.constexpr, FLAT_GRID: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr, BH_PER_PROGRAM: tl.constexpr = 1,
              STORE_LSE: tl.constexpr = True):
    # Grid: axis 0 query blocks, axis 1 groups of BH_PER_PROGRAM (batch, head) pairs; flattened into axis 0 when
    # the groups exceed axis 1's limit. Several pairs per program give short sequences, whose programs are tiny,
    # more work per launch slot; the autotuner decides where that pays.
    num_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m, pid_group = _program_ids(num_m_blocks, FLAT_GRID)
    if CAUSAL != 0:
        # Later query blocks see more keys; launch them first so the short ones fill the tail.
        pid_m = num_m_blocks - 1 - pid_m
    if BH_PER_PROGRAM == 1:
        _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen,
                        stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
                        stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh, stride_om, stride_od,
                        stride_mask_b, stride_mask_n, num_heads, group_size, seq_q, seq_k, qk_scale,
                        pid_m, pid_group, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, BLOCK_M, BLOCK_N, EVEN_M,
                        STORE_LSE)
    else:
        for i in tl.static_range(BH_PER_PROGRAM):
            pid_bh = pid_group * BH_PER_PROGRAM + i
            if pid_bh < batch_heads:
                _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen,
                                stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn,
                                stride_kd, stride_vb, stride_vh, stride_vn, stride_vd, stride_ob, stride_oh,
                                stride_om, stride_od, stride_mask_b, stride_mask_n, num_heads, group_size, seq_q,
                                seq_k, qk_scale, pid_m, pid_bh, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, BLOCK_M,
                                BLOCK_N, EVEN_M, STORE_LSE)


@triton.jit
def _attn_fwd_block(Q, K, V, Out, Lse, KeyMask, KeyLen,  # as in _attn_fwd
                    stride_qb, stride_qh, stride_qm, stride_qd,
                    stride_kb, stride_kh, stride_kn, stride_kd,
                    stride_vb, stride_vh, stride_vn, stride_vd,
                    stride_ob, stride_oh, stride_om, stride_od,
                    stride_mask_b, stride_mask_n,
                    num_heads, group_size, seq_q, seq_k, qk_scale, pid_m, pid_bh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr, KEY_MASK: tl.constexpr,
                    DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_M: tl.constexpr,
                    STORE_LSE: tl.constexpr):
    """Query block ``pid_m`` of the (batch, head) pair ``pid_bh``: output rows and, with STORE_LSE (needed only
    for a backward pass), their log-sum-exp."""
    b = pid_bh // num_heads
    h = pid_bh % num_heads
    kv_h = h // group_size
    start_m = pid_m * BLOCK_M

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + kv_h.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + kv_h.to(tl.int64) * stride_vh
    mask_row = KeyMask + b.to(tl.int64) * stride_mask_b

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q = _load_rows(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd,
                   offs_m, seq_q, offs_d, HEAD_DIM, BLOCK_D, not EVEN_M)

    n_len, diag_shift, full_end, hi = _key_range(KeyLen, b, start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL,
                                                 KEY_MASK)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,
                                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                    offs_m, offs_d, 0, full_end, n_len, diag_shift, qk_scale,
                                    BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, False)
    acc, l_i, m_i = _attn_fwd_inner(acc, l_i, m_i, q, k_base, v_base, mask_row,
                                    stride_kn, stride_kd, stride_vn, stride_vd, stride_mask_n,
                                    offs_m, offs_d, full_end, hi, n_len, diag_shift, qk_scale,
                                    BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, CAUSAL, KEY_MASK, DOT, True)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))

    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    lse_ptrs = Lse + pid_bh.to(tl.int64) * seq_q + offs_m
    out = _cast_out(out, Out.dtype.element_ty, DOT)
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


# ----------------------------------------------------------------------------------------------------------------
# Autotuning: configurations, shared-memory pruning, and the tuned entry point.

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
# Under the interpreter autotuning would only cost time; one small config, with unequal blocks on purpose so that
# CPU tests exercise the diagonal logic where BLOCK_M != BLOCK_N.
FWD_INTERPRETER_BLOCKS = [(32, 16, 4, 1)]


def make_configs(blocks: list[tuple[int, ...]]) -> list[triton.Config]:
    """Triton configs from (BLOCK_M, BLOCK_N, num_warps, num_stages[, BH_PER_PROGRAM]) tuples.

    Example:
        >>> make_configs([(32, 16, 4, 1)])[0].kwargs, make_configs([(64, 64, 4, 3, 2)])[0].kwargs
        ({'BLOCK_M': 32, 'BLOCK_N': 16}, {'BLOCK_M': 64, 'BLOCK_N': 64, 'BH_PER_PROGRAM': 2})
    """
    configs = []
    for bm, bn, warps, stages, *pairs in blocks:
        meta = {"BLOCK_M": bm, "BLOCK_N": bn, **({"BH_PER_PROGRAM": pairs[0]} if pairs else {})}
        configs.append(triton.Config(meta, num_warps=warps, num_stages=stages))
    return configs


def fwd_configs() -> list[triton.Config]:
    """Forward configs for where the kernels run: the GPU list, or the single interpreter config."""
    return make_configs(FWD_INTERPRETER_BLOCKS if _runtime.interpreting() else FWD_GPU_BLOCKS)


def _operand_bytes(args: dict) -> int:
    # Operands are staged in shared memory in their input dtype (float32 inputs stay 4 bytes even with tf32).
    return args["Q"].element_size()


def shared_memory_estimate(config: triton.Config, block_d: int, elem: int, *, streamed: str, resident: str,
                           resident_tiles: int = 1, transposed_fp32_tiles: int = 0, scratch: int = 0) -> int:
    """Bytes of shared memory a kernel of ``config`` asks for: ``num_stages`` buffers of the two pipelined tiles of
    ``streamed`` rows, ``resident_tiles`` tiles of ``resident`` rows held for the whole program, for 4-byte
    operands ``transposed_fp32_tiles`` more tiles of ``streamed`` rows (tf32 tensor-core products read both
    operands in one major order, so a transposed float32 operand is copied), and ``scratch``.

    Fitted to what Triton 3.6 allocates when it compiles the kernels for sm_90 (every config of the lists, head
    dims 16 to 256, bf16 and float32; tests/flashlite/test_attention_shared_memory.py compiles each kept config and
    checks): the tiles account for all of it but ``SCRATCH_BYTES``; the backward kernels keep two resident tiles
    (k and v, or q and dO), and dQ's float32 product dS K^T one transposed copy of the key tile.

    Example:
        >>> shared_memory_estimate(make_configs([(128, 64, 4, 3)])[0], 128, 2, streamed="BLOCK_N", resident="BLOCK_M")
        131072
    """
    meta = config.kwargs
    streamed_tiles = config.num_stages * 2 + (transposed_fp32_tiles if elem == 4 else 0)
    return (streamed_tiles * meta[streamed] + resident_tiles * meta[resident]) * block_d * elem + scratch


def prune_by_resources(configs: list[triton.Config], named_args: dict, *, streamed: tuple[str, str],
                       resident: str, resident_tiles: int = 1, transposed_fp32_tiles: int = 0, scratch: int = 0,
                       budget: int = SHARED_MEMORY_BUDGET, **kwargs) -> list[triton.Config]:
    """Drop configs whose shared memory (``shared_memory_estimate``) passes ``budget`` or whose accumulators cannot
    fit registers.

    ``streamed`` names the two block sizes of the tiles that are pipelined (two tiles of ``streamed[0]`` rows per
    stage), ``resident`` the block size of the tiles that stay on chip; ``resident_tiles``,
    ``transposed_fp32_tiles`` and ``scratch`` as in ``shared_memory_estimate``. Always keeps at least the smallest
    config.
    """
    args = {**named_args, **kwargs}
    block_d = args["BLOCK_D"]
    elem = _operand_bytes(args)
    kept = []
    for config in configs:
        smem = shared_memory_estimate(config, block_d, elem, streamed=streamed[0], resident=resident,
                                      resident_tiles=resident_tiles, transposed_fp32_tiles=transposed_fp32_tiles,
                                      scratch=scratch)
        # Rough register bound: a float32 [resident, BLOCK_D] accumulator over num_warps * 32 threads.
        acc_regs = config.kwargs[resident] * block_d // (config.num_warps * 32)
        if smem <= budget and acc_regs <= 128:
            kept.append(config)
    if not kept:
        kept = [min(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)]
    return kept


def prune_fwd_configs(configs, named_args, **kwargs):
    # Several (batch, head) pairs per program only where a sequence gives each program little work.
    short = named_args.get("SEQ_Q_BUCKET", MULTI_PAIR_MAX_SEQ + 1) <= MULTI_PAIR_MAX_SEQ
    configs = [c for c in configs if short or c.kwargs.get("BH_PER_PROGRAM", 1) == 1]
    return prune_by_resources(configs, named_args, streamed=("BLOCK_N", "BLOCK_M"), resident="BLOCK_M",
                              scratch=SCRATCH_BYTES, **kwargs)


# Sequence lengths enter the autotuning key as powers of two, capped here: past it the best tiles no longer change,
# and the longest cases (S=100,000 takes over a second per call) reuse the tuning of a shorter one.
MAX_SEQ_BUCKET = 16384
# Batch * heads joins the key as a power of two (capped): it sets how many programs share the GPU, so a config tuned
# at B=1 (a fraction of one wave) is not reused at B=16 (many waves) of the same sequence length.
MAX_BATCH_HEADS_BUCKET = 4096
AUTOTUNE_KEY = ["SEQ_Q_BUCKET", "SEQ_K_BUCKET", "BATCH_HEADS_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK", "DOT"]


def tuning_buckets(seq_q: int, seq_k: int, batch_heads: int) -> tuple[int, int, int]:
    """The autotuning key's size buckets (SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET): powers of two, capped.

    Example:
        >>> tuning_buckets(1000, 77, 3 * 5), tuning_buckets(100_000, 100_000, 32 * 16)
        ((1024, 128, 16), (16384, 16384, 512))
    """
    return (min(seq_bucket(seq_q), MAX_SEQ_BUCKET), min(seq_bucket(seq_k), MAX_SEQ_BUCKET),
            min(next_power_of_2(batch_heads), MAX_BATCH_HEADS_BUCKET))


# The kernel with EVEN_M derived from the block size; launch it directly to force a config.
attn_fwd_fixed = triton.heuristics({"EVEN_M": lambda a: a["seq_q"] % a["BLOCK_M"] == 0})(_attn_fwd)
# The autotuned entry point the launcher uses. Tensor dtypes join the key automatically.
attn_fwd = triton.autotune(configs=fwd_configs(), key=AUTOTUNE_KEY,
                           prune_configs_by={"early_config_prune": prune_fwd_configs})(attn_fwd_fixed)
