"""Triton kernels for LayerNorm (optionally fused with a residual add) and for bias + exact GELU.

Raw ``@triton.jit`` kernels only; inputs are checked and grids computed in ``flashlite.norm``.

Row tensors ([M, N]) need unit column stride (the launchers copy when they have not) and take any row stride,
0 included; the [N] parameters take any stride (a column of a matrix, an expanded scalar with stride 0), so the
launchers never copy them. Pointers include the tensor's storage offset.

The LayerNorm kernels hold whole rows in registers: a tile of ``BLOCK_M`` rows by ``BLOCK_N =
next_power_of_two(N)`` columns, masked past ``M`` and ``N`` (one row per program for wide rows on a GPU; many
under the interpreter, whose cost is per program). The GELU kernels are flat elementwise passes. Statistics and
elementwise math run in float32 whatever the storage dtype; results are rounded once, on the store.
"""
from __future__ import annotations

import triton
import triton.language as tl

# 1/sqrt(2) and 1/sqrt(2*pi), for the exact (erf) GELU and its derivative.
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _cast_for_store(x, dtype: tl.constexpr, EMULATE_RTNE: tl.constexpr):
    """Round float32 ``x`` to ``dtype`` to nearest-even.

    Compiled kernels already round that way; Triton's CPU interpreter truncates float32 -> bfloat16 instead, which
    doubles the rounding error, so under the interpreter (``EMULATE_RTNE``) the rounding is done on the bits.
    """
    if EMULATE_RTNE:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _centered_rows(x, mask, cols, N):
    """Rows of ``x`` [BLOCK_M, BLOCK_N] (float32, zero where masked) minus their means, zero where masked.

    Two passes over rows held in registers: the mean first, then (by the caller) squared deviations from it; the
    one-pass E[x^2] - E[x]^2 cancels catastrophically when the mean is large against the spread. The mean itself
    is taken of values shifted by each row's first element: x - shift is exact for values near it, so a large
    common offset costs no precision in the sum either.
    """
    shift = tl.sum(tl.where(cols[None, :] == 0, x, 0.0), axis=1)
    shifted = tl.where(mask, x - shift[:, None], 0.0)
    return tl.where(mask, shifted - (tl.sum(shifted, axis=1) / N)[:, None], 0.0)


