"""Defects the property sweep of damaged saved runs found (test_properties_storage.py), each shrunk to one explicit
case, so each stays fixed.

Every case is a run saved through the storage API, then one field of its file given a value of the wrong JSON type
(or a number beyond float's range). Expected everywhere: the file is refused with ``ReportError`` naming the file
and the field (``--kernel-ab-compare`` then stops with a usage error, exit 4), and history leaves it out with a
warning naming it; never an uncaught exception (INTERNALERROR in a pytest run).
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_kernelcheck.results import gate, report, storage

pytest_plugins = ["pytester"]

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.01", "-p", "no:cacheprovider"]
AB_TEST = """
def test_sorts(kernel_ab):
    kernel_ab.compare(lambda: sorted(range(60)), lambda: sorted(range(120)), name="short vs long")
"""


def _saved_run(folder: Path, name: str = "base", environment: dict[str, Any] | None = None) -> Path:
    record = {"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win", "speedup": 1.2,
              "ci": [1.1, 1.3], "p_value": 0.001, "samples": {"candidate_ms": [1.0], "baseline_ms": [1.2],
                                                             "candidate_first": [True]}}
    built = report.build_report([record], settings={}, environment=environment or {})
    return storage.save(built, folder, name)


def _damage(path: Path, place: tuple, value: Any) -> Path:
    """Set the field at ``place`` (keys and indices from the root) of the saved run at ``path`` to ``value``."""
    document = json.loads(path.read_text())
    holder = document
    for key in place[:-1]:
        holder = holder[key]
    holder[place[-1]] = value
    path.write_text(json.dumps(document))
    return path


def names_field(message: str, field: str) -> bool:
    """Whether ``message`` names ``field``, alone or as a part of a dotted path ('gpu.index', 'environment.gpu')."""
    return re.search(rf"'([\w\[\]]+\.)*{re.escape(field)}(\[\d+\])*(\.[\w\[\]]+)*'", message) is not None


ROW = ("comparisons", 0)
# (place, value); the field name is the place's last string. The ids say what the readers once raised.
WRONG_FIELDS = [
    pytest.param(ROW + ("gpu",), {"index": "x"}, id="gpu-index-not-a-number"),
    pytest.param(ROW + ("gpu",), "x", id="gpu-not-an-object"),
    pytest.param(ROW + ("clock",), True, id="clock-not-an-object"),
    pytest.param(ROW + ("samples",), "x", id="samples-not-an-object"),
    pytest.param(ROW + ("samples", "candidate_ms"), 1, id="samples-times-not-a-list"),
    pytest.param(ROW + ("notes",), 1, id="notes-not-a-list"),
    pytest.param(ROW + ("ceiling",), "x", id="ceiling-not-an-object"),
    pytest.param(ROW + ("vs_last",), "x", id="vs-last-not-an-object"),
    pytest.param(ROW + ("throughput",), "x", id="throughput-not-an-object"),
    pytest.param(ROW + ("throughput",), {"candidate": "x"}, id="throughput-candidate-not-an-object"),
    pytest.param(ROW + ("ceiling",), {"tflops": "x"}, id="ceiling-tflops-not-a-number"),
    pytest.param(ROW + ("clock",), {"sm_clock_mhz": "x"}, id="clock-sm-clock-not-an-object"),
    pytest.param(ROW + ("gpu",), {"index": [1]}, id="gpu-index-a-list"),
    pytest.param(("summary",), {"regressions": 5}, id="summary-regressions-not-a-list"),
    pytest.param(ROW + ("speedup",), 10 ** 400, id="speedup-beyond-float"),
    pytest.param(ROW + ("ci",), [10 ** 400, None], id="ci-end-beyond-float"),
    pytest.param(("summary",), "x", id="summary-not-an-object"),
    pytest.param(("machine_differences",), 1, id="machine-differences-not-a-list"),
    pytest.param(("tournaments",), 1, id="tournaments-not-a-list"),
]


@pytest.mark.parametrize("place, value", WRONG_FIELDS)
def test_a_saved_run_with_a_wrong_typed_field_is_refused_naming_file_and_field(tmp_path, place, value):
    path = _damage(_saved_run(tmp_path), place, value)
    field = [key for key in place if isinstance(key, str)][-1]
    with pytest.raises(report.ReportError) as refused:
        report.load_report(path)
    assert str(path) in str(refused.value) and names_field(str(refused.value), field)


@pytest.mark.parametrize("place, value", WRONG_FIELDS)
def test_history_leaves_out_a_saved_run_with_a_wrong_typed_field(tmp_path, place, value):
    _saved_run(tmp_path, "first")
    _damage(_saved_run(tmp_path, "damaged"), place, value)
    _saved_run(tmp_path, "last")
    assert [run.label for run in storage.history(tmp_path, 5)] == ["0001_first", "0003_last"]


NOT_TEXT = [pytest.param("name", ["a"], id="name-a-list"), pytest.param("nodeid", {"a": 1}, id="nodeid-an-object")]


@pytest.mark.parametrize("field, value", NOT_TEXT)
def test_history_survives_a_row_whose_name_is_not_text(tmp_path, field, value):
    _saved_run(tmp_path, "first")
    _damage(_saved_run(tmp_path, "damaged"), ROW + (field,), value)
    assert [run.label for run in storage.history(tmp_path, 5)][0] == "0001_first"


@pytest.mark.parametrize("field, value", NOT_TEXT)
def test_comparing_with_a_row_whose_name_is_not_text_refuses_it_or_goes_through(tmp_path, field, value):
    path = _damage(_saved_run(tmp_path), ROW + (field,), value)
    try:
        previous = report.load_report(path)
    except report.ReportError as exc:
        assert str(path) in str(exc) and names_field(str(exc), field)
        return
    record = {"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win", "speedup": 1.2}
    built = report.build_report([record], settings={}, previous=previous)
    gate.evaluate(gate.parse_rules(["verdict"]), built)


@pytest.mark.parametrize("place, value", [
    (("environment",), "x"), (("environment", "gpu"), "x"), (("environment", "packages"), "x"),
    (("environment", "machine_info"), "x"), (("environment", "ceilings"), "x"),
    (("environment", "ceilings"), {"measured": [5]}),
    (("environment", "gpu"), {"available": True, "devices": 5}),
    (("environment", "gpu"), {"available": True, "devices": ["NVIDIA H200", 5]})],
    ids=["environment", "gpu", "packages", "machine-info", "ceilings", "ceilings-measured", "gpu-devices-a-number",
         "gpu-devices-a-number-among-names"])
def test_comparing_with_a_run_of_a_wrong_typed_environment_refuses_it_naming_the_field(tmp_path, place, value):
    environment = storage.current_environment()
    path = _damage(_saved_run(tmp_path, environment=environment), place, value)
    try:
        previous = report.load_report(path)
        storage.check_same_machine("latest", path, previous.get("environment") or {}, environment)
    except (report.ReportError, storage.StorageError) as exc:
        assert str(path) in str(exc) and names_field(str(exc), place[-1])
        return
    raise AssertionError("an environment of the wrong type was taken for this machine's")


# ---- end to end ------------------------------------------------------------------------------------------------

def _machine_folder(pytester: pytest.Pytester) -> Path:
    return pytester.path / "runs" / storage.machine_slug(storage.current_environment())


def test_a_bare_compare_with_a_damaged_latest_run_is_a_usage_error_naming_file_and_field(pytester):
    pytester.makepyfile(AB_TEST)
    damaged = _damage(_saved_run(_machine_folder(pytester)), ROW + ("gpu",), {"index": "x"})
    result = pytester.runpytest(*FAST, "--kernel-ab-storage", "runs", "--kernel-ab-compare")
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert damaged.name in output and names_field(output, "gpu")


@pytest.mark.parametrize("content", ["not json", json.dumps({"schema": "pytest-kernelcheck/ab-report",
                                                               "comparisons": [{"name": "a", "verdict": "WIN"}]})],
                         ids=["not-json", "refused-verdict"])
def test_history_names_the_saved_run_it_leaves_out(pytester, content):
    pytester.makepyfile(AB_TEST)
    folder = _machine_folder(pytester)
    _saved_run(folder, "first")
    damaged = folder / "0002_damaged.json"
    damaged.write_text(content)
    result = pytester.runpytest(*FAST, "--kernel-ab-storage", "runs", "--kernel-ab-history", "5",
                                "--kernel-ab-save", "now", "--kernel-ab-report", "out/ab.json")
    assert result.ret == 0 and (folder / "0003_now.json").is_file()
    markdown = (pytester.path / "out" / "ab.md").read_text()
    assert damaged.name in result.stdout.str() + result.stderr.str() + markdown
