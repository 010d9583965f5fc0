"""The public ``attention()`` and ``explain_dispatch()``: validate, decide, and replay decided calls from ``_PLANS``.

Imports every other module of the package; ``flashlite.attention`` re-exports its two functions.
"""
import functools
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from flashlite._attention.ops import _triton_attention
from flashlite._attention.plans import _decide, _decide_with_mask, _log_decision, _TritonPlan
from flashlite._attention.sdpa import _sdpa_attention
from flashlite._attention.validation import CAUSAL_BOTTOM_RIGHT, CAUSAL_TOP_LEFT, _validate
from flashlite.dispatch import Decision

def explain_dispatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
                     scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
                     key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                     backend: str = "auto", precision: Optional[str] = None) -> Decision:
    """Which implementation ``attention(q, k, v, **same arguments)`` would run, and why.

    Raises the same errors as ``attention`` for invalid calls. With FLASHLITE_DEBUG_DISPATCH=1 the decision is
    also logged (logger ``flashlite.attention``, level DEBUG).

    Example:
        >>> q = torch.randn(1, 2, 16, 8)
        >>> print(explain_dispatch(q, q, q).reason)
        kernel cannot run this call: head dim 8 is outside the kernel's range 16..256
    """
    call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
    decision = _decide_with_mask(q, k, call, backend, attn_mask) if attn_mask is not None else \
        _decide(q, k, v, call, backend)
    _log_decision(decision, q, k)
    return decision


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
              scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
              key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
              backend: str = "auto", precision: Optional[str] = None) -> torch.Tensor:
    """Scaled dot-product attention, softmax(scale * q k^T) v, with flashlite's Triton kernel or SDPA.

    Args:
        q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (grouped-query attention, k and v
            are not copied). float16, bfloat16 or float32; any strides.
        causal: False; True for SDPA's ``is_causal`` (top-left: query i sees keys j <= i); "lower_right" for
            bottom-right alignment (j <= i + S_k - S_q, as for decoding against a KV cache).
        scale: defaults to 1 / sqrt(D).
        key_padding_mask: bool [B, S_k], True = attend. Or key_lengths: int [B], keys j >= length masked
            (lengths are clamped to [0, S_k]). Rows that see no key return zeros, with zero gradients. What the
            masks hide from every query row (padding, key lengths, keys past the last row's causal frontier)
            may hold anything, NaN and inf included: it never reaches the output or the gradients. A
            non-finite key or value a row does see makes that row non-finite; the Triton kernel, which sums
            over tiles of up to 128 query rows, may then turn the other rows of that tile NaN too, and SDPA's
            own causal kernel (calls without key masks) every row. Pass ``key_lengths`` for a cache filled
            past its end.
        attn_mask: an arbitrary mask or additive bias broadcastable to [B, H, S_q, S_k]: bool (True = attend) or
            floating (added to the scaled scores), combined with ``causal`` and key padding. The Triton kernel
            has no such input, so these calls run on SDPA (``backend="triton"`` refuses them); rows that see no
            key still give zeros.
        backend: "auto" (per-shape choice from ``flashlite.dispatch``; see ``explain_dispatch``), "triton" or
            "sdpa". Calls without masks are validated and decided once per signature (shapes, strides, dtypes,
            devices, arguments) and replayed after that; with FLASHLITE_DEBUG_DISPATCH=1 each signature's
            decision is logged when it is made (logger ``flashlite.attention``, level DEBUG).
        precision: float32 inputs only: "tf32" (default), "ieee" or "bf16" dot products in the Triton kernel.

    Returns:
        [B, H, S_q, D] in q's dtype.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
        >>> attention(q, k, v, causal=True, backend="sdpa").shape
        torch.Size([2, 4, 10, 16])
    """
    if attn_mask is not None:
        call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
        decision = _decide_with_mask(q, k, call, backend, attn_mask)
        _log_decision(decision, q, k)
        return _sdpa_attention(q, k, v, call, attn_mask)
    plan_key = None
    if key_padding_mask is None and key_lengths is None and not torch.compiler.is_compiling():
        try:
            # causal and scale join the key with their classes: 1 == True == 1.0 hash alike, but validation refuses
            # causal=1 and scale=True, so a plan made for one must never answer the other. (Flat, not nested
            # tuples: the key is built on every call, and a nested tuple costs a tenth of a microsecond.)
            plan_key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                        q.device, k.device, v.device, causal, causal.__class__, scale, scale.__class__, backend,
                        precision)
            plan = _PLANS.get(plan_key)
        except (AttributeError, TypeError):  # not tensors, or unhashable arguments: _validate names the problem
            plan_key = plan = None
        if plan is not None:
            return plan(q, k, v)
    call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
    decision = _decide(q, k, v, call, backend)
    _log_decision(decision, q, k)
    if plan_key is not None and len(_PLANS) < _MAX_PLANS:
        if (decision.backend == "sdpa" and call.causal_mode != CAUSAL_BOTTOM_RIGHT
                and not (call.causal_mode == CAUSAL_TOP_LEFT and k.shape[2] > q.shape[2])):
            # Only the arguments the call needs (SDPA parses every keyword it is given, on every call), bound in a
            # partial so that a replay costs one C-level call.
            sdpa_kwargs = {"is_causal": call.causal_mode == CAUSAL_TOP_LEFT}
            if scale is not None:
                sdpa_kwargs["scale"] = call.scale
            if q.shape[1] != k.shape[1]:
                sdpa_kwargs["enable_gqa"] = True
            _PLANS[plan_key] = functools.partial(F.scaled_dot_product_attention, **sdpa_kwargs)
        elif decision.backend == "triton":
            _PLANS[plan_key] = _TritonPlan(call)
        else:
            _PLANS[plan_key] = functools.partial(_sdpa_attention, call=call)
    if decision.backend == "triton":
        return _triton_attention(q, k, v, call)
    return _sdpa_attention(q, k, v, call)


# A validated, decided call without masks, keyed by shapes, strides, dtypes, devices and arguments, and replayed
# for later calls with the same key: a repeated call costs a dictionary lookup, not a validation and a dispatch.
_PLANS: dict[tuple, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {}
_MAX_PLANS = 4096  # past this many distinct call signatures, new ones are validated every time
