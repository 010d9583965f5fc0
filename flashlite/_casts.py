"""Cast several tensors to one dtype together: one multi-tensor launch on CUDA instead of one cast kernel each.

The layer's "mixed" precision casts its fp32 projection weights and biases to the matmul dtype on every forward
(it keeps no low-precision copy: see ``TransformerLayer``). At launch-bound shapes each of those casts is a kernel
launch of its own, eager, inside a CUDA graph and in Inductor's code alike. ``cast_together`` makes them one where
no gradient is recorded (inference): ``torch._foreach_copy_`` (PyTorch's multi-tensor apply, the kernel its fused
optimizers use; private API, but the one PyTorch kernel that converts a list of tensors in a single launch, and
Inductor lowers it to one foreach kernel) writes every cast into a fresh tensor.

Where autograd records the casts, each is an ordinary ``t.to(dtype)``. A differentiable grouped cast (an
autograd.Function around the same copy, its backward casting the gradients back together) matched per-tensor
casts on the CPU, eager and under Inductor, but under torch.compile on an H200 (torch 2.11, Inductor) its weights'
gradients came out as zeros: the first-gradient check of the training A/B caught it
(benchmarks/results/h200-2026-12-04-d/ at commit 8ca4529). So training keeps the casts autograd knows.
"""
from __future__ import annotations

from typing import Sequence

import torch


def cast_together(tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """``[t.to(dtype) for t in tensors]``: where no gradient is recorded, the casts are fresh tensors written by one
    multi-tensor launch on CUDA; where one is (grad mode on and a tensor that requires grad), per-tensor ``.to``.

    Tensors already in ``dtype`` are returned as they are (as ``t.to(dtype)`` does).

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
    if torch.is_grad_enabled() and any(tensors[i].requires_grad for i in to_cast):
        return [t.to(dtype) for t in tensors]
    # empty_like keeps each source's strides (dense tensors), so the pairs share sizes and strides, which the
    # multi-tensor kernel needs; a pair that does not is copied on its own by the same call (PyTorch's slow path).
    out = [torch.empty_like(tensors[i], dtype=dtype) for i in to_cast]
    torch._foreach_copy_(out, [tensors[i] for i in to_cast])
    for i, t in zip(to_cast, out):
        tensors[i] = t
    return tensors
