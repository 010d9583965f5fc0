"""Work that escapes the timed stream: a check that CUDA events see a callable's work, before it is timed.

CUDA events time the stream they are recorded on. Work a callable leaves on another stream (a side stream it
never joins back, a library's internal stream) or launches from another thread is not between them, so the
events report a fraction of the call and a comparison would be decided on that fraction. The check times a few
samples of each callable twice from an idle device: once between CUDA events, once on the wall clock between
device-wide synchronisations (``torch.cuda.synchronize()``, which waits for every stream). When the events see
less than ``ESCAPE_RATIO`` of the synchronised time, and the difference is more than ``ESCAPE_FLOOR_S``, the
comparison fails with :class:`EscapedWork`, giving both numbers. Only CUDA comparisons are checked (the CPU clock
sees everything the host waits for); ``check_escape=False`` turns the check off.

Another process on the same GPU also opens such a gap: the device time-slices between processes, so a synchronised
sample waits for the other process's slice while the events, which start when the stream does, do not. A gap is
therefore checked against a control before it fails a comparison: a sample of the same length that is certainly on
the timed stream (a spin kernel, ``torch.cuda._sleep``), timed both ways at once. Only the part of the gap the
control does not also show counts as escaped work. (Measured on an H200 with a second process running matmuls half
the time: a 0.96 ms matmul synchronised at 3.4 ms; without the control, 57 of 100 A/A comparisons failed.)

The timers are injectable: anything with ``event_time(fn, repeat)`` and ``synced_time(fn, repeat)`` (seconds
of one sample) is a probe, and ``control_times(seconds)`` (events and synchronised time of an on-stream sample that
long) its optional control; a timer may bring one as ``timer.escape_probe`` (``SimulatedTimer(escaped=...)``).

>>> class Probe:  # events see 0.2 ms of a sample that keeps the device busy for 1 ms
...     def event_time(self, fn, repeat): return 0.2e-3
...     def synced_time(self, fn, repeat): return 1e-3
>>> check_escaping_work(Probe(), [print], ["candidate"], repeat=1)  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
pytest_kernelcheck.speed.escape.EscapedWork: candidate: CUDA events timed 0.2 ms per sample, but ... took 1 ms ...
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from .timing import CallableFailed, CudaEventTimer

# The check fails when the events see less than half the synchronised time: a normal sample loses only launch and
# synchronisation latency to the events, a small share of any sample that is not tiny, while work the events miss
# entirely is as long as the work they see or longer before this trips (so it flags the work, not the noise).
ESCAPE_RATIO = 0.5
# ... and only when the events miss more than this. A synchronised sample of a normal callable costs the events'
# time plus the latency of the first launch after an idle device and of the final synchronisation's return: a few
# microseconds each on an idle host, up to about 20 us together when pytest-xdist workers share the CPU. 50 us
# is well above that, and tiny calls are batched into samples of about 200 us (timing.BATCH_TARGET_S), so work
# escaping from each of them adds up above the floor. (Measured numbers: scripts/escape_latency.py at commit 8ca4529 on
# a GPU.)
ESCAPE_FLOOR_S = 50e-6
# Samples of each callable per timer; the medians shrug off one or two descheduled samples. Past
# ESCAPE_MIN_ROUNDS, a callable stops once its synchronised samples add up to ESCAPE_MAX_S: a 200 ms call is
# checked in 3 rounds (1.2 s with its event samples), not 5, and a median of 3 still ignores one outlier.
ESCAPE_ROUNDS = 5
ESCAPE_MIN_ROUNDS = 3
ESCAPE_MAX_S = 0.25


class EscapedWork(Exception):
    """The events of a callable saw far less time than the device was busy with its calls."""


class EscapeProbe(Protocol):
    """Times one sample (``repeat`` calls of ``fn``) from an idle device, in seconds, both ways."""

    def event_time(self, fn: Callable[[], Any], repeat: int) -> float: ...

    def synced_time(self, fn: Callable[[], Any], repeat: int) -> float: ...


class CudaEscapeProbe:
    """The two timers on one CUDA device.

    >>> probe = CudaEscapeProbe("cuda:0")  # doctest: +SKIP
    >>> probe.event_time(lambda: a @ b, 1), probe.synced_time(lambda: a @ b, 1)  # doctest: +SKIP
    (0.000412, 0.000431)
    """

    def __init__(self, device: Any) -> None:
        import torch

        self._torch, self.device = torch, device
        self._cycles_per_s: float | None = None

    def event_time(self, fn: Callable[[], Any], repeat: int) -> float:
        torch = self._torch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)  # idle device: the events wait behind nothing
            start.record()
            for _ in range(repeat):
                fn()
            end.record()
            torch.cuda.synchronize(self.device)  # all streams: escaped work must not spill into the next sample
        return start.elapsed_time(end) * 1e-3

    def synced_time(self, fn: Callable[[], Any], repeat: int) -> float:
        torch = self._torch
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            begin = time.perf_counter()
            for _ in range(repeat):
                fn()
            torch.cuda.synchronize(self.device)
            return time.perf_counter() - begin

    def control_times(self, seconds: float) -> tuple[float, float]:
        """Events and synchronised time of one spin kernel of about ``seconds`` on the current stream: all of its
        work is between the events, so any gap it shows is latency or another process's share of the device."""
        torch = self._torch
        with torch.cuda.device(self.device):
            if self._cycles_per_s is None:  # the spin kernel counts clock cycles: calibrate once, by events
                self._cycles_per_s = 1e6 / max(self.event_time(lambda: torch.cuda._sleep(1_000_000), 1), 1e-9)
            cycles = max(int(seconds * self._cycles_per_s), 1)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            begin = time.perf_counter()
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            torch.cuda.synchronize(self.device)
            synced = time.perf_counter() - begin
        return start.elapsed_time(end) * 1e-3, synced


