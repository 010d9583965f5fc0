"""The sampling shared by every A/B run: pick the timer, warm up, batch, sample rounds in random order with
looks, watch the clock, and check that every output is unchanged afterwards."""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..results.records import (
    CeilingRecord,
)
from . import clocks, escape, modes, outputs, stats, throughput, timer_resolution, timing
from . import inputs as owned_inputs
from .budget import CHUNK_SECONDS, Budget
from .gpu_lock import device_lock

# Where a run gets this device's ceiling for a dtype (throughput.CeilingMeter.ceiling_for), if anywhere.
CeilingSource = Callable[[Any], "CeilingRecord | None"]



@dataclass
class Measurement:
    samples: timing.RoundSamples  # the rounds the verdict used (throttle="discard" drops some)
    method: str
    calls_per_sample: int
    clock: dict[str, Any]  # clocks.ClockMonitor.summary()
    throttled: bool  # the SM clock fell below 90% of the session's highest (clocks.ClockMonitor.throttled)
    elapsed_s: float
    stop_reason: str
    looks_done: int
    device: str
    notes: list[str]
    ceiling: CeilingRecord | None = None
    input_sets: int | None = None
    unresolved: str | None = None  # why the timer cannot resolve the samples (timer_resolution); None when it can
    device_ms: list[float | None] | None = None  # latency mode on CUDA: each side's median device time (events)


def ceiling_source(
    work_given: bool, dtype: str | None, ceilings: throughput.CeilingMeter | None
) -> CeilingSource | None:
    """Ask ``ceilings`` only when there is work to rate against it."""
    if not work_given or ceilings is None:
        return None
    return lambda timer: ceilings.ceiling_for(timer, dtype)


