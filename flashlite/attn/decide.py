"""Decide which backend runs a validated call, log why, and build the call signature's ``Plan``.

``decide`` asks ``flashlite.dispatch`` for ``backend="auto"``; ``decide_with_mask`` sends explicit masks to SDPA;
``make_plan`` validates, decides (for the Triton backend also which forward and backward kernels: ``gluon``,
``gluon_bwd``) and gives the plan the function that runs its calls (``run``'s, or SDPA's); ``traced_call_plan`` does
it for a call torch.compile traces, outside the trace; ``op_plan`` finds or makes the plan a custom op's call runs,
under the key of the eager call it stands for. Imports every module of the package below it: ``problem``, ``plan``,
``sdpa``, ``gluon``, ``gluon_bwd`` and ``run``.
"""
import functools
import logging
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import has_static_value

from flashlite import _env
from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd
from flashlite.attn import plan as plans
from flashlite.attn.plan import Plan, records_launches
from flashlite.attn.problem import (_CAUSAL_ARGUMENT, _NATIVE_PRECISION, Problem, eager_options, kernel_size_limit,
                                    kernel_unsupported, validate)
from flashlite.attn.run import needs_gradient, run_triton, run_triton_compiled
from flashlite.attn.sdpa import check_attn_mask, plain_sdpa_causal, sdpa_attention
from flashlite.dispatch import Decision, choose_backend

# The public module's name, as the documentation of FLASHLITE_DEBUG_DISPATCH gives it.
_log = logging.getLogger("flashlite.attention")


def static_sizes(t: torch.Tensor) -> bool:
    """Whether every size of ``t`` is a plain integer (False for the symbols torch.compile traces with dynamic
    sizes)."""
    # Traced by dynamo, a symbolic size passes isinstance(size, int) and fails isinstance(size, torch.SymInt);
    # has_static_value tells the two apart there without a guard.
    return all(has_static_value(size) for size in t.shape)


def decide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
           problem: Problem, backend: str, *, variant: Optional[str] = None,
           table_q: Optional[torch.Tensor] = None, backward: bool = False) -> Decision:
    """The backend of a validated call: forced (``backend='triton'`` raises when the kernel cannot run it), or
    ``flashlite.dispatch``'s choice for ``problem.variant`` (or ``variant``), keyed on the sizes of q (or of
    ``table_q``, a stand-in where q's layout is not [B, H, S_q, D], e.g. packed sequences); ``backward``: for a
    call whose gradient will be computed. Traced by torch.compile with symbolic sizes, the rule decides (the
    table's key would specialize the graph on the sizes)."""
    if backend == "sdpa":
        return Decision("sdpa", "forced by backend='sdpa'")
    unsupported = kernel_unsupported(q, k, v, key_padding_mask)
    if backend == "triton":
        if unsupported is not None:
            raise ValueError(f"backend='triton' cannot run this call: {unsupported}")
        return Decision("triton", "forced by backend='triton'")
    symbolic = torch.compiler.is_compiling() and not (static_sizes(q) and static_sizes(k))
    return choose_backend(q if table_q is None else table_q, causal=_CAUSAL_ARGUMENT[problem.causal_mode],
                          seq_k=problem.seq_k, unsupported=unsupported, variant=variant or problem.variant,
                          backward=backward, symbolic_sizes=symbolic)



def log_decision(decision: Decision, q: torch.Tensor, k: torch.Tensor) -> None:
    if _env.flag("FLASHLITE_DEBUG_DISPATCH", False):
        _log.debug("flashlite.attention q %s k %s %s -> %s: %s", tuple(q.shape), tuple(k.shape), q.dtype,
                   decision.backend, decision.reason)


def decide_with_mask(q: torch.Tensor, k: torch.Tensor, problem: Problem, backend: str,
                     attn_mask: object) -> Decision:
    check_attn_mask(q, k, attn_mask)
    reason = "an explicit attn_mask (arbitrary mask or bias) is not an input of the Triton kernel"
    if problem.variant != "dense":
        reason += f" (the call's variant: {problem.variant} with attn_mask)"
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this call: {reason}; use key_padding_mask / key_lengths "
                         f"and causal, or backend='sdpa'")
    return Decision("sdpa", "forced by backend='sdpa'" if backend == "sdpa" else f"kernel cannot run this call: "
                                                                                f"{reason}")


def _run_sdpa(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              key_mask: Optional[torch.Tensor] = None, alibi_slopes: Optional[torch.Tensor] = None) -> torch.Tensor:
    return sdpa_attention(q, k, v, key_mask, problem, alibi_slopes=alibi_slopes)


