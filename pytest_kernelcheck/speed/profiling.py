"""Profile mode of ``kernel_ab``: run each compared callable once, after a warm-up, inside a named NVTX range (and,
with a trace folder, under ``torch.profiler``), time nothing and give no verdicts.

``--kernel-ab-profile`` is for an outside profiler: ``nsys profile ... pytest --kernel-ab --kernel-ab-profile``
sees one range per callable, ``kernelcheck:<test nodeid>:<comparison name>:<side>`` (side: ``candidate`` or
``baseline``, a tournament's variant name, ``measured`` for ``measure``), around exactly the kernels of that one
call; Nsight Compute's NVTX filter picks them out the same way. ``--kernel-ab-trace DIR`` writes a Chrome trace
(``torch.profiler``) of those calls per comparison into DIR. Either option swaps the fixture's object for
:class:`ProfilingKernelAB`, which has the methods of :class:`pytest_kernelcheck.speed.ab.KernelAB` and returns a
:class:`ProfiledRun` from each.

Example::

    >>> mode = ProfileMode(trace_dir=None)
    >>> ab = ProfilingKernelAB(mode, nodeid="t.py::test_add", test_name="test_add")
    >>> run = ab.compare(lambda: 1 + 1, lambda: 2, name="add")
    >>> run.ranges
    ('kernelcheck:t.py::test_add:add:candidate', 'kernelcheck:t.py::test_add:add:baseline')
"""
from __future__ import annotations

import hashlib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from ..visible_text import visible
from . import inputs as owned_inputs
from . import timing
from .ab import KernelAB
from .runs import tournament_variants
from .spec import ABSpec

__all__ = ["ProfileMode", "ProfiledRun", "ProfilingKernelAB", "range_name", "trace_file_name"]

RANGE_PREFIX = "kernelcheck"
# Compilation, autotuning and lazy allocations happen on the first calls; three keep them out of the profiled one
# (the same minimum as the timed warm-up in timing.warm_up).
WARMUP_CALLS = 3
# File names past this many characters are cut (a hash keeps them apart); most file systems allow 255 bytes.
_MAX_STEM = 150
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def range_name(nodeid: str, name: str, side: str) -> str:
    """The NVTX range of one profiled call.

    >>> range_name("tests/perf/test_a.py::test_fwd[S128]", "fwd triton vs sdpa", "candidate")
    'kernelcheck:tests/perf/test_a.py::test_fwd[S128]:fwd triton vs sdpa:candidate'
    """
    # Escaped (visible_text): NVTX takes UTF-8, which a lone surrogate cannot be, and nsys shows control characters raw.
    return f"{RANGE_PREFIX}:{visible(nodeid)}:{visible(name)}:{visible(side)}"


def trace_file_name(nodeid: str, name: str) -> str:
    """A file name for one comparison's trace: the test id and name with every run of characters other than
    letters, digits, ``.``, ``_`` and ``-`` made one ``_``, cut to a sane length, and a short hash of the raw pair,
    so two comparisons whose ids sanitize alike still get files of their own.

    >>> trace_file_name("tests/test_a.py::test_fwd[S128-causal]", "fwd vs sdpa")
    'tests_test_a.py_test_fwd_S128-causal_--fwd_vs_sdpa-3780ba09.json'
    """
    stem = f"{_UNSAFE.sub('_', nodeid)}--{_UNSAFE.sub('_', name)}"[:_MAX_STEM]
    # surrogatepass: a name holding a lone surrogate still has bytes to hash (plain UTF-8 refuses it).
    digest = hashlib.sha1(f"{nodeid}\0{name}".encode("utf-8", "surrogatepass")).hexdigest()[:8]
    return f"{stem}-{digest}.json"