def _resolve_timer(timer: Any, first_outputs: Sequence[Any], budget: Budget) -> timing.Timer:
    if timer not in (None, "auto", "cpu", "cuda"):
        if not hasattr(timer, "time_calls") or not hasattr(timer, "now"):
            raise TypeError(
                f"timer must be 'auto', 'cpu', 'cuda' or an object with time_calls() and now(), got {timer!r}"
            )
        return timer
    if timer == "cpu":
        return timing.CpuTimer()
    torch = sys.modules.get("torch")
    if timer == "cuda":
        return timing.CudaEventTimer(None, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    # "auto": outputs on a GPU mean GPU work; outputs of None mean in-place work, on the GPU when there is one.
    for output in first_outputs:
        device = owned_inputs.cuda_device(output)
        if device is not None:
            return timing.CudaEventTimer(device, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    if all(o is None for o in first_outputs) and torch is not None and torch.cuda.is_available():
        return timing.CudaEventTimer(None, flush_l2=budget.flush_l2, hold_gpu=budget.hold_gpu)
    return timing.CpuTimer()


def measure_rounds(
    fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    budget: Budget,
    timer: Any,
    on_look: Callable[[timing.RoundSamples], bool],
    ceiling: CeilingSource | None = None,
    make_inputs: Any = None,
    mode: str = "throughput",
    check_first: Callable[[Sequence[Any]], None] | None = None,
) -> Measurement:
    """Everything between "these callables" and "these samples": the shared engine of compare, tournament and
    measure. ``ceiling`` is asked for this device's ceiling inside the device lock, after sampling.

    With ``make_inputs`` the callables take the inputs: each timed call runs on the next of several input sets
    (:mod:`.inputs`), and the first call and the same-output check after timing run on the first set.

    Before sampling, a CUDA comparison checks that the events see the callables' work (:mod:`.escape`); during
    sampling the SM clock is read after each chunk of rounds and ``budget.throttle`` applies (:mod:`.clocks`).

    ``mode`` (:mod:`.modes`): ``throughput`` as above; ``latency`` times one call from an idle device per sample;
    ``graph`` replays a CUDA graph of the calls and raises :class:`.modes.ModeUnavailable` where that cannot be.
    ``check_first`` gets the first outputs (one per side) before anything is timed."""
    owned = None
    if make_inputs is not None:
        owned = owned_inputs.build_input_sets(make_inputs)
        pinned = [owned.pinned(fn) for fn in fns]
        fns = owned_inputs.bind_all(owned, fns, sides)
    for fn, side in zip(fns, sides):
        timing.require_zero_arguments(fn, side)
    pinned = pinned if owned is not None else list(fns)
    first_outputs = [outputs.snapshot(timing.call_once(fn, side, "its first call")) for fn, side in zip(pinned, sides)]
    for output, side in zip(first_outputs, sides):
        # Whatever check_output says: the time of a lazy output is the time of making it, never of its work.
        lazy = outputs.lazy_output(output)
        if lazy:
            raise outputs.LazyOutput(
                f"{side} returned {lazy} which does its work only when consumed or awaited, so timing it would time "
                "making it; return the results instead (list(...), a tensor, asyncio.run(...) inside the callable)"
            )
    if budget.check_output:
        for output, side in zip(first_outputs, sides):
            # Compared with itself, only NaN can differ; a type the check cannot compare is refused here, before
            # any time is spent, rather than reported as a change after timing.
            problem = _output_difference(output, output, side)
            if problem:
                raise ValueError(f"{side} {problem}")
    if check_first is not None:
        check_first(first_outputs)
    timer = _resolve_timer(timer, first_outputs, budget)
    is_cuda = isinstance(timer, timing.CudaEventTimer)
    notes: list[str] = [owned.note] if owned is not None else []
    if mode == "graph" and modes.graph_unavailable(timer):
        raise modes.ModeUnavailable(modes.graph_unavailable(timer))
    if mode == "latency":
        timer = modes.latency_timer(timer)
        budget = budget.replace(calls_per_sample=1, use_cuda_graph=False, hold_gpu=False)
        notes.append(getattr(timer, "note", "latency: one call per sample, timed by the given timer"))
    elif mode == "graph":
        budget = budget.replace(use_cuda_graph=True)
    if budget.flush_l2 and not is_cuda:
        notes.append("flush_l2 ignored: it applies to CUDA event timing only")
    if budget.hold_gpu and not is_cuda:
        notes.append("hold_gpu ignored: it applies to CUDA event timing only")
    if budget.flush_l2 and is_cuda and mode != "latency" and getattr(timer, "flush_note", None):
        notes.append(timer.flush_note)
    with device_lock(timer.lock_key) as locked:
        if not locked:
            notes.append("ran without a device lock (no fcntl on this platform)")
        warm = timing.warm_up(timer, fns, sides, budget.warmup)
        if is_cuda and timer.hold_gpu:
            timer.holds = timer.short_holds = 0  # the hold adapts during warm-up; count sampling rounds only
        if budget.calls_per_sample == "auto":
            single = timing.calibrated_single_call(warm)
            calls = timer_resolution.calls_for(timer, single, timing.choose_calls_per_sample(single),
                                               timing.MAX_CALLS_PER_SAMPLE)
        else:
            calls = int(budget.calls_per_sample)
        timed_fns, repeat, method = _timed_callables(timer, fns, calls, budget, notes, strict=mode == "graph")
        probe = escape.probe_for(timer) if budget.check_escape and mode != "latency" else None
        if probe is not None:  # before sampling: a comparison the events cannot see fails before it spends its budget
            escape.check_escaping_work(probe, timed_fns, sides, repeat)
        source, no_clock = clocks.clock_for(timer, is_cuda)
        monitor = clocks.ClockMonitor(source, reason=no_clock, policy=budget.throttle)
        start = timer.now()
        taken, samples, looks_done, stop_reason = _sample_with_looks(
            timer, timed_fns, sides, repeat, calls, warm, budget, on_look, monitor
        )
        elapsed = timer.now() - start
        throttle_note = monitor.note(taken)
        if throttle_note:
            notes.append(throttle_note)
        # Per sample as the timer read it: per-call times times the calls a sample held (one graph replay of them).
        unresolved = timer_resolution.unresolved(timer, [[t * calls for t in times] for times in samples.times])
        if not is_cuda:  # on a GPU the spread is the clock's and the throttling flag's business
            notes.extend(n for n in (stats.spread_note(times, side) for times, side in zip(samples.times, sides)) if n)
        if is_cuda and timer.hold_gpu and timer.short_holds:
            notes.append(f"the GPU hold ended before the host had queued the round in {timer.short_holds} of "
                         f"{timer.holds} sequences: those samples may include launch gaps")
        if budget.check_output:
            for fn, side, first in zip(pinned, sides, first_outputs):
                again = timing.call_once(fn, side, "the output check after timing")
                difference = _output_difference(first, again, side)
                if difference:
                    raise outputs.OutputChanged(
                        f"{side} output is not the same after timing as on its first call: {difference}. "
                        "Callables must return the same result on every call (pass check_output=False for "
                        "kernels that are nondeterministic by design, e.g. atomics)"
                    )
        # The device's ceiling is measured by its own timer: the latency mode's wraps it (modes.LatencyTimer.base).
        found_ceiling = ceiling(getattr(timer, "base", timer)) if ceiling is not None else None
    device = f"{timer.device} ({timer.device_name})" if is_cuda else timer.name
    device_ms = _device_medians(timer, timed_fns)
    return Measurement(
        samples, method, calls, monitor.summary(), monitor.throttled, elapsed, stop_reason, looks_done, device, notes,
        found_ceiling, len(owned) if owned is not None else None, unresolved, device_ms,
    )


def _device_medians(timer: Any, timed_fns: Sequence[Callable[[], Any]]) -> list[float | None] | None:
    """Each side's median device milliseconds, where the timer reads device time beside its own (latency on CUDA)."""
    import statistics

    read = getattr(timer, "device_seconds_of", None)
    if read is None:
        return None
    medians = [statistics.median(seconds) * 1e3 if seconds else None for seconds in (read(fn) for fn in timed_fns)]
    return medians if any(m is not None for m in medians) else None


def _output_difference(first: Any, again: Any, side: str) -> str | None:
    """``outputs.output_difference``, with the side and the way out in the message of an uncomparable output."""
    try:
        return outputs.output_difference(first, again)
    except outputs.OutputNotComparable as exc:
        raise outputs.OutputNotComparable(
            f"{side} {exc}; return such values, or pass check_output=False to skip the output check"
        ) from None


def _timed_callables(
    timer: Any, fns: Sequence[Callable[[], Any]], calls: int, budget: Budget, notes: list[str], strict: bool = False
) -> tuple[list[Callable[[], Any]], int, str]:
    """What one sample runs: the callables ``calls`` times each, or one replay of a CUDA graph of them.

    ``strict`` (the graph mode): a capture that fails raises :class:`.modes.ModeUnavailable` with the reason
    instead of falling back to batched calls, and a timer of the user's own stands for the replay."""
    method = timer.name if calls == 1 else f"{timer.name}-batched x{calls}"
    want_graph = budget.use_cuda_graph is True or (budget.use_cuda_graph == "auto" and calls > 1)
    if not want_graph:
        return list(fns), calls, method
    if not isinstance(timer, timing.CudaEventTimer):
        if strict:
            return list(fns), calls, f"graph ({timer.name})"
        notes.append("use_cuda_graph ignored: not a CUDA comparison")
        return list(fns), calls, method
    try:
        return [timing.capture_cuda_graph(fn, calls) for fn in fns], 1, f"cuda-graph x{calls}"
    except Exception as exc:  # capture is fragile (host syncs, allocations): batching still measures
        if strict:
            raise modes.ModeUnavailable(f"not capturable: {type(exc).__name__}: {exc}") from exc
        notes.append(f"CUDA graph capture failed ({type(exc).__name__}: {exc}); timed batched calls instead")
        return list(fns), calls, method


def _sample_with_looks(
    timer: Any,
    timed_fns: Sequence[Callable[[], Any]],
    sides: Sequence[str],
    repeat: int,
    calls: int,
    warm: Sequence[Sequence[float]],
    budget: Budget,
    on_look: Callable[[timing.RoundSamples], bool],
    monitor: clocks.ClockMonitor,
) -> tuple[int, timing.RoundSamples, int, str]:
    """Sample rounds in chunks, looking at the data at each scheduled count, until decided or out of budget.

    Returns the rounds taken, the samples the last look used, the looks and why sampling stopped. The clock is
    read after each chunk. The schedule counts the rounds the verdict may use: with ``throttle="discard"`` those
    not taken while throttled, so each look judges as many pairs as planned; the time budget counts every round.
    """
    rng = random.Random(budget.seed)
    samples = timing.RoundSamples.empty(len(timed_fns))
    usable = samples
    start = timer.now()
    looks_done, last_look = 0, 0
    for look_at in stats.look_schedule(budget.min_pairs, budget.max_pairs):
        out_of_time = False
        while usable.n_rounds < look_at:
            spent = timer.now() - start
            if spent >= budget.max_time and samples.n_rounds >= budget.min_pairs:
                out_of_time = True
                break
            round_s = _round_seconds(samples, warm, calls)
            chunk = max(1, min(look_at - usable.n_rounds, int(CHUNK_SECONDS / round_s) if round_s > 0 else 64))
            if samples.n_rounds >= budget.min_pairs and round_s > 0:
                chunk = max(1, min(chunk, int((budget.max_time - spent) / round_s) + 1))
            timing.sample_rounds(timer, timed_fns, sides, chunk, repeat, rng, samples, calls_per_sample=calls)
            monitor.after_chunk(samples.n_rounds)  # with throttle="fail", raises here
            kept = monitor.kept_rounds(samples.n_rounds)
            usable = samples if kept is None else samples.select(kept)
        if samples.n_rounds > last_look and usable.n_rounds:  # a look only when there is new data
            monitor.at_look()
            looks_done, last_look = looks_done + 1, samples.n_rounds
            if on_look(usable):
                return samples.n_rounds, usable, looks_done, "decided"
        if out_of_time:
            break
    if not usable.n_rounds:  # discard dropped every round: there is nothing to decide on
        raise monitor.nothing_left(samples.n_rounds)
    return samples.n_rounds, usable, looks_done, "max_time" if out_of_time else "max_pairs"


def _round_seconds(samples: timing.RoundSamples, warm: Sequence[Sequence[float]], calls: int) -> float:
    """Expected seconds per round, from the latest samples (or the warm-up before there are any)."""
    source = samples.times if samples.n_rounds else warm
    return sum(sorted(times[-16:])[len(times[-16:]) // 2] for times in source) * calls


def positive_times(times: Sequence[float], side: str) -> Any:
    import numpy as np

    values = np.asarray(times, dtype=float)
    if np.any(values <= 0):
        raise ValueError(
            f"the timer returned a zero duration for {side}: its calls are faster than the clock resolution; "
            "raise calls_per_sample"
        )
    return values


def log_ratios(numerator: Sequence[float], denominator: Sequence[float], sides: tuple[str, str]) -> Any:
    import numpy as np

    return np.log(positive_times(numerator, sides[0]) / positive_times(denominator, sides[1]))