def _sdpa_run(problem: Problem, scale: Optional[float]) -> Callable[..., torch.Tensor]:
    """How a plan runs its calls on SDPA: ``run(q, k, v, key_mask[, alibi_slopes])``."""
    is_causal = plain_sdpa_causal(problem, problem.seq_q, problem.seq_k)
    if is_causal is not None and not (is_causal and problem.seq_k > problem.seq_q):
        # SDPA itself, bound in a partial so that a replay costs one C-level call, with only the arguments the call
        # needs (SDPA parses every keyword it is given, on every call). Its fourth positional parameter is
        # attn_mask, which receives the call's key mask: None here.
        sdpa_kwargs = {"is_causal": True} if is_causal else {}
        if scale is not None:
            sdpa_kwargs["scale"] = problem.scale
        if problem.heads != problem.kv_heads:
            sdpa_kwargs["enable_gqa"] = True
        # Where SDPA's defaults are the call's (a decoding step's: no causal mask, the default scale), SDPA itself:
        # a partial's keywords are merged into a new dict on every call.
        return functools.partial(F.scaled_dot_product_attention, **sdpa_kwargs) if sdpa_kwargs else \
            F.scaled_dot_product_attention
    return functools.partial(_run_sdpa, problem)


def _runs_by_gradient(no_gradient_runner: Callable[[Plan], Callable[..., torch.Tensor]],
                      gradient_runner: Callable[[Plan], Callable[..., torch.Tensor]],
                      plan: Plan) -> Callable[..., torch.Tensor]:
    """A plan's run that picks per call between the runs of its two decisions."""
    return functools.partial(_run_by_gradient, no_gradient_runner(plan), gradient_runner(plan))


def _run_for(backend: str, plan: Plan, scale: Optional[float]) -> Callable[..., torch.Tensor]:
    """How ``plan`` runs its calls on ``backend``. Plans made while torch.compile traces are never kept: their
    Triton run calls the custom op, which the graph keeps."""
    if backend == "triton":
        if torch.compiler.is_compiling():
            return functools.partial(run_triton_compiled, plan.problem)
        return functools.partial(run_triton, plan)
    return _sdpa_run(plan.problem, scale)


def _run_by_gradient(no_gradient_run: Callable[..., torch.Tensor], gradient_run: Callable[..., torch.Tensor],
                     q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *rest: Optional[torch.Tensor]
                     ) -> torch.Tensor:
    # needs_gradient's test, inline: it runs on every replayed call of such a plan. Under torch.compile the branch
    # is taken at trace time (grad mode and requires_grad are guarded).
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return gradient_run(q, k, v, *rest)
    return no_gradient_run(q, k, v, *rest)


def _serves_any_key_length(problem: Problem, backend: str, decision: Decision, gradient_decision: Decision,
                           q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           key_padding_mask: Optional[torch.Tensor]) -> bool:
    """Whether a plan's run is right, and its decisions those the call would get, for calls of any key length
    (``plan.any_length_key``): SDPA plans whose run reads the sizes from the call's tensors."""
    if decision.backend != "sdpa" or gradient_decision.backend != "sdpa":
        return False  # the Triton launches take the problem's sizes, and their recordings keep them
    if plain_sdpa_causal(problem, problem.seq_q, problem.seq_k) and problem.seq_k <= problem.seq_q:
        return False  # SDPA's is_causal bound as it is (_sdpa_run): a longer key axis must be cut to S_q first
    # A kernel refused for the length of its tensors alone might take a shorter call of the same key.
    return backend != "auto" or kernel_size_limit(q, k, v, key_padding_mask) is None


def make_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Union[bool, str], scale: Optional[float],
              key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor], backend: str,
              precision: Optional[str], window: Optional[tuple[int, int]] = None, softcap: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None) -> Plan:
    """Validate and decide a call (raising what validation raises), logging the decision; the plan's ``run``
    computes calls of its signature: ``run(q, k, v[, key_mask])``, plus the call's ALiBi slopes when it has them.

    With ``backend="auto"`` a signature gets two decisions, one for calls without a gradient and one for calls
    whose gradient autograd will compute (``Plan.gradient_decision``, from the forward+backward entries); where
    they differ, ``run`` picks per call (a grad-mode and ``requires_grad`` check, about 0.1 us), elsewhere it is
    the one backend's run."""
    problem = validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, window, softcap,
                       alibi_slopes)
    decision = decide(q, k, v, key_padding_mask, problem, backend)
    gradient_decision = (decide(q, k, v, key_padding_mask, problem, backend, backward=True)
                         if backend == "auto" else decision)
    uses_triton = "triton" in (decision.backend, gradient_decision.backend)
    on_gluon = launch_gluon.forward_kernel_for(problem, q, k, v) if uses_triton else None
    if on_gluon is not None:
        decision, gradient_decision = (d if d.backend != "triton" else Decision("triton", f"{d.reason}; {on_gluon}")
                                       for d in (decision, gradient_decision))
    backward = (launch_gluon_bwd.backward_kernel_for(problem, q, k, v) if gradient_decision.backend == "triton"
                else None)
    if backward is not None:
        gradient_decision = Decision("triton", f"{gradient_decision.reason}; {backward}")
    log_decision(gradient_decision if needs_gradient(q, k, v) else decision, q, k)
    no_gradient_run, gradient_run = (functools.partial(_run_for, d.backend, scale=scale)
                                     for d in (decision, gradient_decision))
    if gradient_decision.backend == decision.backend:
        runner = no_gradient_run
    else:
        runner = functools.partial(_runs_by_gradient, no_gradient_run, gradient_run)
    plan = Plan(problem, decision, gradient_decision, runner, gluon=on_gluon is not None,
                gluon_bwd=backward is not None,
                any_key_length=_serves_any_key_length(problem, backend, decision, gradient_decision, q, k, v,
                                                      key_padding_mask),
                record=uses_triton and records_launches(q))
    return plan


