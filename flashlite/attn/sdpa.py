"""The SDPA path: run a validated call on ``F.scaled_dot_product_attention`` so that it agrees with the kernel.

Builds the visibility mask from causal mode, window and key padding and the ALiBi bias, checks an explicit
``attn_mask``, keeps hidden keys and values out of the output, and zeros the rows that see no key. SDPA takes a
window and ALiBi only as a dense mask and bias, and softcapping not at all: a softcapped call is computed here in
float32 from explicit scores, and a float16/bfloat16 call with a bias its dtype does not hold exactly (ALiBi, a
float attn_mask of another dtype) in float32 too. Each of these paths holds O(S_q * S_k) memory; they are the
fallback for calls the kernel cannot run. Imports ``problem`` only.
"""
from typing import Optional

import torch
import torch.nn.functional as F

from flashlite.attn.problem import (CAUSAL_BOTTOM_RIGHT, CAUSAL_NONE, CAUSAL_TOP_LEFT, Problem,
                                             check_constant_slopes)

def _visibility_mask(q: torch.Tensor, k: torch.Tensor, key_mask: Optional[torch.Tensor],
                     problem: Problem) -> torch.Tensor:
    """Bool [B or 1, 1, S_q, S_k]: True where query i may attend key j, from causal mode, window and key
    padding."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = torch.ones((1, 1, seq_q, seq_k), dtype=torch.bool, device=q.device)
    shift = _diagonal_shift(problem, seq_q, seq_k)
    if problem.causal_mode != CAUSAL_NONE:
        mask = mask.tril(diagonal=shift)
    if problem.window_left >= 0:
        mask = mask.triu(diagonal=shift - problem.window_left)  # j >= i' - left
    if problem.window_right >= 0:
        mask = mask.tril(diagonal=shift + problem.window_right)  # j <= i' + right
    padded = _padded_keys(k, key_mask, problem)
    if padded is not None:
        mask = mask & ~padded[:, None, None, :]
    return mask


def _diagonal_shift(problem: Problem, seq_q: int, seq_k: int) -> int:
    """i' - i: how far query row i's diagonal sits from key i (S_k - S_q for bottom-right causal, else 0). The sizes
    are the call's own: a plan serves calls of every key length (``plan.any_length_key``), so its problem's may be
    another call's."""
    return seq_k - seq_q if problem.causal_mode == CAUSAL_BOTTOM_RIGHT else 0


def plain_sdpa_causal(problem: Problem, seq_q: int, seq_k: int) -> Optional[bool]:
    """SDPA's ``is_causal`` for a call that SDPA computes alone, without a mask built here, or None where it cannot.

    Dense calls without causal masking, and top-left causal ones (SDPA's ``is_causal``), need none. Neither does
    one query row aligned bottom-right (decoding): it sits at the last key's position and sees every key; nor a
    bottom-right call with as many keys as rows, whose diagonal is the top-left one (a model's prefill).

    Example:
        >>> q = torch.randn(1, 2, 1, 16)
        >>> from flashlite.attn.problem import validate
        >>> plain_sdpa_causal(validate(q, q, q, "lower_right", None, None, None, "sdpa", None), 1, 1)
        False
    """
    if problem.variant != "dense":
        return None
    if problem.causal_mode == CAUSAL_BOTTOM_RIGHT:
        if seq_q == 1:
            return False
        return True if seq_q == seq_k else None
    return problem.causal_mode == CAUSAL_TOP_LEFT


def _alibi_bias(q: torch.Tensor, k: torch.Tensor, problem: Problem,
                alibi_slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Float32 [B or 1, H, S_q, S_k]: -slope * |i' - j|, or None without slopes."""
    if alibi_slopes is None:
        return None
    seq_q, seq_k = q.shape[2], k.shape[2]
    rows = torch.arange(seq_q, device=q.device)[:, None] + _diagonal_shift(problem, seq_q, seq_k)
    distance = (rows - torch.arange(seq_k, device=q.device)[None, :]).abs().to(torch.float32)
    slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None]
    return -slopes[:, :, None, None] * distance


