"""``attention_varlen``: attention over packed variable-length sequences, on the Triton kernel or through SDPA.

The sequences lie end to end: q [total_q, H, D], k and v [total_k, H_kv, D], ``cu_seqlens_q`` / ``cu_seqlens_k``
int32 [batch + 1] starts (the first 0, the last the total). The kernel reads the starts itself (its VARLEN mode,
``flashlite.kernels.attention_common``), so a call costs no padding and no device synchronisation. The SDPA path,
for where the kernel cannot run, pads on the device (scatter and gather, no synchronisation either) and masks the
padding. A call's plan (its problem and decision) is kept in the one plan cache under the "varlen" entry; what
changes from batch to batch (the offsets' values, the token counts) is data of the call, checked per call, not part
of the key. The custom ops find the plan of the eager call their flat arguments stand for. Imports ``problem``,
``plan``, ``triton``, ``triton_bwd``, ``sdpa`` and ``decide``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch

from flashlite import _ops
from flashlite.attn.decide import decide
from flashlite.attn.triton import launch_forward, packed_view
from flashlite.attn.triton_bwd import check_backward_tensors, launch_backward
from flashlite.attn import plan as plans
from flashlite.attn.plan import Plan
from flashlite.attn.sdpa import sdpa_attention
from flashlite.attn.problem import (_CAUSAL_ARGUMENT, _NATIVE_PRECISION, CAUSAL_BOTTOM_RIGHT, Problem,
                                    check_constant_slopes, check_offsets, eager_options, kernel_size_limit,
                                    validate_varlen, value_checks_asked, value_checks_wanted)
from flashlite._double_backward import recomputed_gradients


@torch.library.custom_op("flashlite::varlen_checked_offsets", mutates_args=())
def checked_offsets_op(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, total_q: int, total_k: int,
                       max_seqlen_q: int, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The offsets' value checks in a torch.compile'd graph, where the traced call cannot read them: checks both
    as an eager call does and returns copies, which the rest of the graph reads, so that the check runs first and
    is never dropped as unused. Without it a compiled call on the SDPA path (every CPU call of backend="auto") gave
    an output for decreasing offsets, or an IndexError, where the eager call names the offsets' fault."""
    check_offsets("cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, "max_seqlen_q")
    check_offsets("cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, "max_seqlen_k")
    return cu_seqlens_q.clone(), cu_seqlens_k.clone()


@checked_offsets_op.register_fake
def _checked_offsets_fake(cu_seqlens_q, cu_seqlens_k, total_q, total_k, max_seqlen_q, max_seqlen_k):
    return torch.empty_like(cu_seqlens_q), torch.empty_like(cu_seqlens_k)


# ----------------------------------------------------------------------------------------------------------------
# The kernel path: packed tensors as the kernels' views, and one eager autograd Function (the norms' mechanism).

def _varlen_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, alibi_slopes: Optional[torch.Tensor], plan: Plan,
                    need_lse: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out [total_q, H, D], padded lse [B, H, max S_q] or None)."""
    batch = plan.problem.batch
    out, lse = launch_forward(packed_view(q, batch), packed_view(k, batch), packed_view(v, batch), None,
                              alibi_slopes, plan, need_lse, cu_seqlens=(cu_seqlens_q, cu_seqlens_k))
    return out[0].transpose(0, 1), lse


def _varlen_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                     alibi_slopes: Optional[torch.Tensor], plan: Plan) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv), packed like q, k, v, from the forward's packed out and padded lse."""
    views = (packed_view(t, plan.problem.batch) for t in (grad_out, q, k, v, out))
    dq, dk, dv = launch_backward(*views, lse, None, alibi_slopes, plan, cu_seqlens=(cu_seqlens_q, cu_seqlens_k))
    return dq[0].transpose(0, 1), dk[0].transpose(0, 1), dv[0].transpose(0, 1)


def _setup(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, plan = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.plan = plan


def _differentiable_gradients(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                              alibi_slopes: Optional[torch.Tensor], problem: Problem,
                              needs: tuple[bool, ...]) -> tuple[Optional[torch.Tensor], ...]:
    """(dq, dk, dv) for a backward that autograd records (``create_graph=True``): the packed call recomputed in
    float32 by the SDPA path (``_sdpa_varlen``), differentiated with a graph (``flashlite._double_backward``); the
    kernels' gradients are constants to autograd."""
    return recomputed_gradients(
        lambda qf, kf, vf: _sdpa_varlen(qf, kf, vf, cu_seqlens_q, cu_seqlens_k, alibi_slopes, problem), (q, k, v),
        needs, grad_out)


def _gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        return (*_differentiable_gradients(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                           ctx.plan.problem, ctx.needs_input_grad[:3]), None, None, None, None)
    return (*_varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, ctx.plan),
            None, None, None, None)


_EagerVarlenAttention = _ops.eager_function("_EagerVarlenAttention", _varlen_forward, _setup, _gradient,
                                            non_differentiable=(1,))


# torch.compile sees the kernel path as two opaque custom ops with fake implementations, as for attention().
def _op_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal_mode: int, scale: float,
             precision: str, window_left: int, window_right: int, softcap: float,
             alibi_slopes: Optional[torch.Tensor]) -> Plan:
    """The plan of an op call: that of the eager call ``attention_varlen(..., backend="triton")`` the flat arguments
    stand for (the ops' flat defaults read as its defaults), found or made under its key, with the same per-call
    checks: the ops are public through torch.ops, and a too small ``max_seqlen_q`` sizes the log-sum-exp below what
    the kernels write."""
    if causal_mode.__class__ is not int or causal_mode not in _CAUSAL_ARGUMENT:
        raise ValueError(f"causal_mode must be 0, 1 or 2, got {causal_mode!r}")
    native = _NATIVE_PRECISION.get(q.dtype) if isinstance(q, torch.Tensor) else None
    if native is not None and precision != native:
        raise ValueError(f"precision {precision!r} does not fit {q.dtype} inputs (expected {native!r})")
    eager_scale, eager_precision, window, eager_softcap = eager_options(q, 3, scale, precision, window_left,
                                                                        window_right, softcap)
    return _plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, _CAUSAL_ARGUMENT[causal_mode],
                 eager_scale, window, eager_softcap, alibi_slopes, "triton", eager_precision, None)


