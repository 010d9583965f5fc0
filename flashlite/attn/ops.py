"""The torch.library ops ``flashlite::attention_forward`` / ``attention_backward`` (custom ops, with their fakes and
autograd) and ``attention_inference`` (a schema with a kernel and a fake: no gradient).

``torch.compile`` treats the kernel as one opaque node instead of tracing into it. Each op's kernel runs the plan of
the eager call its flat arguments stand for, found in the one plan cache under that call's key, or made and kept
there (``decide.op_plan``): a compiled graph and an eager call of one signature share one plan. Eager calls skip the
ops (``run.run_triton``). Imports ``problem``, ``triton``, ``triton_bwd``, ``run`` and ``decide``.
"""
from typing import Optional

import torch

from flashlite.attn.decide import op_plan
from flashlite.attn.run import differentiable_gradients
from flashlite.attn.triton import launch_forward
from flashlite.attn.triton_bwd import check_backward_tensors, launch_backward


@torch.library.custom_op("flashlite::attention_forward", mutates_args=())
def attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                         causal_mode: int, scale: float, precision: str, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0,
                         alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton attention forward as an opaque op: (out [B, H, S_q, D], base-2 lse [B, H, S_q] float32)."""
    plan = op_plan(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left, window_right,
                   softcap, alibi_slopes)
    return launch_forward(q, k, v, key_padding_mask if key_lengths is None else key_lengths, alibi_slopes, plan,
                          like_q=True)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left=-1,
                            window_right=-1, softcap=0.0, alibi_slopes=None):
    batch, heads, seq_q, _ = q.shape
    # out as the kernel lays it out (launch_forward's like_q): a compiled graph relies on the declared strides.
    return torch.empty_like(q), q.new_empty((batch, heads, seq_q), dtype=torch.float32)


@torch.library.custom_op("flashlite::attention_backward", mutates_args=())
def attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor,
                          key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                          causal_mode: int, scale: float, precision: str, window_left: int = -1,
                          window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton attention backward as an opaque op: (dq, dk, dv), contiguous, in the dtypes of q, k, v."""
    plan = op_plan(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left, window_right,
                   softcap, alibi_slopes)
    check_backward_tensors(grad_out, out, lse, q)
    return launch_backward(grad_out, q, k, v, out, lse, key_padding_mask if key_lengths is None else key_lengths,
                           alibi_slopes, plan)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                             precision, window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


# The inference op: what a compiled graph calls where no gradient can flow (grad mode off, or no input requires
# grad), so the kernel skips its log-sum-exp. It is a plain torch.library schema with one kernel for every device
# and no autograd formula, not a custom_op: custom_op's per-call wrappers (its autograd function and backend checks)
# cost 13-19 us of host time on the development CPU against 4-6 us for a schema's kernel
# (scripts/custom_op_probe.py at commit 8ca4529), and a compiled graph of a small layer is bound by host time.
_INFERENCE_LIBRARY = torch.library.Library("flashlite", "FRAGMENT")
_INFERENCE_LIBRARY.define(
    "attention_inference(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? key_lengths, "
    "int causal_mode, float scale, str precision, int window_left=-1, int window_right=-1, float softcap=0.0, "
    "Tensor? alibi_slopes=None) -> Tensor")


def _attention_inference(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left=-1,
                         window_right=-1, softcap=0.0, alibi_slopes=None):
    """Triton attention forward without its log-sum-exp, as an opaque op: out [B, H, S_q, D]."""
    plan = op_plan(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left, window_right,
                   softcap, alibi_slopes)
    return launch_forward(q, k, v, key_padding_mask if key_lengths is None else key_lengths, alibi_slopes, plan,
                          need_lse=False, like_q=True)[0]


_INFERENCE_LIBRARY.impl("attention_inference", _attention_inference, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlite::attention_inference")
def _attention_inference_fake(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                              window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None):
    return torch.empty_like(q)  # as launch_forward(like_q=True) lays it out


# The op's autograd sees its flat arguments (what a compiled graph holds); the eager Function below sees the plan.
def _setup_op_context(ctx, inputs, output):
    (q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left, window_right, softcap,
     alibi_slopes) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, key_lengths, alibi_slopes)
    ctx.mark_non_differentiable(lse)
    ctx.arguments = (causal_mode, scale, precision, window_left, window_right, softcap)


def _op_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_padding_mask, key_lengths, alibi_slopes = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        problem = op_plan(q, k, v, key_padding_mask, key_lengths, *ctx.arguments, alibi_slopes).problem
        key_mask = key_padding_mask if key_lengths is None else key_lengths
        return differentiable_gradients(grad_out, q, k, v, key_mask, alibi_slopes, problem,
                                        ctx.needs_input_grad[:3]) + (None,) * 9
    dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, *ctx.arguments,
                                       alibi_slopes)
    return (dq, dk, dv) + (None,) * 9


attention_forward_op.register_autograd(_op_gradient, setup_context=_setup_op_context)
