"""Timing engine for A/B comparisons: timers, warm-up, interleaved sampling and CUDA graphs.

A timer times a sequence of zero-argument callables back to back and returns one duration per element. Rounds
(pairs, for two variants) run every variant once in a fresh random order, so drift, throttling and cache state
hit all variants alike and the per-round ratios cancel them.

Timers:

- :class:`CpuTimer` (``time.perf_counter_ns``) for functions that run on the host.
- :class:`CudaEventTimer`: CUDA events around each element, the whole sequence queued before one synchronisation,
  so the GPU runs the calls back to back. When a call's GPU work outlasts its launches the events measure device
  time; a host-bound call shows its launch gaps, more or fewer depending on the backlog the call before it left.
  With ``hold_gpu`` a spin kernel holds the GPU while the host queues each element (the blocking-kernel method
  of NVIDIA's nvbench), so every element runs from a full queue and its events measure device time alone; each
  hold lasts a margin over that element's own last host time, and elements the hold did not cover are counted. An optional L2
  flush (a write of twice the device's L2, at least 64 MiB: :func:`l2_flush_bytes`) runs before each element,
  outside its events.
- :class:`SimulatedTimer`: draws durations from given models on a virtual clock; it lets tests check the
  statistics against known truths (A/A, known slowdowns, drift) quickly and reproducibly.

Whether an output stayed the same across the timed calls is :mod:`pytest_kernelcheck.speed.outputs`' job; the SM clock
during sampling is :mod:`pytest_kernelcheck.speed.clocks`', and work that escapes the timed stream
:mod:`pytest_kernelcheck.speed.escape`'s.
"""
from __future__ import annotations

import inspect
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from .clocks import ClockMonitor  # noqa: F401  (importable from here, where it lived before clocks.py)
from .gpu_lock import cuda_lock_key
from .outputs import brief_value
from .simulated_timer import (
    DurationModel as DurationModel,  # re-exported with the timer
)
from .simulated_timer import (
    SimulatedTimer as SimulatedTimer,  # re-exported: where tests have found it
)
from .simulated_timer import TimedCallError

# Below this median single-call time a sample batches several calls (or replays a CUDA graph): launch overhead
# and timer resolution would otherwise dominate (an 8 us kernel timed alone varies by ~16% on an H200).
BATCH_THRESHOLD_S = 50e-6
# A batched sample aims at this duration; 20 calls of an 8 us kernel halved the noise on an H200.
BATCH_TARGET_S = 200e-6
MAX_CALLS_PER_SAMPLE = 1000
# The L2 flush writes L2_FLUSH_FACTOR times the device's L2 (a write of the L2's size alone can leave lines of
# the timed kernel's data resident, as L2 replacement is not strict LRU), at least L2_FLUSH_MIN_BYTES; when the
# device does not report its L2, the 256 MiB that triton.testing.do_bench writes.
L2_FLUSH_FACTOR = 2
L2_FLUSH_MIN_BYTES = 64 * 1024 * 1024
L2_FLUSH_BYTES = 256 * 1024 * 1024
# hold_gpu: the spin kernel before an element lasts HOLD_MARGIN times that element's last host time (the time to
# queue its calls), within these bounds.
HOLD_MARGIN = 2.0
HOLD_MIN_S = 200e-6
HOLD_MAX_S = 2.0  # a host-bound callable batched 100 times can take a few hundred ms to queue


def l2_flush_bytes(l2_cache_bytes: int | None) -> int:
    """Bytes the L2 flush writes for a device with ``l2_cache_bytes`` of L2 (None or 0: not reported).

    >>> l2_flush_bytes(60 * 2**20) // 2**20, l2_flush_bytes(4 * 2**20) // 2**20, l2_flush_bytes(None) // 2**20
    (120, 64, 256)
    """
    if not l2_cache_bytes or l2_cache_bytes <= 0:
        return L2_FLUSH_BYTES
    return max(L2_FLUSH_MIN_BYTES, L2_FLUSH_FACTOR * int(l2_cache_bytes))


class CallableFailed(Exception):
    """A compared callable raised; the message names the side (candidate, baseline or variant name)."""

    def __init__(self, side: str, error: BaseException, during: str) -> None:
        super().__init__(f"{side} raised {type(error).__name__} during {during}: {error}")
        self.side = side
        self.error = error


class Timer(Protocol):
    """What the A/B engine needs from a timer.

    ``time_calls(fns, repeat)`` runs each callable of ``fns`` ``repeat`` times back to back, in order, and returns
    the seconds each element took (all ``repeat`` calls). When ``fns[i]`` raises it raises
    ``TimedCallError(i, exc)``. ``now()`` is the clock that time budgets are counted on.
    """

    name: str
    lock_key: str

    def time_calls(self, fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]: ...

    def now(self) -> float: ...


