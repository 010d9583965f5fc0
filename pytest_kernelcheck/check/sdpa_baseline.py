"""PyTorch's own attention in the input precision: the baseline that the check's baseline rule compares a kernel's
error with (see :mod:`.reference` for how each variant is written)."""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from .attention_problem import AttentionProblem, slopes_for, visible_keys


def sdpa_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    attn_mask: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in the input precision as PyTorch computes it, on the given query rows (all by default): what
    the check's baseline rule measures a kernel's error against.

    SDPA itself, with a window and ALiBi as the equivalent dense mask or bias; with a softcap, which SDPA cannot
    express, the same math written out in the input precision (module docstring). ``window`` and ``softcap`` come
    with ``problem``, ``alibi_slopes`` beside it as for :func:`compute_reference`. Rows that see no key may hold
    NaN (the check zeroes them).

    Example::

        >>> from pytest_kernelcheck import attention_reference
        >>> from pytest_kernelcheck.check.attention_problem import describe_problem
        >>> q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
        >>> slopes = torch.tensor([0.5, 0.25])
        >>> problem = describe_problem(q, k, v, causal=True, window=(2, -1), alibi_slopes=slopes)
        >>> base = sdpa_baseline(q, k, v, problem, alibi_slopes=slopes)
        >>> ref = attention_reference(q, k, v, causal=True, window=(2, -1), alibi_slopes=slopes)
        >>> bool(torch.allclose(base, ref))
        True

    Raises whatever SDPA (or matmul, for the softcap) raises when it cannot run this dtype or device, and
    ``MemoryError``/``torch.OutOfMemoryError`` when the dense mask does not fit.
    """
    slopes_for(problem, alibi_slopes)  # the same agreement check as the reference's
    if attn_mask is not None and attn_mask.dim() < 4:
        # SDPA indexes a mask's last two dimensions: a [S_k] mask, which broadcasts as the reference reads it,
        # raised IndexError there. As 4-D it broadcasts the same way in both.
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    q_in = q if rows is None else q.index_select(2, rows.to(q.device))
    is_causal = False
    whole_causal_bias = False  # torch's CausalBias object: passed through as is
    mask = attn_mask
    if problem.has_variant:
        query_rows = rows.to(q.device) if rows is not None else torch.arange(problem.q_len, device=q.device)
        rows_mask = _mask_rows(attn_mask, rows, problem.q_len)
        mask = _dense_variant_mask(problem, query_rows, rows_mask, alibi_slopes, q.dtype)
        if problem.softcap is not None:
            return _softcapped_attention(q_in, k, v, problem, mask)
    elif problem.causal is not None:
        whole = rows is None and attn_mask is None
        if whole and problem.causal == "top_left":
            is_causal = True
        elif whole:
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():  # its NaN warning for S_q > S_k: those rows are zeroed afterwards
                warnings.simplefilter("ignore")
                mask = causal_lower_right(problem.q_len, problem.k_len)
            whole_causal_bias = True
        else:
            query_rows = rows.to(q.device) if rows is not None else torch.arange(problem.q_len, device=q.device)
            keys = torch.arange(problem.k_len, device=q.device)
            allowed = visible_keys(problem, query_rows + problem.diagonal_offset, keys)
            mask = _merge_masks(allowed, _mask_rows(attn_mask, rows, problem.q_len), q.dtype)
    elif attn_mask is not None and rows is not None:
        mask = _mask_rows(attn_mask, rows, problem.q_len)
    if mask is not None and not whole_causal_bias and mask.dtype != torch.bool:
        mask = _rounded_bias(mask, q.dtype)  # SDPA wants a float mask in the query's dtype
    return _run_sdpa(q_in, k, v, problem, mask, is_causal)


def _run_sdpa(
    q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, mask: Any, is_causal: bool
) -> torch.Tensor:
    import torch.nn.functional as F

    extra: dict[str, Any] = {}
    if problem.kv_heads != problem.heads:
        extra["enable_gqa"] = True
    with torch.no_grad():
        try:
            return F.scaled_dot_product_attention(
                q_in, k, v, attn_mask=mask, is_causal=is_causal, scale=problem.scale, **extra
            )
        except TypeError:
            if not extra:
                raise
            # Older torch without enable_gqa: repeat the kv heads instead.
            k_in = k.repeat_interleave(problem.group_size, dim=1)
            v_in = v.repeat_interleave(problem.group_size, dim=1)
            return F.scaled_dot_product_attention(
                q_in, k_in, v_in, attn_mask=mask, is_causal=is_causal, scale=problem.scale
            )


def _dense_variant_mask(
    problem: AttentionProblem,
    query_rows: torch.Tensor,
    attn_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The mask a user would hand SDPA for causal + window + ALiBi + attn_mask on ``query_rows``: bool when
    nothing is added to the scores, else a float bias with -inf where a key is hidden, in float32 (or the input
    dtype or attn_mask's when wider); the caller rounds it (:func:`_rounded_bias`) or adds it in float32."""
    keys = torch.arange(problem.k_len, device=query_rows.device)
    aligned = query_rows + problem.diagonal_offset
    allowed = visible_keys(problem, aligned, keys)  # [r, S_k] or None
    if alibi_slopes is None:
        if allowed is None:
            return attn_mask
        return _merge_masks(allowed, attn_mask, dtype)
    # Built in float32 (or the input dtype when wider), never in a narrower dtype: rounding happens once, in
    # _rounded_bias. [H] slopes give a bias shared by the batch.
    build = torch.promote_types(dtype, torch.float32)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        build = torch.promote_types(build, attn_mask.dtype)
    slopes = alibi_slopes.to(build).reshape(-1, problem.heads)[:, :, None, None]  # [B or 1, H, 1, 1]
    distance = (aligned[:, None] - keys[None, :]).abs_().to(build)  # [r, S_k]
    bias = slopes * -distance
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bias = bias + attn_mask
    elif attn_mask is not None:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    return bias if allowed is None else bias.masked_fill(~allowed, -math.inf)


