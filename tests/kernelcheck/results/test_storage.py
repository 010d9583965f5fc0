"""Saved A/B runs: machine slugs, numbering, names, git state, and which file --kernel-ab-compare means."""
from __future__ import annotations

import datetime
import subprocess
from pathlib import Path

import pytest

from pytest_kernelcheck.results import report, report_files, run_lookup, storage

GPU = {"gpu": {"available": True, "devices": ["NVIDIA H200", "NVIDIA H200"], "driver": "550.54.15", "cuda": "12.4",
               "cudnn": "90100"},
       "packages": {"torch": "2.4.0+cu124", "triton": "3.0.0"}, "cpu_model": "AMD EPYC 9654"}


def test_gpu_slug_names_gpu_driver_and_versions_and_cpu_slug_the_processor():
    assert storage.machine_slug(GPU) == (
        "nvidia-h200_driver-550.54.15_cuda-12.4_torch-2.4.0-cu124_triton-3.0.0_cudnn-90100")
    other_driver = {**GPU, "gpu": {**GPU["gpu"], "driver": "560.1"}}
    assert storage.machine_slug(other_driver) != storage.machine_slug(GPU)
    cpu = {"gpu": {"available": False}, "cpu_model": "AMD EPYC 9654", "machine_info": {"machine": "x86_64"}}
    assert storage.machine_slug(cpu) == "cpu_amd-epyc-9654_x86-64"
    assert storage.machine_slug({}) == "cpu_unknown"


def test_the_current_machine_has_a_slug_usable_as_a_folder_name():
    slug = storage.machine_slug(storage.current_environment())
    assert slug and "/" not in slug and slug == storage.machine_slug(report.environment_info())


def test_saving_numbers_runs_after_the_highest_and_lists_them_in_order(tmp_path):
    built = report.build_report([], settings={})
    (tmp_path / "0007_old.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("not a run")
    path = storage.save(built, tmp_path, "next")
    assert path.name == "0008_next.json" and report.load_report(path)["schema"] == report.SCHEMA
    assert [(r.number, r.name) for r in storage.saved_runs(tmp_path)] == [(7, "old"), (8, "next")]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # written atomically, no temporary left


@pytest.mark.parametrize("name", ["", "latest", "-x", "a b", "a/b", "0001"])
def test_names_that_cannot_be_saved(name):
    with pytest.raises(storage.StorageError, match="--kernel-ab-save: name"):
        storage.check_name(name)


def test_resolve_compare_by_latest_number_name_and_path(tmp_path):
    built = report.build_report([], settings={})
    for name in ("base", "fused", "base"):
        storage.save(built, tmp_path, name)
    asked = []

    def folder():
        asked.append(True)
        return tmp_path

    assert run_lookup.resolve_compare("latest", folder).name == "0003_base.json"
    assert run_lookup.resolve_compare("0002", folder).name == "0002_fused.json"
    assert run_lookup.resolve_compare("1", folder).name == "0001_base.json"
    assert run_lookup.resolve_compare("base", folder).name == "0003_base.json"  # a name saved twice: the latest
    asked.clear()
    assert run_lookup.resolve_compare("earlier/ab.json", folder) == Path("earlier/ab.json")
    assert not asked  # a path never needs the machine's folder
    with pytest.raises(storage.StorageError, match=r"no saved run number 0009 .*\(latest saved: 0001_base.json, "):
        run_lookup.resolve_compare("9", folder)
    with pytest.raises(storage.StorageError, match="no saved run named 'other'"):
        run_lookup.resolve_compare("other", folder)
    with pytest.raises(storage.StorageError, match="no saved runs for this machine"):
        run_lookup.resolve_compare("latest", lambda: tmp_path / "empty")


def test_git_state_in_a_repository_outside_one_and_without_git(tmp_path, monkeypatch):
    assert storage.git_state(tmp_path) == (None, False)

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    commit, dirty = storage.git_state(tmp_path)
    assert commit and len(commit) >= 7 and dirty is False
    (tmp_path / "f").write_text("2")
    assert storage.git_state(tmp_path) == (commit, True)
    monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # git absent
    assert storage.git_state(tmp_path) == (None, False)


def test_autosave_name_is_in_utc():
    plus_two = datetime.timezone(datetime.timedelta(hours=2))
    assert storage.autosave_name("abc1234", False, datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=plus_two)) == (
        "abc1234_20260102T010405Z")


