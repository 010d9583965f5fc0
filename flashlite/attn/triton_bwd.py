"""Launch the pointer (``@triton.jit``) backward kernels for a plan: delta, dQ and dK/dV, or the Gluon dK/dV and dQ
kernels where ``gluon_bwd.backward_on_gluon`` says so, and the public launcher ``attention_backward``.

The launch machinery (configs, grids, recording and replay) is the forward's, ``triton``; the incoming gradient's
layout joins each launch site's name, so every layout has its own recordings. Imports ``problem``, ``plan``,
``triton``, ``gluon`` and ``gluon_bwd``.
"""
import math
from typing import Any, Optional

import torch

from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd, triton as pointer
from flashlite.attn.plan import Plan
from flashlite.attn.problem import CAUSAL_KEY_LENGTH, Problem
from flashlite.attn.triton import (BlockConfig, _block_d, _dot_mode, _forced_config, _Grid, _key_mask_args, _launch,
                                   _launcher_plan, _new_output, _replayed, _variant_args)

if pointer._TRITON_ERROR is None:
    from flashlite.kernels import attention_bwd as _bwd
    from flashlite.kernels import tuning as _tuning

def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor,
                       key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                       causal_mode: int, scale: float, precision: str, window_left: int = -1,
                       window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                       dkdv_config: Optional[BlockConfig] = None,
                       dq_config: Optional[BlockConfig] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels; returns (dq, dk, dv) shaped and typed like q, k, v. The variant arguments as in
    ``attention_forward``, the same as the forward's that gave ``out`` and ``lse``.

    Example:
        >>> dq, dk, dv = attention_backward(do, q, k, v, out, lse, None, None, 1, 0.25, "ieee")  # doctest: +SKIP
    """
    configs = {}
    if dkdv_config is not None:
        configs["dkdv"] = _forced_config(dkdv_config, pointer._DKDV)
    if dq_config is not None:
        configs["dq"] = _forced_config(dq_config, pointer._DQ)
    plan = _launcher_plan(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left,
                          window_right, softcap, alibi_slopes, configs)
    check_backward_tensors(grad_out, out, lse, q)
    return launch_backward(grad_out, q, k, v, out, lse, key_padding_mask if key_lengths is None else key_lengths,
                           alibi_slopes, plan)


def check_backward_tensors(grad_out: Any, out: Any, lse: Any, q: torch.Tensor,
                           lse_shape: Optional[tuple[int, ...]] = None) -> None:
    """What the backward kernels take on trust from a direct call: ``grad_out`` and ``out`` shaped, typed and placed
    like q, ``lse`` float32 ``lse_shape`` (default [B, H, S_q]; packed sequences: [batch, H, max_seqlen_q]) beside
    them. The kernels index all three with these sizes, so a shorter tensor is read and written out of bounds, and
    another dtype is read as raw bits of the wrong type."""
    expected = {"grad_out": (tuple(q.shape), q.dtype), "out": (tuple(q.shape), q.dtype),
                "lse": (tuple(q.shape[:3]) if lse_shape is None else lse_shape, torch.float32)}
    for name, tensor in (("grad_out", grad_out), ("out", out), ("lse", lse)):
        shape, dtype = expected[name]
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a tensor of shape {list(shape)} and dtype {dtype}, got "
                            f"{type(tensor).__name__}")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype or tensor.device != q.device:
            raise ValueError(f"{name} must have shape {list(shape)}, dtype {dtype} and device {q.device} (from q "
                             f"and the forward's outputs), got shape {list(tensor.shape)}, dtype "
                             f"{tensor.dtype} and device {tensor.device}")


def launch_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, key_mask: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor],
                    plan: Plan, cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of a call of ``plan``'s signature, from the forward's ``out`` and ``lse``; ``alibi_slopes`` and
    packed sequences (``cu_seqlens``, every tensor a ``packed_view``, the gradients too) as in ``launch_forward``."""
    p = plan.problem
    if p.causal_mode == CAUSAL_KEY_LENGTH:  # the backward kernels align their diagonals to S_k, not to n_len
        raise ValueError("the backward kernels have no causal mode aligned to each key length (decoding against "
                         "a KV cache is forward only)")
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    if p.varlen:
        dq, dk, dv = _new_output(q, p), _new_output(k, p), _new_output(v, p)
    else:  # contiguous; empty_like parses fewer arguments than empty
        contiguous = torch.contiguous_format
        dq = torch.empty_like(q, memory_format=contiguous)
        dk = torch.empty_like(k, memory_format=contiguous)
        dv = torch.empty_like(v, memory_format=contiguous)
    mask_arg, lengths_arg, stride_mask_b, stride_mask_n = _key_mask_args(q, key_mask, p)
    # The incoming gradient's layout and dtype are not part of the signature (autograd may pass an expanded or
    # transposed gradient): they join the sites' names, so each layout has its own recordings. out and lse come from
    # the forward of this signature, but a direct launcher call may pass its own: their strides join too.
    layout = (grad_out.stride(), grad_out.dtype, out.stride(), out.dtype)
    cu_q, cu_k = (q, q) if cu_seqlens is None else cu_seqlens
    flat_q = p.batch * p.heads > pointer._GRID_AXIS1_LIMIT
    if plan.gluon_bwd and launch_gluon.bases_aligned(q, k, v):
        # The Gluon kernels read delta from the preprocessing kernel.
        delta_tensors = (out, grad_out, delta, cu_q)  # the kernel's leading tensors, in order
        if not _replayed(plan, ("delta", layout), delta_tensors):
            _launch(_bwd.attn_bwd_delta, ("delta", layout), plan, _Grid(p.seq_q, "BLOCK_M", p.batch * p.heads),
                    delta_tensors, (*out.stride(), *grad_out.stride(), p.heads, p.seq_q),
                    dict(HEAD_DIM=p.head_dim, BLOCK_D=_block_d(p.head_dim), FLAT_GRID=flat_q,
                         BLOCK_M=_bwd.DELTA_BLOCK_M, VARLEN=p.varlen))
        tma_grad_out = launch_gluon_bwd.tma_gradient(grad_out)  # one copy at most, for both kernels
        launch_gluon_bwd.launch_dkdv(q, k, v, tma_grad_out, lse, delta, dk, dv, p.causal_mode, p.scale)
        launch_gluon_bwd.launch_dq(q, k, v, tma_grad_out, lse, delta, dq, p.causal_mode, p.scale)
        return dq, dk, dv
    # The pointer kernels: dQ first, since it computes and stores delta, which dK/dV reads. A replayed launch needs
    # only its tensors; the scalars and constexprs of an ordinary launch are worked out when one is needed.
    alibi_arg = q if p.alibi == "none" else alibi_slopes  # the ALiBi pointer, as the forward passes it
    # Each entry's first visible key, where dQ's key loop starts (as in the forward launcher).
    start_arg = mask_arg.argmax(1) if p.key_masking == "bool" else q
    dq_tensors = (q, k, v, grad_out, out, lse, delta, dq, mask_arg, lengths_arg, start_arg, alibi_arg, cu_q, cu_k)
    launch_args = None
    if not _replayed(plan, ("dq", layout), dq_tensors):
        launch_args = variant_scalars, meta, qk_scale, buckets = _pointer_backward_args(alibi_slopes, p)
        _launch(pointer._DQ, ("dq", layout), plan, _Grid(p.seq_q, "BLOCK_M", p.batch * p.heads), dq_tensors,
                (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *out.stride(), *dq.stride(),
                 stride_mask_b, stride_mask_n, *variant_scalars[:2], p.heads, p.group_size, p.seq_q, p.seq_k,
                 qk_scale, p.scale, *variant_scalars[2:], *buckets),
                dict(FLAT_GRID=flat_q, **meta))
    _launch_pointer_dkdv(q, k, v, grad_out, lse, delta, dk, dv, mask_arg, lengths_arg, alibi_slopes, cu_q, cu_k,
                         stride_mask_b, stride_mask_n, plan, layout, launch_args)
    return dq, dk, dv


