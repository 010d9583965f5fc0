"""The plan cache: one ``Plan`` per call signature, owning its problem, decision, configs and recorded launches.

A signature is everything validation and the decision depend on: the shapes, strides, dtypes and devices of q, k,
v and the key mask, and the non-tensor arguments. A call whose signature has a plan skips validation, dispatch and,
once its launches are recorded, Triton's argument binding: at launch-bound sizes those cost as much as the kernel.
``attention()``, the custom ops (which torch.compile'd graphs call) and ``attention_with_kvcache`` (under a
``CacheKey``, without the lengths, which are data of each call) keep their plans here. Imports
``problem`` and ``flashlite._native`` (the key packed in C++) only.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from flashlite import _native
from flashlite.attn.problem import Problem
from flashlite._intmath import seq_bucket

@dataclass(frozen=True, eq=False, slots=True)
class Plan:
    """One call signature, validated and decided once: every decision is made when the plan is built.

    ``run(q, k, v, key_mask)`` computes a call of this signature (``key_mask``: the call's key_padding_mask or
    key_lengths, or None); it is ``runner(plan)``, bound when the plan is built (None without a runner: the
    launchers call ``triton.launch_forward`` with the plan themselves). ``decision`` is the backend of calls
    without a gradient, ``gradient_decision`` that of calls whose gradient autograd computes (``backend="auto"``
    decides the two from forward and forward+backward measurements; ``decision_for`` picks; unset, the same as
    ``decision``). ``gluon`` says whether the forward runs on the Gluon kernel instead of the pointer kernel,
    ``gluon_bwd`` whether the backward's dK/dV and dQ do. ``any_key_length``: whether ``run`` serves calls of every
    key length (then the plan is also kept under its ``sizes_key``, and its problem's seq_k is that of the call it
    was made for). ``record``: whether launches are recorded (only for plans that are kept, on CUDA).

    Two tables hold what the first launches produce, not decisions: ``configs``, per kernel, the config it launches
    (the forced one, or the autotuner's choice for this signature's tuning key, which needs a timed launch), and
    ``recorded``, per launch site, the recorded launch that replays the compiled kernel with a call's tensors (None
    where recording was refused, e.g. an unaligned tensor).

    Example:
        >>> from flashlite.dispatch import Decision
        >>> from flashlite.attn.problem import validate
        >>> q = torch.randn(1, 2, 8, 16)
        >>> plan = Plan(validate(q, q, q, False, None, None, None, "sdpa", None), Decision("sdpa", "forced"))
        >>> plan.decision.backend, plan.gradient_decision is plan.decision, plan.configs, plan.recorded
        ('sdpa', True, {}, {})
    """

    problem: Problem
    decision: Any
    gradient_decision: Any = None
    runner: Optional[Callable[["Plan"], Callable[..., torch.Tensor]]] = None
    gluon: bool = False
    gluon_bwd: bool = False
    any_key_length: bool = False
    record: bool = False
    configs: dict[str, dict] = field(default_factory=dict)
    recorded: dict[Any, Any] = field(default_factory=dict, init=False)
    run: Optional[Callable[..., torch.Tensor]] = field(default=None, init=False)

    def __post_init__(self) -> None:
        # Derived fields, set once while the plan is built (a frozen dataclass sets its own fields this way).
        if self.gradient_decision is None:
            object.__setattr__(self, "gradient_decision", self.decision)
        object.__setattr__(self, "configs", dict(self.configs))
        if self.runner is not None:
            object.__setattr__(self, "run", self.runner(self))

    def decision_for(self, gradient: bool) -> Any:
        """The decision a call of this signature runs by: ``gradient``, whether autograd records the call."""
        return self.gradient_decision if gradient else self.decision


def _mask_signature(mask: Optional[torch.Tensor]) -> Optional[tuple]:
    return None if mask is None else (mask.shape, mask.stride(), mask.dtype, mask.device)


def signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
              key_lengths: Optional[torch.Tensor], causal: Any, scale: Any, backend: str, precision: Any,
              window: Any = None, softcap: Any = None, alibi_slopes: Optional[torch.Tensor] = None) -> tuple:
    """The plan key of a call. Raises AttributeError or TypeError for arguments that are not tensors or not
    hashable; validation then names the problem.

    causal, scale and softcap join the key with their classes: 1 == True == 1.0 hash alike, but validation
    refuses causal=1 and scale=True, so a plan made for one must never answer the other. The key is flat, and
    the optional arguments are appended only when one is given: it is built on every call, and each element
    costs time."""
    key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, causal, causal.__class__, scale, scale.__class__, backend, precision)
    if (key_padding_mask is None and key_lengths is None and window is None and softcap is None
            and alibi_slopes is None):
        return key
    # The window's sides join with their classes too: validation refuses (True, 0), which equals (1, 0).
    window_classes = None if window is None else (window.__class__, *(side.__class__ for side in window))
    return (*key, _mask_signature(key_padding_mask), _mask_signature(key_lengths), window, window_classes,
            softcap, softcap.__class__, _mask_signature(alibi_slopes))


# The same key packed into bytes by C++ (``flashlite._native``): same arguments as ``signature`` (all twelve,
# positional), None for arguments it does not cover, which then take ``signature``. Where the extension could
# not be built, ``signature`` itself.
fast_signature: Callable[..., Optional[Any]] = _native.plan_key or signature


def key_of(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
           key_lengths: Optional[torch.Tensor], causal: Any, scale: Any, backend: str, precision: Any,
           window: Any = None, softcap: Any = None, alibi_slopes: Optional[torch.Tensor] = None) -> Optional[Any]:
    """The key a new plan is kept under: ``fast_signature``'s where it covers the call, else ``signature``'s; None
    for arguments that are not tensors or not hashable (validation then names them).

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> call = (q, q, q, None, None, True, None, "auto", None)
        >>> key_of(*call) == key_of(*call) != key_of(q, q, q, None, None, False, None, "auto", None)
        True
    """
    call = (q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes)
    try:
        key = fast_signature(*call)
        return signature(*call) if key is None else key
    except (AttributeError, TypeError):
        return None


def replay_by_python_key(plans: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor], causal: Any,
                         scale: Any, backend: str, precision: Any, window: Any, softcap: Any,
                         alibi_slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``replay`` with the key built in Python: the output of the plan ``plan`` keeps for this call's
    ``signature``, or None when there is none (or the arguments cannot be keyed: validation then names them)."""
    try:
        plan = plans.get(signature(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window,
                                   softcap, alibi_slopes))
    except (AttributeError, TypeError):
        return None
    if plan is None:
        return None
    key_mask = key_padding_mask if key_lengths is None else key_lengths
    # A dense plan may run SDPA itself, whose fourth parameter is attn_mask (None here) and fifth dropout.
    return plan.run(q, k, v, key_mask) if alibi_slopes is None else plan.run(q, k, v, key_mask, alibi_slopes)


