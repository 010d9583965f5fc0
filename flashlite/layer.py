"""A pre-LN transformer layer on flashlite's kernels (``TransformerLayer``) and its precision and fusion settings.

``x + Attn(LN1(x))`` then ``+ MLP(LN2(.))`` with exact GELU, LayerNorm and attention on flashlite's Triton kernels,
under one of the precision policies of ``flashlite.precision``. Its neighbours, re-exported here so that the public
names stay where they were:

* ``flashlite.plain_block``: :class:`PlainTransformerBlock`, the same block in plain PyTorch (the reference);
  ``TransformerLayer.from_plain`` / ``to_plain`` convert between them;
* ``flashlite.cuda_graph``: :class:`CudaGraphRunner`, which captures the layer's forward once per input signature and
  replays it (inference). It imports this module, so this module names it lazily (``__getattr__``), not at import.
"""
from __future__ import annotations

import importlib
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from flashlite._casts import cast_together
from flashlite._runtime import kernel_device_ok
from flashlite.norm import _check_eps, add_layer_norm, bias_gelu, layer_norm
from flashlite.plain_block import (PlainTransformerBlock, _check_bool, _check_dims, _check_dropout, _check_factory,
                                   _check_input, plain_to_layer_names)
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
            # compiled tournament (test_fusion_tournament_compiled, H200, 2026-12-01, commit abcc4b3) ranked "no
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


def __getattr__(name: str) -> Any:
    # CudaGraphRunner lives in flashlite.cuda_graph, which imports this module: named here on first use.
    if name == "CudaGraphRunner":
        return importlib.import_module("flashlite.cuda_graph").CudaGraphRunner
    raise AttributeError(f"module 'flashlite.layer' has no attribute {name!r}")
