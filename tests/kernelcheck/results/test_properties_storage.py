"""Property-based sweep of damaged saved A/B runs: history, ``--kernel-ab-compare`` and the gate must survive them.

Hypothesis (a well-kept library made for property-based testing) damages a real saved run, one the plugin wrote
(``--kernel-ab-save``), in the ways files get damaged: any field given a value of the wrong JSON type (null, bool,
string, list, object, huge integers, NaN, infinities), fields deleted, fields added, non-ASCII names, the file cut
short, bytes that are not UTF-8. The damaged file is put in the machine's storage folder beside intact runs. Then:

* history (``storage.history`` and the markdown / plots it feeds) never raises: the damaged file is shown or left
  out, the intact runs are always shown;
* comparing with it (``report.load_report``, ``storage.check_same_machine``, ``report.build_report(previous=...)``,
  the gate's ``evaluate``, ``report.write_all``) either refuses it with the plugin's own error naming the file, or
  goes through without an exception;
* end to end (pytester, few examples since each run takes seconds): no INTERNALERROR; a run with history saves and
  writes its report; a run comparing with the damaged file either stops with a usage error (exit 4) naming the file
  or completes with its report.

Profiles and example counts: tests/conftest.py. Known defects found by this sweep have explicit xfail tests in
test_sweep_regressions.py; the strategies of the ci profile leave out what those tests cover (values of another
JSON type than the field's, integers beyond float's range, extra fields named as readers read them), and the sweep
of that region runs under the sweep profiles only. Examples are derandomized, but drawn from a run the plugin
saves afresh (its timings, and whether it carries notes, vary), so two runs may draw different damage.
"""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("hypothesis")  # in the dev extras

from hypothesis import Phase, given, note, settings
from hypothesis import strategies as st

from pytest_kernelcheck.results import gate, report, storage
from tests.conftest import PROFILE, examples

pytest_plugins = ["pytester"]

# The smallest A/B test that gives a saved run with every kind of field a real run writes.
AB_TEST = """
def test_sorts(kernel_ab):
    kernel_ab.compare(lambda: sorted(range(60)), lambda: sorted(range(120)), name="short vs long")
    kernel_ab.compare(lambda: sorted(range(60)), lambda: sorted(range(60)), name="same ünïcode")
"""
FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.01", "-p", "no:cacheprovider"]
RULES = ["verdict", "speedup:5%", "loss"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> str:
    """The text of a run the plugin saved (one pytest process, run once for the module)."""
    root = tmp_path_factory.mktemp("real-run")
    (root / "test_ab.py").write_text(AB_TEST)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", *FAST, "--kernel-ab-save", "base",
                           "--kernel-ab-storage", "runs"], cwd=root, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (root / "runs").glob("*/0001_base.json")
    return path.read_text()


@pytest.fixture(scope="module")
def environment_now() -> dict[str, Any]:
    return storage.current_environment()


# ---- damaging a report -------------------------------------------------------------------------------------------

NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)
# Integers beyond float's range: JSON holds them, Python reads them, and math on them raises OverflowError.
HUGE = st.sampled_from([10 ** 400, -(10 ** 400)])
NUMBERS = (st.integers(-10 ** 6, 10 ** 6) | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -1e308, 2 ** 63]))
# Values of every JSON type, the numbers no run writes included.
ANY_VALUE = st.one_of(st.none(), st.booleans(), NUMBERS, HUGE, NAMES, st.lists(st.integers(-2, 2) | NAMES, max_size=3),
                      st.dictionaries(NAMES, st.integers(-2, 2) | NAMES, max_size=2),
                      st.fixed_dictionaries({"index": NAMES | st.none()}))
# Field names the readers look for: an extra field of one of these names is read, not ignored.
KNOWN_FIELDS = st.sampled_from(["gpu", "samples", "environment", "name", "nodeid", "verdict", "speedup", "ci",
                                "throughput", "ceiling", "vs_last", "clock", "shape", "summary", "notes",
                                "machine_differences", "finished", "version", "packages", "machine_info"])


# Every key a report holds or a reader looks for: extra fields of these names are not "extra".
_READ_KEYS = frozenset(KNOWN_FIELDS.elements) | {"schema", "kind", "error", "p_value", "p_value_raw", "n_pairs",
                                                "candidate_ms", "baseline_ms", "flush_l2", "method", "available",
                                                "devices", "index", "uuid", "tournaments", "measurements",
                                                "comparisons", "settings", "created", "p_bh", "verdict_bh"}