@torch.library.custom_op("flashlite::attention_varlen_forward", mutates_args=())
def attention_varlen_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal_mode: int,
                                scale: float, precision: str, window_left: int, window_right: int, softcap: float,
                                alibi_slopes: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed forward as an opaque op (arguments checked as ``attention_varlen`` checks them): (out
    [total_q, H, D], padded base-2 lse [B, H, max_seqlen_q] float32)."""
    plan = _op_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_mode, scale, precision,
                    window_left, window_right, softcap, alibi_slopes)
    out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, plan)
    return out, lse


@attention_varlen_forward_op.register_fake
def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_mode, scale, precision,
                  window_left, window_right, softcap, alibi_slopes):
    return (q.new_empty(q.shape),
            q.new_empty((cu_seqlens_q.shape[0] - 1, q.shape[1], max_seqlen_q), dtype=torch.float32))


@torch.library.custom_op("flashlite::attention_varlen_backward", mutates_args=())
def attention_varlen_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int,
                                 causal_mode: int, scale: float, precision: str, window_left: int,
                                 window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor]
                                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The packed backward as an opaque op: (dq, dk, dv), contiguous, shaped like q, k, v."""
    plan = _op_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_mode, scale, precision,
                    window_left, window_right, softcap, alibi_slopes)
    p = plan.problem
    check_backward_tensors(grad_out, out, lse, q, lse_shape=(p.batch, p.heads, p.seq_q))
    return _varlen_backward(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, plan)


