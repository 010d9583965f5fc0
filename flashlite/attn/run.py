"""How a Triton plan runs a call: eagerly, the autograd Function around its launches (``run_triton``), or inside
torch.compile, the custom op the graph keeps (``run_triton_compiled``).

Eager calls with gradients skip the op's dispatcher through ``_EagerTritonAttention``, built by the same mechanism
as the norms' (``_ops``). The custom ops themselves are ``ops``'s; ``run_triton_compiled`` calls them by name,
through ``torch.ops``, so that the plans' module order stays one way (``ops`` finds its plans through ``decide``,
which binds these runs into them). Imports ``problem``, ``plan``, ``sdpa``, ``triton`` and ``triton_bwd``.
"""
import functools
from typing import Optional

import torch

from flashlite import _ops
from flashlite.attn.plan import Plan
from flashlite.attn.problem import Problem, check_constant_slopes
from flashlite.attn.sdpa import sdpa_attention
from flashlite.attn.triton import launch_forward
from flashlite.attn.triton_bwd import launch_backward
from flashlite._double_backward import recomputed_gradients


def needs_gradient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether autograd will record this call: grad mode on and an input that requires grad."""
    return torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)


def differentiable_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_mask: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], problem: Problem,
                             needs: tuple[bool, ...]) -> tuple[Optional[torch.Tensor], ...]:
    """(dq, dk, dv) for a backward that autograd records (``create_graph=True``): the call recomputed in float32 by
    the SDPA path of the same variant, differentiated with a graph (``flashlite._double_backward``); the kernels'
    gradients are constants to autograd. ``needs``: which of q, k, v need a gradient."""
    return recomputed_gradients(
        lambda qf, kf, vf: sdpa_attention(qf, kf, vf, key_mask, problem, alibi_slopes=alibi_slopes), (q, k, v),
        needs, grad_out)


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


def run_triton(plan: Plan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               key_mask: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    """An eager call of a Triton plan: the autograd Function when a gradient is needed, else the forward without
    its log-sum-exp."""
    if alibi_slopes is not None:  # the kernels compute no gradient for the slopes
        check_constant_slopes(alibi_slopes)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):  # needs_gradient, inline
        return _EagerTritonAttention.apply(q, k, v, key_mask, alibi_slopes, plan)[0]
    return launch_forward(q, k, v, key_mask, alibi_slopes, plan, need_lse=False, like_q=True)[0]


def run_triton_compiled(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_mask: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None
                        ) -> torch.Tensor:
    """A Triton call of ``problem`` inside torch.compile: an opaque op with its fake; the custom op with its autograd
    (``flashlite::attention_forward``) where a gradient can flow, else the inference op (grad mode and
    ``requires_grad`` are known, and guarded, at trace time). The op's kernel finds the plan of the eager call with
    the same arguments (``decide.op_plan``)."""
    check_constant_slopes(alibi_slopes)  # the kernels compute no gradient for the slopes
    p = problem
    masks = (key_mask, None) if p.key_masking == "bool" else (None, key_mask)
    arguments = (*masks, p.causal_mode, p.scale, p.precision, p.window_left, p.window_right, p.softcap, alibi_slopes)
    if needs_gradient(q, k, v):
        return torch.ops.flashlite.attention_forward.default(q, k, v, *arguments)[0]
    return torch.ops.flashlite.attention_inference.default(q, k, v, *arguments)
