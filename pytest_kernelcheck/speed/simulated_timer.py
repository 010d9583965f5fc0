"""A timer that needs no device (each callable's time drawn from the random generator and the simulated clock,
for tests of everything above the timers), and the error every timer raises for a callable that raised."""
from __future__ import annotations

import random
from typing import Any, Callable, Mapping, Sequence

from . import clocks

DurationModel = Callable[[random.Random, float], float]


class TimedCallError(Exception):
    """Raised by a timer when the callable at ``index`` of the sequence raised; the cause is chained."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"callable {index} raised {type(error).__name__}: {error}")
        self.index = index
        self.error = error


class SimulatedTimer:
    """Timer with known truth: each callable's duration is drawn from its model on a virtual clock.

    ``models`` maps each callable (by identity) to ``model(rng, now) -> seconds``; ``now`` lets a model drift.
    The clock advances by every simulated duration plus ``overhead_s`` per element. The callables themselves are
    not run unless ``run_callables`` is true.

    ``sm_clock(now) -> MHz`` gives the simulated device an SM clock (``timer.sm_clock``, read by
    :mod:`.clocks`), so throttling can be simulated together with what it does to the durations. ``escaped``
    maps callables to models of work they leave outside the timed stream: the timer then answers the escape
    check (:mod:`.escape`) as a CUDA device would, events seeing the model's time and a synchronised wall clock
    that plus the escaped work plus ``sync_overhead_s`` (launch and synchronisation latency). Without
    ``escaped`` there is no escape check, as on the CPU. ``device_models`` gives callables a device time beside
    each drawn time (the latency mode's CUDA events), read by :meth:`device_seconds_of`.

    >>> fast, slow = (lambda: None), (lambda: None)
    >>> timer = SimulatedTimer({fast: lambda rng, now: 1e-3, slow: lambda rng, now: 2e-3})
    >>> timer.time_calls([fast, slow], repeat=2), timer.now()
    ([0.002, 0.004], 0.006)
    >>> timer = SimulatedTimer({fast: lambda rng, now: 1e-3}, escaped={fast: lambda rng, now: 3e-3})
    >>> timer.escape_probe.event_time(fast, 1), round(timer.escape_probe.synced_time(fast, 1), 6)
    (0.001, 0.00401)
    """

    name = "simulated"
    lock_key = "simulated"
    resolution_s = 0.0  # a virtual clock adds exact durations: nothing is rounded

    def __init__(
        self,
        models: Mapping[Callable[[], Any], DurationModel],
        seed: int = 0,
        overhead_s: float = 0.0,
        run_callables: bool = False,
        sm_clock: Callable[[float], float] | None = None,
        escaped: Mapping[Callable[[], Any], DurationModel] | None = None,
        sync_overhead_s: float = 10e-6,
        device_models: Mapping[Callable[[], Any], DurationModel] | None = None,
    ) -> None:
        self._models = {id(fn): model for fn, model in models.items()}
        self._rng = random.Random(seed)
        self._clock = 0.0
        self._overhead_s = overhead_s
        self._run_callables = run_callables
        self.sm_clock = clocks.FakeClock(lambda: sm_clock(self._clock)) if sm_clock is not None else None
        self._escaped = {id(fn): model for fn, model in (escaped or {}).items()}
        self.escape_probe = self if escaped is not None else None
        self._sync_overhead_s = sync_overhead_s
        # Latency mode's device clock: each call's device seconds beside its wall-clock time (device_seconds_of).
        self._device_models = {id(fn): model for fn, model in (device_models or {}).items()}
        self._device_s: dict[int, list[float]] = {}

    def device_seconds_of(self, fn: Callable[[], Any]) -> list[float]:
        """Device seconds of each timed call of ``fn`` drawn from its ``device_models`` entry (empty without)."""
        return list(self._device_s.get(id(fn), ()))

    def event_time(self, fn: Callable[[], Any], repeat: int) -> float:
        """Seconds the events of one sample of ``fn`` see: its model's time (the escape check's event timer)."""
        return self.time_calls([fn], repeat)[0]

    def synced_time(self, fn: Callable[[], Any], repeat: int) -> float:
        """Seconds between device-wide synchronisations around one sample: its time, escaped work and latency."""
        timed = self.time_calls([fn], repeat)[0]
        model = self._escaped.get(id(fn))
        escaped = sum(model(self._rng, self._clock) for _ in range(repeat)) if model is not None else 0.0
        self._clock += escaped + self._sync_overhead_s
        return timed + escaped + self._sync_overhead_s

    def time_calls(self, fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]:
        durations = []
        for index, fn in enumerate(fns):
            model = self._models.get(id(fn))
            if model is None:
                raise ValueError(f"SimulatedTimer has no model for callable {index} ({fn!r})")
            if self._run_callables:
                try:
                    fn()
                except Exception as exc:
                    raise TimedCallError(index, exc) from exc
            total = 0.0
            device = self._device_models.get(id(fn))
            for _ in range(repeat):
                total += model(self._rng, self._clock)
                if device is not None:
                    self._device_s.setdefault(id(fn), []).append(device(self._rng, self._clock))
            durations.append(total)
            self._clock += total + self._overhead_s
        return durations

    def now(self) -> float:
        return self._clock