def _rounded_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float bias (-inf where hidden) in ``dtype``, as a correct implementation rounds it: exactly when
    ``dtype`` holds its values, else shifted first so that each row's largest value is 0.

    Softmax is unchanged by a shift along a row, and the keys that carry the weight are those near the row's
    largest bias: after the shift their bias is small and keeps nearly all its bits in ``dtype``. Rounded as it
    comes, ALiBi's -slope * |i' - j| at a distance of 60 lands on bfloat16's grid of 0.25: errors of up to 20 times
    the output's own rounding, which a baseline computed that way would have allowed a kernel too. A bias already
    of ``dtype`` (an attn_mask in the input dtype) is passed as is: the shift could only round it."""
    if bias.dtype == dtype or torch.promote_types(bias.dtype, dtype) == dtype:
        return bias.to(dtype)
    peak = bias.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)  # rows that see no key stay -inf (the check zeroes them)
    return (bias - peak).to(dtype)


def _softcapped_attention(
    q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softcapped attention in the input precision, one batch entry at a time (see the module docstring)."""
    softmax_dtype = torch.promote_types(q_in.dtype, torch.float32)
    if problem.kv_heads != problem.heads:
        k = k.repeat_interleave(problem.group_size, dim=1)
        v = v.repeat_interleave(problem.group_size, dim=1)
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    outs = []
    with torch.no_grad():
        for b in range(q_in.shape[0]):
            scores = torch.matmul(q_in[b], k[b].transpose(-1, -2)) * problem.scale  # [H, r, S_k], input dtype
            scores = torch.tanh(scores / problem.softcap) * problem.softcap
            scores = scores.to(softmax_dtype)
            if mask4 is not None:
                # The bias is added unrounded, in the softmax's precision: rounded to bfloat16 it would move the
                # scores by more than a correct kernel's whole error (_rounded_bias says how much).
                piece = mask4[b if mask4.shape[0] > 1 else 0]
                scores = (scores.masked_fill(~piece, -math.inf) if piece.dtype == torch.bool
                          else scores + piece.to(torch.promote_types(piece.dtype, softmax_dtype)))
            weights = torch.softmax(scores, dim=-1).to(q_in.dtype)
            outs.append(torch.matmul(weights, v[b]))
    return torch.stack(outs)


def _mask_rows(attn_mask: torch.Tensor | None, rows: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    if attn_mask is None or rows is None:
        return attn_mask
    mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return mask4.index_select(2, rows.to(attn_mask.device)) if mask4.shape[2] > 1 else mask4


def _merge_masks(allowed: torch.Tensor, attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return allowed & attn_mask
    # Unrounded: sdpa_baseline rounds the merged bias once (_rounded_bias).
    return torch.where(allowed, attn_mask, -math.inf)
