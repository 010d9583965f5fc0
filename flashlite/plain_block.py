"""The pre-LN transformer block in plain PyTorch (``PlainTransformerBlock``), the reference ``TransformerLayer`` is
checked against, and the argument checks the layer and its CUDA-graph runner share with it.

The block is the module a user already has (``nn.LayerNorm``, ``nn.Linear``, ``F.scaled_dot_product_attention``,
``F.gelu``): the float64 reference of the tests and the baseline of the benchmarks. ``flashlite.layer`` re-exports
it; ``TransformerLayer.from_plain`` / ``to_plain`` convert between the two. Imports nothing from flashlite but
``flashlite.norm``'s eps check.
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flashlite.norm import _check_eps

def _positive_int(name: str, value: Any) -> int:
    """``value`` as a Python int: ints and NumPy integers are accepted, bool (an int subclass) is not."""
    accepted = "a positive integer (a Python or NumPy int, not bool)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be {accepted}, got {value!r}")
    return int(value)


def _check_dims(d_model: Any, n_heads: Any, n_kv_heads: Any, d_ff: Any) -> tuple[int, int, int, int]:
    """(d_model, n_heads, n_kv_heads, d_ff) as Python ints, with the defaults filled in."""
    d_model, n_heads = _positive_int("d_model", d_model), _positive_int("n_heads", n_heads)
    if d_model % n_heads:
        raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    n_kv_heads = n_heads if n_kv_heads is None else _positive_int("n_kv_heads", n_kv_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
    d_ff = 4 * d_model if d_ff is None else _positive_int("d_ff", d_ff)
    return d_model, n_heads, n_kv_heads, d_ff


def _check_dropout(dropout: Any) -> float:
    accepted = "a number in [0, 1) (a Python or NumPy float or int)"
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be {accepted}, got {type(dropout).__name__} {dropout!r}")
    if not (math.isfinite(dropout) and 0.0 <= dropout < 1.0):
        raise ValueError(f"dropout must be {accepted}, got {dropout!r}")
    return float(dropout)


def _check_bool(name: str, value: Any) -> bool:
    # NumPy's bool is no subclass of bool; an int 0/1 is refused, as it is more likely a misplaced argument.
    numpy_bool = type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")
    if not (isinstance(value, bool) or numpy_bool):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {value!r}")
    return bool(value)


def _check_factory(device: Any, dtype: Any) -> Optional[torch.device]:
    """``device`` as a torch.device (or None), after checking both factory arguments."""
    if dtype is not None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r}")
        if not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype}")
    if device is None:
        return None
    try:
        if isinstance(device, bool):
            raise TypeError
        return torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device must be a torch.device, a device string such as 'cpu' or 'cuda:0', or None; "
                         f"got {device!r}") from None


def _check_input(x: torch.Tensor, key_padding_mask: Optional[torch.Tensor], d_model: int,
                 param: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 3:
        raise ValueError(f"x must have shape [batch, seq, d_model], got {tuple(x.shape)}")
    if x.shape[-1] != d_model:
        raise ValueError(f"x's last dimension is {x.shape[-1]} but the layer's d_model is {d_model}")
    if not x.is_floating_point():
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    if x.device != param.device:
        raise ValueError(f"x is on {x.device} but the layer's parameters are on {param.device}")
    if key_padding_mask is None:
        return
    if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
        got = key_padding_mask.dtype if isinstance(key_padding_mask, torch.Tensor) else type(key_padding_mask).__name__
        raise TypeError(f"key_padding_mask must be a bool tensor (True = attend), got {got}")
    if tuple(key_padding_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"key_padding_mask must have shape [batch, seq] = {tuple(x.shape[:2])}, got {tuple(key_padding_mask.shape)}"
        )
    if key_padding_mask.device != x.device:
        raise ValueError(f"key_padding_mask is on {key_padding_mask.device} but x is on {x.device}")


# ----------------------------------------------------------------------------------------------------------------
# The plain PyTorch block
# ----------------------------------------------------------------------------------------------------------------


def _attention_mask(key_padding_mask: Optional[torch.Tensor], seq_len: int, causal: bool,
                    device: torch.device) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Boolean SDPA mask [B, 1, S, S] (True = attend) and the [B, 1, S, 1] rows that see no key at all.

    Rows with no visible key (left padding under a causal mask) are opened to every key, so that softmax has
    something to normalize and neither output nor gradient becomes NaN, and their output is zeroed afterwards:
    the same convention as flashlite's kernel (a fully masked row gives zeros).
    """
    if key_padding_mask is None:
        return None, None
    mask = key_padding_mask[:, None, None, :]
    if causal:
        mask = mask & torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    empty_rows = ~mask.any(dim=-1, keepdim=True)
    return mask | empty_rows, empty_rows


