"""The SM clock during a comparison, and what throttling does to it: flag it, drop its rounds, or fail.

A :class:`ClockMonitor` reads the device's SM clock (and temperature) after every chunk of rounds the engine
times, and keeps the highest clock seen on that device in this process (:class:`SessionClocks`). A round is
*throttled* when the reading that closed its chunk is more than 10% below that highest clock
(``THROTTLE_FRACTION``). What a throttled round does to the comparison is the policy of ``Budget.throttle``
(``--kernel-ab-throttle``):

- ``flag``: nothing changes but the record's ``throttled`` and a note.
- ``discard``: the throttled rounds are dropped before each look, and the verdict is decided on the others; the
  record says how many were dropped.
- ``fail``: the comparison raises :class:`ThrottledComparison`, naming both clocks.

The clock is read where the engine can read it without disturbing a measurement: between chunks, right after the
timer's synchronisation, while the GPU is still at the clock it ran the chunk with (an idle GPU lowers its clock
only after a while; a reading taken before the first chunk, after warm-up and graph capture, could already show
the idle clock, so none is taken there). Readers are injectable: :class:`NvmlClock` reads NVML (nvidia-ml-py, or
any object with its functions), :class:`FakeClock` replays given values, and a timer may bring its own as
``timer.sm_clock`` (``SimulatedTimer(sm_clock=...)``).

>>> session = SessionClocks()
>>> monitor = ClockMonitor(FakeClock([1980, 1500]), policy="discard", session=session)
>>> monitor.after_chunk(20); monitor.after_chunk(40)
>>> monitor.throttled, len(monitor.kept_rounds(40)), monitor.dropped
(True, 20, 20)
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from ..results.measured import ClockRecord

# A round is throttled when its SM clock is below this fraction of the session's highest: a clock 10% down slows a
# compute-bound kernel by about 10%, the size of the differences comparisons are asked to tell.
THROTTLE_FRACTION = 0.9
POLICIES = ("flag", "discard", "fail")


class ThrottledComparison(Exception):
    """The SM clock fell too far below the session's highest: with ``throttle="fail"`` at any point, with
    ``"discard"`` when no round is left to decide on. The message gives both clocks."""


@dataclass(frozen=True)
class ClockReading:
    """One NVML reading: the SM clock in MHz and the GPU temperature in degrees C (None when not read)."""

    sm_mhz: int
    temperature_c: int | None = None


class ClockSource(Protocol):
    """What a monitor reads. ``key`` names the physical device (the session's highest clock is kept per key);
    ``read()`` raises when the clock cannot be read."""

    key: str
    max_supported_mhz: int | None

    def read(self) -> ClockReading: ...


class NvmlClock:
    """The SM clock and temperature of one CUDA device through NVML.

    ``nvml``: the NVML module (default: ``pynvml`` from nvidia-ml-py) or a stand-in with its functions;
    ``handle``: the NVML device handle (default: torch's, which maps ``CUDA_VISIBLE_DEVICES`` to the physical
    device). Construction raises ``ImportError`` without nvidia-ml-py and NVML's error when NVML refuses.

    >>> class FakeNvml:
    ...     NVML_CLOCK_SM, NVML_TEMPERATURE_GPU = 1, 0
    ...     def nvmlDeviceGetMaxClockInfo(self, handle, kind): return 1980
    ...     def nvmlDeviceGetClockInfo(self, handle, kind): return 1755
    ...     def nvmlDeviceGetTemperature(self, handle, kind): return 61
    >>> NvmlClock("cuda:0", key="gpu-a", nvml=FakeNvml(), handle="h").read()
    ClockReading(sm_mhz=1755, temperature_c=61)
    """

    def __init__(self, device: Any, key: str, nvml: Any = None, handle: Any = None) -> None:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py: pip install pytest-kernelcheck[nvml]
        if handle is None:
            import torch

            handle = torch.cuda._get_pynvml_handler(device)  # initialises NVML, maps the visible index
        self._nvml, self._handle, self.key = nvml, handle, key
        self.max_supported_mhz: int | None = int(nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))

    def read(self) -> ClockReading:
        nvml = self._nvml
        return ClockReading(int(nvml.nvmlDeviceGetClockInfo(self._handle, nvml.NVML_CLOCK_SM)),
                            int(nvml.nvmlDeviceGetTemperature(self._handle, nvml.NVML_TEMPERATURE_GPU)))


class FakeClock:
    """A clock of given values, for tests and simulations: a sequence (each read takes the next, the last one
    repeats) or a callable returning MHz. Each instance has its own ``key`` unless given one, so the highest
    clock of one test's fake device does not leak into another's.

    >>> clock = FakeClock([1980, 1500])
    >>> [clock.read().sm_mhz for _ in range(3)]
    [1980, 1500, 1500]
    """

    _instances = itertools.count()

    def __init__(self, values: Sequence[float] | Callable[[], float], key: str | None = None,
                 max_supported_mhz: int | None = None) -> None:
        if callable(values):
            self._next: Callable[[], float] = values
        else:
            if not values:
                raise ValueError("FakeClock needs at least one value")
            remaining, last = iter(values), values[-1]
            self._next = lambda: next(remaining, last)
        self.key = key or f"fake-clock-{next(self._instances)}"
        self.max_supported_mhz = max_supported_mhz

    def read(self) -> ClockReading:
        return ClockReading(int(round(self._next())))


class SessionClocks:
    """The highest SM clock seen per device (by ``ClockSource.key``) in this process.

    Under pytest-xdist each worker keeps its own: a worker's first comparison on a GPU sets its reference.

    >>> session = SessionClocks()
    >>> session.observe("gpu", 1500), session.observe("gpu", 1980), session.observe("gpu", 1700)
    (1500, 1980, 1980)
    """

    def __init__(self) -> None:
        self._highest: dict[str, int] = {}

    def observe(self, key: str, sm_mhz: int) -> int:
        """Note a reading; return the highest clock of ``key`` so far."""
        self._highest[key] = max(sm_mhz, self._highest.get(key, sm_mhz))
        return self._highest[key]

    def highest(self, key: str) -> int | None:
        return self._highest.get(key)


SESSION = SessionClocks()  # this process's: comparisons of one session share it


def check_policy(policy: Any) -> str:
    """``policy`` if it is a throttle policy; ``ValueError`` naming the accepted ones otherwise.

    >>> check_policy("drop")
    Traceback (most recent call last):
    ...
    ValueError: throttle must be one of flag, discard, fail; got 'drop'
    """
    if policy not in POLICIES:
        raise ValueError(f"throttle must be one of {', '.join(POLICIES)}; got {policy!r}")
    return policy


def clock_for(timer: Any, is_cuda: bool) -> tuple[ClockSource | None, str]:
    """The clock a comparison timed by ``timer`` watches, or None and why there is none.

    A timer's own ``sm_clock`` comes first (simulated and test timers); a CUDA event timer's device is read
    through NVML; any other timer runs on the host, where there is no SM clock.

    >>> clock_for(object(), is_cuda=False)
    (None, 'not a CUDA comparison')
    """
    own = getattr(timer, "sm_clock", None)
    if own is not None:
        return own, ""
    if not is_cuda:
        return None, "not a CUDA comparison"
    try:
        return NvmlClock(timer.device, key=timer.lock_key), ""
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install pytest-kernelcheck[nvml])"
    except Exception as exc:  # NVML can be missing or refuse (containers, MIG): record, never fail a test
        return None, f"NVML unavailable: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class _Chunk:
    start: int  # first round of the chunk
    end: int  # one past its last round
    reading: ClockReading


class ClockMonitor:
    """The clock of one comparison: a reading after each chunk of rounds, judged against the session's highest.

    The engine calls :meth:`after_chunk` after each chunk (``rounds`` is the count of rounds taken so far),
    :meth:`at_look` at each look, and :meth:`kept_rounds` for the rounds the verdict may use. Without a source
    (a CPU comparison, NVML missing) it only reports why.

    >>> ClockMonitor(None, reason="not a CUDA comparison").summary()
    {'available': False, 'reason': 'not a CUDA comparison', 'throttled': False}
    """

    def __init__(self, source: ClockSource | None, *, reason: str = "", policy: str = "flag",
                 session: SessionClocks | None = None) -> None:
        self._source = source
        self._reason = reason if source is None else ""
        self.policy = check_policy(policy)
        self._session = SESSION if session is None else session
        self._chunks: list[_Chunk] = []
        self._at_looks: list[int] = []
        self.dropped = 0  # rounds left out of the last look (discard)

    @property
    def _key(self) -> str:
        return self._source.key if self._source is not None else ""

    @property
    def session_highest(self) -> int | None:
        return self._session.highest(self._key) if self._chunks else None

    @property
    def threshold_mhz(self) -> float | None:
        """Readings below this are throttled: ``THROTTLE_FRACTION`` of the session's highest clock."""
        highest = self.session_highest
        return None if highest is None else THROTTLE_FRACTION * highest

    def after_chunk(self, rounds: int) -> None:
        """Read the clock for the rounds taken since the last reading; with ``fail``, raise when throttled."""
        if self._source is None or self._reason:
            return
        start = self._chunks[-1].end if self._chunks else 0
        if rounds <= start:
            return
        try:
            reading = self._source.read()
        except Exception as exc:  # a failing query ends the watch, never the test
            self._reason = f"NVML query failed: {type(exc).__name__}: {exc}"
            return
        self._chunks.append(_Chunk(start, rounds, reading))
        self._session.observe(self._key, reading.sm_mhz)
        if self.policy == "fail" and self.throttled:
            raise ThrottledComparison(
                f"SM clock {self._lowest()} MHz during this comparison, more than "
                f"{(1 - THROTTLE_FRACTION) * 100:.0f}% below the session's highest {self.session_highest} MHz "
                f"(--kernel-ab-throttle fail): the GPU is throttling (power, temperature, or another process "
                f"on it); {self._rounds_below()} of {rounds} rounds so far ran below "
                f"{self.threshold_mhz:.0f} MHz"
            )

    def at_look(self) -> None:
        """Keep the clock the latest chunk ended with as this look's."""
        if self._chunks and not self._reason:
            self._at_looks.append(self._chunks[-1].reading.sm_mhz)

    def kept_rounds(self, rounds: int) -> list[int] | None:
        """Indices of the first ``rounds`` rounds the verdict may use; None: all of them (not ``discard``, or
        no readings). Judged against the session's highest clock now, so a round kept at one look can be dropped
        at a later one when a higher clock has been seen since."""
        if self.policy != "discard" or not self._chunks or self._reason:
            self.dropped = 0
            return None
        threshold = self.threshold_mhz
        kept = [i for chunk in self._chunks if chunk.reading.sm_mhz >= threshold
                for i in range(chunk.start, min(chunk.end, rounds))]
        kept.extend(range(self._chunks[-1].end, rounds))  # not read yet: nothing against them
        self.dropped = rounds - len(kept)
        return kept

    def nothing_left(self, rounds: int) -> ThrottledComparison:
        """The error of a ``discard`` comparison whose every round was taken while throttled."""
        return ThrottledComparison(
            f"every one of the {rounds} rounds ran with the SM clock more than "
            f"{(1 - THROTTLE_FRACTION) * 100:.0f}% below the session's highest {self.session_highest} MHz (as low "
            f"as {self._lowest()} MHz): --kernel-ab-throttle discard left no round to decide on; the GPU is "
            "throttling (power, temperature, or another process on it)"
        )

    def _lowest(self) -> int:
        return min(chunk.reading.sm_mhz for chunk in self._chunks)

    def _rounds_below(self) -> int:
        threshold = self.threshold_mhz
        return sum(c.end - c.start for c in self._chunks if threshold is not None and c.reading.sm_mhz < threshold)

    @property
    def throttled(self) -> bool:
        """Whether any reading of this comparison was below ``THROTTLE_FRACTION`` of the session's highest."""
        threshold = self.threshold_mhz
        return threshold is not None and not self._reason and self._lowest() < threshold

    def note(self, rounds: int) -> str | None:
        """What throttling did to this comparison, for its notes; None when it was not throttled."""
        if not self.throttled:
            return None
        clocks = (f"SM clock as low as {self._lowest()} MHz, more than {(1 - THROTTLE_FRACTION) * 100:.0f}% below "
                  f"the session's highest {self.session_highest} MHz")
        if self.policy == "discard":
            return (f"throttled: dropped {self.dropped} of {rounds} rounds taken with the {clocks}; the verdict "
                    f"uses the other {rounds - self.dropped} (--kernel-ab-throttle discard)")
        return (f"throttled: {self._rounds_below()} of {rounds} rounds ran with the {clocks}; they count in the "
                "verdict (--kernel-ab-throttle flag; discard drops them, fail fails the comparison)")

    def record(self) -> ClockRecord:
        """The typed summary the comparison's record carries."""
        if self._reason or not self._chunks:
            return ClockRecord(available=False, reason=self._reason or "no samples", throttled=False)
        readings = [chunk.reading for chunk in self._chunks]
        temperatures = [r.temperature_c for r in readings if r.temperature_c is not None]
        return ClockRecord(
            available=True, throttled=self.throttled, samples=len(readings),
            sm_start_mhz=readings[0].sm_mhz, sm_min_mhz=self._lowest(), sm_end_mhz=readings[-1].sm_mhz,
            sm_max_supported_mhz=self._source.max_supported_mhz if self._source is not None else None,
            session_highest_mhz=self.session_highest, at_looks_mhz=tuple(self._at_looks),
            temperature_start_c=temperatures[0] if temperatures else None,
            temperature_max_c=max(temperatures) if temperatures else None,
            temperature_end_c=temperatures[-1] if temperatures else None,
            policy=self.policy, rounds_below=self._rounds_below(), dropped_rounds=self.dropped,
        )

    def summary(self) -> dict[str, Any]:
        """:meth:`record` in its JSON form."""
        return self.record().to_json()
