"""The torch.library custom ops ``flashlite::attention_forward`` / ``attention_backward``, with their fakes and
autograd, and how a Triton plan runs a call (``run_triton``, ``run_triton_compiled``).

``torch.compile`` treats the kernel as one opaque node instead of tracing into it; eager calls with gradients skip
the op's dispatcher through ``_EagerTritonAttention``, built by the same mechanism as the norms' (``_ops``).
Imports ``validation``, ``plans`` and ``launch``.
"""
from typing import Optional

import torch

from flashlite import _ops
from flashlite._attention.launch import attention_backward, attention_forward, launch_backward, launch_forward
from flashlite._attention.plans import Plan


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


# The op's autograd sees its flat arguments (what a compiled graph holds); the eager Function below sees the plan.
def _setup_op_context(ctx, inputs, output):
    q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, key_lengths)
    ctx.mark_non_differentiable(lse)
    ctx.causal_mode, ctx.scale, ctx.precision = causal_mode, scale, precision


def _op_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_padding_mask, key_lengths = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths,
                                       ctx.causal_mode, ctx.scale, ctx.precision)
    return dq, dk, dv, None, None, None, None, None


attention_forward_op.register_autograd(_op_gradient, setup_context=_setup_op_context)


def _setup_eager_context(ctx, inputs, output):
    q, k, v, key_mask, plan = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask)
    ctx.mark_non_differentiable(lse)
    ctx.plan = plan


def _eager_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_mask = ctx.saved_tensors
    dq, dk, dv = launch_backward(grad_out, q, k, v, out, lse, key_mask, ctx.plan)
    return dq, dk, dv, None, None


# Eager calls with gradients: the plan's forward and backward launches, without the op's dispatcher.
_EagerTritonAttention = _ops.eager_function("_EagerTritonAttention", launch_forward, _setup_eager_context,
                                            _eager_gradient, non_differentiable=())


def run_triton(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """An eager call of a Triton plan: the autograd Function when a gradient is needed, else the forward without
    its log-sum-exp."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerTritonAttention.apply(q, k, v, key_mask, plan)[0]
    return launch_forward(q, k, v, key_mask, plan, need_lse=False)[0]


def run_triton_compiled(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """A Triton plan's call inside torch.compile: the custom op, opaque, with its fake and autograd."""
    p = plan.problem
    masks = (key_mask, None) if p.key_masking == "bool" else (None, key_mask)
    return attention_forward_op(q, k, v, *masks, p.causal_mode, p.scale, p.precision)[0]