@attention_varlen_backward_op.register_fake
def _backward_fake(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *arguments):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_op(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *arguments, alibi_slopes = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    ctx.mark_non_differentiable(lse)
    ctx.arguments = arguments


def _op_gradient(ctx, grad_out, _grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        problem = _op_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, *ctx.arguments, alibi_slopes).problem
        return _differentiable_gradients(grad_out, q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, problem,
                                         ctx.needs_input_grad[:3]) + (None,) * 11
    dq, dk, dv = attention_varlen_backward_op(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                              *ctx.arguments, alibi_slopes)
    return (dq, dk, dv) + (None,) * 11


attention_varlen_forward_op.register_autograd(_op_gradient, setup_context=_setup_op)


# ----------------------------------------------------------------------------------------------------------------
# The SDPA path: pad on the device, attend with the padding masked, gather the rows back.

def _token_positions(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence, position in it) of every packed token, computed on the device."""
    tokens = torch.arange(total, device=cu_seqlens.device, dtype=torch.int32)
    sequence = torch.searchsorted(cu_seqlens[1:].contiguous(), tokens, right=True)
    return sequence, (tokens - cu_seqlens[sequence]).long()


def _sdpa_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 cu_seqlens_k: torch.Tensor, alibi_slopes: Optional[torch.Tensor], problem: Problem) -> torch.Tensor:
    p = problem
    lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lengths_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    seq_q, pos_q = _token_positions(cu_seqlens_q, q.shape[0])
    seq_k, pos_k = _token_positions(cu_seqlens_k, k.shape[0])
    if p.causal_mode == CAUSAL_BOTTOM_RIGHT:
        # Bottom-right alignment is per sequence: end-align queries and keys in the padded batch, so that every
        # sequence's diagonal ends in the padded corner (i + S_k - S_q stays i' for each of them).
        pos_q = pos_q + (p.seq_q - lengths_q)[seq_q]
        pos_k = pos_k + (p.seq_k - lengths_k)[seq_k]
        keep = torch.arange(p.seq_k, device=q.device)[None, :] >= (p.seq_k - lengths_k)[:, None]
    else:
        keep = torch.arange(p.seq_k, device=q.device)[None, :] < lengths_k[:, None]

    def padded(t: torch.Tensor, sequence: torch.Tensor, position: torch.Tensor, length: int) -> torch.Tensor:
        return t.new_zeros(p.batch, length, *t.shape[1:]).index_put((sequence, position), t).transpose(1, 2)

    out = sdpa_attention(padded(q, seq_q, pos_q, p.seq_q), padded(k, seq_k, pos_k, p.seq_k),
                         padded(v, seq_k, pos_k, p.seq_k), keep, _with_key_padding(p), alibi_slopes=alibi_slopes)
    return out.transpose(1, 2)[seq_q, pos_q]


def _with_key_padding(problem: Problem) -> Problem:
    """The padded batch's problem: dense sizes, the padding as a boolean key mask."""
    return dataclasses.replace(problem, key_masking="bool", varlen=False)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                     cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                     causal: Union[bool, str] = False, scale: Optional[float] = None,
                     window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[torch.Tensor] = None, backend: str = "auto",
                     precision: Optional[str] = None, check_values: Optional[bool] = None) -> torch.Tensor:
    """Attention over packed variable-length sequences: each sequence attends only within itself.

    Args:
        q: [total_q, H, D]; k, v: [total_k, H_kv, D] (H a multiple of H_kv); any strides; float16, bfloat16 or
            float32. Sequence b holds rows ``cu_seqlens_q[b]:cu_seqlens_q[b + 1]`` of q and the matching rows of
            k and v.
        cu_seqlens_q, cu_seqlens_k: int32 [batch + 1] starts on q's device: 0 first, the token count last,
            never decreasing (empty sequences are allowed; rows of a sequence without keys are zeros).
        max_seqlen_q, max_seqlen_k: the longest sequence's lengths (they size the launch; passing them avoids
            reading the offsets back from the device).
        causal, scale, window, softcap, precision: as in ``flashlite.attention``, per sequence ("lower_right"
            aligns each sequence's own diagonal). alibi_slopes: float32 [H] or [batch, H].
        backend: "auto" (``flashlite.dispatch``: the table's entry for the call's variant, else the kernel where
            it can run on CUDA; SDPA on a padded copy otherwise), "triton" or "sdpa".
        check_values: read the offsets back and check them (start 0, end the total, never decreasing, no
            sequence longer than the maxima). Default: on for CPU tensors; on CUDA off, since reading them
            synchronises the device and breaks CUDA-graph capture, unless FLASHLITE_CHECK_VALUES=1. Offsets
            that break these rules give wrong results without the check. Under torch.compile the graph checks
            them by the same rule each time it runs.

    Returns:
        [total_q, H, D] in q's dtype. Differentiable with respect to q, k and v, twice too (``create_graph=True``),
        as ``flashlite.attention``.

    Example:
        >>> q, k, v = (torch.randn(9, 4, 16) for _ in range(3))
        >>> cu = torch.tensor([0, 2, 9], dtype=torch.int32)  # sequences of 2 and 7 tokens
        >>> attention_varlen(q, k, v, cu, cu, 7, 7, causal=True, backend="sdpa").shape
        torch.Size([9, 4, 16])
    """
    plan = _plan(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, window, softcap,
                 alibi_slopes, backend, precision, check_values)
    if alibi_slopes is not None:  # as attention(): constants on every backend (the kernels give them no gradient)
        check_constant_slopes(alibi_slopes)
    p = problem = plan.problem
    if torch.compiler.is_compiling() and value_checks_asked(check_values, cu_seqlens_q):
        # validate_varlen could not read traced offsets: the graph checks them when it runs, by the eager rule.
        cu_seqlens_q, cu_seqlens_k = checked_offsets_op(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], p.seq_q,
                                                        p.seq_k)
    if plan.decision.backend == "sdpa":
        return _sdpa_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, problem)
    # The kernels read the starts at offset b: a strided view is copied ([batch + 1] elements).
    cu_seqlens_q, cu_seqlens_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    if torch.compiler.is_compiling():
        return attention_varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k, p.seq_q, p.seq_k, p.causal_mode,
                                           p.scale, p.precision, p.window_left, p.window_right, p.softcap,
                                           alibi_slopes)[0]
    inputs = (q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes)
    if _ops.needs_grad((q, k, v)):
        return _EagerVarlenAttention.apply(*inputs, plan)[0]
    return _varlen_forward(*inputs, plan, need_lse=False)[0]


