"""Eager autograd for flashlite's custom ops: one ``autograd.Function`` per op, built from the op's own parts.

A call through ``torch.ops`` crosses between Python and the C++ dispatcher several times (autograd, then the device
kernel), which costs tens of microseconds: at launch-bound sizes, more than the kernel. Eager calls therefore take an
``autograd.Function`` made here from the same forward, context setup and gradient the op registers, and
``torch.compile`` sees the custom op itself, opaque, with its fake implementation.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def eager_function(name: str, forward: Callable[..., Any], setup: Callable[..., None], grad: Callable[..., Any],
                   non_differentiable: tuple[int, ...]) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` that runs ``forward(*inputs)``, then ``setup(ctx, inputs, output)`` (what the op's
    ``register_autograd`` calls ``setup_context``), and ``grad(ctx, *grads)`` on the way back. The outputs at the
    positions ``non_differentiable`` (of a tuple output) are marked so.

    Example:
        >>> def setup(ctx, inputs, output):
        ...     ctx.save_for_backward(inputs[0])
        >>> def grad(ctx, dy):
        ...     (x,) = ctx.saved_tensors
        ...     return 2 * x * dy
        >>> Square = eager_function("Square", lambda x: x * x, setup, grad, ())
        >>> x = torch.tensor([3.0], requires_grad=True)
        >>> Square.apply(x).backward()
        >>> x.grad
        tensor([6.])
    """

    def fwd(ctx, *inputs):
        output = forward(*inputs)
        setup(ctx, inputs, output)
        if isinstance(output, tuple):
            ctx.mark_non_differentiable(*(output[i] for i in non_differentiable))
        return output

    def bwd(ctx, *grads):
        return grad(ctx, *grads)

    return type(name, (torch.autograd.Function,), {"forward": staticmethod(fwd), "backward": staticmethod(bwd)})


def needs_grad(inputs: tuple[Any, ...]) -> bool:
    """Whether autograd must record a call on ``inputs``: grad mode is on and a tensor among them requires grad."""
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)


def run(op: Callable[..., Any], eager: type[torch.autograd.Function], forward: Callable[..., Any],
        *inputs: Any) -> Any:
    """The custom op under torch.compile; else the eager Function when a gradient is needed; else the forward."""
    if torch.compiler.is_compiling():
        return op(*inputs)
    if needs_grad(inputs):
        return eager.apply(*inputs)
    return forward(*inputs)