@dataclass(frozen=True)
class ProfileMode:
    """What the session's profile run does: NVTX ranges always; a Chrome trace per comparison into ``trace_dir``.

    >>> ProfileMode(trace_dir=None).summary_lines([])[0]
    'kernelcheck: profile mode, 0 callables run inside NVTX ranges, nothing timed'
    """

    trace_dir: Path | None = None

    @classmethod
    def from_options(cls, profile: bool, trace_dir: str | None) -> "ProfileMode | None":
        """The mode the options ask for, or None for an ordinary timed run; creates the trace folder.

        >>> ProfileMode.from_options(False, None) is None, ProfileMode.from_options(True, None).trace_dir
        (True, None)

        Raises:
            OSError: the trace folder cannot be created.
        """
        if not profile and not trace_dir:
            return None
        folder = None
        if trace_dir:
            folder = Path(trace_dir).resolve()  # absolute: xdist workers and tests may change directory
            folder.mkdir(parents=True, exist_ok=True)
        return cls(folder)

    def summary_lines(self, entries: list[dict[str, Any]]) -> list[str]:
        """The terminal summary of a profile run, from every process's :meth:`ProfiledRun.to_json` entries.

        >>> entry = {"callables": 2, "nvtx": False, "trace": "/t/a.json", "nvtx_note": "no NVTX here"}
        >>> for line in ProfileMode(Path("/t")).summary_lines([entry]):
        ...     print(line)
        kernelcheck: profile mode, 2 callables run, nothing timed; NVTX ranges were not emitted (no NVTX here)
        kernelcheck: 1 torch.profiler trace in /t
        """
        callables = sum(int(entry.get("callables", 0)) for entry in entries)
        missing = [entry for entry in entries if not entry.get("nvtx", False)]
        if missing:
            note = missing[0].get("nvtx_note") or "NVTX unavailable"
            lines = [f"kernelcheck: profile mode, {callables} callables run, nothing timed; "
                     f"NVTX ranges were not emitted ({note})"]
        else:
            lines = [f"kernelcheck: profile mode, {callables} callables run inside NVTX ranges, nothing timed"]
        if self.trace_dir is not None:
            traces = sum(1 for entry in entries if entry.get("trace"))
            lines.append(f"kernelcheck: {traces} torch.profiler trace{'' if traces == 1 else 's'} in {self.trace_dir}")
        return lines


@dataclass
class ProfiledRun:
    """What a profiled ``compare``, ``tournament`` or ``measure`` did: the callables it ran and their ranges.

    Nothing was timed, so a profiled run has no verdict, speedup or ranking; a test that reads one is skipped at
    that point (its callables have run inside their ranges already), with a reason that says so.
    """

    name: str
    nodeid: str
    sides: tuple[str, ...]
    ranges: tuple[str, ...]
    nvtx: bool  # whether the ranges reached NVTX (False without a CUDA build of torch)
    nvtx_note: str = ""  # why not, when they did not
    trace: str | None = None  # the Chrome trace written for this run
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        """One line: what ran, where its ranges went, nothing timed.

        >>> ProfiledRun("add", "t.py::t", ("candidate", "baseline"), ("r1", "r2"), nvtx=True).describe()
        'add: profiled candidate, baseline once each after 3 warm-up calls inside NVTX ranges; nothing timed'
        """
        where = "inside NVTX ranges" if self.nvtx else f"(NVTX ranges not emitted: {self.nvtx_note})"
        text = f"{visible(self.name)}: profiled {', '.join(map(visible, self.sides))} once each after {WARMUP_CALLS} warm-up calls {where}"
        return text + (f"; trace {self.trace}" if self.trace else "") + "; nothing timed"

    def to_json(self) -> dict[str, Any]:
        """The entry that travels to the session's summary (xdist-safe: plain JSON values)."""
        return {"kind": "profile", "name": self.name, "nodeid": self.nodeid, "callables": len(self.sides),
                "nvtx": self.nvtx, "nvtx_note": self.nvtx_note, "trace": self.trace}

    def __getattr__(self, attribute: str) -> Any:
        # Only for attributes a profiled run lacks (verdict, speedup, best, median_ms, ...): the test was written
        # for a timed run, and neither passing nor failing it would be true here.
        if attribute.startswith("_"):
            raise AttributeError(attribute)
        import pytest

        reason = (f"kernel_ab profile mode (--kernel-ab-profile / --kernel-ab-trace): {self.name!r} was run, not "
                  f"timed, so it has no {attribute!r}")
        try:  # reported at the test's location, as pytest's skipif marker does
            skip = pytest.skip.Exception(reason, _use_item_location=True)
        except TypeError:  # pytest without the keyword: the location is this module's, the reason is intact
            skip = pytest.skip.Exception(reason)
        raise skip


