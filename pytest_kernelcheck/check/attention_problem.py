"""The attention problem a reference computes, checked: sizes, head grouping, causal mode, mask, scale and the
variants (window, softcap, ALiBi slopes), and which keys each query row sees."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Union

import torch

Causal = Union[bool, str]


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Validated sizes and options of one attention call."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    v_dim: int
    causal: str | None  # None, "top_left" or "lower_right"
    scale: float
    device: torch.device
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded on that side
    softcap: float | None = None
    alibi: bool = False  # the slopes themselves travel beside the problem, as attn_mask does

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def diagonal_offset(self) -> int:
        """What is added to a query row to align it with the causal diagonal (the ``i'`` of the module docstring)."""
        return self.k_len - self.q_len if self.causal == "lower_right" else 0

    @property
    def has_variant(self) -> bool:
        """Whether a window, softcap or ALiBi is in play (SDPA alone cannot be the baseline then)."""
        return self.window is not None or self.softcap is not None or self.alibi

    def flops_per_row(self) -> float:
        """Float64 FLOPs of one query row of one (batch, head) against all keys (QK^T and PV)."""
        return 2.0 * self.k_len * (self.head_dim + self.v_dim)


def describe_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> AttentionProblem:
    """Check q, k, v, mask and options against SDPA's rules (and the variants of the module docstring) and
    return the sizes.

    Example::

        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> describe_problem(q, k, v, causal="lower_right").causal
        'lower_right'
        >>> p = describe_problem(q, k, v, window=(3, 0), softcap=30, alibi_slopes=torch.tensor([0.5, 0.25]))
        >>> p.window, p.softcap, p.alibi
        ((3, 0), 30.0, True)

    Raises:
        TypeError: a non-tensor input, an integer or complex tensor, a mask of an unsupported dtype, a window
            that is not a pair of ints, a softcap that is not a number, slopes that are not a floating tensor.
        ValueError: wrong ranks, sizes that do not agree, an empty dimension (B, H, H_kv, S_q, S_k, D or D_v
            of 0), a bad ``causal`` value, heads that need ``enable_gqa``, tensors on different devices, a window
            side below -1, a softcap that is not finite and > 0, slopes of a shape other than [H] or [B, H].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D]; got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {t.device}")
    batch, heads, q_len, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k head dims differ: {head_dim} vs {k.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[2]} vs {v.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    sizes = {"B": batch, "H": heads, "H_kv": k.shape[1], "S_q": q_len, "S_k": k.shape[2], "D": head_dim,
             "D_v": v.shape[3]}
    empty = [f"{name}={size}" for name, size in sizes.items() if size == 0]
    if empty:
        # An empty problem has no output element to check, and a check that compares nothing would pass whatever
        # the kernel returned; refused here, before the planning and the reference divide or loop by these sizes.
        raise ValueError(
            f"the attention problem is empty ({', '.join(empty)}; q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}): there is nothing to compute or check; every size of q, k and v must be at least 1"
        )
    kv_heads = k.shape[1]
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(
                f"q has {heads} heads but k and v have {kv_heads}; pass enable_gqa=True for grouped-query attention"
            )
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"grouped-query attention needs q heads ({heads}) divisible by kv heads ({kv_heads})")
    if causal is True or causal == "top_left":
        mode = "top_left"
    elif causal is False or causal is None:
        mode = None
    elif causal == "lower_right":
        mode = "lower_right"
    else:
        raise ValueError(f"causal must be False, True, 'top_left' or 'lower_right'; got {causal!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor; got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (added); got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"q is on {q.device} but attn_mask is on {attn_mask.device}")
        full = (batch, heads, q_len, k.shape[2])
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, full)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(full):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [B, H, S_q, S_k] = {full}"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    if alibi_slopes is not None:
        _check_alibi_slopes(alibi_slopes, batch, heads, q.device)
    return AttentionProblem(
        batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, k_len=k.shape[2], head_dim=head_dim,
        v_dim=v.shape[3], causal=mode, scale=float(scale), device=q.device, window=_check_window(window),
        softcap=_check_softcap(softcap), alibi=alibi_slopes is not None,
    )


def _check_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, -1 for unbounded; got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        # bool is an int to Python, but window=(True, 0) is surely a mistake, not a one-key window.
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window {name} side must be an int >= -1 (-1 = unbounded); got {side!r}")
        if side < -1:
            raise ValueError(f"window {name} side must be >= -1 (-1 = unbounded); got {side}")
        sides.append(int(side))
    return sides[0], sides[1]


def _check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a finite number > 0; got {softcap!r}")
    value = float(softcap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be a finite number > 0; got {softcap!r}")
    return value


def _check_alibi_slopes(slopes: Any, batch: int, heads: int, device: torch.device) -> None:
    """Refuse ALiBi slopes that are not a floating tensor of shape [H] or [B, H] on ``device``."""
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes must be a floating torch.Tensor of shape [H] or [B, H]; got {type(slopes).__name__}"
        )
    if not slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be floating point (float32 is what kernels take); got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape [H] = ({heads},) or [B, H] = ({batch}, {heads}); got {tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(f"q is on {device} but alibi_slopes is on {slopes.device}")


def slopes_for(problem: AttentionProblem, alibi_slopes: torch.Tensor | None) -> torch.Tensor | None:
    """The slopes as float64 [B, H] (a broadcast view for [H]), after checking they agree with ``problem``."""
    if alibi_slopes is None:
        if problem.alibi:
            raise ValueError("the problem was described with alibi_slopes, but none were passed")
        return None
    if not problem.alibi:
        raise ValueError("alibi_slopes were passed, but the problem was described without them")
    _check_alibi_slopes(alibi_slopes, problem.batch, problem.heads, problem.device)
    return alibi_slopes.to(torch.float64).expand(problem.batch, problem.heads)


def visible_keys(problem: AttentionProblem, aligned: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """[rows, S_k] bool, True where a query row (``aligned``: its index plus the diagonal offset) may see a key
    under ``causal`` and ``window``; None when both leave every key visible."""
    upper = 0 if problem.causal is not None else None  # the largest j - i' allowed
    lower = None  # the smallest j - i' allowed
    if problem.window is not None:
        left, right = problem.window
        if right >= 0:
            upper = right if upper is None else min(upper, right)
        if left >= 0:
            lower = -left
    allowed = None
    if upper is not None:
        allowed = keys[None, :] <= aligned[:, None] + upper
    if lower is not None:
        above = keys[None, :] >= aligned[:, None] + lower
        allowed = above if allowed is None else allowed.logical_and_(above)
    return allowed