def test_history_reads_the_last_runs_speedups_and_skips_damaged_files(tmp_path):
    def run(speedup):
        return report.build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
                                     "speedup": speedup, "ci": [speedup - 0.1, speedup + 0.1], "p_value": 0.001}],
                                   settings={})

    for name, speedup in (("one", 1.1), ("two", 1.2), ("three", 1.3)):
        storage.save(run(speedup), tmp_path, name)
    (tmp_path / "0004_broken.json").write_text("not json")
    found = storage.history(tmp_path, 3)
    assert [(r.label, r.speedups[("t.py::a", "a")]) for r in found] == [("0002_two", 1.2), ("0003_three", 1.3)]
    assert storage.history(tmp_path, 0) == ()


def test_an_empty_save_name_is_refused_as_empty():
    with pytest.raises(storage.StorageError, match="--kernel-ab-save: name '' is empty; give a name of letters"):
        storage.check_name("")


def test_machine_differences_name_each_field_of_the_slug_that_differs():
    assert storage.machine_differences(GPU, GPU) == ()
    # More GPUs of the same model, or another host or CPU on a GPU run, is the same machine (as its slug says).
    assert storage.machine_differences(GPU, {**GPU, "gpu": {**GPU["gpu"], "devices": ["NVIDIA H200"]},
                                             "hostname": "other", "cpu_model": "Intel Xeon"}) == ()
    newer = {**GPU, "gpu": {**GPU["gpu"], "driver": "560.1"}, "packages": {"torch": "2.5.0", "triton": "3.0.0"}}
    assert storage.machine_differences(GPU, newer) == ("driver 550.54.15 then, 560.1 now",
                                                       "torch 2.4.0+cu124 then, 2.5.0 now")
    cpu = {"gpu": {"available": False}, "cpu_model": "AMD EPYC 9654", "machine_info": {"machine": "x86_64"},
           "packages": {"torch": "2.4.0+cu124", "triton": "3.0.0"}}
    assert storage.machine_differences(GPU, cpu) == (
        "GPU NVIDIA H200 then, none now", "driver 550.54.15 then, none now", "CUDA 12.4 then, none now",
        "cuDNN 90100 then, none now")
    assert storage.machine_differences(cpu, {**cpu, "cpu_model": "Intel Xeon"}) == (
        "CPU AMD EPYC 9654 then, Intel Xeon now",)
    assert storage.machine_differences({}, cpu) == (
        "the earlier report records no environment, so its machine is unknown",)
    assert storage.machine_differences(GPU, {}) == ()  # no environment read now: nothing to compare


def test_a_saved_run_of_another_machine_is_refused_naming_the_run_and_the_differences(tmp_path):
    cpu = {"gpu": {"available": False}, "cpu_model": "AMD EPYC 9654", "machine_info": {"machine": "x86_64"}}
    storage.check_same_machine("latest", tmp_path / "0001_a.json", cpu, cpu)
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-compare 0001: .*0001_a.json was measured on "
                                                   r"another machine \(GPU NVIDIA H200 then, none now; driver "):
        storage.check_same_machine("0001", tmp_path / "0001_a.json", GPU, cpu)


def test_a_compare_spec_names_a_file_by_a_path_and_a_saved_run_otherwise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "before").write_text("{}")
    assert [storage.names_a_file(spec) for spec in ("a/b", "ab.json", "before", "latest", "0003", "fused")] == [
        True, True, True, False, False, False]


