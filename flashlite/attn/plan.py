"""The plan cache: one ``Plan`` per call signature, owning its problem, decision, configs and recorded launches.

A signature is everything validation and the decision depend on: the shapes, strides, dtypes and devices of the
tensors, and the non-tensor arguments; what varies per call without changing a decision (a decoding step's key
length, a cache's lengths, packed sequences' offsets) is data of the call, not of its key. A call whose signature
has a plan skips validation, dispatch and, once its launches are recorded, Triton's argument binding: at
launch-bound sizes those cost as much as the kernel. Every entry keeps its plans here, keyed by the one builder
``key_of`` (``attention_key`` is its C++ form for ``attention()`` calls, which the custom ops of compiled graphs
share): ``attention()``, ``attention_varlen``, ``attention_with_kvcache`` and the flat launchers. Imports
``problem``, ``flashlite._native`` (the keys packed in C++) and ``flashlite._runtime`` (whether the kernels are
interpreted) only.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

import torch

from flashlite import _native, _runtime
from flashlite.attn.problem import Problem
from flashlite._intmath import seq_bucket


@dataclass(frozen=True, eq=False, slots=True)
class Plan:
    """One call signature, validated and decided once: every decision is made when the plan is built.

    ``run(q, k, v[, key_mask[, alibi_slopes]])`` computes a call of this signature (``key_mask``: the call's
    key_padding_mask or key_lengths; None, or left off, without them); it is ``runner(plan)``, bound when the plan
    is built (None without a runner: the launchers call ``triton.launch_forward`` with the plan themselves).
    ``decision`` is the backend of calls without a gradient, ``gradient_decision`` that of calls whose gradient
    autograd computes (``backend="auto"`` decides the two from forward and forward+backward measurements;
    ``decision_for`` picks; unset, the same as ``decision``). ``gluon`` says whether the forward runs on the Gluon
    kernel instead of the pointer kernel, ``gluon_bwd`` whether the backward's dK/dV and dQ do.
    ``any_key_length``: whether ``run`` serves calls of every key length (then the plan is also kept under its
    ``any_length_key``, and its problem's seq_k is that of the call it was made for). ``record``: whether launches are recorded (only for plans that are kept, on CUDA).

    Two tables hold what the first launches produce, not decisions: ``configs``, per kernel, the config it launches
    (the forced one, or the autotuner's choice for this signature's tuning key, which needs a timed launch), and
    ``recorded``, per launch site, the recorded launch that replays the compiled kernel with a call's tensors (None
    where recording was refused, e.g. an unaligned tensor). ``layouts``, per launcher, what it derived once from
    the signature (the decoding kernel's ``DecodeLayout``: buffers, grids and scalars), so a replayed call only
    allocates its buffers and binds its tensors.

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
    layouts: dict[str, Any] = field(default_factory=dict, init=False)
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


class PlanKey(tuple):
    """A key of the one plan cache, as ``key_of`` builds it: (entry, field, ...). The entry comes first, so keys of
    two entries never equal: "attention" (``attention_key``), "attention/any_key_length" (``any_length_key``),
    "varlen", "kvcache" and "launcher" (the flat launchers). A key packed by C++ is bytes, which never equals a
    tuple; its first byte (and for ``key_of``'s packed form the entry after it) tells its entry (``entry_of``)."""

    __slots__ = ()


def _field(value: Any) -> Any:
    # A tensor by its layout; None as None; any other value with its class (1 == True == 1.0 hash alike, but
    # validation refuses causal=1 and scale=True, so a plan made for one must never answer the other), a tuple with
    # its items' classes too (validation refuses the window (True, 0), which equals (1, 0)).
    if isinstance(value, torch.Tensor):
        return value.shape, value.stride(), value.dtype, value.device
    if value is None:
        return None
    if value.__class__ is tuple:
        return value, tuple, tuple(item.__class__ for item in value)
    return value, value.__class__


def key_of(entry: str, *fields: Any) -> Optional[Any]:
    """The one key builder of the plan cache: ``entry`` and each field, a tensor by its shape, strides, dtype and
    device, any other value with its class. Packed into bytes by C++ (``flashlite._native.fields_key``) where it
    covers every field (None, tensors, bools, str, float, int and tuples of them), else a ``PlanKey``; a given
    call always gets the same form. None for fields that cannot be keyed (not hashable, a tensor whose layout
    cannot be read): validation then names them.

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> key_of("attention", q, True) == key_of("attention", torch.randn(1, 2, 8, 16), True)
        True
        >>> key_of("attention", q, True) == key_of("attention", q, 1), key_of("varlen", q, True) == key_of(
        ...     "attention", q, True)
        (False, False)
    """
    packed = _packed(_packed_fields_key, (entry, *fields))
    return packed if packed is not None else python_key_of(entry, *fields)


def python_key_of(entry: str, *fields: Any) -> Optional[PlanKey]:
    """``key_of``'s Python form, a ``PlanKey`` (entry, field, ...), for fields C++ does not cover or machines
    without the extension.

    Example:
        >>> python_key_of("kvcache", torch.randn(1, 2, 8, 16), 1)[0]
        'kvcache'
    """
    try:
        key = PlanKey((entry, *map(_field, fields)))
        hash(key)
    except (AttributeError, TypeError, RuntimeError):
        return None
    return key


# The C++ forms of key_of, attention_key and any_length_key (``flashlite._native``): the same fields packed into
# bytes, or None for a call they do not cover (then the Python key); None themselves where the extension was not
# built.
_packed_fields_key: Optional[Callable[..., Optional[bytes]]] = _native.fields_key
_packed_key: Optional[Callable[..., Optional[bytes]]] = _native.plan_key
_packed_any_length_key: Optional[Callable[..., Optional[bytes]]] = _native.any_length_key


def _packed(pack: Optional[Callable[..., Optional[bytes]]], call: tuple) -> Optional[bytes]:
    """The key C++ packs for ``call``, or None where there is no C++ form or it does not cover the call."""
    if pack is None:
        return None
    try:
        return pack(*call)
    except (AttributeError, TypeError):
        return None


def attention_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                  key_lengths: Optional[torch.Tensor], causal: Any, scale: Any, backend: str, precision: Any,
                  window: Any = None, softcap: Any = None, alibi_slopes: Optional[torch.Tensor] = None
                  ) -> Optional[Any]:
    """The key of an ``attention()`` call (what its plan is kept and found under): packed by C++ where it covers
    the call, else ``key_of("attention", ...)``; None for arguments that cannot be keyed (validation then names
    them). The custom ops find their plans under it too (``decide.op_plan``).

    Example:
        >>> q = torch.randn(1, 2, 8, 16)
        >>> call = (q, q, q, None, None, True, None, "auto", None)
        >>> attention_key(*call) == attention_key(*call) != attention_key(q, q, q, None, None, False, None, "auto",
        ...                                                               None)
        True
    """
    call = (q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes)
    packed = _packed(_packed_key, call)
    return packed if packed is not None else key_of("attention", *call)


