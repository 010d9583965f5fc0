"""Cast several tensors to one dtype together: one multi-tensor launch on CUDA instead of one cast kernel each.

The layer's "mixed" precision casts its fp32 projection weights and biases to the matmul dtype on every forward
(it keeps no low-precision copy: see ``TransformerLayer``). At launch-bound shapes each of those casts is a kernel
launch of its own, eager, inside a CUDA graph and in Inductor's code alike. ``cast_together`` makes them one:
``torch._foreach_copy_`` (PyTorch's multi-tensor apply, the kernel its fused optimizers use; private API, but the
one PyTorch kernel that converts a list of tensors in a single launch, and Inductor lowers it to one foreach kernel)
writes every cast into a fresh tensor. Differentiable: the gradients go back to each source's dtype, again
together.
"""
from __future__ import annotations

from typing import Sequence

import torch


def _cast_list(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    # empty_like keeps each source's strides (dense tensors), so the pairs share sizes and strides, which the
    # multi-tensor kernel needs; a pair that does not is copied on its own by the same call (PyTorch's slow path).
    out = [torch.empty_like(t, dtype=dtype) for t in tensors]
    torch._foreach_copy_(out, list(tensors))
    return out


class _CastTogether(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dtype: torch.dtype, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.source_dtypes = tuple(t.dtype for t in tensors)
        ctx.set_materialize_grads(False)
        return tuple(_cast_list(tensors, dtype))

    @staticmethod
    def backward(ctx, *grads):
        present = [i for i, g in enumerate(grads) if g is not None]
        back: list = [None] * len(grads)
        # Grouped by source dtype so each group is one multi-tensor launch (all fp32 in the layer's use).
        for dtype in {ctx.source_dtypes[i] for i in present}:
            group = [i for i in present if ctx.source_dtypes[i] == dtype]
            for i, g in zip(group, _cast_list([grads[i] for i in group], dtype)):
                back[i] = g
        return (None, *back)


def cast_together(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]``, as fresh tensors, with one multi-tensor launch on CUDA; differentiable.

    Tensors already in ``dtype`` are returned as they are (as ``t.to(dtype)`` does); the others are cast together.

    Example:
        >>> w, b = torch.randn(4, 3), torch.randn(4)
        >>> [t.dtype for t in cast_together([w, b], torch.bfloat16)]
        [torch.bfloat16, torch.bfloat16]
        >>> torch.equal(cast_together([w], torch.bfloat16)[0], w.to(torch.bfloat16))
        True
    """
    tensors = list(tensors)
    to_cast = [i for i, t in enumerate(tensors) if t.dtype != dtype]
    if not to_cast:
        return tensors
    cast = _CastTogether.apply(dtype, *(tensors[i] for i in to_cast))
    for i, t in zip(to_cast, cast):
        tensors[i] = t
    return tensors