def _save_after_barrier(barrier, folder: str, name: str, built: dict) -> None:
    barrier.wait()
    storage.save(built, folder, name)


def test_concurrent_saves_get_a_number_each_and_overwrite_nothing(tmp_path, monkeypatch):
    # Two runs saving at once (parallel pytest invocations in one checkout) both took the next number after the
    # same listing: with one name the second file replaced the first, with two names two runs shared a number.
    import multiprocessing
    import random
    import time

    writes = report_files.write_json
    monkeypatch.setattr(report_files, "write_json", lambda *args: (time.sleep(0.3), writes(*args)))  # a slow disk
    names = [random.choice(["nightly", "nightly", "fused"]) for _ in range(4)]
    built = report.build_report([], settings={"seed": random.random()})
    context = multiprocessing.get_context("fork")  # the children keep the slow write
    barrier = context.Barrier(len(names))
    children = [context.Process(target=_save_after_barrier, args=(barrier, str(tmp_path), name, built))
                for name in names]
    for child in children:
        child.start()
    for child in children:
        child.join(30)
    assert [child.exitcode for child in children] == [0] * len(names)
    runs = storage.saved_runs(tmp_path)
    assert [run.number for run in runs] == [1, 2, 3, 4]
    assert sorted(run.name for run in runs) == sorted(names)


def _save_with_own_temp_dir(barrier, temp_dir: str, folder: str, name: str, built: dict) -> None:
    import os
    import tempfile

    os.environ["TMPDIR"] = temp_dir  # a CI job or user of its own: nothing in the temp directory is shared
    tempfile.tempdir = None  # read TMPDIR again
    barrier.wait()
    storage.save(built, folder, name)


def test_saves_from_processes_with_different_temp_dirs_each_get_a_number_and_lose_nothing(tmp_path, monkeypatch):
    # 40 saves into one folder from processes whose TMPDIR differed (separate CI jobs sharing the storage folder)
    # once left 24 files while each said "A/B run saved": the lock that kept them apart lived in the temp directory.
    import multiprocessing
    import random
    import time

    writes = report_files.write_json
    monkeypatch.setattr(report_files, "write_json", lambda *args: (time.sleep(0.2), writes(*args)))  # a slow disk
    rng = random.Random(11)
    names = [rng.choice(["nightly", "nightly", "Nightly", "fused"]) for _ in range(40)]
    built = report.build_report([], settings={"seed": rng.random()})
    folder = tmp_path / "runs"
    context = multiprocessing.get_context("fork")  # the children keep the slow write
    barrier = context.Barrier(len(names))
    children = []
    for index, name in enumerate(names):
        temp_dir = tmp_path / f"tmp{index}"
        temp_dir.mkdir()
        children.append(context.Process(target=_save_with_own_temp_dir,
                                        args=(barrier, str(temp_dir), str(folder), name, built)))
    for child in children:
        child.start()
    for child in children:
        child.join(60)
    assert [child.exitcode for child in children] == [0] * len(names)
    runs = storage.saved_runs(folder)
    assert [run.number for run in runs] == list(range(1, len(names) + 1))
    assert sorted(run.name for run in runs) == sorted(names)
    assert sorted(path.name for path in folder.iterdir()) == sorted(run.path.name for run in runs)  # no claim left
    assert all(report.load_report(run.path)["settings"] == built["settings"] for run in runs)


