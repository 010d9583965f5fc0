"""End to end with pytester: saved A/B runs that are damaged, saved at once, stored where they cannot be, or named
alike; and the numeric options' values."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider"]

# A simulated timer of known effect: the candidate takes 1 ms, the baseline 2 ms (a 2x win).
SIMULATED = """
from pytest_kernelcheck.speed.timing import SimulatedTimer

def candidate():
    pass

def baseline():
    pass

def test_fused(kernel_ab):
    timer = SimulatedTimer({candidate: lambda rng, now: 1e-3 * (1 + 0.01 * rng.random()),
                            baseline: lambda rng, now: 2e-3 * (1 + 0.01 * rng.random())})
    kernel_ab.compare(candidate, baseline, name="fused", timer=timer)
"""


def _machine_folder(storage_root):
    """The one machine folder runs made under ``storage_root``."""
    folders = [p for p in storage_root.iterdir() if p.is_dir()]
    assert len(folders) == 1, folders
    return folders[0]


def _damage(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


DAMAGES = {
    "gpu index": (lambda data: data["comparisons"][0].update(gpu={"index": "x"}),
                  "comparisons[[]0[]] ('fused'): field 'gpu.index': 'x' is refused; accepted: a whole number, or null"),
    "name": (lambda data: data["comparisons"][0].update(name=["a"]),
             "comparisons[[]0[]] ([[]'a'[]]): field 'name': [[]'a'[]] is refused; accepted: a string"),
    "samples": (lambda data: data["comparisons"][0].update(samples="x"),
                "comparisons[[]0[]] ('fused'): field 'samples': 'x' is refused; accepted: a JSON object, or null"),
    "environment": (lambda data: data.update(environment="x"),
                    "field 'environment': 'x' is refused; accepted: a JSON object, or null"),
}


@pytest.mark.parametrize("damage", ["gpu index", "name"])
def test_a_damaged_older_saved_run_is_left_out_of_history_and_the_run_still_reports_and_saves(pytester, damage):
    # Once: ValueError (int("x")) or TypeError (unhashable list) at the end of the run, exit 1, no markdown report,
    # and the run never saved.
    change, field = DAMAGES[damage]
    pytester.makepyfile(test_sim=SIMULATED)
    for name in ("first", "second"):
        pytester.runpytest(*FAST, "--kernel-ab-save", name).assert_outcomes(passed=1)
    folder = _machine_folder(pytester.path / ".kernelcheck")
    _damage(folder / "0001_first.json", change)
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "r.json", "--kernel-ab-save", "third")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines([f"WARNING: A/B history: a damaged saved run left out: earlier report "
                                 f"'{folder / '0001_first.json'}': {field}",
                                 f"A/B run saved: {folder / '0003_third.json'}", "A/B report: r.json, r.md*"])
    markdown = (pytester.path / "r.md").read_text()
    assert "| comparison | shape | 0002_second | this run |" in markdown
    assert json.loads((folder / "0003_third.json").read_text())["comparisons"][0]["verdict"] == "win"


@pytest.mark.parametrize("damage, spec", [("samples", "--kernel-ab-compare=base"),
                                          ("environment", "--kernel-ab-compare=1"), ("name", "--kernel-ab-compare"),
                                          ("gpu index", "--kernel-ab-compare=0001")])
def test_comparing_with_a_damaged_saved_run_is_a_usage_error_naming_the_file_and_the_field(pytester, damage, spec):
    # Once an INTERNALERROR ("samples": "x" -> 'str' object has no attribute 'get'; a list name -> unhashable).
    change, field = DAMAGES[damage]
    pytester.makepyfile(test_sim=SIMULATED)
    pytester.runpytest(*FAST, "--kernel-ab-save", "base").assert_outcomes(passed=1)
    saved = _machine_folder(pytester.path / ".kernelcheck") / "0001_base.json"
    _damage(saved, change)
    result = pytester.runpytest(*FAST, "--kernel-ab-compare-fail", "verdict", spec)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kernel A/B: earlier report '{saved}': {field}"])
    assert "passed" not in result.stdout.str()  # refused at start-up: no test ran


def _this_machine_slug():
    from pytest_kernelcheck.results import storage

    return storage.machine_slug(storage.current_environment())


@pytest.mark.parametrize("layout, args, message", [
    ("afile", ["--kernel-ab-storage", "afile", "--kernel-ab-save", "x"],
     "--kernel-ab-storage / kernel_ab_storage: 'afile' is not a folder; give a folder of saved runs*"),
    ("afile", ["--kernel-ab-storage", "afile", "--kernel-ab-compare"],
     "--kernel-ab-storage / kernel_ab_storage: 'afile' is not a folder; give a folder of saved runs*"),
    ("afile", ["--kernel-ab-storage", "afile", "--kernel-ab-report", "r.json"],
     "--kernel-ab-storage / kernel_ab_storage: 'afile' is not a folder; give a folder of saved runs*"),
    ("afile", ["--kernel-ab-storage", "afile/runs", "--kernel-ab-autosave"],
     "--kernel-ab-storage / kernel_ab_storage: cannot create 'afile/runs/*': 'afile' is not a folder; give a folder*"),
    ("machine file", ["--kernel-ab-storage", "runs", "--kernel-ab-save", "x"],
     "--kernel-ab-storage / kernel_ab_storage: 'runs/*' is not a folder; give a folder of saved runs*"),
])
def test_a_storage_folder_that_cannot_hold_runs_is_refused_before_any_comparison_is_timed(pytester, layout, args,
                                                                                           message):
    # Once found only at the end, after every comparison had been timed: the run's results were lost.
    pytester.makepyfile(test_sim=SIMULATED)
    if layout == "afile":
        (pytester.path / "afile").write_text("not a folder")
    else:  # the storage folder exists, but this machine's folder in it is a file
        (pytester.path / "runs").mkdir()
        (pytester.path / "runs" / _this_machine_slug()).write_text("not a folder")
    result = pytester.runpytest(*FAST, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: kernel A/B: {message}"])
    assert "passed" not in result.stdout.str()  # refused at start-up: no test ran


def test_a_storage_file_is_left_alone_by_a_run_that_uses_no_saved_run(pytester):
    pytester.makepyfile(test_sim=SIMULATED)
    (pytester.path / "afile").write_text("not a folder")
    # The folder set as a project default (an ini setting, which never stops a run): on the command line without
    # a save, a compare or history, --kernel-ab-storage is refused as an option that would do nothing.
    pytester.makeini("[pytest]\nkernel_ab_storage = afile\n")
    pytester.runpytest(*FAST).assert_outcomes(passed=1)
    pytester.runpytest(*FAST, "--kernel-ab-report", "r.json", "--kernel-ab-history", "0").assert_outcomes(passed=1)
    assert (pytester.path / "afile").read_text() == "not a folder"


HUGE = "9" * 5000  # past int()'s 4300-digit limit, whose ValueError once ended in INTERNALERROR
NOT_NUMBERS = ["\u00b3", "\u0663", "\uff11", "1_0", "nan", "inf", "1e309", HUGE]  # ³, Arabic-Indic 3, full-width 1
NUMERIC_OPTIONS = {
    "--kernel-ab-alpha": (NOT_NUMBERS + ["-3", "1e20"], "accepted: a finite number|budget alpha must be"),
    "--kernel-ab-margin": (NOT_NUMBERS + ["-3"], "accepted: a finite number|budget margin must be"),
    "--kernel-ab-max-time": (NOT_NUMBERS + ["-3", "0"], "accepted: a finite number|budget max_time must be"),
    "--kernel-ab-calls-per-sample": (NOT_NUMBERS + ["+3", "-3", "0.5", "99999999999999999999"],
                                     "accepted: 'auto', or a whole number from 1 to 2147483647, in ASCII digits"),
    "--kernel-ab-history": (NOT_NUMBERS + ["+3", "-3", "0.5", "99999999999999999999"],
                            "accepted: a whole number from 0 to 2147483647, in ASCII digits"),
    "--kernel-ab-cpu-threads": (NOT_NUMBERS + ["+3", "-3", "0", "0.5", "99999999999999999999"],
                                "accepted: a whole number from 1 to 2147483647, in ASCII digits"),
    "--kernel-device-memory": (["\u0663GiB", "\uff11", "-3", "nan", HUGE, "0"], "give plain bytes"),
    "--kernel-gpus": (["\u0663", "-3", "0.5", HUGE, "1,\u0663"], "is not 'all', a count of GPUs"),
}


@pytest.mark.parametrize("option, value", [(option, value) for option, (values, _) in NUMERIC_OPTIONS.items()
                                           for value in values])
def test_every_numeric_option_refuses_what_is_not_its_number_naming_itself_and_what_it_accepts(pytester, option,
                                                                                              value):
    # Once: "٣" and "１" were read as 3 and 1, "1_0" as 10, and 5000 digits ended in INTERNALERROR.
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--kernel-ab", "-p", "no:cacheprovider", f"{option}={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-2000:]
    error = [line for line in result.stderr.lines if line.startswith("ERROR:")]
    assert len(error) == 1 and "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert option in error[0] or option.replace("--kernel-ab-", "kernel_ab_").replace("-", "_") in error[0], error
    assert any(accepted in error[0] for accepted in NUMERIC_OPTIONS[option][1].split("|")), error
    assert len(error[0]) < 400 or not option.startswith("--kernel-ab")  # a 5000-digit value is not echoed whole


def test_compare_specs_that_collide_or_are_no_run_are_usage_errors_before_any_test_runs(pytester):
    pytester.makepyfile(test_sim=SIMULATED)
    for name in ("base", "0001_base", "base"):  # a name saved twice, and a name that is another run's file stem
        pytester.runpytest(*FAST, "--kernel-ab-save", name).assert_outcomes(passed=1)
    folder = _machine_folder(pytester.path / ".kernelcheck")
    assert sorted(p.name for p in folder.iterdir()) == ["0001_base.json", "0002_0001_base.json", "0003_base.json"]
    for spec, message in [
        # str.isdigit() is true of "³", which int() refuses: once an INTERNALERROR.
        ("\u00b3", "--kernel-ab-compare \u00b3: no saved run named '\u00b3' for this machine in * (latest saved: "
                   "0001_base.json, 0002_0001_base.json, 0003_base.json); accepted: 'latest', a run number in ASCII "
                   "digits (0003), a saved run's name or file stem (0003_NAME), or a report's path*"),
        ("0001_base", "--kernel-ab-compare 0001_base: ambiguous: it is the file stem of 0001_base.json and the name "
                      "of 0002_0001_base.json; give the run's number (0001 or 0002)"),
    ]:
        result = pytester.runpytest(*FAST, f"--kernel-ab-compare={spec}")
        assert result.ret == pytest.ExitCode.USAGE_ERROR, spec
        result.stderr.fnmatch_lines([f"ERROR: kernel A/B: {message}"])
        assert "passed" not in result.stdout.str()
    # A name saved twice means its latest run; a file stem means that file.
    by_name = pytester.runpytest(*FAST, "--kernel-ab-compare=base", "--kernel-ab-report", "by_name.json")
    by_name.assert_outcomes(passed=1)
    by_stem = pytester.runpytest(*FAST, "--kernel-ab-compare=0002_0001_base", "--kernel-ab-report", "by_stem.json")
    by_stem.assert_outcomes(passed=1)
    saved_by = {name: json.loads((folder / name).read_text())["comparisons"][0]["speedup"]
                for name in ("0002_0001_base.json", "0003_base.json")}
    for report, expected in (("by_name.json", "0003_base.json"), ("by_stem.json", "0002_0001_base.json")):
        vs_last = json.loads((pytester.path / report).read_text())["comparisons"][0]["vs_last"]
        assert vs_last["speedup"] == saved_by[expected], report
    saving = pytester.runpytest(*FAST, "--kernel-ab-save", "base.json")
    assert saving.ret == pytest.ExitCode.USAGE_ERROR
    saving.stderr.fnmatch_lines(["ERROR: kernel A/B: --kernel-ab-save: name 'base.json' ends in .json, which "
                                 "--kernel-ab-compare reads as a report's path; leave out the .json"])
