"""Measurement modes of an A/B comparison: what one timed sample is, for each way a caller meets the code.

- ``throughput``: calls back to back (batched when short, as :mod:`.sampling` decides), timed by CUDA events on
  the GPU: steady-state device time, with the host's launch cost hidden behind the queue. What a long training
  step or a large batch sees. The default.
- ``latency``: one call from an idle device per sample (:class:`LatencyTimer`): synchronise, flush the L2 on CUDA,
  pause ``LATENCY_IDLE_S`` so the queue is empty, then time a single call on the host's wall clock from before the
  call to after ``torch.cuda.synchronize()`` (host launch cost and one synchronisation included); CUDA events
  around the call give its device time, and the difference is the host overhead per call. What small-batch
  inference, decoding and any host-bound loop see. On the CPU: one call after the same pause, wall clock.
- ``graph``: a CUDA graph of the calls replayed per sample: device time without any host launch cost, the best
  case of a captured model. Not capturable: the mode is reported unavailable with the reason, not an error; on
  the CPU it is unavailable.

Each mode gets its own paired, interleaved samples and its own verdict (:mod:`.comparison`). Verdicts that
disagree across modes (:func:`modes_disagree`) are flagged in every output.

>>> parse_modes("throughput, latency")
('throughput', 'latency')
>>> modes_disagree({"throughput": "win", "latency": "loss", "graph": "inconclusive"})
True
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..results.measured import modes_disagree as modes_disagree  # one rule for the engine and the report
from .simulated_timer import TimedCallError
from .timing import CpuTimer, CudaEventTimer, l2_flush_bytes

MODES = ("throughput", "latency", "graph")
# Throughput alone by default: it is the method every earlier saved run and gate used (so --kernel-ab-compare
# stays comparable), and each further mode spends its own budget; latency pays an idle pause per sample.
DEFAULT_MODES: tuple[str, ...] = ("throughput",)
# The pause before each latency sample: long enough for the queue to drain and the device to sit idle, short
# enough that a 2 s budget still holds hundreds of pairs.
LATENCY_IDLE_S = 1e-3
MODES_HELP = "measurement modes: a comma-separated list of throughput, latency, graph"


class ModeUnavailable(Exception):
    """A mode cannot measure this comparison (a CUDA graph on the CPU, a call that cannot be captured)."""


def parse_modes(value: Any, what: str = "modes") -> tuple[str, ...]:
    """The modes of ``value`` (a comma-separated string or an iterable of names), in order, each once.

    >>> parse_modes(["latency", "graph"])
    ('latency', 'graph')
    >>> parse_modes("speed")
    Traceback (most recent call last):
    ...
    ValueError: modes must name measurement modes among throughput, latency, graph; got 'speed'
    """
    names: Iterable[Any] = value.split(",") if isinstance(value, str) else value
    try:
        items = [str(name).strip() if isinstance(name, str) else name for name in names]
    except TypeError:
        raise ValueError(f"{what} must be a comma-separated string or a sequence of mode names among "
                         f"{', '.join(MODES)}; got {type(value).__name__}") from None
    if not items or any(item not in MODES for item in items) or len(set(items)) != len(items):
        raise ValueError(f"{what} must name measurement modes among {', '.join(MODES)}"
                         f"{' (each once)' if items and len(set(items)) != len(items) else ''}; got {value!r}")
    return tuple(items)


def timer_for_mode(timer: Any, mode: str) -> Any:
    """The timer a user gave for ``mode``: ``timer`` itself, or its entry when it maps mode names to timers
    (tests inject a simulated timer per mode); ``None`` (choose) when the mapping has no entry for the mode.

    >>> timer_for_mode({"latency": "cpu"}, "latency"), timer_for_mode({"latency": "cpu"}, "graph")
    ('cpu', None)
    """
    if isinstance(timer, Mapping):
        unknown = [key for key in timer if key not in MODES]
        if unknown:
            raise ValueError(f"timer= as a mapping must map mode names ({', '.join(MODES)}) to timers; got keys "
                             f"{unknown!r}")
        return timer.get(mode)
    return timer


class LatencyTimer:
    """One call from an idle device per element: the ``latency`` mode's timer, around a resolved base timer.

    On CUDA (the base a :class:`CudaEventTimer`): write the L2 flush buffer, synchronise, sleep ``idle_s``, then
    time one call on ``time.perf_counter`` from before it to after ``torch.cuda.synchronize()``, with CUDA events
    around it for its device time (:meth:`device_seconds_of`). On the CPU: sleep ``idle_s``, time one call.
    ``repeat`` calls each get their own pause; the sample is their sum.

    >>> timer = LatencyTimer(CpuTimer(), idle_s=0.0)
    >>> timer.time_calls([lambda: sum(range(100))], repeat=1)[0] > 0
    True
    """

    def __init__(self, base: Any, idle_s: float = LATENCY_IDLE_S) -> None:
        self.base = base
        self.idle_s = idle_s
        self.is_cuda = isinstance(base, CudaEventTimer)
        self.name = "latency-from-idle"
        self.hold_gpu = False  # read by the sampling engine of every CUDA timer
        self.lock_key = base.lock_key
        self.resolution_s = CpuTimer.resolution_s  # the host's wall clock decides
        self._device_s: dict[int, list[float]] = {}
        self._flush = None
        if self.is_cuda:
            import torch

            self._torch = torch
            self.device, self.device_name = base.device, base.device_name
            flush = getattr(base, "_flush_buffer", None)
            self._flush = flush if flush is not None else torch.empty(
                l2_flush_bytes(getattr(torch.cuda.get_device_properties(base.device), "L2_cache_size", None)) // 4,
                dtype=torch.int32, device=base.device)
        self.note = (
            f"latency: one call per sample after a {idle_s * 1e3:g} ms idle pause"
            + (", L2 flushed before it; time = host wall clock from before the call to after "
               "torch.cuda.synchronize() (launch cost and one synchronisation included), CUDA events give the "
               "call's device time" if self.is_cuda else "; wall clock (no device clock on the CPU)")
        )

    def time_calls(self, fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]:
        durations = []
        for index, fn in enumerate(fns):
            total = 0.0
            for _ in range(repeat):
                try:
                    total += self._one_call(fn)
                except Exception as exc:
                    raise TimedCallError(index, exc) from exc
            durations.append(total)
        return durations

    def _one_call(self, fn: Callable[[], Any]) -> float:
        if not self.is_cuda:
            time.sleep(self.idle_s)
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        torch = self._torch
        with torch.cuda.device(self.device):
            self._flush.zero_()
            torch.cuda.synchronize(self.device)
            time.sleep(self.idle_s)
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start = time.perf_counter()
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize(self.device)
            wall = time.perf_counter() - start
        self._device_s.setdefault(id(fn), []).append(begin.elapsed_time(end) * 1e-3)
        return wall

    def device_seconds_of(self, fn: Callable[[], Any]) -> list[float]:
        """Device seconds (CUDA events) of each timed call of ``fn``; empty on the CPU."""
        return list(self._device_s.get(id(fn), ()))

    def now(self) -> float:
        return time.perf_counter()


def latency_timer(timer: Any) -> Any:
    """The latency mode's timer around a resolved ``timer``: a :class:`LatencyTimer` for the plugin's own timers,
    the timer itself when it is the user's (an injected timer stands for whichever mode it was given for)."""
    if isinstance(timer, (CpuTimer, CudaEventTimer)):
        return LatencyTimer(timer)
    return timer


def graph_unavailable(timer: Any) -> str | None:
    """Why the graph mode cannot run with ``timer`` (None: it can): a CUDA graph needs CUDA events on a GPU."""
    if isinstance(timer, CpuTimer):
        return ("not available on the CPU: CUDA graphs need a CUDA device (this comparison runs on the host's "
                "wall clock)")
    return None