def check_attn_mask(q: torch.Tensor, k: torch.Tensor, attn_mask: object) -> torch.Tensor:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (an additive bias), got "
                        f"{attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to [B, H, S_q, S_k] = "
                         f"{list(target)}") from None
    return attn_mask


def _padded_keys(k: torch.Tensor, key_mask: Optional[torch.Tensor], problem: Problem) -> Optional[torch.Tensor]:
    """Bool [B, S_k], True for keys that key_padding_mask or key_lengths hide from every query; None without."""
    if problem.key_masking == "bool":
        return ~key_mask
    if problem.key_masking == "lengths":
        return torch.arange(k.shape[2], device=k.device)[None, :] >= key_mask[:, None]
    return None


def _without_hidden_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem,
                           visible: torch.Tensor, empty_rows: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v, where the output must be NaN) for a masked SDPA call, so that what the masks hide never reaches
    the output or the gradients, as in the kernel: SDPA multiplies its zero weights by every value, and 0 * NaN is
    NaN; a NaN key makes its hidden score NaN, and NaN + -inf is NaN.

    Copies, never the caller's tensors: keys and values that no row of their group sees (whichever mask hides
    them: key padding, causal, window, attn_mask) and non-finite ones become zeros, and so do the queries of rows
    that see no key (they attend to every key, then are zeroed: see _sdpa_masked). Zeroed inputs get zero
    gradients, which is what hidden inputs have. A non-finite key or value a row does see still shows, as in the
    exact sum: the returned bool [B, H, S_q, D or 1] is True in the rows that see a non-finite key (all of the
    row) and in the columns of a non-finite value of a key they see. The copies cost O(S * D); the masked path
    already builds an [S_q, S_k] mask."""
    seen = visible.any(dim=2)  # [B or 1, H or 1, S_k]: keys some row of that head sees
    if seen.shape[1] > 1:  # a kv head's key is seen if some row of some query head of its group sees it
        seen = seen.unflatten(1, (problem.kv_heads, problem.group_size)).any(dim=2)
    bad_k, bad_v = ~torch.isfinite(k), ~torch.isfinite(v)
    bad_k_rows, bad_v_rows = bad_k.any(dim=-1), bad_v.any(dim=-1)  # [B, H_kv, S_k]
    drop = (bad_k_rows | bad_v_rows | ~seen)[..., None]
    k, v = k.masked_fill(drop, 0.0), v.masked_fill(drop, 0.0)
    q = q.masked_fill(empty_rows, 0.0)

    def rows_seeing(keys: torch.Tensor) -> torch.Tensor:  # [B, H_kv, S_k] -> bool [B, H, S_q, 1]
        keys = keys.repeat_interleave(problem.group_size, dim=1)[:, :, None, :]
        return (visible & keys).any(dim=-1, keepdim=True)

    # Columns of non-finite values, per (batch, kv head): a row that sees one such key gets NaN in the bad columns
    # of every such key of its head, a small over-reach in a row that is not finite anyway.
    bad_columns = bad_v.any(dim=2).repeat_interleave(problem.group_size, dim=1)[:, :, None, :]  # [B, H, 1, D]
    return q, k, v, rows_seeing(bad_k_rows) | (rows_seeing(bad_v_rows) & bad_columns)


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                   problem: Problem, attn_mask: Optional[torch.Tensor] = None,
                   alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A validated call on SDPA (``key_mask``: the call's key_padding_mask or key_lengths, as ``problem`` says)."""
    if alibi_slopes is not None:  # the slopes' bias would carry a gradient here, which the kernels' path cannot
        check_constant_slopes(alibi_slopes)
    gqa = {"enable_gqa": True} if problem.heads != problem.kv_heads else {}
    seq_q = q.shape[2]
    is_causal = None if attn_mask is not None else plain_sdpa_causal(problem, seq_q, k.shape[2])
    if is_causal is not None:
        if is_causal and k.shape[2] > seq_q:
            # Keys past the last query row are hidden from every row: SDPA never sees them (a view, no copy).
            k, v = k[:, :, :seq_q], v[:, :, :seq_q]
        # SDPA's own causal kernels: a NaN in a key that later rows see may turn earlier rows NaN too (see
        # ``attention``).
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=problem.scale, **gqa)
    visible = _visibility_mask(q, k, key_mask, problem)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    bias = _alibi_bias(q, k, problem, alibi_slopes)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bias = attn_mask.to(torch.float32) if bias is None else bias + attn_mask.to(torch.float32)
        # A -inf bias (a float attn_mask's) hides its key as the masks do: a row it hides whole sees no key.
        visible = visible & ~torch.isneginf(bias)
    empty_rows = ~visible.any(dim=-1, keepdim=True)
    q, k, v, not_finite = _without_hidden_inputs(q, k, v, problem, visible, empty_rows)
    # A float attn_mask of q's half dtype (without ALiBi) is exact there and goes to SDPA as given; any other bias
    # is float32 (ALiBi's -slope * |i' - j|, a mask of another dtype) and is computed in float32 (_sdpa_masked).
    as_given = (problem.softcap == 0 and q.dtype != torch.float32 and alibi_slopes is None and bias is not None
                and attn_mask.dtype == q.dtype)
    if bias is not None:
        bias = torch.where(visible, bias, float("-inf"))
        if not as_given:
            # Softmax is unchanged by a shift along a row: each row's largest bias becomes 0, so that a large
            # offset (-1e9 on a whole row, -3e5 plus small differences) does not swallow the scores in float32,
            # whose grid at 1e9 is 64 wide.
            bias = bias - bias.amax(dim=-1, keepdim=True).masked_fill(empty_rows, 0.0)
        bias = bias.masked_fill(empty_rows, 0.0)  # rows that see no key see every key, then are zeroed
    if problem.softcap > 0:
        out = _softcapped(q, k, v, problem, bias, visible, empty_rows)
    else:
        out = _sdpa_masked(q, k, v, problem, bias, visible, empty_rows, as_given, gqa)
    return out.masked_fill(not_finite, float("nan"))


