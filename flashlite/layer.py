"""A pre-LN transformer layer on flashlite's kernels, the plain PyTorch block it is checked against, and a CUDA-graph
runner for small, launch-bound shapes.

* :class:`TransformerLayer`: ``x + Attn(LN1(x))`` then ``+ MLP(LN2(.))`` with exact GELU, LayerNorm and attention on
  flashlite's Triton kernels, under one of the precision policies of ``flashlite.precision``.
* :class:`PlainTransformerBlock`: the same block written with ``nn.LayerNorm``, ``nn.Linear``,
  ``F.scaled_dot_product_attention`` and ``F.gelu``: the module a user already has, the float64 reference of the
  tests and the baseline of the benchmarks. ``TransformerLayer.from_plain`` / ``to_plain`` convert between them.
* :class:`CudaGraphRunner`: captures the layer's forward once per input signature and replays it (inference).
"""
from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from flashlite._casts import cast_together
from flashlite._runtime import kernel_device_ok
from flashlite.norm import _check_eps, add_layer_norm, bias_gelu, layer_norm
from flashlite.precision import PrecisionPolicy, resolve_policy

# Kernel choices that ``TransformerLayer(fusions=...)`` switches, so that an A/B suite can compare variants:
#   "triton_layer_norm": LayerNorms on flashlite's kernel (writing the matmul operand dtype directly), else
#                        F.layer_norm followed by a cast;
#   "add_layer_norm":    the first residual add fused into the second LayerNorm (one kernel), else add, then norm;
#   "bias_gelu":         fc1's bias add, exact GELU and the cast to fc2's operand dtype in one kernel, else
#                        F.linear with bias, then F.gelu in float32, then a cast.
FUSIONS = frozenset({"triton_layer_norm", "add_layer_norm", "bias_gelu"})
# fusions="auto" (the default): on a CUDA device, all fusions from FUSED_MIN_TOKENS tokens (B * S) up and none
# below. The H200 tournament (tests/perf/test_layer_ab.py::test_fusion_tournament,
# benchmarks/results/h200-2026-11-29-b/run4_ab.md at commit 8ca4529) ranked "no fusions" first at 128, 1,024 and 2,048
# tokens (each
# Triton launch costs more host time than the torch ops it replaces) and "all fusions" first at 4,096 (1.13x over
# none), 8,192 and 16,384 tokens (1.43x and 1.47x over none). Elsewhere (the CPU interpreter) all fusions run.
# Under torch.compile on a CUDA device: none (``TransformerLayer._fusions_for`` says why).
FUSED_MIN_TOKENS = 4096
# ``backend`` of flashlite.attention.attention: "auto" is its per-shape dispatch (SDPA for CPU tensors).
ATTENTION_BACKENDS = ("auto", "triton", "sdpa")
# Parameter dtypes a forward takes: those of the precision modes, each cast as the layer's mode says (bf16
# parameters of a "mixed" layer, as FSDP's mixed precision makes them, like its fp32 ones). float64 is refused.
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_fusions(fusions: Union[str, Iterable[str], None]) -> Optional[frozenset[str]]:
    """The fusion set, or None for "auto" (chosen per call by token count)."""
    if fusions is None or fusions == "auto":
        return None
    if isinstance(fusions, str):
        raise TypeError(f"fusions must be a collection of names, not the string {fusions!r}; e.g. {{{fusions!r}}}")
    try:
        chosen = frozenset(fusions)
    except TypeError:  # not iterable, or holding unhashable items
        raise TypeError(f"fusions must be 'auto' or a collection of fusion names ({', '.join(sorted(FUSIONS))}), "
                        f"got {type(fusions).__name__} {fusions!r}") from None
    unknown = chosen - FUSIONS
    if unknown:
        # Sorted by repr: the unknown items need not be strings, nor comparable with each other.
        raise ValueError(f"unknown fusions {sorted(unknown, key=repr)}; known: {sorted(FUSIONS)}")
    return chosen


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


# ----------------------------------------------------------------------------------------------------------------
# The layer
# ----------------------------------------------------------------------------------------------------------------