def plain_to_layer_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed like :class:`PlainTransformerBlock`'s parameters (weights, or their gradients) under
    :class:`TransformerLayer`'s names: ``q_proj``/``k_proj``/``v_proj`` concatenated into ``qkv``, ``out_proj``
    renamed ``out``.

    Example:
        >>> block = PlainTransformerBlock(32, 2)
        >>> plain_to_layer_names(block.state_dict())["qkv.weight"].shape
        torch.Size([96, 32])
    """
    own = {k: v for k, v in tensors.items() if not k.startswith(("q_proj.", "k_proj.", "v_proj.", "out_proj."))}
    for kind in ("weight", "bias"):
        own[f"qkv.{kind}"] = torch.cat([tensors[f"{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
        own[f"out.{kind}"] = tensors[f"out_proj.{kind}"]
    return own


class PlainTransformerBlock(nn.Module):
    """The pre-LN transformer block written with plain PyTorch modules: the reference for ``TransformerLayer``.

    ``x + out_proj(SDPA(q_proj, k_proj, v_proj of ln1(x)))`` then ``+ fc2(gelu(fc1(ln2(.))))``, with exact GELU,
    grouped-query attention when ``n_kv_heads < n_heads`` (query head h reads key/value head
    ``h // (n_heads // n_kv_heads)``), dropout after each branch, and a boolean ``key_padding_mask`` [B, S]
    (True = attend). Query rows that see no key give zeros, as in flashlite's kernel.

    Example:
        >>> block = PlainTransformerBlock(32, 2)
        >>> block(torch.randn(2, 8, 32)).shape
        torch.Size([2, 8, 32])
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: Optional[int] = None, *, n_kv_heads: Optional[int] = None,
                 causal: bool = True, dropout: float = 0.0, eps: float = 1e-5,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        d_model, n_heads, n_kv_heads, d_ff = _check_dims(d_model, n_heads, n_kv_heads, d_ff)
        self.d_model, self.n_heads, self.n_kv_heads, self.d_ff = d_model, n_heads, n_kv_heads, d_ff
        self.head_dim = d_model // n_heads
        self.causal, self.dropout = _check_bool("causal", causal), _check_dropout(dropout)
        self.eps = _check_eps(None, eps)
        factory = {"device": _check_factory(device, dtype), "dtype": dtype}
        kv_width = n_kv_heads * self.head_dim
        self.ln1 = nn.LayerNorm(d_model, eps=eps, **factory)
        self.q_proj = nn.Linear(d_model, d_model, **factory)
        self.k_proj = nn.Linear(d_model, kv_width, **factory)
        self.v_proj = nn.Linear(d_model, kv_width, **factory)
        self.out_proj = nn.Linear(d_model, d_model, **factory)
        self.ln2 = nn.LayerNorm(d_model, eps=eps, **factory)
        self.fc1 = nn.Linear(d_model, d_ff, **factory)
        self.fc2 = nn.Linear(d_ff, d_model, **factory)

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        _check_input(x, key_padding_mask, self.d_model, self.ln1.weight)
        batch, seq, _ = x.shape
        h = self.ln1(x)
        q = self.q_proj(h).view(batch, seq, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(batch, seq, self.n_kv_heads, self.head_dim).transpose(1, 2)
        mask, empty_rows = _attention_mask(key_padding_mask, seq, self.causal, x.device)
        if batch == 0 or seq == 0:
            # No tokens, no attention. (SDPA on CUDA returned None for an empty batch with torch 2.11 on an H200.)
            # The products keep the projections in the graph, so every parameter gets its zero gradient.
            o = q * 0.0 + (k.sum() + v.sum()) * 0.0
        else:
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=self.causal and mask is None,
                enable_gqa=self.n_kv_heads != self.n_heads,
            )
        if empty_rows is not None:
            o = o.masked_fill(empty_rows, 0.0)
        o = o.transpose(1, 2).reshape(batch, seq, self.d_model)
        x = x + F.dropout(self.out_proj(o), self.dropout, self.training)
        mlp = self.fc2(F.gelu(self.fc1(self.ln2(x))))
        return x + F.dropout(mlp, self.dropout, self.training)