def same_type(value: Any) -> st.SearchStrategy:
    """Other values of ``value``'s JSON type, the extreme ones included (NaN, infinities, non-ASCII text, empty
    containers), but no integer beyond float's range (test_sweep_regressions.py holds those)."""
    if value is None or isinstance(value, bool):
        return st.just(value) if value is None else st.booleans()
    if isinstance(value, (int, float)):
        return NUMBERS
    if isinstance(value, str):
        return NAMES
    if isinstance(value, list):
        first = value[0] if value else None
        return st.lists(same_type(first), max_size=3) if value else st.just([])
    return st.dictionaries(NAMES, st.integers(-2, 2) | NAMES, max_size=2)


def places(value: Any, at: tuple = ()) -> list[tuple]:
    """Every place in a JSON document, as the keys and indices that lead to it (the root excluded)."""
    found = []
    children = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in children:
        found.append(at + (key,))
        found.extend(places(child, at + (key,)))
    return found


def _parent(document: Any, place: tuple) -> Any:
    for key in place[:-1]:
        document = document[key]
    return document


@st.composite
def damaged_texts(draw, text: str, *, wrong_types: bool = False) -> tuple[bytes, list[str]]:
    """A damaged copy of the saved run ``text`` (its bytes) and what was done to it. ``wrong_types``: values of
    any JSON type replace fields and extra fields take the names readers look for; else values keep their field's
    type and extra fields have random names (what the readers handle today; the rest is in
    test_sweep_regressions.py)."""
    document = json.loads(text)
    done = []
    for _ in range(draw(st.integers(1, 3))):
        where = places(document)
        kind = draw(st.sampled_from(["replace", "replace", "delete", "extra"]))
        place = draw(st.sampled_from(where)) if where else ()
        if kind == "replace" and place:
            parent = _parent(document, place)
            parent[place[-1]] = value = draw(ANY_VALUE if wrong_types else same_type(parent[place[-1]]))
            done.append(f"{place} = {value!r}")
        elif kind == "delete" and place and isinstance(_parent(document, place), dict):
            del _parent(document, place)[place[-1]]
            done.append(f"del {place}")
        else:
            target = _parent(document, place)[place[-1]] if place else document
            holder, at = (target, place) if isinstance(target, dict) else (document, ())  # an object gets the field
            name = draw(KNOWN_FIELDS | NAMES if wrong_types else NAMES.filter(lambda n: n not in _READ_KEYS))
            holder[name] = value = draw(ANY_VALUE if wrong_types else st.integers(-2, 2) | NAMES | st.none())
            done.append(f"extra {name!r} = {value!r} in {at}")
    data = json.dumps(document, ensure_ascii=draw(st.booleans())).encode()  # NaN and inf as JSON's extensions
    cut = draw(st.sampled_from(["whole", "whole", "whole", "truncated", "not utf-8", "empty"]))
    if cut == "truncated":
        data = data[:draw(st.integers(0, len(data) - 1))]
    elif cut == "not utf-8":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80"])) + data[at:]
    elif cut == "empty":
        data = b""
    done.append(cut)
    return data, done


FILE_NAMES = st.sampled_from(["0002_damaged.json", "0002_ünïcode-名前.json", "0002_with space.json"])


def _storage(folder: Path, text: str, data: bytes, file_name: str) -> Path:
    """A machine folder with the intact run as 0001 and 0003 and the damaged one between them; its path."""
    folder.mkdir(parents=True)
    (folder / "0001_base.json").write_text(text)
    damaged = folder / file_name
    damaged.write_bytes(data)
    (folder / "0003_after.json").write_text(text)
    return damaged


def _records(text: str) -> list[dict[str, Any]]:
    """This run's records: the intact saved run's rows, as a run hands them to ``build_report``."""
    return [{key: value for key, value in row.items() if key not in ("p_bh", "verdict_bh", "vs_last")}
            for row in json.loads(text)["comparisons"]]


# ---- the properties, through the functions the options use -------------------------------------------------------

@examples(25)
@given(data=st.data())
def test_history_shows_every_intact_run_whatever_a_damaged_one_holds(saved_run, tmp_path_factory, data):
    damaged_bytes, done = data.draw(damaged_texts(saved_run))
    note(repr(done))
    folder = tmp_path_factory.mktemp("history") / "machine"
    damaged = _storage(folder, saved_run, damaged_bytes, data.draw(FILE_NAMES))
    found = storage.history(folder, 5)
    labels = [run.label for run in found]
    assert labels[0] == "0001_base" and labels[-1] == "0003_after", labels
    assert set(labels) <= {"0001_base", damaged.stem, "0003_after"}
    built = report.build_report(_records(saved_run), settings={})
    written = report.write_all(built, folder.parent / "out" / "ab.json", found)
    assert written.paths


