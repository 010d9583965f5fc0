"""fp8 (e4m3) KV caches for ``attention_with_kvcache``: the scales' checks, quantizing new tokens into such a cache,
and the dequantized copy that the paths which cannot read fp8 (SDPA, the general forward kernel) run on.

A cache of dtype ``torch.float8_e4m3fn`` comes with a float32 scale per kv head, ``k_scale`` and ``v_scale`` [H_kv]:
key position j of kv head g is ``k_cache[..., g, j, :].float() * k_scale[g]``, likewise for values. The decoding
kernel reads the fp8 cache in place (``DEQUANT``); everything else here exists for the other paths and the writes.
Imports nothing from the package.
"""
from __future__ import annotations

from typing import Optional

import torch

FP8 = torch.float8_e4m3fn
# e4m3's largest finite magnitude. Values past it are clamped before the cast: the cast's own overflow rule is the
# device's (torch 2.13 on the CPU saturates to 448, but an e4m3 cast may instead give NaN), and the clamp makes a
# large new token the nearest representable value on every device.
FP8_MAX = float(torch.finfo(FP8).max)
_OTHER_FP8 = tuple(getattr(torch, name) for name in ("float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                     "float8_e8m0fnu") if hasattr(torch, name))


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def check_scales(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: Optional[torch.Tensor],
                 v_scale: Optional[torch.Tensor]) -> None:
    """TypeError/ValueError, naming the argument, unless the caches and scales are one of the two accepted forms:
    caches in q's dtype without scales, or float8_e4m3fn caches with float32 [H_kv] scales on q's device (both
    given). Shapes, dtypes and devices only; the values are ``check_scale_values``'. Runs before the other checks
    of the cache arguments (the cache's dtype decides what k_new's must be), and leaves tensors that are not 4-D
    to them."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k_cache, v_cache)):
        return
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype in _OTHER_FP8:
            raise TypeError(f"{name} has dtype {cache.dtype}; the fp8 cache accepted is torch.float8_e4m3fn "
                            f"(with k_scale and v_scale), otherwise a cache in q's dtype ({q.dtype})")
    if is_fp8(k_cache) != is_fp8(v_cache):
        raise TypeError(f"k_cache and v_cache must both be torch.float8_e4m3fn or both in q's dtype ({q.dtype}), "
                        f"got k_cache {k_cache.dtype} and v_cache {v_cache.dtype}")
    if (k_scale is None) != (v_scale is None):
        raise ValueError("pass k_scale and v_scale together (an fp8 cache), or neither")
    if not is_fp8(k_cache):
        if k_scale is not None:
            raise ValueError(f"k_scale and v_scale are for a torch.float8_e4m3fn cache; this cache has dtype "
                             f"{k_cache.dtype}: pass them as None, or pass an fp8 cache")
        return
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"an fp8 cache is read with q in float16, bfloat16 or float32, got q {q.dtype}")
    if k_scale is None:
        raise ValueError("a torch.float8_e4m3fn cache needs k_scale and v_scale: float32 tensors [H_kv], the "
                         "dequantized key of kv head g being k_cache[..., g, j, :].float() * k_scale[g]")
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32:
            raise TypeError(f"{name} must be a float32 tensor [H_kv], got "
                            f"{getattr(scale, 'dtype', type(scale).__name__)}")
        if tuple(scale.shape) != (k_cache.shape[1],):
            raise ValueError(f"{name} must have shape [H_kv] = [{k_cache.shape[1]}], got {list(scale.shape)}")
        if scale.device != q.device:
            raise ValueError(f"{name} is on {scale.device}, q on {q.device}")


def check_scale_values(k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """ValueError for a scale that is not finite or not > 0 (it would turn the cache into NaN, infinities or
    zeros). Reads the values back (a device synchronisation on a GPU): ``check_values`` only."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        bad = ~(torch.isfinite(scale) & (scale > 0))
        if bool(bad.any()):
            raise ValueError(f"{name} must be finite and > 0, got {scale.tolist()}")


def quantized(new: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """New tokens [B, H_kv, S_q, D] in q's dtype as stored in an fp8 cache: ``new / scale`` per kv head, clamped
    to e4m3's range [-448, 448] and cast (round to nearest). NaN stays NaN.

    Example:
        >>> quantized(torch.tensor([1.0, 3.0, 1e4]).view(1, 1, 1, 3), torch.tensor([2.0])).float().flatten()
        tensor([  0.5000,   1.5000, 448.0000])
    """
    return (new.float() / scale[None, :, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantized(cache: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An fp8 cache [B or blocks, H_kv, S, D] dequantized into a new tensor of ``dtype``: ``cache.float() *
    scale[g]`` per kv head g, for the paths that cannot read fp8 (a full copy: the cache's unused positions too)."""
    return (cache.float() * scale[None, :, None, None]).to(dtype)
