"""The float64 attention reference for packed variable-length batches: sequences laid end to end in one tensor.

Layout, as packed attention kernels take it: q is [total_q, H, D], k and v are [total_k, H_kv, D], and
``cu_seqlens_q`` / ``cu_seqlens_k`` are integer [batch + 1] offsets (the first 0, the last the total, never
decreasing): sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and the matching rows of k and v,
and attends only within itself. Every option means per sequence what it means in
:func:`pytest_kernelcheck.check.reference.attention_reference` (``causal`` aligned to each sequence's own lengths,
``window``, ``softcap``; ``alibi_slopes`` [H] or [batch, H]); the reference of each sequence is that function's,
so it is chunked the same way when a sequence's scores do not fit. A sequence with no keys gives zero rows; one
with no queries gives nothing.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .attention_problem import Causal
from .reference import attention_reference
from .shapes import python_scalar


def _offset(name: str, position: int, value: Any) -> int:
    """One entry of a sequence of offsets as an int; ``int()`` would truncate 5.7 to 5 and read True as 1, moving a
    sequence boundary without a word."""
    number = python_scalar(value)  # numpy integers and 0-d integer tensors are integers too
    if isinstance(number, bool) or not isinstance(number, int):
        raise TypeError(f"{name}[{position}] is {value!r} ({type(value).__name__}); offsets are integers: ints, numpy "
                        "integers, or a 1-D int32 or int64 tensor")
    return number


def _offsets(name: str, cu_seqlens: torch.Tensor | Sequence[int], total: int) -> list[int]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 or int64 tensor; got {cu_seqlens.dtype} of shape "
                            f"{tuple(cu_seqlens.shape)}")
        offsets = [int(x) for x in cu_seqlens.cpu()]
    else:
        offsets = [_offset(name, position, x) for position, x in enumerate(cu_seqlens)]
    if len(offsets) < 2:
        raise ValueError(f"{name} needs batch + 1 >= 2 entries; got {len(offsets)}")
    if offsets[0] != 0 or offsets[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the total ({total}); got {offsets[0]} ... {offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must never decrease; got {offsets}")
    return offsets


def attention_reference_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor | Sequence[int],
    cu_seqlens_k: torch.Tensor | Sequence[int],
    *,
    causal: Causal = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    memory_budget: int | None = None,
) -> torch.Tensor:
    """Float64 attention of packed sequences: [total_q, H, D_v] on q's device (module docstring for the layout).

    Example::

        >>> q, k, v = (torch.randn(9, 4, 8) for _ in range(3))
        >>> cu = torch.tensor([0, 2, 9], dtype=torch.int32)  # two sequences, of 2 and 7 tokens
        >>> out = attention_reference_varlen(q, k, v, cu, cu, causal=True)
        >>> out.shape, out.dtype
        (torch.Size([9, 4, 8]), torch.float64)
        >>> torch.allclose(out[0], v[0].double())  # the first token of a causal sequence sees only itself
        True

    Raises:
        TypeError: q, k or v not a 3-D floating tensor; offsets that are not integer.
        ValueError: head dims or head counts that do not fit, offsets that do not start at 0, end at the total,
            or that decrease, different sequence counts, slopes of a shape other than [H] or [batch, H].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.dtype.is_floating_point or t.dim() != 3:
            raise TypeError(f"{name} must be a 3-D floating tensor [total, heads, head_dim]; got "
                            f"{getattr(t, 'dtype', type(t).__name__)} of shape {tuple(getattr(t, 'shape', ()))}")
    if k.shape[0] != v.shape[0] or k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must hold the same tokens and heads; got {tuple(k.shape)} and {tuple(v.shape)}")
    starts_q = _offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0])
    starts_k = _offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0])
    if len(starts_q) != len(starts_k):
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k hold different sequence counts: {len(starts_q) - 1} and "
                         f"{len(starts_k) - 1}")
    batch, heads = len(starts_q) - 1, q.shape[1]
    if alibi_slopes is not None and alibi_slopes.dim() == 2 and tuple(alibi_slopes.shape) != (batch, heads):
        raise ValueError(f"alibi_slopes must be [H] = [{heads}] or [batch, H] = [{batch}, {heads}]; got "
                         f"{tuple(alibi_slopes.shape)}")
    out = torch.zeros(q.shape[0], heads, v.shape[2], dtype=torch.float64, device=q.device)
    for b in range(batch):
        q0, q1, k0, k1 = starts_q[b], starts_q[b + 1], starts_k[b], starts_k[b + 1]
        if q1 == q0 or k1 == k0:  # no rows to compute, or rows that see no key: zeros
            continue
        slopes = alibi_slopes if alibi_slopes is None or alibi_slopes.dim() == 1 else alibi_slopes[b]
        one = attention_reference(
            q[q0:q1].transpose(0, 1)[None], k[k0:k1].transpose(0, 1)[None], v[k0:k1].transpose(0, 1)[None],
            causal=causal, scale=scale, enable_gqa=k.shape[1] != heads, window=window, softcap=softcap,
            alibi_slopes=slopes, memory_budget=memory_budget,
        )
        out[q0:q1] = one[0].transpose(0, 1)
    return out