class CpuTimer:
    """Wall-clock timer for host functions (``time.perf_counter_ns``).

    >>> CpuTimer().time_calls([lambda: sum(range(100))], repeat=3)[0] > 0
    True
    """

    name = "cpu-clock"
    # One lock for the host: two pytest-xdist workers timing at once would share (and disturb) the same cores.
    lock_key = "cpu"
    resolution_s = time.get_clock_info("perf_counter").resolution  # see timer_resolution

    def time_calls(self, fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]:
        clock = time.perf_counter_ns
        durations = []
        for index, fn in enumerate(fns):
            try:
                start = clock()
                for _ in range(repeat):
                    fn()
                end = clock()
            except Exception as exc:
                raise TimedCallError(index, exc) from exc
            durations.append((end - start) * 1e-9)
        return durations

    def now(self) -> float:
        return time.perf_counter()


class CudaEventTimer:
    """CUDA-event timer on one device; work must be queued on the current stream.

    ``hold_gpu``: queue each element behind a spin kernel long enough for the host to queue all of that element's
    calls, so its events time device work alone (see the module docstring). The spin runs before the start event
    and stays out of the measurement.

    >>> timer = CudaEventTimer("cuda:0", flush_l2=True, hold_gpu=True)  # doctest: +SKIP
    >>> timer.time_calls([lambda: a @ b], repeat=1)  # doctest: +SKIP
    [0.000412]
    """

    def __init__(self, device: Any = None, flush_l2: bool = False, flush_bytes: int | None = None,
                 hold_gpu: bool = False) -> None:
        import torch

        from .timer_resolution import CUDA_EVENT_RESOLUTION_S

        self._torch = torch
        self.resolution_s = CUDA_EVENT_RESOLUTION_S
        self.name = "events-held" if hold_gpu else "events"
        self.hold_gpu = hold_gpu
        self.holds = self.short_holds = 0
        # Host seconds to queue one call of each callable (keyed by identity; the callables of one comparison
        # live as long as its timer): the next hold before that callable is sized from it.
        self._host_s_per_call: dict[int, float] = {}
        self._spin_cycles_per_s = 0.0
        self.device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        properties = torch.cuda.get_device_properties(self.device)
        uuid = getattr(properties, "uuid", None)
        # The lock must follow the physical GPU: with CUDA_VISIBLE_DEVICES, index 0 differs between processes.
        self.lock_key = cuda_lock_key(str(uuid) if uuid else None, self.device.index)
        self.device_name = properties.name
        l2_bytes = getattr(properties, "L2_cache_size", None)
        self.flush_bytes = l2_flush_bytes(l2_bytes) if flush_bytes is None else int(flush_bytes)
        self.flush_note = (
            f"L2 flush: {self.flush_bytes // 2**20} MiB written before each sample"
            + (f" ({L2_FLUSH_FACTOR}x the {l2_bytes // 2**20} MiB L2, at least {L2_FLUSH_MIN_BYTES // 2**20} MiB)"
               if flush_bytes is None and l2_bytes else "")
        ) if flush_l2 else None
        self._flush_buffer = (
            torch.empty(self.flush_bytes // 4, dtype=torch.int32, device=self.device) if flush_l2 else None
        )

    def time_calls(self, fns: Sequence[Callable[[], Any]], repeat: int) -> list[float]:
        torch = self._torch
        starts = [torch.cuda.Event(enable_timing=True) for _ in fns]
        ends = [torch.cuda.Event(enable_timing=True) for _ in fns]
        with torch.cuda.device(self.device):
            for index, fn in enumerate(fns):
                if self._flush_buffer is not None:
                    self._flush_buffer.zero_()
                hold_s = self._hold(fn, repeat) if self.hold_gpu else 0.0
                host_start = time.perf_counter()
                try:
                    starts[index].record()
                    for _ in range(repeat):
                        fn()
                    ends[index].record()
                except Exception as exc:
                    raise TimedCallError(index, exc) from exc
                if self.hold_gpu:
                    self._account_hold(fn, repeat, hold_s, time.perf_counter() - host_start)
            # One synchronisation per sequence: the host queues ahead, so the device never waits between calls.
            torch.cuda.synchronize(self.device)
        return [start.elapsed_time(end) * 1e-3 for start, end in zip(starts, ends)]

    def hold_for(self, fn: Callable[[], Any], repeat: int) -> float:
        """Seconds of spin to queue before ``repeat`` calls of ``fn``: a margin over their last host time."""
        per_call = self._host_s_per_call.get(id(fn))
        if per_call is None:
            # Not seen yet: as long as the slowest callable seen, so a new partner is not left uncovered.
            per_call = max(self._host_s_per_call.values(), default=HOLD_MIN_S / HOLD_MARGIN)
        return min(HOLD_MAX_S, max(HOLD_MIN_S, HOLD_MARGIN * per_call * repeat))

    def _hold(self, fn: Callable[[], Any], repeat: int) -> float:
        """Queue the spin kernel for ``fn``'s hold; returns the hold in seconds."""
        if not self._spin_cycles_per_s:
            self._spin_cycles_per_s = self._calibrate_spin()
        hold_s = self.hold_for(fn, repeat)
        self._torch.cuda._sleep(max(1, int(hold_s * self._spin_cycles_per_s)))
        return hold_s

    def _account_hold(self, fn: Callable[[], Any], repeat: int, hold_s: float, host_s: float) -> None:
        """Count a hold that ended before the host finished queueing; remember this host time for the next."""
        self.holds += 1
        if host_s > hold_s:
            self.short_holds += 1
        self._host_s_per_call[id(fn)] = host_s / repeat

    def _calibrate_spin(self) -> float:
        """Spin-kernel cycles per second on this device (the spin counts clock cycles, not time)."""
        torch = self._torch
        cycles = 10_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # first launch loads the kernel
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize(self.device)
        return cycles / (start.elapsed_time(end) * 1e-3)

    def now(self) -> float:
        return time.perf_counter()




def require_zero_arguments(fn: Any, side: str) -> None:
    """Raise ``TypeError`` unless ``fn`` can be called with no arguments.

    >>> require_zero_arguments(lambda x: x, "candidate")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: candidate must be callable with no arguments; it requires 'x' ...
    """
    if not callable(fn):
        hint = " (pass a callable such as lambda: f(x), not its result)" if hasattr(fn, "shape") else ""
        raise TypeError(f"{side} must be a callable taking no arguments, got {brief_value(fn)}{hint}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins have no signature; calling them will tell
        return
    required = [
        p.name
        for p in signature.parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if required:
        names = ", ".join(repr(n) for n in required)
        raise TypeError(
            f"{side} must be callable with no arguments; it requires {names} "
            f"(bind inputs first, e.g. functools.partial or a lambda)"
        )


def call_once(fn: Callable[[], Any], side: str, during: str) -> Any:
    """Call ``fn`` and name the side when it raises."""
    try:
        return fn()
    except Exception as exc:
        raise CallableFailed(side, exc, during) from exc


@dataclass
class RoundSamples:
    """Per-call seconds of each variant, one entry per round, and the order each round ran in."""

    times: list[list[float]]
    orders: list[tuple[int, ...]] = field(default_factory=list)

    @classmethod
    def empty(cls, n_variants: int) -> "RoundSamples":
        return cls(times=[[] for _ in range(n_variants)])

    @property
    def n_rounds(self) -> int:
        return len(self.orders)

    def select(self, rounds: Sequence[int]) -> "RoundSamples":
        """These samples with only the given rounds (indices, in order), e.g. those a throttled clock left.

        >>> RoundSamples([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], [(0, 1), (1, 0), (0, 1)]).select([0, 2]).times
        [[1.0, 3.0], [4.0, 6.0]]
        """
        return RoundSamples([[times[i] for i in rounds] for times in self.times], [self.orders[i] for i in rounds])


def checked_durations(timer: Any, durations: Any, sides: Sequence[str]) -> list[float]:
    """``durations``, as ``timer.time_calls`` returned them for callables of ``sides`` (one side per call, in
    order), after checking that there is one per call and each is a finite, non-negative number of seconds.

    A timer of the user's own (any object with ``time_calls`` and ``now``) could return NaN, an infinity or a
    negative duration; a NaN sorts past every number, so a median over it would still read as a time, and a
    comparison made of such samples would have no meaning. A zero duration passes here: the A/B engine refuses it
    with its own advice (raise calls_per_sample).

    >>> checked_durations(CpuTimer(), [0.002, 0.0], ["candidate", "baseline"])
    [0.002, 0.0]
    >>> checked_durations(CpuTimer(), [float("nan")], ["baseline"])
    Traceback (most recent call last):
    ...
    ValueError: timer 'cpu-clock' returned nan seconds for a call of baseline: a duration must be a finite number of seconds, 0 or more
    """
    name = getattr(timer, "name", type(timer).__name__)
    try:
        values = [float(d) for d in durations]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"timer {name!r} returned {durations!r} from time_calls: expected a list of seconds, one "
                         f"per call") from exc
    if len(values) != len(sides):
        raise ValueError(f"timer {name!r} returned {len(values)} durations for {len(sides)} calls: time_calls must "
                         f"return one per call")
    for value, side in zip(values, sides):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"timer {name!r} returned {value} seconds for a call of {side}: a duration must be a "
                             f"finite number of seconds, 0 or more")
    return values


def sample_rounds(
    timer: Timer,
    fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    n_rounds: int,
    repeat: int,
    rng: random.Random,
    into: RoundSamples,
    calls_per_sample: int | None = None,
) -> None:
    """Run ``n_rounds`` rounds, each timing every callable once in a fresh random order, and append to ``into``.

    Each sample runs its callable ``repeat`` times; stored times are per call, dividing by ``calls_per_sample``
    (default ``repeat``; a CUDA graph replay runs once but holds several calls).

    >>> samples = RoundSamples.empty(2)
    >>> sample_rounds(CpuTimer(), [int, float], ["candidate", "baseline"], 5, 1, random.Random(0), samples)
    >>> samples.n_rounds, len(samples.times[1])
    (5, 5)
    """
    indices = list(range(len(fns)))
    orders = []
    sequence = []
    for _ in range(n_rounds):
        order = indices[:]
        rng.shuffle(order)
        orders.append(tuple(order))
        sequence.extend(order)
    try:
        durations = timer.time_calls([fns[i] for i in sequence], repeat)
    except TimedCallError as exc:
        raise CallableFailed(sides[sequence[exc.index]], exc.error, "timing") from exc.error
    durations = checked_durations(timer, durations, [sides[i] for i in sequence])
    divisor = calls_per_sample or repeat
    for position, variant in enumerate(sequence):
        into.times[variant].append(durations[position] / divisor)
    into.orders.extend(orders)


def warm_up(
    timer: Timer,
    fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    seconds: float,
    min_rounds: int = 3,
    max_rounds: int = 10_000,
) -> list[list[float]]:
    """Run rounds of single calls until ``seconds`` have passed (at least ``min_rounds``); return their times.

    Compilation and autotuning happen on the first calls and stay out of the samples; the later warm-up times
    serve to calibrate how many calls a sample needs.
    """
    samples = RoundSamples.empty(len(fns))
    start = timer.now()
    rng = random.Random(0)
    while samples.n_rounds < min_rounds or (timer.now() - start < seconds and samples.n_rounds < max_rounds):
        sample_rounds(timer, fns, sides, 1, 1, rng, samples)
    return samples.times


def choose_calls_per_sample(single_call_s: float) -> int:
    """Calls per sample so that a sample lasts about ``BATCH_TARGET_S`` when one call is under the threshold.

    >>> choose_calls_per_sample(1e-3), choose_calls_per_sample(8e-6)
    (1, 25)
    """
    if single_call_s >= BATCH_THRESHOLD_S:
        return 1
    if single_call_s <= 0:
        return MAX_CALLS_PER_SAMPLE
    return max(1, min(MAX_CALLS_PER_SAMPLE, math.ceil(BATCH_TARGET_S / single_call_s - 1e-9)))


def calibrated_single_call(warmup_times: Sequence[Sequence[float]]) -> float:
    """Median single-call time of the fastest variant over the second half of the warm-up."""
    medians = []
    for times in warmup_times:
        tail = list(times[len(times) // 2 :]) or list(times)
        medians.append(statistics.median(tail))
    return min(medians)


def capture_cuda_graph(fn: Callable[[], Any], calls: int) -> Callable[[], Any]:
    """Capture ``calls`` calls of ``fn`` into a CUDA graph and return its replay; raises if capture fails.

    Replay removes host launch overhead entirely: it measures device time of the captured kernels, not what an
    eager caller pays.
    """
    import torch

    side_stream = torch.cuda.Stream()
    side_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side_stream):  # capture needs a warm-up on a side stream (allocator, lazy init)
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side_stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    torch.cuda.synchronize()
    return graph.replay


class torch_threads:  # noqa: N801  (used as a context manager, like contextlib's)
    """Set ``torch.set_num_threads(n)`` inside the block and restore the previous count after; None: no change.

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with torch_threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
    """

    def __init__(self, n: int | None) -> None:
        self._n = n
        self._before: int | None = None

    def __enter__(self) -> "torch_threads":
        if self._n is not None:
            import torch

            self._before = torch.get_num_threads()
            torch.set_num_threads(self._n)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._before is not None:
            import torch

            torch.set_num_threads(self._before)