def _replay_in_python(plans: dict, fallback: Callable[..., Optional[torch.Tensor]], *call: Any
                      ) -> Optional[torch.Tensor]:
    return fallback(plans, *call)


# replay(plans, replay_by_python_key, <signature's twelve arguments>): the output of the kept plan of a call, or
# None when it has none. In C++ (``flashlite._native.replay``) the key, the lookup and the plan's call are one C
# call, which hands the calls its key does not cover to ``replay_by_python_key``; without the extension, that
# function alone.
replay: Callable[..., Optional[torch.Tensor]] = _native.replay or _replay_in_python


class SizesKey(tuple):
    """``sizes_key``'s key: a tuple of its own class, so that it never equals a ``signature``."""

    __slots__ = ()


def sizes_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
              key_lengths: Optional[torch.Tensor], causal: Any, scale: Any, backend: str, precision: Any,
              window: Any = None, softcap: Any = None, alibi_slopes: Optional[torch.Tensor] = None
              ) -> Optional[SizesKey]:
    """The key of a call without its key length: calls that differ only in S_k (and so in the strides of k, v and
    key_padding_mask, as a cache grown by ``torch.cat`` has) share it. A decoding loop's key length grows by one
    per call; a plan whose run reads the key length from the tensors (``Plan.any_key_length``) serves all of its
    calls once made, where a key with S_k in it would validate and plan every step anew. The key length's bucket
    in the dispatch table (``seq_bucket``) stays in the key, so that a call is decided by its own table entry.
    None for arguments that cannot be keyed so (not tensors, not hashable, an empty key axis): the full path then
    validates them.

    Example:
        >>> q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 100, 16)
        >>> sizes_key(q, k, k, None, None, "lower_right", None, "auto", None) == sizes_key(
        ...     q, k[:, :, :99], k[:, :, :99], None, None, "lower_right", None, "auto", None)
        True
    """
    try:
        k_shape, v_shape = k.shape, v.shape
        key = (q.shape, q.stride(), q.dtype, q.device, k_shape[:2], k_shape[3:], k.dtype, k.device, v_shape[:2],
               v_shape[3:], v.dtype, v.device, seq_bucket(max(q.shape[2], k_shape[2])), causal, causal.__class__,
               scale, scale.__class__, backend, precision, _mask_signature(key_lengths),
               _mask_signature(alibi_slopes), window, None if window is None else tuple(map(type, window)),
               softcap, softcap.__class__)
        if key_padding_mask is not None:
            key += (key_padding_mask.shape[:1], key_padding_mask.shape[2:], key_padding_mask.dtype,
                    key_padding_mask.device)
        hash(key)
    except (AttributeError, TypeError, IndexError, ValueError):
        return None
    return SizesKey(key)


class CacheKey(tuple):
    """The key of an ``attention_with_kvcache`` plan (``kvcache._plan_key``): a tuple of its own class, so that it
    never equals an ``attention()`` key in the one plan cache."""

    __slots__ = ()


def fits_any_length_plan(k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> bool:
    """What validation checks of a call's key length beyond ``sizes_key``: k and v of one length, and a
    key_padding_mask [B, S_k] of it."""
    seq_k = k.shape[2]
    return v.shape[2] == seq_k and (key_padding_mask is None or key_padding_mask.shape[1] == seq_k)


# Plans by signature (a ``signature`` tuple or a ``fast_signature`` bytes key), and plans that serve every key
# length also by ``sizes_key``. Past MAX_PLANS distinct signatures,
# new ones are validated and decided on every call.
_PLANS: dict[Any, Plan] = {}
MAX_PLANS = 4096


def has_room() -> bool:
    """Whether a new plan will be kept (``keep``): a plan that will not be records no launches."""
    return len(_PLANS) < MAX_PLANS


def keep(key: Optional[tuple], plan: Plan, any_length_key: Optional[SizesKey] = None) -> Plan:
    """Keep ``plan`` for ``key`` while there is room, and for ``any_length_key`` too where the plan serves every
    key length; returns the plan, or, where it is not kept, a copy that records nothing (a recording is kept
    only by a plan that later calls find)."""
    if key is None or not has_room():
        return replace(plan, record=False) if plan.record else plan
    _PLANS[key] = plan
    if any_length_key is not None and plan.any_key_length:
        _PLANS[any_length_key] = plan
    return plan