def probe_for(timer: Any) -> EscapeProbe | None:
    """The probe for a comparison timed by ``timer``: its own ``escape_probe``, the CUDA one for CUDA events,
    else None (host timers see all the host waits for).

    >>> probe_for(object()) is None
    True
    """
    own = getattr(timer, "escape_probe", None)
    if own is not None:
        return own
    if isinstance(timer, CudaEventTimer):
        return CudaEscapeProbe(timer.device)
    return None


@dataclass(frozen=True)
class EscapeTimes:
    """One callable's medians: per sample, between events and between synchronisations."""

    side: str
    event_s: float
    synced_s: float
    control_gap_s: float = 0.0  # the gap an on-stream sample of the same length showed (0: no control run)

    @property
    def escaped(self) -> bool:
        synced = self.synced_s - self.control_gap_s  # what the device spent on this callable's work
        return self.event_s < ESCAPE_RATIO * synced and synced - self.event_s > ESCAPE_FLOOR_S


def check_escaping_work(
    probe: EscapeProbe, fns: Sequence[Callable[[], Any]], sides: Sequence[str], repeat: int,
    rounds: int = ESCAPE_ROUNDS,
) -> list[EscapeTimes]:
    """Time ``rounds`` samples of each callable both ways (alternating, so drift hits both alike; at least
    ``ESCAPE_MIN_ROUNDS`` and, past them, until ``ESCAPE_MAX_S`` of synchronised time); raise
    :class:`EscapedWork` for the first whose events miss most of its synchronised time, else return the medians.
    A callable that raises becomes :class:`pytest_kernelcheck.speed.timing.CallableFailed` naming its side.

    >>> class Probe:
    ...     def event_time(self, fn, repeat): return 0.98e-3
    ...     def synced_time(self, fn, repeat): return 1e-3
    >>> check_escaping_work(Probe(), [print], ["candidate"], repeat=1)
    [EscapeTimes(side='candidate', event_s=0.00098, synced_s=0.001, control_gap_s=0.0)]
    """
    found = []
    for fn, side in zip(fns, sides):
        events, synced = [], []
        try:
            for _ in range(rounds):
                events.append(probe.event_time(fn, repeat))
                synced.append(probe.synced_time(fn, repeat))
                if len(synced) >= min(rounds, ESCAPE_MIN_ROUNDS) and sum(synced) >= ESCAPE_MAX_S:
                    break
        except Exception as exc:
            raise CallableFailed(side, exc, "the escape check") from exc
        times = EscapeTimes(side, statistics.median(events), statistics.median(synced))
        control = getattr(probe, "control_times", None)
        if times.escaped and control is not None:
            # Before failing: does work that is certainly on the stream show the same gap? (Another process on the
            # device, or latency.) Controls alternate with fresh synchronised samples of the callable, so that
            # load that comes and goes meets both.
            gaps = []
            try:
                for _ in range(len(synced)):
                    event_s, synced_s = control(times.event_s)
                    gaps.append(max(synced_s - event_s, 0.0))
                    synced.append(probe.synced_time(fn, repeat))
            except Exception as exc:
                raise CallableFailed(side, exc, "the escape check") from exc
            times = EscapeTimes(side, times.event_s, statistics.median(synced), statistics.median(gaps))
        if times.escaped:
            control_note = ("" if control is None else
                            f"; on-stream work as long waited {times.control_gap_s * 1e3:.3g} ms more than its events")
            calls = f"{repeat} call{'s' if repeat != 1 else ''}"
            raise EscapedWork(
                f"{side}: CUDA events timed {times.event_s * 1e3:.4g} ms per sample, but the same sample "
                f"({calls}) took {times.synced_s * 1e3:.4g} ms between device-wide synchronisations (medians of "
                f"{len(synced)}{control_note}): most of its GPU work runs outside the stream the events time, "
                "likely launched on "
                "another CUDA stream or from another thread. Queue it on the current stream, or make the current "
                "stream wait for the other one (torch.cuda.current_stream().wait_stream(side)) before returning; "
                "check_escape=False times it anyway"
            )
        found.append(times)
    return found
