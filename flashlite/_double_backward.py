"""Gradients that autograd can differentiate again: what flashlite's backward passes return under
``create_graph=True`` (a gradient penalty, Hessian-vector products, ``torch.autograd.gradgradcheck``).

The Triton backward kernels write plain tensors: autograd cannot see how they depend on the inputs, so a second
differentiation through them would silently treat the first gradients as constants. Each backward therefore checks
``torch.is_grad_enabled()`` (on inside a backward only when autograd builds a graph of it) and, when on, computes
the gradients here instead, with differentiable PyTorch operations in float32 (float64 stays float64):

- attention (``flashlite.attention``, ``attention_varlen``): the forward recomputed by the SDPA path of the same
  variant on SDPA's math backend (the fused SDPA kernels' backward has no derivative), then ``torch.autograd.grad``
  with ``create_graph=True`` (``recomputed_gradients``). It holds O(S_q * S_k) memory, as the SDPA path does;
- LayerNorm and bias + GELU: their backward formulas written as tensor operations (``layer_norm_gradients``,
  ``bias_gelu_gradients``).

An ordinary backward (``create_graph=False``) never comes here and runs the kernels as before.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel


def _math_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 for float16, bfloat16 and float32 tensors; float64 for float64 (what gradcheck runs)."""
    return torch.promote_types(t.dtype, torch.float32)


def recomputed_gradients(compute: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
                         needs: Sequence[bool], grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
    """The gradients of ``compute(*inputs)`` (run on float32 casts of ``inputs``; float64 ones stay) against
    ``grad_out``, one per input (None where ``needs`` is False), as functions of ``inputs`` and ``grad_out`` that
    autograd can differentiate again. Each has its input's dtype (the gradient flows back through the cast).

    Example:
        >>> x = torch.randn(3, dtype=torch.float16, requires_grad=True)
        >>> dx, = recomputed_gradients(lambda t: t.pow(3), [x], [True], torch.ones(3))
        >>> dx.dtype, dx.requires_grad
        (torch.float16, True)
    """
    wanted = [i for i, need in enumerate(needs) if need]
    gradients: list[Optional[torch.Tensor]] = [None] * len(inputs)
    if not wanted:
        return tuple(gradients)
    with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
        # One distinct graph node per argument slot: one tensor passed as k and v (or q, k and v) would otherwise
        # receive, in each slot, the gradient of all its uses, and autograd would sum those again.
        slots = [t.view_as(t) for t in inputs]
        out = compute(*(t.to(_math_dtype(t)) for t in slots))
    # Zeros, not None, for an input the recompute does not reach (a key every mask hides): autograd expects a
    # gradient for each input that requires one.
    found = torch.autograd.grad(out, [slots[i] for i in wanted], grad_out.to(out.dtype), create_graph=True,
                                materialize_grads=True)
    for i, gradient in zip(wanted, found):
        gradients[i] = gradient
    return tuple(gradients)


def layer_norm_gradients(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                         dsum: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dweight, dbias) of ``layer_norm(x, weight, bias, eps)`` over the last dimension (plus ``dsum``, the
    gradient that reaches x directly, for the residual add), from x itself (the statistics are recomputed, as
    functions of x), in float32; dx in x's dtype, dweight and dbias in weight's (as the kernel returns them).

    Example:
        >>> x, w, dy = torch.randn(4, 8), torch.rand(8), torch.randn(4, 8)
        >>> dx, dw, db = layer_norm_gradients(dy, x, w, 1e-5)
        >>> dx.shape, dw.shape, torch.allclose(db, dy.sum(0))
        (torch.Size([4, 8]), torch.Size([8]), True)
    """
    n = x.shape[-1]
    xf = x.to(_math_dtype(x))
    centered = xf - xf.mean(dim=-1, keepdim=True)
    rstd = torch.rsqrt(centered.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = centered * rstd
    dyf = dy.to(xf.dtype)
    g = dyf * weight.to(xf.dtype)
    dx = rstd * (g - g.mean(dim=-1, keepdim=True) - normed * (g * normed).mean(dim=-1, keepdim=True))
    if dsum is not None:
        dx = dx + dsum.to(xf.dtype)
    dweight = (dyf * normed).reshape(-1, n).sum(0)
    dbias = dyf.reshape(-1, n).sum(0)
    return dx.to(x.dtype), dweight.to(weight.dtype), dbias.to(weight.dtype)


def bias_gelu_gradients(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, dbias) of the exact GELU of ``x + bias``, in float32: dx = dy * (Phi(z) + z * phi(z)), z = x + bias;
    dx in x's dtype, dbias (summed over every row in float32) in bias's.

    Example:
        >>> x, b, dy = torch.randn(3, 5), torch.randn(5), torch.randn(3, 5)
        >>> dx, db = bias_gelu_gradients(dy, x, b)
        >>> torch.allclose(db, dx.sum(0))
        True
    """
    z = x.to(_math_dtype(x)) + bias.to(_math_dtype(x))
    cdf = 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))
    pdf = torch.exp(-0.5 * z * z) * (1.0 / math.sqrt(2.0 * math.pi))
    dx = dy.to(z.dtype) * (cdf + z * pdf)
    return dx.to(x.dtype), dx.reshape(-1, x.shape[-1]).sum(0).to(bias.dtype)
