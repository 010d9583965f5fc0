"""What one A/B run is asked to do, as one frozen, checked object: the work of a call, the inputs and their
check, the budget, the measurement modes and the timer.

``compare``, ``tournament``, ``measure`` and the ``run_*`` functions all take their keywords through
:meth:`ABSpec.build`, which checks every one once (a misspelled keyword, a bad mode, an ``inputs=`` that is not
a callable are refused before anything runs, naming the argument); the public keywords stay the way to write it.

>>> spec = ABSpec.build(None, max_time=0.5, modes="throughput,latency", flops=2e9)
>>> spec.budget.max_time, spec.modes, spec.work.flops
(0.5, ('throughput', 'latency'), 2000000000.0)
>>> ABSpec.build(None, flop=1)
Traceback (most recent call last):
...
TypeError: unknown budget keyword 'flop'; expected one of: alpha, calls_per_sample, check_escape, check_output, flush_l2, hold_gpu, margin, max_pairs, max_time, min_pairs, seed, throttle, use_cuda_graph, warmup; or a keyword of the spec: bytes, check, dtype, flops, inputs, modes, timer
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from . import inputs as owned_inputs
from .budget import Budget
from .modes import DEFAULT_MODES, MODES, parse_modes, timer_for_mode

# The keywords of the spec itself; every other keyword is the budget's.
SPEC_KEYWORDS = ("bytes", "check", "dtype", "flops", "inputs", "modes", "timer")


@dataclass(frozen=True)
class WorkSpec:
    """The work of one call, the same for both sides: ``flops`` and ``bytes`` (numbers, callables of the test's
    shape, or for a tournament mappings of variant names to either) and the ``dtype`` whose ceiling rates them."""

    flops: Any = None
    bytes: Any = None  # noqa: A003  (the keyword users write)
    dtype: Any = None


@dataclass(frozen=True)
class InputSpec:
    """Inputs the plugin owns (``make``: a zero-argument callable returning a tuple of arguments or a dict of
    keyword arguments) and the output check: ``check`` a tolerance policy, a callable ``(candidate_out,
    baseline_out)`` that raises, ``None``/``True`` (the policy of the output's dtype) or ``False`` (no check)."""

    make: Callable[[], Any] | None = None
    check: Any = None

    @property
    def checks_outputs(self) -> bool:
        return self.check is not False


@dataclass(frozen=True)
class ABSpec:
    """Everything an A/B run is asked to do, checked once by :meth:`build` (or :meth:`validate`)."""

    budget: Budget = Budget()
    work: WorkSpec = WorkSpec()
    inputs: InputSpec = InputSpec()
    modes: tuple[str, ...] = DEFAULT_MODES
    timer: Any = None  # None/"auto", "cpu", "cuda", a timer object, or a mapping of mode names to timers

    @classmethod
    def build(cls, base: "ABSpec | Budget | None" = None, **keywords: Any) -> "ABSpec":
        """``base`` (a spec, a budget or None) with ``keywords`` applied: spec keywords (flops, bytes, dtype,
        inputs, check, modes, timer) and budget keywords; checked before it is returned."""
        spec = base if isinstance(base, ABSpec) else cls(budget=base if isinstance(base, Budget) else Budget())
        if base is not None and not isinstance(base, (ABSpec, Budget)):
            raise TypeError(f"the budget argument must be a Budget or an ABSpec, got {type(base).__name__}")
        budget_keys = {f.name for f in dataclasses.fields(Budget)}
        for key in keywords:
            if key not in SPEC_KEYWORDS and key not in budget_keys:
                raise TypeError(f"unknown budget keyword {key!r}; expected one of: {', '.join(sorted(budget_keys))}; "
                                f"or a keyword of the spec: {', '.join(SPEC_KEYWORDS)}")
        budget_changes = {k: v for k, v in keywords.items() if k in budget_keys}
        work = WorkSpec(**{name: keywords.get(name, getattr(spec.work, name)) for name in ("flops", "bytes", "dtype")})
        made = dataclasses.replace(
            spec,
            budget=spec.budget.replace(**budget_changes) if budget_changes else spec.budget,
            work=work,
            inputs=InputSpec(keywords.get("inputs", spec.inputs.make), keywords.get("check", spec.inputs.check)),
            modes=parse_modes(keywords["modes"]) if keywords.get("modes") is not None else spec.modes,
            timer=keywords.get("timer", spec.timer),
        )
        made.validate()
        return made

    def validate(self) -> None:
        """Refuse what no run can do, naming the argument."""
        self.budget.validate()
        parse_modes(self.modes)
        for mode in MODES:
            timer_for_mode(self.timer, mode)  # a mapping's keys must be mode names
        make = self.inputs.make
        if make is not None and not callable(make):
            raise TypeError(
                "inputs must be a zero-argument callable returning a tuple of arguments or a dict of keyword "
                f"arguments (e.g. inputs=lambda: (x,)), got {owned_inputs.brief(make)}"
            )
        owned_inputs.validate_check(self.inputs.check)

    @property
    def primary_mode(self) -> str:
        """The mode whose verdict is the comparison's (the report row's, the gate's, the assertions'): the first."""
        return self.modes[0]

    def with_modes(self, modes: Any) -> "ABSpec":
        return dataclasses.replace(self, modes=parse_modes(modes))

    def with_work(self, flops: Any, bytes: Any, dtype: Any) -> "ABSpec":  # noqa: A002
        return dataclasses.replace(self, work=WorkSpec(flops, bytes, dtype))