class _Nvtx:
    """``torch.cuda.nvtx`` push and pop, or nothing where torch has no NVTX: CPU builds raise on a push ("NVTX
    functions not installed"), and from then on the calls run without ranges and the note says why."""

    def __init__(self) -> None:
        self.note = ""
        self._nvtx: Any = None
        try:
            import torch.cuda.nvtx as nvtx

            self._nvtx = nvtx
        except Exception as exc:  # noqa: BLE001 -- any failure means: run without ranges, and say why
            self.note = f"{type(exc).__name__}: {exc}"

    @property
    def emitted(self) -> bool:
        return self._nvtx is not None

    def push(self, name: str) -> bool:
        """Open the range; False when NVTX is unavailable (then there is nothing to pop)."""
        if self._nvtx is None:
            return False
        try:
            self._nvtx.range_push(name)
        except Exception as exc:  # noqa: BLE001
            self._nvtx, self.note = None, f"{type(exc).__name__}: {exc}"
            return False
        return True

    def pop(self) -> None:
        self._nvtx.range_pop()


def _synchronize() -> None:
    """Wait for queued GPU work, so a range's span holds its own kernels and none left over from the warm-up."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _bind(fns: Mapping[str, Callable[..., Any]], make_inputs: Any) -> dict[str, Callable[[], Any]]:
    """Zero-argument callables: as given, or each bound to one input set from ``make_inputs()``."""
    if make_inputs is None:
        for side, fn in fns.items():
            timing.require_zero_arguments(fn, side)
        return dict(fns)
    args, kwargs = owned_inputs.call_inputs(make_inputs)
    bound: dict[str, Callable[[], Any]] = {}
    for side, fn in fns.items():
        owned_inputs.require_accepts(fn, (args, kwargs), side)
        bound[side] = lambda fn=fn: fn(*args, **kwargs)
    return bound


def profile_callables(
    fns: Mapping[str, Callable[..., Any]],
    *,
    nodeid: str,
    name: str,
    trace_dir: Path | None = None,
    make_inputs: Any = None,
) -> ProfiledRun:
    """Warm up every callable, then run each once inside its NVTX range (all of them under ``torch.profiler``
    when ``trace_dir`` is given, exported as one Chrome trace); time nothing.

    >>> run = profile_callables({"candidate": lambda: 1, "baseline": lambda: 2}, nodeid="t.py::t", name="n")
    >>> run.sides, run.trace
    (('candidate', 'baseline'), None)
    """
    bound = _bind(fns, make_inputs)
    for side, fn in bound.items():
        for _ in range(WARMUP_CALLS):
            timing.call_once(fn, side, "its warm-up")
    _synchronize()
    nvtx = _Nvtx()
    ranges = tuple(range_name(nodeid, name, side) for side in bound)
    trace_path = trace_dir / trace_file_name(nodeid, name) if trace_dir is not None else None
    with _trace(trace_path) as record_function:
        for (side, fn), label in zip(bound.items(), ranges):
            with record_function(label):  # the same label in the Chrome trace as in the NVTX timeline
                pushed = nvtx.push(label)
                try:
                    timing.call_once(fn, side, "its profiled call")
                    _synchronize()
                finally:
                    if pushed:
                        nvtx.pop()
    return ProfiledRun(name, nodeid, tuple(bound), ranges, nvtx=nvtx.emitted, nvtx_note=nvtx.note,
                       trace=str(trace_path) if trace_path is not None else None)


class _trace:  # noqa: N801  (a context manager, like contextlib's)
    """``torch.profiler.profile`` over the block, exported to ``path`` on a clean exit; without a path, nothing.

    Entering gives a ``record_function``-like factory: torch's with a trace, a no-op context without one."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._profiler: Any = None

    def __enter__(self) -> Callable[[str], Any]:
        if self.path is None:
            import contextlib

            return lambda label: contextlib.nullcontext()
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()
        return record_function

    def __exit__(self, kind: Any, error: Any, traceback: Any) -> None:
        if self._profiler is None:
            return
        self._profiler.__exit__(kind, error, traceback)
        if kind is None and self.path is not None:
            self._profiler.export_chrome_trace(str(self.path))