@examples(40)
@given(data=st.data())
def test_comparing_with_a_damaged_run_refuses_it_by_name_or_goes_through(saved_run, environment_now,
                                                                          tmp_path_factory, data):
    damaged_bytes, done = data.draw(damaged_texts(saved_run))
    note(repr(done))
    folder = tmp_path_factory.mktemp("compare") / "machine"
    damaged = _storage(folder, saved_run, damaged_bytes, data.draw(FILE_NAMES))
    check_comparison(saved_run, damaged, environment_now, folder.parent / "out")


def check_comparison(saved_run: str, damaged: Path, environment_now: dict[str, Any], out: Path) -> None:
    """The property: --kernel-ab-compare's functions refuse ``damaged`` with their own error, naming the file (and
    the field, where the file is JSON of our schema), or take it through the report and the gate."""
    try:
        previous = report.load_report(damaged)
        storage.check_same_machine("latest", damaged, previous.get("environment") or {}, environment_now)
    except (report.ReportError, storage.StorageError) as exc:
        message = str(exc)
        assert str(damaged) in message, f"the error does not name the file: {message}"
        if isinstance(exc, report.ReportError) and "JSON" not in message and "not a kernel A/B report" not in message:
            assert re.search(r"field '|\w\[\d+\]", message), f"the error does not name the field: {message}"
        return
    built = report.build_report(_records(saved_run), settings={}, environment=environment_now, previous=previous)
    gate.evaluate(gate.parse_rules(RULES), built)
    assert report.write_all(built, out / "ab.json").paths


# Every field given values of any type, and extra fields of the names readers look for: each case this found once
# crashed the readers and is kept in test_sweep_regressions.py. No shrinking: the regression tests hold the small
# cases.
@settings(settings.default, max_examples=settings.default.max_examples * 4, phases=[Phase.explicit, Phase.generate])
@given(data=st.data())
def test_comparing_with_a_run_of_wrong_typed_fields_refuses_it_by_name_or_goes_through(saved_run, environment_now,
                                                                                        tmp_path_factory, data):
    damaged_bytes, done = data.draw(damaged_texts(saved_run, wrong_types=True))
    note(repr(done))
    folder = tmp_path_factory.mktemp("wrong-types") / "machine"
    damaged = _storage(folder, saved_run, damaged_bytes, "0002_damaged.json")
    storage.history(folder, 5)
    check_comparison(saved_run, damaged, environment_now, folder.parent / "out")


# ---- end to end ------------------------------------------------------------------------------------------------

def _no_internal_error(result: pytest.RunResult) -> str:
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output and "Traceback (most recent call last)" not in output, output[-3000:]
    return output


@examples(3)
@given(data=st.data())
def test_a_run_with_history_and_a_comparison_survives_a_damaged_saved_run(saved_run, environment_now, pytester,
                                                                          data):
    damaged_bytes, done = data.draw(damaged_texts(saved_run))
    note(repr(done))
    example = pytester.mkdir(f"example{len(list(pytester.path.iterdir()))}")
    (example / "test_ab.py").write_text(AB_TEST)
    folder = example / "runs" / storage.machine_slug(environment_now)
    damaged = _storage(folder, saved_run, damaged_bytes, data.draw(FILE_NAMES))
    damaged.with_name("0003_after.json").unlink()  # the damaged run is the latest: what a bare --kernel-ab-compare takes
    storage_options = ["--kernel-ab-storage", str(example / "runs"), "--rootdir", str(example), str(example)]

    # History (the markdown's table and trend plot) and a save: both must complete.
    saving = pytester.runpytest(*FAST, *storage_options, "--kernel-ab-history", "5", "--kernel-ab-save", "now",
                                "--kernel-ab-report", str(example / "out" / "ab.json"))
    _no_internal_error(saving)
    assert saving.ret == 0, saving.stdout.str()[-3000:]
    assert (example / "out" / "ab.json").is_file() and (example / "out" / "ab.md").is_file()
    assert (folder / "0003_now.json").is_file()
    (folder / "0003_now.json").unlink()

    # Comparing with it and gating on it: a usage error naming the file, or a run that writes its report.
    comparing = pytester.runpytest(*FAST, *storage_options, "--kernel-ab-compare",
                                   *[item for rule in RULES for item in ("--kernel-ab-compare-fail", rule)],
                                   "--kernel-ab-report", str(example / "compared" / "ab.json"))
    output = _no_internal_error(comparing)
    if comparing.ret == pytest.ExitCode.USAGE_ERROR:
        assert damaged.name in output, output[-3000:]
    else:
        assert comparing.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED), output[-3000:]
        assert (example / "compared" / "ab.json").is_file()