def test_a_save_skips_a_number_another_save_has_claimed_and_never_replaces_a_file(tmp_path):
    built = report.build_report([], settings={})
    (tmp_path / "0002_a.json").write_text("{}")
    (tmp_path / ".0003.claim").write_text("")  # a save that holds number 3 now (or was killed holding it)
    path = storage.save(built, tmp_path, "a")
    assert path.name == "0004_a.json"
    assert (tmp_path / "0002_a.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".0003.claim", "0002_a.json", "0004_a.json"]


def test_a_run_that_cannot_be_saved_is_a_storage_error_naming_the_option(tmp_path):
    (tmp_path / "afile").write_text("")
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-save: cannot write report .*Not a directory"):
        storage.save(report.build_report([], settings={}), tmp_path / "afile" / "machine", "a")


def _run_file(folder: Path, stem: str) -> Path:
    path = folder / f"{stem}.json"
    path.write_text("{}")
    return path


def test_a_compare_spec_that_means_several_saved_runs_is_refused_listing_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "machine"
    folder.mkdir()
    for stem in ("0001_base", "0002_nightly", "0003_0001_base", "0004_Nightly", "0005_a", "0005_b"):
        _run_file(folder, stem)
    runs = lambda: folder  # noqa: E731
    # Several files of one number (copied in, or saved by an older version racing another save): once one of them
    # was taken without a word, by the order of the names.
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-compare latest: ambiguous: the latest number 0005 "
                                                   r"is held by 2 saved runs \(0005_a.json, 0005_b.json\); give the "
                                                   r"path"):
        run_lookup.resolve_compare("latest", runs)
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-compare 5: ambiguous: run number 0005 is held by 2"):
        run_lookup.resolve_compare("5", runs)
    # One run's file stem and another's name: once the name won, though the history table labels runs by stem.
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-compare 0001_base: ambiguous: it is the file stem "
                                                   r"of 0001_base.json and the name of 0003_0001_base.json; give the "
                                                   r"run's number \(0001 or 0003\)"):
        run_lookup.resolve_compare("0001_base", runs)
    assert run_lookup.resolve_compare("0002_nightly", runs).name == "0002_nightly.json"  # a stem alone
    assert run_lookup.resolve_compare("base", runs).name == "0001_base.json"
    # Names are matched exactly, case included, on every file system.
    assert run_lookup.resolve_compare("nightly", runs).name == "0002_nightly.json"
    assert run_lookup.resolve_compare("Nightly", runs).name == "0004_Nightly.json"
    with pytest.raises(storage.StorageError, match=r"no saved run named 'NIGHTLY' .*; names are matched exactly, "
                                                   r"case included, and these differ only in case: "
                                                   r"0002_nightly.json, 0004_Nightly.json$"):
        run_lookup.resolve_compare("NIGHTLY", runs)
    # A saved run's name that is also a file here: once the file was compared with, without a word.
    (tmp_path / "base").write_text("{}")
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-compare base: ambiguous: both a saved run "
                                                   r"\(0001_base.json\) and a file or folder here \('base'\); give "
                                                   r"the run's number \(0001\) for the saved run, or ./base for the "
                                                   r"file$"):
        run_lookup.resolve_compare("base", runs)
    assert run_lookup.resolve_compare("./base", runs) == Path("./base")
    (tmp_path / "other").write_text("{}")
    assert run_lookup.resolve_compare("other", runs) == Path("other")  # a file that names no saved run


@pytest.mark.parametrize("spec", ["\u00b3", "\u0663", "+1", "9" * 5000])
def test_a_compare_spec_in_no_accepted_form_is_refused_saying_what_is_accepted(tmp_path, spec):
    # "³" once ended in INTERNALERROR (str.isdigit() is true of it, int() refuses it); "٣" was read as run 3.
    _run_file(tmp_path, "0003_base")
    with pytest.raises(storage.StorageError, match=r"no saved run (named|number) .*latest saved: 0003_base.json"):
        run_lookup.resolve_compare(spec, lambda: tmp_path)


def test_a_name_ending_in_json_is_refused_since_compare_reads_it_as_a_path():
    with pytest.raises(storage.StorageError, match=r"^--kernel-ab-save: name 'base.json' ends in .json, which "
                                                   r"--kernel-ab-compare reads as a report's path"):
        storage.check_name("base.json")
