"""The torch.library custom ops ``flashlite::attention_forward`` / ``attention_backward``, with their fakes
and autograd, and the eager path of a Triton call (``_triton_attention``).

``torch.compile`` treats the kernel as one opaque node instead of tracing into it; eager calls with gradients skip
the op's dispatcher through ``_EagerTritonAttention``. Imports ``validation`` and ``launch``.
"""
from typing import Callable, Optional

import torch

from flashlite import _ops
from flashlite._attention.launch import (_launch_backward, _launch_forward, _launch_inference, attention_backward,
                                         attention_forward)
from flashlite._attention.validation import _Call

@torch.library.custom_op("flashlite::attention_forward", mutates_args=())
def attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                         causal_mode: int, scale: float, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton attention forward as an opaque op: (out [B, H, S_q, D], base-2 lse [B, H, S_q] float32)."""
    return attention_forward(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision):
    batch, heads, seq_q, head_dim = q.shape
    return (q.new_empty((batch, heads, seq_q, head_dim)),
            q.new_empty((batch, heads, seq_q), dtype=torch.float32))


@torch.library.custom_op("flashlite::attention_backward", mutates_args=())
def attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor,
                          key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                          causal_mode: int, scale: float, precision: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton attention backward as an opaque op: (dq, dk, dv), contiguous, in the dtypes of q, k, v."""
    return attention_backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                              precision)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                             precision):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, key_lengths)
    ctx.mark_non_differentiable(lse)
    ctx.causal_mode, ctx.scale, ctx.precision = causal_mode, scale, precision


def _gradient(backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """The forward's gradient through ``backward``: the backward op under torch.compile, its launcher in eager
    calls (the op's dispatcher round trips would cost as much as a small kernel)."""

    def grad(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, key_padding_mask, key_lengths = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, ctx.causal_mode,
                              ctx.scale, ctx.precision)
        return dq, dk, dv, None, None, None, None, None

    return grad


attention_forward_op.register_autograd(_gradient(attention_backward_op), setup_context=_setup_context)
# Eager calls with gradients: the same forward launcher, context and gradient, without the op's dispatcher.
_EagerTritonAttention = _ops.eager_function("_EagerTritonAttention", _launch_forward, _setup_context,
                                            _gradient(_launch_backward), non_differentiable=())


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> torch.Tensor:
    args = (q, k, v, call.key_padding_mask, call.key_lengths, call.causal_mode, call.scale, call.precision)
    if torch.compiler.is_compiling():
        return attention_forward_op(*args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerTritonAttention.apply(*args)[0]
    return _launch_inference(*args)
