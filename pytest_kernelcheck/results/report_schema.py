"""The JSON type of every field an A/B report holds, and the check that a report read back from a file keeps them.

A report read from disk (``--kernel-ab-compare``, a saved run, the history of saved runs) may have been edited
by hand or damaged. One field of another JSON type (``"gpu": {"index": "x"}``, ``"name": ["a"]``,
``"samples": "x"``, ``"environment": "x"``) once crashed the run that read it, or was read as something else
without a word (``"notes": "abc"`` as three notes). :func:`checked_report` walks the document against
:data:`REPORT` before anything reads it and raises :class:`pytest_kernelcheck.results.fields.DamagedReport` naming the
field and what is accepted; every reader of a report file goes through it (:func:`.report.load_report`).

Missing keys are accepted (earlier versions wrote fewer, and ``from_json`` gives each its default), and so are keys
this version does not know; a value's own range (a verdict's words, a speedup above 0) is checked where the typed
record is made (:mod:`.records`).

>>> checked_report({"schema": "pytest-kernelcheck/ab-report", "comparisons": [
...     {"name": "fused", "verdict": "win", "gpu": {"index": "x"}}]})
Traceback (most recent call last):
...
pytest_kernelcheck.results.fields.DamagedReport: comparisons[0] ('fused'): field 'gpu.index': 'x' is refused; accepted: \
a whole number, or null
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any, Mapping

from .records import SCHEMA, SCHEMA_VERSION, DamagedReport
from .report_record import ABReport


@dataclass(frozen=True)
class Scalar:
    """A JSON string, number, whole number or true/false; ``nullable``: null too."""

    kind: str  # "text", "number", "whole" or "bool"
    nullable: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if self.kind == "text":
            return isinstance(value, str)
        if self.kind == "bool":
            return isinstance(value, bool)
        if isinstance(value, bool):  # True is an int to Python, but no number a run writes
            return False
        if self.kind == "whole":
            return isinstance(value, int)
        if isinstance(value, int):  # compared exactly: an integer past float's range is no number a run writes
            return abs(value) <= sys.float_info.max
        return isinstance(value, float) and math.isfinite(value)

    @property
    def accepted(self) -> str:
        what = {"text": "a string", "number": "a finite number", "whole": "a whole number", "bool": "true or false"}
        return what[self.kind] + (", or null" if self.nullable else "")


@dataclass(frozen=True)
class ListOf:
    """A JSON array whose every item is ``item``."""

    item: Any
    nullable: bool = False


@dataclass(frozen=True)
class MapOf:
    """A JSON object whose every value is ``value`` (its keys are any strings)."""

    value: Any
    nullable: bool = False


@dataclass(frozen=True)
class Fields:
    """A JSON object with known keys; keys not named here are left alone."""

    fields: Mapping[str, Any]
    nullable: bool = False


def _required(spec: Any) -> Any:
    """``spec`` without null: an item of an array or a value of a map, which every reader takes for one."""
    return replace(spec, nullable=False)


ANY = None  # any JSON value: what the test gave (a shape), or pytest-benchmark's own entries

TEXT, TEXT_OR_NULL = Scalar("text"), Scalar("text", True)
NUMBER, NUMBER_OR_NULL = Scalar("number"), Scalar("number", True)
WHOLE, WHOLE_OR_NULL = Scalar("whole"), Scalar("whole", True)
BOOL = Scalar("bool")
SAMPLES = ListOf(NUMBER_OR_NULL, nullable=True)  # times as written: a non-finite one becomes null
INTERVAL = ListOf(NUMBER_OR_NULL, nullable=True)  # its ends and their order: records._interval_from_json

GPU = Fields({"index": WHOLE_OR_NULL, "name": TEXT_OR_NULL, "uuid": TEXT_OR_NULL}, nullable=True)
CEILING = Fields({"device": TEXT, "dtype": TEXT_OR_NULL, "tflops": NUMBER_OR_NULL, "gbps": NUMBER_OR_NULL,
                  "flops_method": TEXT_OR_NULL, "bandwidth_method": TEXT_OR_NULL, "reason": TEXT_OR_NULL},
                 nullable=True)
THROUGHPUT = Fields({name: NUMBER_OR_NULL for name in ("flops", "bytes", "tflops", "gbps", "tflops_pct", "gbps_pct")},
                    nullable=True)
CLOCK = Fields({
    "available": BOOL, "reason": TEXT_OR_NULL, "throttled": BOOL, "samples": WHOLE_OR_NULL,
    "sm_clock_mhz": Fields({**{key: NUMBER_OR_NULL for key in ("start", "min", "end", "max_supported",
                                                                "session_highest")},
                            "at_looks": ListOf(NUMBER_OR_NULL, nullable=True)}, nullable=True),
    "temperature_c": Fields({key: NUMBER_OR_NULL for key in ("start", "max", "end")}, nullable=True),
    "throttle": Fields({"policy": TEXT_OR_NULL, "rounds_below": WHOLE_OR_NULL, "dropped_rounds": WHOLE_OR_NULL},
                       nullable=True),
}, nullable=True)
# What every kind of row holds of how it was measured (records.RunDetails, written into the row itself).
RUN_DETAILS = {
    "method": TEXT_OR_NULL, "calls_per_sample": WHOLE_OR_NULL, "alpha": NUMBER_OR_NULL, "margin": NUMBER_OR_NULL,
    "ci_level": NUMBER_OR_NULL, "looks_planned": WHOLE_OR_NULL, "looks_done": WHOLE_OR_NULL,
    "stop_reason": TEXT_OR_NULL, "elapsed_s": NUMBER_OR_NULL, "device": TEXT_OR_NULL, "clock": CLOCK,
    "throttled": BOOL, "notes": ListOf(TEXT, nullable=True), "input_sets": WHOLE_OR_NULL, "gpu": GPU,
}
ROW = {"kind": TEXT, "name": TEXT, "nodeid": TEXT_OR_NULL, "shape": ANY, "error": TEXT_OR_NULL, **RUN_DETAILS}
LAST_RUN = Fields({"speedup": NUMBER_OR_NULL, "ci": INTERVAL, "verdict": TEXT_OR_NULL, "ratio": NUMBER_OR_NULL,
                   "regression": BOOL, "reason": TEXT_OR_NULL, "timing_change": TEXT_OR_NULL,
                   "baseline_change": TEXT_OR_NULL}, nullable=True)
MODE = Fields({
    "mode": TEXT, "verdict": TEXT_OR_NULL, "speedup": NUMBER_OR_NULL, "ci": INTERVAL, "p_value": NUMBER_OR_NULL,
    "p_value_raw": NUMBER_OR_NULL, "n_pairs": WHOLE_OR_NULL, "method": TEXT_OR_NULL, "unavailable": TEXT_OR_NULL,
    **{f"{side}{what}_ms": NUMBER_OR_NULL for side in ("candidate", "baseline") for what in ("", "_device", "_host")},
    "samples": Fields({"candidate_ms": SAMPLES, "baseline_ms": SAMPLES}, nullable=True),
})
COMPARISON = Fields({
    **ROW, "verdict": TEXT, "speedup": NUMBER_OR_NULL, "ci": INTERVAL, "p_value": NUMBER_OR_NULL,
    "p_value_raw": NUMBER_OR_NULL, "n_pairs": WHOLE, "candidate_ms": NUMBER_OR_NULL, "baseline_ms": NUMBER_OR_NULL,
    "flush_l2": BOOL, "p_bh": NUMBER_OR_NULL, "verdict_bh": TEXT_OR_NULL, "vs_last": LAST_RUN,
    "samples": Fields({"candidate_ms": SAMPLES, "baseline_ms": SAMPLES, "candidate_first": ListOf(BOOL, nullable=True)},
                      nullable=True),
    "throughput": Fields({"candidate": THROUGHPUT, "baseline": THROUGHPUT}, nullable=True), "ceiling": CEILING,
    "mode": TEXT_OR_NULL, "modes": ListOf(MODE, nullable=True), "modes_disagree": BOOL,
})
PAIR = Fields({"faster": TEXT, "slower": TEXT, "verdict": TEXT_OR_NULL, "speedup": NUMBER_OR_NULL, "ci": INTERVAL,
               "p_value": NUMBER_OR_NULL, "p_value_raw": NUMBER_OR_NULL})
TOURNAMENT = Fields({
    **ROW, "verdict": TEXT_OR_NULL, "ranking": ListOf(TEXT, nullable=True), "best": TEXT,
    "indistinguishable_from_best": ListOf(TEXT, nullable=True), "median_ms": MapOf(NUMBER_OR_NULL, nullable=True),
    "pairwise": ListOf(PAIR, nullable=True), "n_rounds": WHOLE,
    "samples": Fields({"ms": MapOf(_required(SAMPLES), nullable=True), "orders": ListOf(ListOf(TEXT), nullable=True)},
                      nullable=True),
    "throughput": MapOf(_required(THROUGHPUT), nullable=True), "ceiling": CEILING,
})
MEASUREMENT = Fields({
    **ROW, "median_ms": NUMBER_OR_NULL, "ci_ms": INTERVAL, "n_samples": WHOLE,
    "samples": Fields({"ms": SAMPLES}, nullable=True), "throughput": THROUGHPUT, "ceiling": CEILING,
})
SUMMARY = Fields({
    **{key: WHOLE for key in ("comparisons", "win", "loss", "tie", "inconclusive", "error", "bh_win", "bh_loss",
                              "throttled", "tournaments", "measurements", "modes_disagree")},
    "geomean_speedup": NUMBER_OR_NULL, "bh_alpha": NUMBER, "regressions": ListOf(TEXT, nullable=True),
}, nullable=True)
ENVIRONMENT = Fields({
    "date": TEXT_OR_NULL, "hostname": TEXT_OR_NULL, "python": TEXT_OR_NULL,
    "packages": MapOf(TEXT_OR_NULL, nullable=True),
    # pytest-benchmark's dicts, kept as it writes them: only what the machine's slug and the report read is typed.
    "machine_info": Fields({"machine": TEXT_OR_NULL}, nullable=True),
    "commit_info": Fields({"id": TEXT_OR_NULL}, nullable=True), "machine_info_error": TEXT_OR_NULL,
    "gpu": Fields({"available": BOOL, "devices": ListOf(TEXT, nullable=True), "cuda": TEXT_OR_NULL,
                   "driver": TEXT_OR_NULL, "cudnn": TEXT_OR_NULL}, nullable=True),
    "cpu_model": TEXT_OR_NULL, "cpu_threads": WHOLE_OR_NULL,
    "ceilings": Fields({"enabled": Scalar("bool", True), "measured": ListOf(_required(CEILING), nullable=True)},
                       nullable=True),
}, nullable=True)
REPORT = Fields({
    "created": TEXT_OR_NULL, "settings": MapOf(ANY, nullable=True), "environment": ENVIRONMENT, "summary": SUMMARY,
    "comparisons": ListOf(COMPARISON), "vanished": ListOf(COMPARISON, nullable=True),
    "tournaments": ListOf(TOURNAMENT, nullable=True),
    "measurements": ListOf(MEASUREMENT, nullable=True), "finished": BOOL,
    "machine_differences": ListOf(TEXT, nullable=True),
})
ROWS = ("comparisons", "tournaments", "measurements")


def checked_report(data: Any) -> ABReport:
    """The typed report of ``data``, a report read from a file: ``NotAReport`` unless it is one of ours,
    ``DamagedReport`` naming the field (and the row, ``comparisons[0] ('fused')``) whose JSON type no run writes."""
    is_ours = isinstance(data, Mapping) and data.get("schema") == SCHEMA and data.get("version", SCHEMA_VERSION) \
        == SCHEMA_VERSION and isinstance(data.get("comparisons"), list)
    if is_ours:  # otherwise ABReport.from_json says what the document is not (another schema, another version)
        for key, spec in REPORT.fields.items():
            if key not in data:
                continue
            if key in ROWS and isinstance(data[key], list):
                for index, row in enumerate(data[key]):
                    if isinstance(row, Mapping):  # a row that is no object: records._rows_from_json says so
                        where = f"{key}[{index}] ({row.get('name')!r}): "
                        _check(row, spec.item, f"{key}[{index}]", where)
                        if key == "tournaments" and row.get("verdict") != "error":
                            _check_ranking(row, where)
            else:
                _check(data[key], spec, key, "")
    return ABReport.from_json(data)


def _check_ranking(row: Mapping[str, Any], where: str) -> None:
    """A tournament's ranking names only variants it timed: the report shows each one's median time."""
    timed = row.get("median_ms") or {}
    for index, variant in enumerate(row.get("ranking") or ()):
        if variant not in timed:
            _refuse(variant, f"a variant with a time in 'median_ms' ({', '.join(map(repr, timed)) or 'none'})",
                    f"row.ranking[{index}]", where)


def _check(value: Any, spec: Any, path: str, where: str) -> None:
    """``DamagedReport`` unless ``value`` is of ``spec``; ``path`` names the field, ``where`` the row it is in."""
    if spec is ANY or (value is None and spec.nullable):
        return
    if isinstance(spec, Scalar):
        if not spec.accepts(value):
            _refuse(value, spec.accepted, path, where)
        return
    if isinstance(spec, ListOf):
        if not isinstance(value, list):
            _refuse(value, "a JSON array" + (", or null" if spec.nullable else ""), path, where)
        for index, item in enumerate(value):
            _check(item, spec.item, f"{path}[{index}]", where)
        return
    if not isinstance(value, Mapping):
        _refuse(value, "a JSON object" + (", or null" if spec.nullable else ""), path, where)
    if isinstance(spec, MapOf):
        for key, item in value.items():
            _check(item, spec.value, f"{path}.{key}", where)
        return
    for key, field_spec in spec.fields.items():
        if key in value:
            _check(value[key], field_spec, f"{path}.{key}", where)


def _refuse(value: Any, accepted: str, path: str, where: str) -> None:
    # A row's path starts with its place ("comparisons[0].gpu.index"), which ``where`` says already.
    field = path.split(".", 1)[1] if where and "." in path else path
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise DamagedReport(f"{where}field {field!r}: {shown} is refused; accepted: {accepted}")
