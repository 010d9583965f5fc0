"""Shared inputs for the A/B suite: fresh random tensors on the GPU, never zeros."""
from __future__ import annotations

import pytest
import torch

from flashlite.cases import attention_flops, attention_io_bytes

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="GPU speed needs a CUDA GPU: CPU timings of an interpreted Triton kernel say nothing about GPU speed",
)


def qkv(B: int, H: int, S: int, D: int, dtype: torch.dtype, *, requires_grad: bool = False, seed: int = 0):
    """Random q, k, v of shape [B, H, S, D] on the current CUDA device (or CPU without one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    return tuple(
        torch.randn(B, H, S, D, device=device, dtype=dtype, generator=gen).requires_grad_(requires_grad)
        for _ in range(3)
    )


def attention_bytes(shape, copies: int = 5) -> int:
    """Memory estimate for an A/B pair: q, k, v and one output per side, with headroom for statistics."""
    elem = torch.empty((), dtype=shape.dtype).element_size()
    return int(copies * shape.B * shape.H * shape.S * shape.D * elem * 1.1)


def attention_work(shape, *, passes: str = "forward", dtype: torch.dtype | None = None) -> dict:
    """``flops`` and ``bytes`` of one causal self-attention call on ``shape`` (B, H, S, D; its dtype unless
    ``dtype`` is given), for ``kernel_ab.compare``: the counts of flashlite.cases, the same for both sides."""
    dtype = dtype or shape.dtype
    return {
        "flops": attention_flops(shape.B, shape.H, shape.S, shape.S, shape.D, causal=True, passes=passes),
        "bytes": attention_io_bytes(shape.B, shape.H, shape.S, shape.S, shape.D, dtype, passes=passes),
        "dtype": dtype,
    }


def forward_backward(inputs: tuple[torch.Tensor, ...], forward):
    """A timed step of ``forward()`` and a backward with one fixed random incoming gradient (made on the first
    call, shaped like the output), the inputs' gradients cleared first; returns the first input's gradient."""
    grad_out = None

    def run():
        nonlocal grad_out
        for t in inputs:
            t.grad = None
        out = forward()
        if grad_out is None:
            grad_out = torch.randn_like(out)
        out.backward(grad_out)
        return inputs[0].grad
    return run


def pointer_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, precision: str,
                    causal_mode: int = 1, window: tuple[int, int] = (-1, -1)):
    """A callable of the pointer kernel's forward alone, (out, lse): a plan of its own whose Gluon decision is made,
    False. ``attention_forward`` and ``attention(backend="triton")`` take the Gluon forward wherever the dispatch
    rule does, so they are not the pointer kernel at the shapes the Gluon A/B compares."""
    from flashlite.attn.triton import _check_launch, launch_forward
    from flashlite.attn.plan import Plan
    from flashlite.dispatch import Decision

    problem = _check_launch(q, k, v, None, None, causal_mode, scale, precision, window[0], window[1], 0.0, None)
    plan = Plan(problem, Decision("triton", "the pointer kernel alone (an A/B baseline)"), record=q.is_cuda,
                gluon=False)

    def forward():
        return launch_forward(q, k, v, None, None, plan)
    return forward