# A tensor as traced_call_plan takes it: (shape, strides, dtype, device), or None for an absent argument.
Layout = Optional[tuple[torch.Size, tuple[int, ...], torch.dtype, torch.device]]
# The errors validation raises, by name: a constant-marked function hands its error back instead of raising it
# (Dynamo would wrap it as an internal error), and the traced caller raises it.
TRACED_ERRORS = {"TypeError": TypeError, "ValueError": ValueError}


# Dynamo calls a function marked constant once while it traces and keeps its result, without tracing into it: the
# validation, the dispatch table and the switches this reads leave no guards on the compiled graph. Traced, they left
# about 160 guards on a compiled TransformerLayer, checked before every call (an 8ca4529 run on the H200: 16.7 us a call
# against the plain block's 2.1 us). What the result depends on is either guarded anyway (the tensors' sizes, strides,
# dtypes, devices and requires_grad; the arguments) or fixed for the compiled graph, as it is for a kept plan (the
# dispatch table, the FLASHLITE_* switches).
@torch.compiler.assume_constant_result
def traced_call_plan(layouts: tuple[Layout, ...], causal: Union[bool, str], scale: Optional[float], backend: str,
                     precision: Optional[str], window: Optional[tuple[int, int]], softcap: Optional[float],
                     gradient: bool) -> tuple[Optional[tuple[str, str]], Optional[Problem], Optional[str]]:
    """(error, problem, backend) of a call torch.compile traces with static sizes: ``layouts`` describe q, k, v,
    key_padding_mask, key_lengths and alibi_slopes; ``gradient``, whether autograd records the call. ``error`` is
    (the exception's class name, its message) where validation refuses the call, and the rest None; else None and
    the call's validated problem and backend ("triton" or "sdpa"), decided by make_plan on fake tensors of those
    layouts.

    Example:
        >>> layout = (torch.Size([1, 2, 8, 16]), (256, 128, 16, 1), torch.float32, torch.device("cpu"))
        >>> error, problem, backend = traced_call_plan((layout,) * 3 + (None,) * 3, True, None, "sdpa", None,
        ...                                            None, None, False)
        >>> error, problem.causal_mode, backend
        (None, 1, 'sdpa')
    """
    with FakeTensorMode():
        q, k, v, key_padding_mask, key_lengths, alibi_slopes = (
            None if layout is None else torch.empty_strided(layout[0], layout[1], dtype=layout[2], device=layout[3])
            for layout in layouts)
        # So that make_plan's log (FLASHLITE_DEBUG_DISPATCH) names the decision the call runs by.
        q.requires_grad_(gradient and q.is_floating_point())
        try:
            plan = make_plan(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision, window,
                             softcap, alibi_slopes)
        except (TypeError, ValueError) as error:
            return (type(error).__name__, str(error)), None, None
    return None, plan.problem, plan.decision_for(gradient).backend


def op_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
            key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float, precision: str, window_left: int,
            window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor]) -> Plan:
    """The plan a call of the custom ops runs (``flashlite::attention_forward``, ``_backward``, ``_inference``: what
    compiled graphs hold): the plan of the eager call ``attention(q, k, v, backend="triton", ...)`` that the flat
    arguments stand for, found under that call's ``attention_key`` in the one plan cache, else made by
    ``make_plan`` and kept there. The ops' flat forms of attention()'s defaults become the defaults (the default
    scale and precision, window sides -1, softcap 0.0: None), so that a graph's op and the eager call share a plan.

    The ops are public through torch.ops: a call that no eager call stands for (a causal mode outside 0..2, a
    precision that does not fit the dtype) is refused, as validation refuses the rest.

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> op_plan(q, q, q, None, None, 1, 0.25, "ieee", -1, -1, 0.0, None).problem.causal_mode  # doctest: +SKIP
        1
    """
    causal = _CAUSAL_ARGUMENT.get(causal_mode) if causal_mode.__class__ is int else None
    native = _NATIVE_PRECISION.get(q.dtype) if isinstance(q, torch.Tensor) else None
    eager_scale, eager_precision, window, eager_softcap = eager_options(q, 4, scale, precision, window_left,
                                                                        window_right, softcap)
    call = (q, k, v, key_padding_mask, key_lengths, causal, eager_scale, "triton", eager_precision, window,
            eager_softcap, alibi_slopes)
    key = plans.attention_key(*call) if causal is not None else None
    plan = None if key is None else plans._PLANS.get(key)
    if plan is not None:
        return plan
    if causal is None:
        raise ValueError(f"causal_mode must be 0, 1 or 2, got {causal_mode}")
    if native is not None and precision != native:
        raise ValueError(f"precision {precision!r} does not fit {q.dtype} inputs (expected {native!r})")
    q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes = call
    return plans.keep(key, make_plan(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision,
                                     window, softcap, alibi_slopes))
