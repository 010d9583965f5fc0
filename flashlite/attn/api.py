"""The public ``attention()`` and ``explain_dispatch()``: replay a call's plan, or make and keep it.

Under torch.compile with static sizes, a call is validated and decided by ``decide.traced_call_plan``, outside
dynamo's trace, so that none of it becomes a guard of the graph; the graph holds the chosen op.
Under torch.compile with dynamic sizes, ``backend="auto"`` calls without a gradient become one op,
``flashlite::attention_auto``, whose kernel is ``attention()`` itself: the choice is made per call, not at trace time.
Imports ``plan``, ``decide``, ``run``, ``ops`` (which registers the custom ops a compiled graph holds), ``sdpa`` and
``triton`` (``like_layout``); ``flashlite.attention`` re-exports the two functions.
"""
from typing import Optional, Union

import torch

from flashlite.attn import plan as plans
from flashlite.attn.decide import (TRACED_ERRORS, decide_with_mask, log_decision, make_plan, needs_gradient,
                                         static_sizes, traced_call_plan)
from flashlite.attn.triton import like_layout
from flashlite.attn import ops  # noqa: F401  (registers flashlite::attention_forward and the other ops)
from flashlite.attn.run import run_triton_compiled
from flashlite.attn.sdpa import sdpa_attention
from flashlite.attn.problem import _CAUSAL_ARGUMENT, check_constant_slopes, validate
from flashlite.dispatch import Decision

# Bound here, a replayed call skips their attribute lookups (it costs about 0.8 us over SDPA alone, and each lookup
# about 0.01 us). torch.compile treats is_compiling as a constant wherever it is called from. plans._PLANS is read
# on every call: tests replace it.
_is_compiling = torch.compiler.is_compiling
_replay = plans.replay
_replay_by_python_key = plans.replay_by_python_key


# What a compiled graph of dynamic sizes calls for backend="auto" where no gradient can flow. Its sizes are symbols
# at trace time, so a decision made there would specialize the graph on them (one graph per batch size and sequence
# bucket, the dispatch table's key); this op decides per call, as an eager call does (the plan of the call's
# signature, made once and replayed). Its arguments are attention()'s own. A compiled graph relies on the layout
# the fake declares: torch.empty_like(q)'s, which the Triton kernel writes (launch_forward's like_q); SDPA's output
# is copied to it only where SDPA returned another layout. A plain schema with one kernel, like
# ``flashlite::attention_inference`` (ops.py says why).
_AUTO_LIBRARY = torch.library.Library("flashlite", "FRAGMENT")
_AUTO_LIBRARY.define(
    "attention_auto(Tensor q, Tensor k, Tensor v, Tensor? key_padding_mask, Tensor? key_lengths, int causal_mode, "
    "float? scale, str? precision, int[]? window, float? softcap, Tensor? alibi_slopes) -> Tensor")


def _attention_auto(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window, softcap,
                    alibi_slopes):
    out = attention(q, k, v, causal=_CAUSAL_ARGUMENT[causal_mode], scale=scale, key_padding_mask=key_padding_mask,
                    key_lengths=key_lengths, window=None if window is None else tuple(window), softcap=softcap,
                    alibi_slopes=alibi_slopes, precision=precision)
    return like_layout(out, q)


_AUTO_LIBRARY.impl("attention_auto", _attention_auto, "CompositeExplicitAutograd")


@torch.library.register_fake("flashlite::attention_auto")
def _attention_auto_fake(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window, softcap,
                         alibi_slopes):
    return torch.empty_like(q)


def _constants(*arguments: object) -> bool:
    """Whether attention()'s non-tensor arguments are plain Python values (not symbols torch.compile traces, nor
    objects validation will refuse): what traced_call_plan can take."""
    return all(isinstance(a, (bool, int, float, str, type(None)))
               or (isinstance(a, tuple) and all(isinstance(side, int) for side in a)) for a in arguments)


def _tensors_where_expected(q: object, k: object, v: object, *optional: object) -> bool:
    """Whether q, k and v are tensors and each of ``optional`` a tensor or None: what traced_call_plan's layouts
    (shapes, strides) are read from."""
    return (all(isinstance(t, torch.Tensor) for t in (q, k, v))
            and all(t is None or isinstance(t, torch.Tensor) for t in optional))


