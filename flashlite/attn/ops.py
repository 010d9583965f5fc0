"""The torch.library ops ``flashlite::attention_forward`` / ``attention_backward`` (custom ops, with their fakes and
autograd) and ``attention_inference`` (a schema with a kernel and a fake: no gradient), and how a Triton plan runs a
call (``run_triton``, ``run_triton_compiled``).

``torch.compile`` treats the kernel as one opaque node instead of tracing into it; eager calls with gradients skip
the op's dispatcher through ``_EagerTritonAttention``, built by the same mechanism as the norms' (``_ops``).
Imports ``problem``, ``plan`` and ``triton``.
"""
import functools
from typing import Optional

import torch

from flashlite import _ops
from flashlite.attn.triton import _launcher_plan, attention_forward, launch_forward
from flashlite.attn.triton_bwd import attention_backward, launch_backward
from flashlite.attn.plan import Plan
from flashlite.attn.sdpa import sdpa_attention
from flashlite.attn.problem import Problem, check_constant_slopes
from flashlite._double_backward import recomputed_gradients


@torch.library.custom_op("flashlite::attention_forward", mutates_args=())
def attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                         causal_mode: int, scale: float, precision: str, window_left: int = -1,
                         window_right: int = -1, softcap: float = 0.0,
                         alibi_slopes: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton attention forward as an opaque op: (out [B, H, S_q, D], base-2 lse [B, H, S_q] float32)."""
    return attention_forward(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                             window_left=window_left, window_right=window_right, softcap=softcap,
                             alibi_slopes=alibi_slopes)


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
    return attention_backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                              precision, window_left=window_left, window_right=window_right, softcap=softcap,
                              alibi_slopes=alibi_slopes)


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
    return attention_forward(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                             window_left=window_left, window_right=window_right, softcap=softcap,
                             alibi_slopes=alibi_slopes, need_lse=False)[0]


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


def differentiable_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_mask: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], problem: Problem,
                             needs: tuple[bool, ...]) -> tuple[Optional[torch.Tensor], ...]:
    """(dq, dk, dv) for a backward that autograd records (``create_graph=True``): the call recomputed in float32 by
    the SDPA path of the same variant, differentiated with a graph (``flashlite._double_backward``); the kernels'
    gradients are constants to autograd. ``needs``: which of q, k, v need a gradient."""
    return recomputed_gradients(
        lambda qf, kf, vf: sdpa_attention(qf, kf, vf, key_mask, problem, alibi_slopes=alibi_slopes), (q, k, v),
        needs, grad_out)


def _op_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_padding_mask, key_lengths, alibi_slopes = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        problem = _launcher_plan(q, k, v, key_padding_mask, key_lengths, *ctx.arguments, alibi_slopes, {}).problem
        key_mask = key_padding_mask if key_lengths is None else key_lengths
        return differentiable_gradients(grad_out, q, k, v, key_mask, alibi_slopes, problem,
                                        ctx.needs_input_grad[:3]) + (None,) * 9
    dq, dk, dv = attention_backward_op(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, *ctx.arguments,
                                       alibi_slopes)
    return (dq, dk, dv) + (None,) * 9


attention_forward_op.register_autograd(_op_gradient, setup_context=_setup_op_context)


def _setup_eager_context(ctx, inputs, output):
    q, k, v, key_mask, alibi_slopes, plan = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_mask, alibi_slopes)
    ctx.mark_non_differentiable(lse)
    ctx.plan = plan


def _eager_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, key_mask, alibi_slopes = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        return differentiable_gradients(grad_out, q, k, v, key_mask, alibi_slopes, ctx.plan.problem,
                                        ctx.needs_input_grad[:3]) + (None,) * 3
    dq, dk, dv = launch_backward(grad_out, q, k, v, out, lse, key_mask, alibi_slopes, ctx.plan)
    return dq, dk, dv, None, None, None


# Eager calls with gradients: the plan's forward and backward launches, without the op's dispatcher. attention()'s
# output is laid out like q (launch_forward's like_q): for a layer's q, a view of [B, S, H, D] projections, the
# heads merge back into [B, S, H * D] without a copy, as they do after SDPA.
_EagerTritonAttention = _ops.eager_function("_EagerTritonAttention", functools.partial(launch_forward, like_q=True),
                                            _setup_eager_context, _eager_gradient, non_differentiable=())


def needs_gradient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd will record this call: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def run_triton(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
               alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An eager call of a Triton plan: the autograd Function when a gradient is needed, else the forward without
    its log-sum-exp."""
    if alibi_slopes is not None:  # the kernels compute no gradient for the slopes
        check_constant_slopes(alibi_slopes)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):  # needs_gradient, inline
        return _EagerTritonAttention.apply(q, k, v, key_mask, alibi_slopes, plan)[0]
    return launch_forward(q, k, v, key_mask, alibi_slopes, plan, need_lse=False, like_q=True)[0]


def run_triton_compiled(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_mask: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """A Triton call of ``problem`` inside torch.compile: an opaque op with its fake; the custom op with its autograd
    where a gradient can flow, else the inference op (grad mode and ``requires_grad`` are known, and guarded, at
    trace time)."""
    check_constant_slopes(alibi_slopes)  # the kernels compute no gradient for the slopes
    p = problem
    masks = (key_mask, None) if p.key_masking == "bool" else (None, key_mask)
    arguments = (*masks, p.causal_mode, p.scale, p.precision, p.window_left, p.window_right, p.softcap, alibi_slopes)
    if needs_gradient(q, k, v):
        return attention_forward_op(q, k, v, *arguments)[0]
    return torch.ops.flashlite.attention_inference.default(q, k, v, *arguments)