def any_length_key(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                   key_lengths: Optional[torch.Tensor], causal: Any, scale: Any, backend: str, precision: Any,
                   window: Any = None, softcap: Any = None, alibi_slopes: Optional[torch.Tensor] = None
                   ) -> Optional[Any]:
    """The key of a call without its key length: calls that differ only in S_k (and so in the strides of k, v and
    key_padding_mask, as a cache grown by ``torch.cat`` has) share it. A decoding loop's key length grows by one
    per call; a plan whose run reads the key length from the tensors (``Plan.any_key_length``) serves all of its
    calls once made, where a key with S_k in it would validate and plan every step anew. The key length's bucket
    in the dispatch table (``seq_bucket``) stays in the key, so that a call is decided by its own table entry.
    Packed by C++ where it covers the call; None for arguments that cannot be keyed so (not 4-d tensors, an empty
    key axis, k and v or key_padding_mask of other key lengths): the full path then validates them.

    Example:
        >>> q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 100, 16)
        >>> any_length_key(q, k, k, None, None, "lower_right", None, "auto", None) == any_length_key(
        ...     q, k[:, :, :99], k[:, :, :99], None, None, "lower_right", None, "auto", None)
        True
    """
    call = (q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes)
    packed = _packed(_packed_any_length_key, call)
    if packed is not None:
        return packed
    try:
        if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or not fits_any_length_plan(k, v, key_padding_mask):
            return None
        seq_k = k.shape[2]
        masks = () if key_padding_mask is None else (
            key_padding_mask.shape[:1] + key_padding_mask.shape[2:], key_padding_mask.dtype, key_padding_mask.device)
        return key_of("attention/any_key_length", q, *(t.shape[:2] + t.shape[3:] for t in (k, v)), k.dtype, k.device,
                      v.dtype, v.device, masks, seq_bucket(max(q.shape[2], seq_k)), key_lengths, causal, scale,
                      backend, precision, window, softcap, alibi_slopes)
    except (AttributeError, TypeError, IndexError, ValueError):
        return None