class ProfilingKernelAB(KernelAB):
    """The ``kernel_ab`` fixture in profile mode: ``compare``, ``assert_faster``, ``assert_not_slower``,
    ``tournament`` and ``measure`` run their callables inside NVTX ranges (:func:`profile_callables`) instead of
    timing them, and return :class:`ProfiledRun`. Names follow the timed fixture's rule (unique per test), budget
    keywords are checked and otherwise ignored, ``flops``/``bytes``/``dtype``/``timer``/``check`` are ignored.

    >>> ab = ProfilingKernelAB(ProfileMode(), nodeid="t.py::t", test_name="t")
    >>> ab.tournament({"a": lambda: 1, "b": lambda: 2, "c": lambda: 3}).ranges[2]
    'kernelcheck:t.py::t:t:c'
    """

    def __init__(self, mode: ProfileMode, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode

    def _profile(self, fns: Mapping[str, Callable[..., Any]], name: str | None, keywords: dict[str, Any]
                 ) -> ProfiledRun:
        # A misspelt keyword, a bad inputs=, check= or modes= fails here as it would in a timed run.
        given = {k: v for k, v in keywords.items() if k not in ("spec", "mode")}
        spec = ABSpec.build(keywords["spec"], **given) if keywords.get("spec") is not None else self.spec(**given)
        inputs = spec.inputs.make
        label = self._name(name)
        self._claim(label)
        run = profile_callables(fns, nodeid=self._nodeid, name=label, trace_dir=self.mode.trace_dir,
                                make_inputs=inputs)
        self.results.append(run)  # type: ignore[arg-type]  # the timed results' list holds these in this mode
        self._record(run.to_json())
        return run

    def compare(self, candidate: Callable[..., Any], baseline: Callable[..., Any], *, name: str | None = None,
                **keywords: Any) -> Any:
        """Run ``candidate`` and ``baseline`` once each inside their ranges (see the class)."""
        return self._profile({"candidate": candidate, "baseline": baseline}, name, keywords)

    def assert_faster(self, candidate: Callable[..., Any], baseline: Callable[..., Any], *,
                      name: str | None = None, **budget: Any) -> Any:
        """As :meth:`compare`: there is no verdict to assert in profile mode."""
        return self.compare(candidate, baseline, name=name, **budget)

    def assert_not_slower(self, candidate: Callable[..., Any], baseline: Callable[..., Any], *,
                          name: str | None = None, **budget: Any) -> Any:
        """As :meth:`compare`: there is no verdict to assert in profile mode."""
        return self.compare(candidate, baseline, name=name, **budget)

    def tournament(self, variants: Mapping[str, Callable[..., Any]], *, name: str | None = None,
                   **keywords: Any) -> Any:
        """Run every variant once inside its range, named by the variant."""
        # The timed rules: names as text could collide ({1: f, "1": g}), and a dict of them would keep one silently.
        names, fns = tournament_variants(variants)
        return self._profile(dict(zip(names, fns)), name, keywords)

    def measure(self, fn: Callable[..., Any], *, name: str | None = None, **keywords: Any) -> Any:
        """Run ``fn`` once inside its range, side ``measured``."""
        return self._profile({"measured": fn}, name, keywords)