def explain_dispatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
                     scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
                     key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                     window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[torch.Tensor] = None, backend: str = "auto",
                     precision: Optional[str] = None) -> Decision:
    """Which implementation ``attention(q, k, v, **same arguments)`` would run, and why.

    Raises the same errors as ``attention`` for invalid calls. With FLASHLITE_DEBUG_DISPATCH=1 the decision is
    also logged (logger ``flashlite.attention``, level DEBUG). Like the call, the answer depends on whether
    autograd would record it (grad mode on and an input that requires grad): ``backend="auto"`` decides such calls
    by the forward+backward measurements.

    Example:
        >>> q = torch.randn(1, 2, 16, 8)
        >>> print(explain_dispatch(q, q, q).reason)
        kernel cannot run this call: head dim 8 is outside the kernel's range 16..256
    """
    variants = dict(window=window, softcap=softcap, alibi_slopes=alibi_slopes)
    if attn_mask is not None:
        problem = validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, **variants)
        check_constant_slopes(alibi_slopes)  # as every run of the call checks it
        decision = decide_with_mask(q, k, problem, backend, attn_mask)
        log_decision(decision, q, k)
        return decision
    plan = make_plan(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, **variants)
    check_constant_slopes(alibi_slopes)
    return plan.decision_for(needs_gradient(q, k, v))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
              scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
              key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
              window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None, backend: str = "auto",
              precision: Optional[str] = None) -> torch.Tensor:
    """Scaled dot-product attention, softmax(scale * q k^T) v, with flashlite's Triton kernel or SDPA.

    Args:
        q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (grouped-query attention, k and v
            are not copied). float16, bfloat16 or float32; any strides.
        causal: False; True for SDPA's ``is_causal`` (top-left: query i sees keys j <= i); "lower_right" for
            bottom-right alignment (j <= i + S_k - S_q, as for decoding against a KV cache).
        scale: defaults to 1 / sqrt(D).
        key_padding_mask: bool [B, S_k], True = attend. Or key_lengths: int [B], keys j >= length masked
            (lengths are clamped to [0, S_k]). Rows that see no key return zeros, with zero gradients. What the
            masks hide from every query row (padding, key lengths, keys past the last row's causal frontier,
            keys outside every row's window, keys an ``attn_mask`` hides) may hold anything, NaN and inf
            included: it never reaches the output or the gradients. A
            non-finite key or value a row does see makes that row non-finite; the Triton kernel, which sums
            over tiles of up to 128 query rows, may then turn the other rows of that tile NaN too, and SDPA's
            own causal kernel (calls without key masks) every row. Pass ``key_lengths`` for a cache filled
            past its end.
        attn_mask: an arbitrary mask or additive bias broadcastable to [B, H, S_q, S_k]: bool (True = attend) or
            floating (added to the scaled scores), combined with ``causal`` and key padding. The Triton kernel
            has no such input, so these calls run on SDPA (``backend="triton"`` refuses them); rows that see no
            key still give zeros, and a non-finite key a row does not see never reaches it. On SDPA, a float
            mask of another dtype than q's, or ALiBi, makes a float16/bfloat16 call compute in float32, rounded
            once at the end: SDPA takes a bias in q's dtype, and rounding it there cost many times the output's
            own rounding error.
        window: (left, right): query i sees only keys i' - left <= j <= i' + right, -1 meaning unbounded on that
            side, where i' is row i aligned to the diagonal ``causal`` names (i for False and True,
            i + S_k - S_q for "lower_right"); ``causal`` still hides keys j > i'. The Triton kernel skips key
            blocks wholly outside the window, so its cost grows as S times the window, not S squared.
        softcap: c > 0: the scaled scores s become c * tanh(s / c) (before ALiBi and the masks).
        alibi_slopes: float32 [H] or [B, H]: adds -slope * |i' - j| to the (capped) scores of head h.
            Order of operations: scale * q.k, then softcap, then ALiBi, then every mask. The slopes are
            constants: no backend computes their gradient, and slopes that require grad are refused while grad
            mode is on (pass ``alibi_slopes.detach()``).
        backend: "auto" (per-shape choice from ``flashlite.dispatch``, by forward measurements for calls
            without a gradient and by forward+backward ones for calls whose gradient autograd computes; see
            ``explain_dispatch``), "triton" or "sdpa". Calls without ``attn_mask`` are validated and decided
            once per signature (shapes, strides, dtypes, devices, arguments) and replayed after that; with
            FLASHLITE_DEBUG_DISPATCH=1 each signature's decision is logged when it is made (logger
            ``flashlite.attention``, level DEBUG).
        precision: float32 inputs only: "tf32" (default), "ieee" or "bf16" dot products in the Triton kernel.

    Returns:
        [B, H, S_q, D] in q's dtype. Differentiable with respect to q, k and v, twice too: a backward with
        ``create_graph=True`` (a gradient penalty) on the Triton kernel computes its gradients from a float32
        recompute on SDPA's math backend instead of the backward kernels (O(S_q * S_k) memory, as the SDPA
        path). On the SDPA path PyTorch's fused SDPA kernels have no second derivative and PyTorch raises; run
        such calls under ``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``. Under torch.compile, AOTAutograd
        refuses a double backward.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
        >>> attention(q, k, v, causal=True, backend="sdpa").shape
        torch.Size([2, 4, 10, 16])
    """
    if attn_mask is not None:  # arbitrary masks and biases run on SDPA, unplanned: their cost dwarfs validation
        problem = validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, window,
                           softcap, alibi_slopes)
        log_decision(decide_with_mask(q, k, problem, backend, attn_mask), q, k)
        return sdpa_attention(q, k, v, key_padding_mask if key_lengths is None else key_lengths, problem,
                              attn_mask=attn_mask, alibi_slopes=alibi_slopes)
    if window.__class__ is list:  # validation takes [left, right] too; plan keys and the trace cache hash a tuple
        window = tuple(window)
    key = length_free_key = None
    if not _is_compiling():  # under torch.compile the plan is made at trace time, not kept
        # One C call: the call's key, else its key without the key length (a decoding step's), a kept plan's run.
        out = _replay(plans._PLANS, _replay_by_python_key, q, k, v, key_padding_mask, key_lengths, causal, scale,
                      backend, precision, window, softcap, alibi_slopes)
        if out is not None:
            return out
        call = (q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap,
                alibi_slopes)
        # Where C++ did not pack the key without the key length, its Python form may still find a plan.
        length_free_key = plans.any_length_key(*call)
        plan = plans._PLANS.get(length_free_key)
        if plan is not None:
            key_mask = key_padding_mask if key_lengths is None else key_lengths
            return plan.run(q, k, v, key_mask) if alibi_slopes is None else plan.run(q, k, v, key_mask, alibi_slopes)
        key = plans.attention_key(*call)
    elif not _tensors_where_expected(q, k, v, key_padding_mask, key_lengths, alibi_slopes):
        # Traced, reading a list's layout (its .stride) for the plan below failed with Dynamo's own error under
        # fullgraph=True: validation names the argument instead, as in the eager call.
        validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, window, softcap,
                 alibi_slopes)
    elif static_sizes(q) and static_sizes(k):
        if _constants(causal, scale, backend, precision, window, softcap):
            # Compiled with static sizes: validated and decided outside the trace, so that none of it becomes a
            # guard (decide.traced_call_plan says why). Other arguments (symbols) take make_plan, traced, below.
            error, problem, chosen = traced_call_plan(
                tuple(None if t is None else (t.shape, t.stride(), t.dtype, t.device)
                      for t in (q, k, v, key_padding_mask, key_lengths, alibi_slopes)),
                causal, scale, backend, precision, window, softcap, needs_gradient(q, k, v))
            if error is not None:
                raise TRACED_ERRORS[error[0]](error[1])
            key_mask = key_padding_mask if key_lengths is None else key_lengths
            if chosen == "triton":
                return run_triton_compiled(problem, q, k, v, key_mask, alibi_slopes)
            return sdpa_attention(q, k, v, key_mask, problem, alibi_slopes=alibi_slopes)
    elif backend == "auto" and not needs_gradient(q, k, v):
        # Compiled with dynamic sizes: the decision is made per call, inside one opaque op, not at trace time (which
        # would specialize the graph on the sizes). The call is still checked here, at trace time.
        problem = validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, window,
                           softcap, alibi_slopes)
        return torch.ops.flashlite.attention_auto.default(
            q, k, v, key_padding_mask, key_lengths, problem.causal_mode, scale, precision,
            None if window is None else list(window), softcap, alibi_slopes)
    plan = plans.keep(key, make_plan(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision,
                                     window, softcap, alibi_slopes), length_free_key)
    key_mask = key_padding_mask if key_lengths is None else key_lengths
    return plan.run(q, k, v, key_mask) if alibi_slopes is None else plan.run(q, k, v, key_mask, alibi_slopes)
