"""Timer resolution: batch calls until a sample spans many ticks, and refuse a verdict on samples that do not.

A timer reads time in ticks. A sample that lasts a few ticks is mostly rounding: two functions that both take
less than a tick read 0 or 1 tick each, and two whose samples always read the same count of ticks give paired
ratios of exactly 1, which the statistics would call a tie (or, with unlucky rounding, a win) although the timer
never saw a difference. So a sample must last at least :data:`TICKS_PER_SAMPLE` ticks (one tick is then at most
1% of it, below the default 2% tie margin):

- with ``calls_per_sample="auto"`` the engine batches calls until a sample does (:func:`calls_for`);
- a comparison whose samples still do not (a pinned ``calls_per_sample``, or calls too fast even for the largest
  batch) is ``inconclusive``, and its note names the timer's resolution (:func:`unresolved`).

A timer's resolution is what it declares (``resolution_s``: :class:`.timing.CpuTimer` the clock's own,
:class:`.timing.CudaEventTimer` the half microsecond CUDA documents for events; 0 declares an exact clock, as
:class:`.timing.SimulatedTimer`'s virtual one is); for a timer that declares none, the smallest step seen between
its readings (and when every reading is the same, no difference could show at all).

>>> class Ticks:  # a clock of 1 ms ticks
...     name, resolution_s = "ticks", 1e-3
>>> unresolved(Ticks(), [[0.002, 0.002], [0.003, 0.003]])
"inconclusive: the samples (median 0.002 s) span fewer than 100 ticks of timer 'ticks', whose resolution is 0.001 s: \
a difference below it cannot be told from rounding; time more calls per sample (calls_per_sample)"
"""
from __future__ import annotations

import math
import statistics
from typing import Any, Sequence

TICKS_PER_SAMPLE = 100
UNRESOLVED_PREFIX = "inconclusive: "  # how the note of a comparison the timer could not resolve begins
# cudaEventElapsedTime: "this value has a resolution of around 0.5 microseconds" (CUDA runtime API reference).
CUDA_EVENT_RESOLUTION_S = 0.5e-6


def declared(timer: Any) -> float | None:
    """The resolution ``timer`` declares in seconds (``resolution_s``), or None when it declares none."""
    value = getattr(timer, "resolution_s", None)
    try:
        value = float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
    return value if value is not None and math.isfinite(value) and value >= 0 else None


def observed_step(durations: Sequence[float]) -> float | None:
    """The smallest positive step between distinct readings; None with fewer than two distinct values.

    >>> observed_step([0.003, 0.001, 0.002, 0.002])
    0.001
    """
    distinct = sorted(set(durations))
    steps = [b - a for a, b in zip(distinct, distinct[1:]) if b > a]
    return min(steps) if steps else None


def calls_for(timer: Any, single_call_s: float, calls: int, most: int) -> int:
    """``calls`` per sample, raised (up to ``most``) until a sample of calls of ``single_call_s`` spans
    :data:`TICKS_PER_SAMPLE` ticks of the timer's declared resolution; a call read as 0 takes ``most``.

    >>> class Ticks:
    ...     resolution_s = 1e-3
    >>> calls_for(Ticks(), 20e-6, 10, 100_000), calls_for(Ticks(), 0.0, 10, 1000), calls_for(Ticks(), 0.2, 1, 1000)
    (5000, 1000, 1)
    """
    resolution = declared(timer) or 0.0
    if resolution == 0:
        return calls
    if single_call_s <= 0:
        return most
    needed = math.ceil(TICKS_PER_SAMPLE * resolution / single_call_s - 1e-9)
    return max(calls, min(most, needed))


def unresolved(timer: Any, raw_samples: Sequence[Sequence[float]]) -> str | None:
    """Why the timer cannot resolve these samples (seconds per sample as the timer read them, one list per
    side), or None when every side's median sample spans at least :data:`TICKS_PER_SAMPLE` ticks."""
    resolution = declared(timer)
    if resolution == 0:  # an exact clock (a simulation): nothing is rounded
        return None
    name = getattr(timer, "name", type(timer).__name__)
    readings = [value for side in raw_samples for value in side]
    if not readings:
        return None
    step = observed_step(readings)
    if step is None and resolution is None:  # every sample read the same: the clock showed no step at all
        return (f"{UNRESOLVED_PREFIX}every sample of timer {name!r} read {readings[0]:.3g} s, so its resolution may be "
                f"as coarse as the samples and no difference could show; time more calls per sample "
                f"(calls_per_sample)")
    if resolution is None:  # a timer that declares none: the smallest step between its readings bounds its tick
        resolution = step
    shortest = min(statistics.median(side) for side in raw_samples if side)
    # The relative slack keeps a sample of exactly 100 ticks, read through floating point, on the right side.
    if shortest >= TICKS_PER_SAMPLE * resolution * (1 - 1e-9):
        return None
    return (f"{UNRESOLVED_PREFIX}the samples (median {shortest:.3g} s) span fewer than {TICKS_PER_SAMPLE} ticks of timer "
            f"{name!r}, whose resolution is {resolution:.3g} s: a difference below it cannot be told from rounding; "
            f"time more calls per sample (calls_per_sample)")