def _softcapped(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem, bias: Optional[torch.Tensor],
                visible: torch.Tensor, empty_rows: torch.Tensor) -> torch.Tensor:
    """softmax(mask(c * tanh(scale * q.k / c) + bias)) v from explicit float32 scores (SDPA has no score
    function); rows that see no key give zeros."""
    if problem.group_size > 1:
        k, v = (t.repeat_interleave(problem.group_size, dim=1) for t in (k, v))
    scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * problem.scale
    scores = problem.softcap * torch.tanh(scores / problem.softcap)
    if bias is not None:  # shifted along each row by the caller, 0 on rows that see no key
        scores = scores + bias
    # Rows that see no key see every key instead (finite, so that neither they nor their gradients are NaN), and
    # are zeroed after, as in _sdpa_masked.
    weights = torch.softmax(scores.masked_fill(~(visible | empty_rows), float("-inf")), dim=-1)
    return torch.matmul(weights, v.float()).to(q.dtype).masked_fill(empty_rows, 0.0)


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem,
                 bias: Optional[torch.Tensor], visible: torch.Tensor, empty_rows: torch.Tensor, as_given: bool,
                 gqa: dict) -> torch.Tensor:
    """SDPA under ``visible`` (bool), or with ``bias`` (-inf where hidden, 0 on rows that see no key) when there is
    one: in q's dtype where ``as_given`` or q is float32, else in float32.

    SDPA returns NaN for a row that sees no key; such rows see every key (finite), then are zeroed, so that the
    output and its gradients match the kernel's zeros."""
    if bias is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | empty_rows, scale=problem.scale, **gqa)
        return out.masked_fill(empty_rows, 0.0)
    if as_given or q.dtype == torch.float32:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype), scale=problem.scale, **gqa)
        return out.masked_fill(empty_rows, 0.0)
    # SDPA takes a bias in q's dtype: rounded to bfloat16, ALiBi's -slope * |i' - j| and a float32 mask move the
    # scores by up to 2^-9 of their size (0.06 at a distance of 32), many times the output's own rounding error,
    # and float16 ends at 65504. Half-precision inputs with such a bias run in float32 (exact for their values)
    # and are rounded once, at the end: the result is as close to the exact one as the output dtype allows.
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, scale=problem.scale,
                                         **gqa)
    return out.to(q.dtype).masked_fill(empty_rows, 0.0)