def _launch_pointer_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                         delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, mask_arg: torch.Tensor,
                         lengths_arg: torch.Tensor, alibi_slopes: Optional[torch.Tensor], cu_q: torch.Tensor,
                         cu_k: torch.Tensor, stride_mask_b: int, stride_mask_n: int, plan: Plan, layout: tuple,
                         launch_args: Optional[tuple] = None) -> None:
    """The pointer dK/dV kernel into ``dk`` and ``dv``, reading ``delta`` (written by the pointer dQ kernel);
    ``launch_args``: ``_pointer_backward_args``' result where the dQ launch already worked it out."""
    p = plan.problem
    alibi_arg = q if p.alibi == "none" else alibi_slopes  # the ALiBi pointer, as the forward passes it
    dkdv_tensors = (q, k, v, grad_out, lse, delta, dk, dv, mask_arg, lengths_arg, alibi_arg, cu_q, cu_k)
    if not _replayed(plan, ("dkdv", layout), dkdv_tensors):
        variant_scalars, meta, qk_scale, buckets = launch_args or _pointer_backward_args(alibi_slopes, p)
        _launch(pointer._DKDV, ("dkdv", layout), plan, _Grid(p.seq_k, "BLOCK_N", p.batch * p.kv_heads), dkdv_tensors,
                (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
                 stride_mask_b, stride_mask_n, *variant_scalars[:2], p.heads, p.kv_heads, p.group_size, p.seq_q,
                 p.seq_k, qk_scale, p.scale, *variant_scalars[2:], *buckets),
                dict(FLAT_GRID=p.batch * p.kv_heads > pointer._GRID_AXIS1_LIMIT, **meta))


def _pointer_backward_args(alibi_slopes: Optional[torch.Tensor], problem: Problem) -> tuple[tuple, dict, float, tuple]:
    """What an ordinary launch of the pointer dQ or dK/dV kernel takes beside its tensors: (variant scalars, shared
    constexprs, qk_scale, tuning buckets)."""
    p = problem
    variant_scalars, variant_flags = _variant_args(alibi_slopes, p)
    meta = dict(HEAD_DIM=p.head_dim, BLOCK_D=_block_d(p.head_dim), CAUSAL=p.causal_mode, KEY_MASK=p.key_masking,
                DOT=_dot_mode(p.precision), **variant_flags)
    return (variant_scalars, meta, p.scale * math.log2(math.e),
            _tuning.tuning_buckets(p.seq_q, p.seq_k, p.batch * p.heads))