def entry_of(key: Any) -> str:
    """The entry a key of the plan cache belongs to (``PlanKey``'s first field; a packed key's first byte).

    Example:
        >>> entry_of(key_of("kvcache", 1)), entry_of(attention_key(*(torch.randn(1, 1, 4, 16),) * 3, None, None,
        ...                                                         False, None, "auto", None))
        ('kvcache', 'attention')
    """
    if isinstance(key, bytes):
        if key[:1] == _FIELDS_TAG:  # tag, then the entry as plan_key.cpp's put_str packs it: str tag, length, text
            length = int.from_bytes(key[2:10], sys.byteorder)
            return key[10:10 + length].decode()
        return "attention/any_key_length" if key[:1] == _ANY_LENGTH_TAG else "attention"
    return key[0]


# The first byte of a packed any_length_key (plan_key.cpp's kAnyLength) and of a packed key_of (kFields); a packed
# attention_key starts with q's tag.
_ANY_LENGTH_TAG = bytes([7])
_FIELDS_TAG = bytes([8])


def replay_by_python_key(plans: dict, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor], causal: Any,
                         scale: Any, backend: str, precision: Any, window: Any, softcap: Any,
                         alibi_slopes: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """``replay`` with the keys built in Python: the output of the plan ``plans`` keeps for this call's
    ``key_of("attention", ...)``, else for its key without the key length; None when there is none (or the
    arguments cannot be keyed: validation then names them)."""
    call = (q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes)
    plan = plans.get(key_of("attention", *call))
    if plan is None:
        key = any_length_key(*call)
        plan = None if key is None else plans.get(key)
        if plan is None:
            return None
    key_mask = key_padding_mask if key_lengths is None else key_lengths
    # A dense plan may run SDPA itself, whose fourth parameter is attn_mask (None here) and fifth dropout.
    return plan.run(q, k, v, key_mask) if alibi_slopes is None else plan.run(q, k, v, key_mask, alibi_slopes)


def _replay_in_python(plans: dict, fallback: Callable[..., Optional[torch.Tensor]], *call: Any
                      ) -> Optional[torch.Tensor]:
    return fallback(plans, *call)


# replay(plans, replay_by_python_key, <attention_key's twelve arguments>): the output of the kept plan of a call, or
# None when it has none. In C++ (``flashlite._native.replay``) the keys, the lookups and the plan's call are one C
# call, which hands the calls its key does not cover to ``replay_by_python_key``; without the extension, that
# function alone.
replay: Callable[..., Optional[torch.Tensor]] = _native.replay or _replay_in_python


def fits_any_length_plan(k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor]) -> bool:
    """What validation checks of a call's key length beyond ``any_length_key``: k and v of one length, and a
    key_padding_mask [B, S_k] of it."""
    seq_k = k.shape[2]
    return v.shape[2] == seq_k and (key_padding_mask is None or key_padding_mask.shape[1] == seq_k)


# Plans by key (``attention_key``, ``key_of``), and plans that serve every key length also by ``any_length_key``.
# Past MAX_PLANS distinct keys, new calls are validated and decided on every call.
_PLANS: dict[Any, Plan] = {}
MAX_PLANS = 4096


def launches_on_gpu(q: torch.Tensor) -> bool:
    """Whether the kernels launch compiled on a GPU for ``q`` (not in Triton's interpreter): where launches can be
    recorded."""
    return q.is_cuda and not _runtime.interpreting()


def records_launches(q: torch.Tensor) -> bool:
    """Whether a Triton plan made now for a call on ``q`` records its launches (every entry's one rule): on a GPU,
    with room in the cache to keep the plan, and never while torch.compile traces. A traced plan is not kept (its
    run is the graph's op), and asking the cache's size there made Dynamo guard on it: the op keeps each new size's
    plan at run time, so every size recompiled a dynamic graph (7 graphs for 7 sizes on an H100).

    Example:
        >>> records_launches(torch.zeros(1))
        False
    """
    return launches_on_gpu(q) and not torch.compiler.is_compiling() and has_room()


def has_room() -> bool:
    """Whether a new plan will be kept (``keep``): a plan that will not be records no launches."""
    return len(_PLANS) < MAX_PLANS


def keep(key: Optional[Any], plan: Plan, length_free_key: Optional[Any] = None) -> Plan:
    """Keep ``plan`` for ``key`` while there is room, and for ``length_free_key`` (the call's ``any_length_key``)
    too where the plan serves every key length; returns the plan, or, where it is not kept, a copy that records
    nothing (a recording is kept only by a plan that later calls find)."""
    if key is None or not has_room():
        return replace(plan, record=False) if plan.record else plan
    _PLANS[key] = plan
    if length_free_key is not None and plan.any_key_length:
        _PLANS[length_free_key] = plan
    return plan