class _LayerNormParams(nn.Module):
    """Holds a LayerNorm's ``weight`` and ``bias`` (the computation is in ``TransformerLayer.forward``, with the
    layer's ``eps``)."""

    def __init__(self, d_model: int, device: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))

    @property
    def eps(self) -> float:
        # Both norms use the layer's eps: an eps kept here too would be a second value that nothing reads, and
        # setting it (as on nn.LayerNorm) would change nothing.
        raise AttributeError("the layer's norms have no eps of their own: both use TransformerLayer.eps")

    @eps.setter
    def eps(self, value: Any) -> None:
        raise AttributeError("the layer's norms have no eps of their own: set TransformerLayer.eps, which both use")


class TransformerLayer(nn.Module):
    """Pre-LN transformer layer on flashlite's Triton kernels: ``x + Attn(LN1(x))``, then ``+ MLP(LN2(.))``.

    The MLP is ``fc2(gelu(fc1(.)))`` with exact (erf) GELU; ``d_ff`` defaults to ``4 * d_model``. Attention is
    ``flashlite.attention.attention`` with ``n_heads`` query heads and ``n_kv_heads`` key/value heads (grouped-query
    attention when fewer; query head h reads key/value head ``h // (n_heads // n_kv_heads)``), causal or not, with
    an optional boolean ``key_padding_mask`` [B, S] (True = attend; query rows that see no key give zeros, never NaN).
    Dropout (``dropout``) applies to each branch's output before its residual add, in training mode.

    Precision (``precision``; the full table is in ``flashlite.precision``, measured errors in docs/precision.md):

    * ``"mixed"`` (default): fp32 parameters and residual stream; projections and attention dots on
      ``compute_dtype`` operands (``torch.bfloat16`` default, or ``torch.float16``) with fp32 accumulation;
      LayerNorm statistics, softmax and GELU in fp32.
    * ``"mixed_bf16_residual"``: as "mixed" with the residual stream in bf16.
    * ``"bf16_fp32_residual"``: bf16 parameters (no cast of the weights per forward) with the fp32 residual stream
      and fp32 statistics: "mixed"'s accuracy in inference without its weight casts; in training the gradients
      and a plain optimizer's updates are bf16.
    * ``"fp32"``: everything fp32; the attention kernel's dots per ``attention_precision``: "ieee" (default),
      "tf32" or "bf16". The projections follow PyTorch's matmul settings (``torch.backends.cuda.matmul.allow_tf32``).
    * ``"bf16"`` / ``"fp16"``: parameters, activations and residual stream in that dtype; LayerNorm statistics,
      softmax and GELU math still fp32 inside the kernels.

    The output has ``x``'s dtype. Under ``torch.autocast`` the projections follow autocast (which only matters for
    "fp32" mode: the other modes already cast their operands); the kernels take whatever dtype arrives. The mode,
    not the parameters' dtype, sets the dtypes of the computation: float64 parameters (``layer.double()``) are
    refused, since the result would still have the mode's precision; ``layer.to_plain(torch.float64)`` is the
    float64 reference.

    Weights are cast to the matmul operand dtype on every forward ("mixed": fp32 parameters to bf16/fp16
    operands; the other modes need no cast), in inference as in training: the layer keeps no low-precision copy,
    so the next forward sees every change of a parameter, however it is made (optimizer step, ``load_state_dict``,
    ``param.copy_`` under no_grad, writes through ``param.data`` such as EMA updates, ``param.data = t``). A kept
    copy could not know when to refresh: a write through ``param.data`` does not move the parameter's version
    counter (each ``.data`` is a new tensor with its own counter) and PyTorch keeps no per-storage counter. The
    cost is one multi-tensor cast per forward (all projection weights and biases in one launch on CUDA), which
    reads each weight in fp32 and writes it in the operand dtype before the matmul reads it;
    :class:`CudaGraphRunner` replays that cast inside its graph.

    ``attention_backend`` is passed to ``flashlite.attention.attention``: "auto" (its per-shape dispatch between
    the Triton kernel and SDPA), "triton" or "sdpa".

    ``fusions`` switches the fused kernels on or off: a collection of "triton_layer_norm", "add_layer_norm",
    "bias_gelu" (see ``FUSIONS`` in this module), or "auto" (default): on CUDA, all of them for inputs of at
    least ``FUSED_MIN_TOKENS`` tokens (B * S) or while a CUDA graph is captured (``CudaGraphRunner``), and none
    otherwise, where their launch cost outweighs what they save (measured: see the comment at
    ``FUSED_MIN_TOKENS``); none while torch.compile traces a CUDA call (Inductor's own fusion measured faster);
    under the CPU interpreter, all. Tensors on a device where
    Triton cannot run (CPU without ``TRITON_INTERPRET=1``) use the PyTorch path for LayerNorm and GELU.

    Parameters (``state_dict`` keys and shapes), with ``D = d_model // n_heads``, ``H = n_heads``,
    ``H_kv = n_kv_heads``:

    ===============  ================================  ==============================================
    key              shape                             meaning
    ===============  ================================  ==============================================
    ln1.weight/bias  [d_model]                         LayerNorm before attention
    qkv.weight       [(H + 2*H_kv) * D, d_model]       rows: H*D query, then H_kv*D key, H_kv*D value
    qkv.bias         [(H + 2*H_kv) * D]                same row order
    out.weight/bias  [d_model, H*D] / [d_model]        attention output projection
    ln2.weight/bias  [d_model]                         LayerNorm before the MLP
    fc1.weight/bias  [d_ff, d_model] / [d_ff]          MLP up-projection (GELU follows)
    fc2.weight/bias  [d_model, d_ff] / [d_model]       MLP down-projection
    ===============  ================================  ==============================================

    :class:`PlainTransformerBlock` is the same block in plain PyTorch (separate ``q_proj``/``k_proj``/``v_proj``,
    ``out_proj``); ``TransformerLayer.from_plain(block)`` and ``layer.to_plain()`` convert with identical weights,
    ``load_plain_state_dict`` / ``plain_state_dict`` do the same for state dicts.

    Example:
        >>> layer = TransformerLayer(64, 4, n_kv_heads=2, precision="fp32")
        >>> x = torch.randn(2, 16, 64)
        >>> mask = torch.ones(2, 16, dtype=torch.bool); mask[1, 12:] = False
        >>> layer(x, key_padding_mask=mask).shape
        torch.Size([2, 16, 64])
        >>> plain = layer.to_plain()  # the same weights in nn.LayerNorm / nn.Linear / SDPA form
        >>> torch.allclose(plain(x, mask), layer(x, mask), atol=1e-4)
        True
    """

    def __init__(self, d_model: int, n_heads: int, d_ff: Optional[int] = None, *, n_kv_heads: Optional[int] = None,
                 causal: bool = True, dropout: float = 0.0, precision: str = "mixed",
                 compute_dtype: Optional[torch.dtype] = None, attention_precision: Optional[str] = None,
                 fusions: Union[str, Iterable[str], None] = "auto", attention_backend: str = "auto", eps: float = 1e-5,
                 device: Optional[torch.device | str] = None, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        d_model, n_heads, n_kv_heads, d_ff = _check_dims(d_model, n_heads, n_kv_heads, d_ff)
        device = _check_factory(device, dtype)
        if attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {attention_backend!r}; choose one of {ATTENTION_BACKENDS}")
        self.attention_backend = attention_backend
        self.policy: PrecisionPolicy = resolve_policy(
            precision, compute_dtype=compute_dtype, attention_precision=attention_precision
        )
        if dtype is not None and dtype != self.policy.param_dtype:
            raise ValueError(
                f"dtype={dtype} conflicts with precision={precision!r}, whose parameters are "
                f"{self.policy.param_dtype}; leave dtype unset or pick the matching precision mode"
            )
        eps = _check_eps(None, eps)
        self.d_model, self.n_heads, self.n_kv_heads, self.d_ff = d_model, n_heads, n_kv_heads, d_ff
        self.head_dim = d_model // n_heads
        self.causal, self.dropout, self.eps = _check_bool("causal", causal), _check_dropout(dropout), eps
        self.fusions = _check_fusions(fusions)
        factory = {"device": device, "dtype": self.policy.param_dtype}
        self.ln1 = _LayerNormParams(d_model, device, self.policy.param_dtype)
        self.qkv = nn.Linear(d_model, (n_heads + 2 * n_kv_heads) * self.head_dim, **factory)
        self.out = nn.Linear(d_model, d_model, **factory)
        self.ln2 = _LayerNormParams(d_model, device, self.policy.param_dtype)
        self.fc1 = nn.Linear(d_model, d_ff, **factory)
        self.fc2 = nn.Linear(d_ff, d_model, **factory)

    @property
    def precision(self) -> str:
        """The precision mode name (one of ``flashlite.precision.MODES``)."""
        return self.policy.mode

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, d_ff={self.d_ff}, "
                f"causal={self.causal}, dropout={self.dropout}, precision={self.precision!r}, "
                f"attention_backend={self.attention_backend!r}, "
                f"matmul_dtype={self.policy.matmul_dtype}, "
                f"fusions={'auto' if self.fusions is None else sorted(self.fusions)!r}")

    # -- forward ------------------------------------------------------------------------------------------------

    def _fusions_for(self, x: torch.Tensor) -> frozenset[str]:
        if not kernel_device_ok(x):
            return frozenset()
        if self.fusions is not None:
            return self.fusions
        if x.is_cuda and torch.compiler.is_compiling():
            # Under torch.compile Inductor fuses the plain ops itself (and cannot see into the opaque kernels): the
            # compiled tournament (test_fusion_tournament_compiled, H200, 2026-12-01, session 5 run 5) ranked "no
            # fusions" first at every token count it ran, 128 to 16,384, 1.09x to 1.69x ahead of the next variant.
            return frozenset()
        if not x.is_cuda or x.shape[0] * x.shape[1] >= FUSED_MIN_TOKENS:
            return FUSIONS
        # Below the threshold the fused kernels lose only by their launch cost, which a CUDA graph replay skips.
        return FUSIONS if torch.cuda.is_current_stream_capturing() else frozenset()

    def forward(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Apply the layer to ``x`` [B, S, d_model]; ``key_padding_mask`` is bool [B, S] with True = attend.

        An input without tokens (B or S is 0) gives an empty output of ``x``'s shape, and zero parameter gradients.

        Example:
            >>> TransformerLayer(32, 2, precision="fp32")(torch.randn(1, 8, 32)).shape
            torch.Size([1, 8, 32])
        """
        _check_input(x, key_padding_mask, self.d_model, self.qkv.weight)
        if self.qkv.weight.dtype not in _PARAM_DTYPES:
            # layer.double() / .to(torch.float64): the policy would still compute in its own dtypes (bf16 matmuls in
            # "mixed") and hand back float64 numbers of that precision, and the fused kernels take no float64.
            raise TypeError(
                f"the layer's parameters are {self.qkv.weight.dtype}, but precision={self.precision!r} computes with "
                f"{self.policy.param_dtype} parameters (float32, bfloat16 and float16 are accepted); convert back "
                f"with layer.to({self.policy.param_dtype}), or for a float64 reference of the same weights use "
                "layer.to_plain(torch.float64)"
            )
        if x.shape[0] == 0 or x.shape[1] == 0:
            return self._forward_without_tokens(x)
        policy = self.policy
        fusions = self._fusions_for(x)
        operand = policy.matmul_dtype
        stream = x.to(policy.residual_dtype)

        operands = self._matmul_operands(fusions)
        attn = self._attention_branch(self._norm(self.ln1, stream, operand, fusions), key_padding_mask, operands)
        attn = F.dropout(attn, self.dropout, self.training)
        if "add_layer_norm" in fusions:
            normed, stream = add_layer_norm(stream, attn, self.ln2.weight, self.ln2.bias, self.eps, out_dtype=operand)
        else:
            stream = stream + attn.to(stream.dtype)
            normed = self._norm(self.ln2, stream, operand, fusions)

        mlp = F.dropout(self._mlp_branch(normed, fusions, operands), self.dropout, self.training)
        return (stream + mlp.to(stream.dtype)).to(x.dtype)

    def _forward_without_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The output for B == 0 or S == 0: empty, with x's shape and dtype, as :class:`PlainTransformerBlock` gives.

        The attention kernels refuse empty inputs (there is no key to attend to), so no branch runs. Every
        parameter still joins the autograd graph, with weight 0, so that backward gives each a zero gradient, as
        a torch module's empty matmuls do; an optimizer then treats this step like any other.
        """
        untouched = torch.stack([p.sum().to(x.dtype) for p in self.parameters()]).sum() * 0
        return x + untouched

    def _matmul_operands(self, fusions: frozenset[str]) -> dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]:
        """(weight, bias) of each projection ("qkv", "out", "fc1", "fc2") in the matmul operand dtype; fc1's bias is
        None when the bias_gelu kernel adds it (in its own dtype).

        The weights are cast on every call, in inference too: a kept low-precision copy could not tell when to
        refresh, because writes through ``param.data`` (EMA updates, hand edits, some loaders) do not move the
        parameter's version counter and no storage-level counter exists. A cast is never stale; under
        CudaGraphRunner it is part of the graph, so every replay re-reads the parameters. All of them are cast
        together (``flashlite._casts.cast_together``): one multi-tensor launch instead of one per tensor.
        """
        sources = {f"{name}.{kind}": getattr(getattr(self, name), kind)
                   for name in ("qkv", "out", "fc1", "fc2") for kind in ("weight", "bias")}
        if "bias_gelu" in fusions:
            del sources["fc1.bias"]  # the bias_gelu kernel adds it in its own dtype
        cast = dict(zip(sources, cast_together(list(sources.values()), self.policy.matmul_dtype)))
        return {name: (cast[f"{name}.weight"], cast.get(f"{name}.bias")) for name in ("qkv", "out", "fc1", "fc2")}

    def _norm(self, params: _LayerNormParams, stream: torch.Tensor, out_dtype: torch.dtype,
              fusions: frozenset[str]) -> torch.Tensor:
        if "triton_layer_norm" in fusions:
            return layer_norm(stream, params.weight, params.bias, self.eps, out_dtype=out_dtype)
        # F.layer_norm computes its statistics in fp32 for low-precision inputs too.
        weight, bias = params.weight.to(stream.dtype), params.bias.to(stream.dtype)
        return F.layer_norm(stream, (self.d_model,), weight, bias, self.eps).to(out_dtype)

    def _attention_branch(self, h: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                          operands: dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]) -> torch.Tensor:
        batch, seq, _ = h.shape
        heads, kv_heads, head_dim = self.n_heads, self.n_kv_heads, self.head_dim
        dtype = self.policy.matmul_dtype
        qkv = F.linear(h.to(dtype), *operands["qkv"])
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        q = q.view(batch, seq, heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, kv_heads, head_dim).transpose(1, 2)
        o = _attend(q, k, v, self.causal, key_padding_mask, self.policy.attention_precision, self.attention_backend)
        o = o.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        return F.linear(o.to(dtype), *operands["out"])

    def _mlp_branch(self, h: torch.Tensor, fusions: frozenset[str],
                    operands: dict[str, tuple[torch.Tensor, Optional[torch.Tensor]]]) -> torch.Tensor:
        policy = self.policy
        up = F.linear(h.to(policy.matmul_dtype), *operands["fc1"])
        if "bias_gelu" in fusions:
            act = bias_gelu(up, self.fc1.bias, out_dtype=policy.gelu_out_dtype)
        else:
            act = F.gelu(up.to(policy.gelu_math_dtype)).to(policy.gelu_out_dtype)
        return F.linear(act.to(policy.matmul_dtype), *operands["fc2"])

    # -- conversion from and to the plain block ----------------------------------------------------------------

    def plain_state_dict(self) -> dict[str, torch.Tensor]:
        """This layer's weights under :class:`PlainTransformerBlock`'s keys (``q_proj``/``k_proj``/``v_proj``,
        ``out_proj``); tensors are detached copies in the parameter dtype.

        Example:
            >>> sorted(TransformerLayer(32, 2).plain_state_dict())[:3]
            ['fc1.bias', 'fc1.weight', 'fc2.bias']
        """
        own = {k: v.detach().clone() for k, v in self.state_dict().items()}
        q_rows, kv_rows = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        plain = {k: v for k, v in own.items() if not k.startswith(("qkv.", "out."))}
        for kind in ("weight", "bias"):
            q, k, v = own[f"qkv.{kind}"].split([q_rows, kv_rows, kv_rows], dim=0)
            plain[f"q_proj.{kind}"], plain[f"k_proj.{kind}"], plain[f"v_proj.{kind}"] = q, k, v
            plain[f"out_proj.{kind}"] = own[f"out.{kind}"]
        return plain

    def load_plain_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load weights saved from a :class:`PlainTransformerBlock` (or any module with its keys and shapes),
        converting them to this layer's parameter dtype.

        Example:
            >>> plain = PlainTransformerBlock(32, 2)
            >>> layer = TransformerLayer(32, 2)
            >>> layer.load_plain_state_dict(plain.state_dict())
            >>> torch.equal(layer.out.weight, plain.out_proj.weight)
            True
        """
        expected = {key: tuple(value.shape) for key, value in self.plain_state_dict().items()}
        missing, unexpected = set(expected) - set(state_dict), set(state_dict) - set(expected)
        if missing or unexpected:
            raise KeyError(
                f"plain state dict does not match: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        # Each plain tensor's own shape, before q, k and v are concatenated: a q_proj short of rows and a k_proj
        # with as many extra would make a qkv of the right shape, and load rows of k as rows of q.
        for key, shape in expected.items():
            if tuple(state_dict[key].shape) != shape:
                raise ValueError(f"{key}: plain weights have shape {tuple(state_dict[key].shape)}, the layer expects "
                                 f"{shape}")
        own = plain_to_layer_names(state_dict)
        params = dict(self.named_parameters())
        with torch.no_grad():
            for key, value in own.items():
                params[key].copy_(value)

    @classmethod
    def from_plain(cls, block: PlainTransformerBlock, **kwargs: Any) -> "TransformerLayer":
        """A layer with ``block``'s configuration, weights and training mode; ``kwargs`` (precision, fusions, ...)
        pass through. The norms' eps is read from the block's LayerNorms, which is what its forward uses; the layer
        has one eps for both, so norms with different eps are refused.

        Example:
            >>> block = PlainTransformerBlock(32, 2, n_kv_heads=1, causal=False)
            >>> layer = TransformerLayer.from_plain(block, precision="fp32")
            >>> layer.n_kv_heads, layer.causal
            (1, False)
        """
        if block.ln1.eps != block.ln2.eps:
            raise ValueError(f"block's norms have different eps (ln1 {block.ln1.eps}, ln2 {block.ln2.eps}); the layer "
                             "takes one eps for both")
        config = dict(d_model=block.d_model, n_heads=block.n_heads, d_ff=block.d_ff, n_kv_heads=block.n_kv_heads,
                      causal=block.causal, dropout=block.dropout, eps=block.ln1.eps, device=block.ln1.weight.device)
        config.update(kwargs)
        layer = cls(**config)
        layer.load_plain_state_dict(block.state_dict())
        # The training mode too: an eval block with dropout would otherwise become a layer that drops.
        return layer.train(block.training)

    def to_plain(self, dtype: Optional[torch.dtype] = None) -> PlainTransformerBlock:
        """The equivalent :class:`PlainTransformerBlock` with this layer's weights and training mode (in ``dtype``,
        default the parameters' dtype), e.g. a float64 reference: ``layer.to_plain(torch.float64)``.

        Example:
            >>> layer = TransformerLayer(32, 2)
            >>> layer.to_plain(torch.float64).fc1.weight.dtype
            torch.float64
        """
        block = PlainTransformerBlock(self.d_model, self.n_heads, self.d_ff, n_kv_heads=self.n_kv_heads,
                                      causal=self.causal, dropout=self.dropout, eps=self.eps,
                                      device=self.qkv.weight.device, dtype=dtype or self.qkv.weight.dtype)
        block.load_state_dict({k: v.to(block.ln1.weight.dtype) for k, v in self.plain_state_dict().items()})
        return block.train(self.training)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            key_padding_mask: Optional[torch.Tensor], fp32_precision: Optional[str], backend: str) -> torch.Tensor:
    """Attention through ``flashlite.attention``; ``fp32_precision`` sets the dot precision of float32 operands."""
    from flashlite.attention import attention  # imported on first use: it pulls in the attention kernels

    precision = fp32_precision if q.dtype == torch.float32 else None
    return attention(q, k, v, causal=causal, key_padding_mask=key_padding_mask, backend=backend,
                     precision=precision)


# ----------------------------------------------------------------------------------------------------------------
# CUDA graphs for launch-bound shapes
# ----------------------------------------------------------------------------------------------------------------


def _layer_settings(layer: "TransformerLayer") -> tuple:
    # The layer attributes a captured forward bakes in.
    return (layer.policy, layer.fusions, layer.causal, layer.eps, layer.attention_backend, layer.dropout,
            layer.training)


@dataclass(frozen=True)
class _ReplayLayout:
    """What a captured graph's kernels read besides its static buffers, checked before every replay: which module
    sits under each name, which parameter object under each name with its memory (address, shape, strides, dtype,
    device), and the layer settings baked into the capture. A replay is valid only while all of it is unchanged.

    The check runs on every call, so it costs per call what the graph saves: it compares the recorded objects by
    identity and each parameter's fields directly (a few microseconds), where rebuilding a signature through
    ``named_parameters()`` cost 18 us on the development CPU against 9 us for this
    (benchmarks/results/cpu-host-2026-12-04/replay_check_probe.txt at commit 8ca4529), and 48 us on the H200's host
    (run N1).
    """

    # (parent, name, child) for every submodule: a replaced submodule carries parameters the graph never read.
    modules: tuple[tuple[nn.Module, str, Optional[nn.Module]], ...]
    # (module, name, parameter, data_ptr, shape, stride, dtype, device) for every parameter.
    params: tuple[tuple, ...]
    settings: tuple

    @classmethod
    def of(cls, layer: nn.Module) -> "_ReplayLayout":
        modules = tuple((parent, name, child) for parent in layer.modules() for name, child in parent._modules.items())
        params = tuple((module, name, p, p.data_ptr(), p.shape, p.stride(), p.dtype, p.device)
                       for module in layer.modules() for name, p in module._parameters.items() if p is not None)
        return cls(modules, params, _layer_settings(layer))

    def holds_for(self, layer: nn.Module) -> bool:
        """Whether ``layer`` still has this layout (so a graph captured with it may replay)."""
        for parent, name, child in self.modules:
            if parent._modules.get(name) is not child:
                return False
        for module, name, p, ptr, shape, stride, dtype, device in self.params:
            if (module._parameters.get(name) is not p or p.data_ptr() != ptr or p.shape != shape
                    or p.stride() != stride or p.dtype != dtype or p.device != device):
                return False
        return _layer_settings(layer) == self.settings


@dataclass
class _CapturedCall:
    graph: "torch.cuda.CUDAGraph"
    static_x: torch.Tensor
    static_mask: Optional[torch.Tensor]
    static_out: torch.Tensor
    layout: _ReplayLayout
    # The parameters' tensors at capture, held so that their memory cannot be freed and handed to a new parameter
    # at the same address, which would make a replaced storage look unchanged.
    held: tuple[torch.Tensor, ...]


class CudaGraphRunner:
    """Runs a layer's inference forward as a replayed CUDA graph: one capture per (shape, dtype, mask present).

    At small shapes (B=1, S=128) the layer's time is mostly kernel-launch overhead; a graph replays all of its
    kernels with one launch. The first call with a new input signature warms the layer up on a side stream
    (``warmup_calls`` forwards, at least 1: compiling and autotuning Triton kernels outside the capture),
    captures one forward, and then every call copies its inputs into the graph's static buffers and replays.
    Inference only: forward runs under ``torch.no_grad()``, and the layer must be in eval mode or have no dropout.

    Weight changes: the graph reads the parameters' own memory on every replay (the casts to the matmul dtype are
    kernels inside the graph, not copies made at capture), so any in-place change of a parameter's values is
    picked up: optimizer steps, ``load_state_dict``, ``param.copy_``, and writes through ``param.data``. A change
    of what the graph's kernels point at (``param.data = t``, ``layer.to(...)``, a new layer setting such as
    ``causal``) is detected before each replay by comparing every parameter's address, shape, strides, dtype and
    device, and the layer's settings, with those at capture; it triggers a re-capture.

    The returned tensor is a fresh copy unless ``clone_output=False``, in which case it is the graph's static
    output, overwritten by the next call with the same signature.

    ``layer`` may also be the layer under ``torch.compile`` (``torch.compile(layer, fullgraph=True)``): the warm-up
    calls compile it, and the graph captures Inductor's kernels instead of the eager layer's. On an H200 (d_model
    1024, "mixed", 128 to 16,384 tokens) that graph measured 1.18-1.24x the eager layer's
    (benchmarks/results/h200-2026-12-04-d/ at commit 8ca4529), so it is the one to use where torch.compile works.
    Compile it in the
    default mode: ``mode="reduce-overhead"`` records CUDA graphs of its own, which this runner does not nest.

    Example (needs a CUDA device):
        >>> layer = TransformerLayer(1024, 16, device="cuda").eval()  # doctest: +SKIP
        >>> run = CudaGraphRunner(layer)  # doctest: +SKIP
        >>> y = run(torch.randn(1, 128, 1024, device="cuda"))  # doctest: +SKIP
        >>> run_compiled = CudaGraphRunner(torch.compile(layer, fullgraph=True))  # doctest: +SKIP
    """

    def __init__(self, layer: TransformerLayer, *, warmup_calls: int = 3, clone_output: bool = True) -> None:
        if not isinstance(getattr(layer, "_orig_mod", layer), TransformerLayer):
            raise TypeError(f"layer must be a TransformerLayer or one under torch.compile, got {type(layer).__name__}")
        # At least one warm-up call: without it the layer's first forward (Triton compiling and autotuning its
        # kernels, torch.compile tracing) would run inside the capture. And a bool for clone_output: None or a
        # string would silently hand out the static output, which the next call overwrites.
        warmup_calls = _positive_int("warmup_calls", warmup_calls)
        clone_output = _check_bool("clone_output", clone_output)
        device = layer.qkv.weight.device
        if device.type != "cuda":
            raise RuntimeError(
                f"CUDA graphs need a CUDA device, but the layer's parameters are on {device}; call the layer "
                "directly (on the CPU there is no launch overhead to save)"
            )
        self.layer = layer
        # The TransformerLayer itself, also under torch.compile: the per-call checks read its attributes directly
        # (through the compiled wrapper each read is a delegated lookup) and its parameters are what a graph reads.
        self._inner: TransformerLayer = getattr(layer, "_orig_mod", layer)
        self.warmup_calls = warmup_calls
        self.clone_output = clone_output
        self._captured: dict[tuple, _CapturedCall] = {}

    def __call__(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        layer = self._inner
        _check_input(x, key_padding_mask, layer.d_model, layer.qkv.weight)
        if x.requires_grad:
            raise ValueError("CudaGraphRunner is for inference: x requires grad; call the layer directly to train")
        if layer.training and layer.dropout > 0:
            raise ValueError("CudaGraphRunner replays a fixed graph: put the layer in eval() mode (dropout > 0)")
        key = (tuple(x.shape), x.dtype, x.device, key_padding_mask is not None)
        with torch.no_grad():
            call = self._captured.get(key)
            if call is not None and not call.layout.holds_for(layer):
                # Free the stale graph (and the old parameter memory it holds) before capturing its replacement.
                del self._captured[key]
                call = None
            if call is None:
                call = self._capture(x, key_padding_mask)
                self._captured[key] = call
            call.static_x.copy_(x)
            if call.static_mask is not None:
                call.static_mask.copy_(key_padding_mask)
            call.graph.replay()
        return call.static_out.clone() if self.clone_output else call.static_out

    def clear(self) -> None:
        """Drop every captured graph and its buffers."""
        self._captured.clear()

    def _capture(self, x: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> _CapturedCall:
        static_x = x.clone()
        static_mask = key_padding_mask.clone() if key_padding_mask is not None else None
        side = torch.cuda.Stream(device=x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup_calls):
                self.layer(static_x, static_mask)
        torch.cuda.current_stream(x.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = self.layer(static_x, static_mask)
        held = tuple(p.detach() for p in self.layer.parameters())
        return _CapturedCall(graph, static_x, static_mask, static_out, _ReplayLayout.of(self._inner), held)
