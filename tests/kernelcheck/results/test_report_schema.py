"""A report read back from a file, with any one field of the wrong JSON type: refused naming the file and the field,
or read without harm by everything that reads an earlier run (comparison, gate, history, report, machine check)."""
from __future__ import annotations

import copy
import io
import json
import random

import pytest

from pytest_kernelcheck.results import gate, report, storage
from pytest_kernelcheck.results.records import DamagedReport
from pytest_kernelcheck.results.report_schema import checked_report

GPU_ENVIRONMENT = {
    "date": "2026-12-07T10:00:00+00:00", "hostname": "h", "python": "3.12.0",
    "packages": {"torch": "2.4.0", "triton": "3.0.0"},
    "machine_info": {"machine": "x86_64", "node": "h", "cpu_count": 16},
    "commit_info": {"id": "abc123", "dirty": False},
    "gpu": {"available": True, "devices": ["NVIDIA H200"], "driver": "550.54", "cuda": "12.4", "cudnn": "90100"},
    "cpu_model": "AMD EPYC", "cpu_threads": 1,
}


def _records(rng: random.Random) -> list[dict]:
    """One of each kind of row, with every optional block a run can write (throughput, ceiling, GPU, clock)."""
    def samples(n=3):
        return [rng.uniform(0.5, 2.0) for _ in range(n)]

    speedup = rng.uniform(1.2, 2.0)
    clock = {"available": True, "sm_clock_mhz": {"start": 1980, "min": 1500, "end": 1900, "max_supported": 1980,
                                                   "session_highest": 1980, "at_looks": [1980, 1500]},
             "temperature_c": {"start": 40, "max": 60, "end": 55}, "samples": 2, "throttled": True,
             "throttle": {"policy": "flag", "rounds_below": 3, "dropped_rounds": 0}}
    rates = {"flops": 2e9, "bytes": 1e6, "tflops": 1.5, "gbps": 200.0, "tflops_pct": 50.0, "gbps_pct": 10.0}
    ceiling = {"device": "cuda:0 (NVIDIA H200)", "dtype": "bfloat16", "tflops": 700.0, "gbps": 4000.0,
               "flops_method": "matmul", "bandwidth_method": "copy", "reason": None}
    details = {"method": "events", "calls_per_sample": 4, "alpha": 0.05, "margin": 0.02, "ci_level": 0.95,
               "looks_planned": 4, "looks_done": 2, "stop_reason": "decided", "elapsed_s": 0.5, "device": "cuda:0",
               "clock": clock, "throttled": True, "notes": ["a note"], "input_sets": 2,
               "gpu": {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-1f"}}
    comparison = {"kind": "comparison", "name": "fused", "nodeid": "t.py::test_a", "shape": {"B": 2, "S": 128},
                  "verdict": "win", "error": None, "speedup": speedup, "ci": [speedup - 0.1, speedup + 0.1],
                  "p_value": 0.001, "p_value_raw": 0.0005, "n_pairs": 3, "candidate_ms": 1.0,
                  "baseline_ms": speedup, "flush_l2": False, **details,
                  "samples": {"candidate_ms": samples(), "baseline_ms": samples(), "candidate_first": [True, False]},
                  "throughput": {"candidate": rates, "baseline": rates}, "ceiling": ceiling}
    tournament = {"kind": "tournament", "name": "variants", "nodeid": "t.py::test_b", "shape": None, "error": None,
                  "ranking": ["a", "b"], "best": "a", "indistinguishable_from_best": ["b"],
                  "median_ms": {"a": 1.0, "b": 1.1}, "n_rounds": 3, **details,
                  "pairwise": [{"faster": "a", "slower": "b", "verdict": "tie", "speedup": 1.1, "ci": [0.9, 1.3],
                                "p_value": 0.4, "p_value_raw": 0.2}],
                  "samples": {"ms": {"a": samples(2), "b": samples(2)}, "orders": [["a", "b"], ["b", "a"]]},
                  "throughput": {"a": rates}, "ceiling": ceiling}
    measurement = {"kind": "measurement", "name": "copy", "nodeid": "t.py::test_c", "shape": {"N": 7},
                   "error": None, "median_ms": 1.5, "ci_ms": [1.4, 1.6], "n_samples": 3, **details,
                   "samples": {"ms": samples()}, "throughput": rates, "ceiling": ceiling}
    return [comparison, tournament, measurement]


def _paths(value, path=()):
    """Every place in a JSON document: each object key and array item, containers and leaves alike."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, path + (index,))


def _replaced(document, path, value):
    damaged = copy.deepcopy(document)
    target = damaged
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    return damaged


WRONG_TYPES = ["x", ["a"], {"k": "v"}, 2.5, -3, True, None, []]


class _Terminal:
    def __init__(self):
        self.out = io.StringIO()

    def write_sep(self, sep, title="", **markup):
        self.out.write(f"{sep} {title}\n")

    def write_line(self, line, **markup):
        self.out.write(line + "\n")

    def write(self, text, **markup):
        self.out.write(text)


def _read_as_every_reader_does(path, now_records, folder, tmp_path):
    """What a run does with an earlier report: load it, compare with it, gate on it, show it in history, check its
    machine, and write this run's report."""
    earlier = report.load_report(path)
    built = report.build_report(now_records, settings={"alpha": 0.05}, environment=GPU_ENVIRONMENT,
                                previous=earlier)
    regressions = gate.evaluate(gate.parse_rules(["verdict", "speedup:5%", "loss"]), built)
    gate.regression_lines(regressions, built.get("machine_differences") or ())
    storage.machine_differences(earlier.get("environment") or {}, GPU_ENVIRONMENT)
    storage.machine_slug(earlier.get("environment") or {})
    history = storage.history(folder, 5, [])
    report.write_markdown(built, tmp_path / "now.md", history)
    report.write_terminal(_Terminal(), built, ["note"])
    report.write_terminal(_Terminal(), earlier)  # the earlier report itself, as a reader of the file shows it


def test_every_field_of_a_saved_run_of_the_wrong_type_is_refused_naming_it_or_read_without_harm(tmp_path):
    # One field of another JSON type once crashed the reading run (int("x") for a GPU index, an unhashable list
    # for a name, .get on a string for samples or the environment), at start-up or after every test had run.
    rng = random.Random(7)
    records = _records(rng)
    earlier = report.build_report(records, settings={"alpha": 0.05}, environment=GPU_ENVIRONMENT)
    earlier = report.build_report(records, settings={"alpha": 0.05}, environment=GPU_ENVIRONMENT, previous=earlier)
    assert earlier["comparisons"][0]["vs_last"] is not None  # the compared form, vs_last and all
    earlier["machine_differences"] = ["GPU NVIDIA H100 then, NVIDIA H200 now"]
    now_records = _records(random.Random(8))
    folder = tmp_path / "runs"
    folder.mkdir()
    path = folder / "0001_earlier.json"
    path.write_text(json.dumps(earlier))
    _read_as_every_reader_does(path, now_records, folder, tmp_path)  # the undamaged report reads throughout

    places = [place for place in _paths(earlier) if place and place[:1] != ("schema",)]
    assert len(places) > 200
    crashed, refused = [], 0
    for place in places:
        for value in WRONG_TYPES:
            damaged = _replaced(earlier, place, value)
            path.write_text(json.dumps(damaged))
            try:
                _read_as_every_reader_does(path, now_records, folder, tmp_path)
            except report.ReportError as exc:
                refused += 1
                assert str(path) in str(exc), (place, value, exc)
                named = [step for step in place if isinstance(step, str)][-1:]
                assert not named or f"{named[0]}" in str(exc).split(str(path))[1], (place, value, exc)
            except Exception as exc:  # noqa: BLE001 (any other exception is the defect this test looks for)
                crashed.append(f"{'.'.join(map(str, place))} = {value!r}: {type(exc).__name__}: {exc}")
    assert not crashed, "\n".join(crashed[:40])
    assert refused > len(places)  # most wrong types are refused, not read


@pytest.mark.parametrize("damage, field", [
    ({"gpu": {"index": "x"}}, "field 'gpu.index': 'x' is refused; accepted: a whole number, or null"),
    ({"name": ["a"]}, "field 'name': ['a'] is refused; accepted: a string"),
    ({"samples": "x"}, "field 'samples': 'x' is refused; accepted: a JSON object, or null"),
    ({"notes": "abc"}, "field 'notes': 'abc' is refused; accepted: a JSON array, or null"),
    ({"n_pairs": 2.5}, "field 'n_pairs': 2.5 is refused; accepted: a whole number"),
])
def test_a_row_field_of_the_wrong_type_is_named_with_its_row(damage, field):
    row = {"kind": "comparison", "name": "fused", "verdict": "win", "speedup": 1.5, **damage}
    with pytest.raises(DamagedReport) as caught:
        checked_report({"schema": report.SCHEMA, "comparisons": [row]})
    name = row["name"]
    assert str(caught.value) == f"comparisons[0] ({name!r}): {field}"


def test_a_top_level_field_of_the_wrong_type_is_named():
    with pytest.raises(DamagedReport, match=r"^field 'environment': 'x' is refused; accepted: a JSON object, or null$"):
        checked_report({"schema": report.SCHEMA, "comparisons": [], "environment": "x"})
    with pytest.raises(DamagedReport, match=r"^field 'environment.gpu.devices\[0\]': \['a'\] is refused; accepted: a "
                                            r"string$"):
        checked_report({"schema": report.SCHEMA, "comparisons": [], "environment": {"gpu": {"devices": [["a"]]}}})