@triton.jit
def _layer_norm_fwd_kernel(
    X,  # [M, N] input rows (the residual stream when HAS_RESIDUAL)
    RESIDUAL,  # [M, N] branch output added to X before normalizing; unused unless HAS_RESIDUAL
    SUM_OUT,  # [M, N] X + RESIDUAL, the new residual stream; unused unless HAS_RESIDUAL
    W,  # [N] scale, element stride stride_w
    B,  # [N] shift, element stride stride_b
    Y,  # [M, N] normalized output, in its own dtype
    RSTD,  # [M] float32 row reciprocal standard deviations, kept for the backward pass
    stride_x,
    stride_r,
    stride_s,
    stride_y,
    stride_w,
    stride_b,
    M,
    N,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    mask = row_mask[:, None] & (cols < N)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(RESIDUAL + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        summed = _cast_for_store(x, SUM_OUT.dtype.element_ty, EMULATE_RTNE)
        tl.store(SUM_OUT + rows[:, None] * stride_s + cols[None, :], summed, mask=mask)
        # Normalize what was stored, so that the backward pass (which reads SUM_OUT) sees the same values.
        x = summed.to(tl.float32)
    centered = _centered_rows(x, mask, cols, N)
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=row_mask)
    # int64 column offsets: for a parameter that is a column of a large matrix, cols * stride can pass 2**31.
    w = tl.load(W + cols.to(tl.int64) * stride_w, mask=cols < N, other=0.0).to(tl.float32)
    b = tl.load(B + cols.to(tl.int64) * stride_b, mask=cols < N, other=0.0).to(tl.float32)
    y = centered * rstd[:, None] * w[None, :] + b[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _cast_for_store(y, Y.dtype.element_ty, EMULATE_RTNE),
             mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    X,  # [M, N] the rows that were normalized (SUM_OUT of the forward pass when a residual was fused)
    W,  # [N] scale, element stride stride_w
    DY,  # [M, N] gradient of the normalized output
    DSUM,  # [M, N] gradient reaching the residual stream directly; unused unless HAS_DSUM
    DX,  # [M, N] gradient of the normalized rows (plus DSUM when HAS_DSUM)
    DW_PARTIAL,  # [num_programs, N] float32 per-program partial sums of dW
    DB_PARTIAL,  # [num_programs, N] float32 per-program partial sums of dB
    RSTD,  # [M] float32 reciprocal standard deviations from the forward pass
    stride_x,
    stride_dy,
    stride_ds,
    stride_dx,
    stride_w,
    M,
    N,
    rows_per_program,  # a multiple of BLOCK_M
    HAS_DSUM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w = tl.load(W + cols.to(tl.int64) * stride_w, mask=col_mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # int64 bounds make the loop index int64, so row offsets cannot overflow on very large inputs.
    row_start = pid.to(tl.int64) * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for tile_start in range(row_start, row_end, BLOCK_M):
        rows = tile_start + tl.arange(0, BLOCK_M)
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        # The mean is recomputed as in the forward pass rather than stored: a float32 mean rounded at a large
        # offset would shift every centered value by up to half an ulp of that offset.
        xhat = _centered_rows(x, mask, cols, N) * rstd[:, None]
        wdy = w[None, :] * dy
        # dx = rstd * (w*dy - mean(w*dy) - xhat * mean(w*dy*xhat)): the gradient through the row statistics.
        c_xhat = tl.sum(xhat * wdy, axis=1) / N
        c_mean = tl.sum(wdy, axis=1) / N
        dx = (wdy - (xhat * c_xhat[:, None] + c_mean[:, None])) * rstd[:, None]
        if HAS_DSUM:
            dx += tl.load(DSUM + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], _cast_for_store(dx, DX.dtype.element_ty, EMULATE_RTNE),
                 mask=mask)
        dw_acc += dy * xhat
        db_acc += dy
    tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    tl.store(DB_PARTIAL + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


@triton.jit
def _biased_block(X,  # [M, N] matmul output without its bias, contiguous
                  BIAS,  # [N], element stride stride_bias
                  stride_bias, numel, N, BLOCK: tl.constexpr):
    """This program's flat offsets, their in-bounds mask, and X + BIAS there in float32 (the GELU input)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    z = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    z += tl.load(BIAS + (offs % N) * stride_bias, mask=mask, other=0.0).to(tl.float32)
    return offs, mask, z


@triton.jit
def _bias_gelu_fwd_kernel(
    X,  # [M, N] matmul output without its bias, contiguous
    BIAS,  # [N], element stride stride_bias
    Y,  # [M, N] gelu(X + BIAS), contiguous, in its own dtype (typically the next matmul's operand dtype)
    stride_bias,
    numel,
    N,
    BLOCK: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    offs, mask, z = _biased_block(X, BIAS, stride_bias, numel, N, BLOCK)
    y = 0.5 * z * (1.0 + tl.math.erf(z * _INV_SQRT2))
    tl.store(Y + offs, _cast_for_store(y, Y.dtype.element_ty, EMULATE_RTNE), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(
    X,  # [M, N] matmul output without its bias (as given to the forward kernel), contiguous
    BIAS,  # [N], element stride stride_bias
    DY,  # [M, N] gradient of gelu(X + BIAS), contiguous
    DX,  # [M, N] gradient of X (equal to that of X + BIAS), contiguous
    stride_bias,
    numel,
    N,
    BLOCK: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    offs, mask, z = _biased_block(X, BIAS, stride_bias, numel, N, BLOCK)
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(z * _INV_SQRT2))
    pdf = tl.exp(-0.5 * z * z) * _INV_SQRT_2PI
    tl.store(DX + offs, _cast_for_store(dy * (cdf + z * pdf), DX.dtype.element_ty, EMULATE_RTNE), mask=mask)