def _plan_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *options: object
              ) -> Optional[plans.PlanKey]:
    """The key of a packed call, the plan cache's "varlen" entry: q, k and v without their token counts (which
    change with every batch of sequences), the offsets' layouts (not their values), the maxima (they size the
    launch's grid and log-sum-exp) and the options with their classes. None where the arguments cannot be keyed:
    validation then names them.

    Example:
        >>> q = torch.randn(9, 4, 16)
        >>> cu = torch.tensor([0, 2, 9], dtype=torch.int32)
        >>> call = (7, 7, True, None, None, None, None, "auto", None)
        >>> _plan_key(q, q, q, cu, cu, *call) == _plan_key(q[:8], q[:8], q[:8], cu - 0, cu.clone(), *call)
        True
    """
    try:
        tokens = tuple((t.shape[1:], t.stride(), t.dtype, t.device) for t in (q, k, v))
    except (AttributeError, TypeError):
        return None
    return plans.key_of("varlen", *tokens, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *options)


def _plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
          max_seqlen_q: int, max_seqlen_k: int, causal: Union[bool, str], scale: Optional[float],
          window: Optional[tuple[int, int]], softcap: Optional[float], alibi_slopes: Optional[torch.Tensor],
          backend: str, precision: Optional[str], check_values: Optional[bool]) -> Plan:
    """The plan of a packed call: kept under its key (``_plan_key``), else validated, decided and kept. A kept plan
    still checks per call what its key leaves out: the token counts (not empty; within the kernel's 32-bit offsets
    where it runs the kernel) and, as ``check_values`` says, the offsets' values."""
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _plan_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                           scale, window, softcap, alibi_slopes, backend, precision)
    plan = None if key is None else plans._PLANS.get(key)
    if plan is not None and q.shape[0] and k.shape[0] and (
            plan.decision.backend != "triton"
            or kernel_size_limit(*(packed_view(t, plan.problem.batch) for t in (q, k, v)), None) is None):
        if value_checks_wanted(check_values, cu_seqlens_q):
            check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q, "max_seqlen_q")
            check_offsets("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k, "max_seqlen_k")
        return plan
    problem = validate_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                              window, softcap, alibi_slopes, precision, check_values)
    if backend not in ("auto", "triton", "sdpa"):
        raise ValueError(f"backend must be one of ('auto', 'triton', 'sdpa'), got {backend!r}")
    p = problem
    # The table keys on (sequences, heads, the longest sequence, head dim): a stride-0 stand-in of those sizes.
    table_q = q[:1].transpose(0, 1)[None, :, :1].expand(p.batch, p.heads, p.seq_q, p.head_dim)
    decision = decide(*(packed_view(t, p.batch) for t in (q, k, v)), None, p, backend, table_q=table_q)
    # The Gluon kernels take no packed sequences: gluon and gluon_bwd stay False. A plan decided for token counts
    # past the kernel's size limit is not kept: a shorter call of the same key may run the kernel.
    plan = Plan(problem, decision)
    if kernel_size_limit(*(packed_view(t, p.batch) for t in (q, k, v)), None) is None:
        plans.keep(key, plan)
    return plan
