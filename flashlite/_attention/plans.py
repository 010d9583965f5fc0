"""Decide which backend runs a validated call (and log why), and the replayable plan of a Triton call.

``_decide`` asks ``flashlite.dispatch`` for ``backend="auto"``; ``_decide_with_mask`` sends explicit masks to SDPA;
``_TritonPlan`` replays a decided Triton call. Imports ``validation``, ``launch``, ``ops`` and ``sdpa``.
"""
import logging
import os
from typing import Optional

import torch

from flashlite import _direct_launch
from flashlite._attention.launch import _launch_forward_recorded, _launch_inference
from flashlite._attention.ops import _triton_attention
from flashlite._attention.sdpa import _check_attn_mask
from flashlite._attention.validation import _CAUSAL_ARGUMENT, _Call, _kernel_unsupported
from flashlite.dispatch import Decision, choose_backend

# The public module's name, as the documentation of FLASHLITE_DEBUG_DISPATCH gives it.
_log = logging.getLogger("flashlite.attention")


def _decide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call, backend: str) -> Decision:
    if backend == "sdpa":
        return Decision("sdpa", "forced by backend='sdpa'")
    unsupported = _kernel_unsupported(q, k, v, call.key_padding_mask)
    if backend == "triton":
        if unsupported is not None:
            raise ValueError(f"backend='triton' cannot run this call: {unsupported}")
        return Decision("triton", "forced by backend='triton'")
    return choose_backend(q, causal=_CAUSAL_ARGUMENT[call.causal_mode], seq_k=k.shape[2], unsupported=unsupported)


def _log_decision(decision: Decision, q: torch.Tensor, k: torch.Tensor) -> None:
    if os.environ.get("FLASHLITE_DEBUG_DISPATCH", "0") not in ("", "0"):
        _log.debug("flashlite.attention q %s k %s %s -> %s: %s", tuple(q.shape), tuple(k.shape), q.dtype,
                   decision.backend, decision.reason)


def _decide_with_mask(q: torch.Tensor, k: torch.Tensor, call: _Call, backend: str,
                      attn_mask: object) -> Decision:
    _check_attn_mask(q, k, attn_mask)
    reason = "an explicit attn_mask (arbitrary mask or bias) is not an input of the Triton kernel"
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this call: {reason}; use key_padding_mask / key_lengths "
                         f"and causal, or backend='sdpa'")
    return Decision("sdpa", "forced by backend='sdpa'" if backend == "sdpa" else f"kernel cannot run this call: "
                                                                                f"{reason}")


class _TritonPlan:
    """A replayed Triton-backend call (no masks; fixed shapes, strides, dtypes, devices and arguments).

    Inference calls replay the forward launch recorded on the plan's first inference replay straight into the
    compiled kernel (``flashlite._direct_launch``), skipping Triton's per-call argument binding; calls that need
    gradients, compiled code, and calls the recording cannot take (unaligned tensors) launch the ordinary way. The
    plan keeps its own recording rather than going through the launch cache: its signature is already fixed, so a
    replay needs no bucket arithmetic, argument tuple or cache key, each of which would add host time to every
    call at launch-bound sizes."""

    __slots__ = ("call", "recorded", "tried")

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.recorded: Optional[_direct_launch.RecordedLaunch] = None
        self.tried = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        call = self.call
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _triton_attention(q, k, v, call)
        recorded = self.recorded
        if recorded is not None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            # As recorded: out in the (unused) lse slot, q in the mask slots.
            if recorded.launch(q, k, v, out, out, q, q):
                return out
        if self.tried or not q.is_cuda:
            return _launch_inference(q, k, v, None, None, call.causal_mode, call.scale, call.precision)
        self.tried = True
        out, _, self.recorded = _launch_forward_recorded(q, k, v, None, None, call.causal_mode, call.scale,
                                                         call.precision, record=True, need_lse=False)
        return out
