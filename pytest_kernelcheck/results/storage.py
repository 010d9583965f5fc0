"""Saved A/B runs: one folder per machine, numbered report files, and finding the run ``--kernel-ab-compare`` means.

Layout: ``STORAGE/MACHINE/0001_NAME.json``, where STORAGE is ``--kernel-ab-storage`` (default ``.kernelcheck/`` in
the rootdir) and MACHINE a slug of what decides the speed of a kernel there (:func:`machine_slug`): a run is
only compared with runs of the same GPU, driver and library versions, or of the same CPU. Each file is the
run's full JSON report, written whole or not at all (:func:`pytest_kernelcheck.results.report.write_json`).

>>> machine_slug({"gpu": {"available": True, "devices": ["NVIDIA H200"], "driver": "550.54", "cuda": "12.4",
...               "cudnn": "90100"}, "packages": {"torch": "2.4.0", "triton": "3.0.0"}})
'nvidia-h200_driver-550.54_cuda-12.4_torch-2.4.0_triton-3.0.0_cudnn-90100'
"""
from __future__ import annotations

import datetime as _datetime
import os
import re
import secrets
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import report_files
from .environment import environment_info
from .report_record import ABReport, RunEnvironment

LATEST = "latest"  # what --kernel-ab-compare without a value stands for
DEFAULT_FOLDER = ".kernelcheck"
# ASCII digits: \d also matches other scripts' digits ("٠٠٠٣"); and at most 18, so int() always reads them.
_FILE = re.compile(r"([0-9]{4,18})_(.+)\.json")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class StorageError(Exception):
    """A saved run cannot be found or saved, or a name is refused; the message names the option."""


@dataclass(frozen=True)
class SavedRun:
    """One saved report file: its number (order of saving), its name and where it is."""

    number: int
    name: str
    path: Path


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-.") or "unknown"


def machine_slug(environment: Mapping[str, Any]) -> str:
    """The folder name of a machine, from a report's ``environment`` (:func:`report.environment_info`).

    A GPU run: the GPU model, driver, CUDA, torch, triton and cuDNN versions; a CPU run: the CPU model and
    architecture, since there the speed of the code depends on the processor. A host of several GPUs of one
    model is that model's machine (a run spread over its GPUs, ``--kernel-gpus``, is compared with runs on one of
    them); a host of mixed models gets a folder of its own naming them all, so its runs are never matched with a
    single model's (rows of such a run also name their GPU, and are matched only within one model).

    >>> machine_slug({"cpu_model": "Intel(R) Xeon(R) Processor", "machine_info": {"machine": "x86_64"}})
    'cpu_intel-r-xeon-r-processor_x86-64'
    >>> machine_slug({"gpu": {"available": True, "devices": ["NVIDIA H100", "NVIDIA A100", "NVIDIA H100"]}})
    'nvidia-a100+nvidia-h100'
    """
    typed = RunEnvironment.from_json(environment)
    if typed.gpu.available and typed.gpu.devices:
        parts = ["+".join(sorted({_slug(device) for device in typed.gpu.devices}))]
        versions = {"driver": typed.gpu.driver, "cuda": typed.gpu.cuda, "torch": typed.packages.get("torch"),
                    "triton": typed.packages.get("triton"), "cudnn": typed.gpu.cudnn}
        parts += [f"{key}-{_slug(str(value))}" for key, value in versions.items() if value]
        return "_".join(parts)
    architecture = (typed.machine_info or {}).get("machine")
    return "_".join(["cpu", _slug(typed.cpu_model or "unknown")] + ([_slug(architecture)] if architecture else []))


def machine_differences(earlier: Mapping[str, Any], now: Mapping[str, Any]) -> tuple[str, ...]:
    """How the machine of an earlier report's ``environment`` differs from this run's, in what makes a machine's
    slug (:func:`machine_slug`): for GPU runs the GPU models, driver, CUDA, cuDNN, torch and triton versions; for CPU
    runs the CPU model and architecture. One text per field that differs; none when they match.

    An earlier report without an environment block (written by hand) cannot be placed on any machine: that is said
    too, rather than taken for a match. ``now`` empty (no environment was read) compares nothing.

    >>> gpu = {"gpu": {"available": True, "devices": ["NVIDIA H100"], "driver": "550.54", "cuda": "12.4"},
    ...        "packages": {"torch": "2.4.0"}}
    >>> machine_differences(gpu, {"gpu": {"available": False}, "packages": {"torch": "2.5.1"}, "cpu_model": "EPYC"})
    ('GPU NVIDIA H100 then, none now', 'driver 550.54 then, none now', 'CUDA 12.4 then, none now', \
'torch 2.4.0 then, 2.5.1 now')
    >>> machine_differences(gpu, gpu)
    ()
    """
    if not now:
        return ()
    if not earlier:
        return ("the earlier report records no environment, so its machine is unknown",)
    then_fields, now_fields = _machine_fields(earlier), _machine_fields(now)
    # A GPU run on either side: compare the GPU fields (a CPU run's are "none"); two CPU runs: the processor's.
    keys = _GPU_FIELDS if then_fields["GPU"] or now_fields["GPU"] else _CPU_FIELDS
    return tuple(f"{key} {then_fields[key] or 'none'} then, {now_fields[key] or 'none'} now"
                 for key in keys if then_fields[key] != now_fields[key])


_GPU_FIELDS = ("GPU", "driver", "CUDA", "cuDNN", "torch", "triton")
_CPU_FIELDS = ("GPU", "CPU", "architecture")


def _machine_fields(environment: Mapping[str, Any]) -> dict[str, str | None]:
    typed = RunEnvironment.from_json(environment)
    on_gpu = typed.gpu.available and typed.gpu.devices
    return {
        # As in the slug, the set of models: a run spread over more GPUs of one model is the same machine.
        "GPU": " + ".join(sorted(set(typed.gpu.devices))) if on_gpu else None,
        "driver": typed.gpu.driver if on_gpu else None, "CUDA": typed.gpu.cuda if on_gpu else None,
        "cuDNN": typed.gpu.cudnn if on_gpu else None,
        "torch": typed.packages.get("torch"), "triton": typed.packages.get("triton"),
        "CPU": typed.cpu_model, "architecture": (typed.machine_info or {}).get("machine"),
    }


def current_environment() -> dict[str, Any]:
    """This machine's environment for its slug, with the GPU described even before any test imported torch.

    The report describes a GPU only when torch is loaded (the plugin never imports it by itself); a run that
    saves or compares by machine needs the same slug at start-up as at the end, so torch is loaded here when
    it is installed.
    """
    import importlib.util

    if importlib.util.find_spec("torch") is not None:
        import torch  # noqa: F401  (loaded for report.environment_info's GPU description)
    return environment_info()


def saved_runs(folder: str | Path) -> list[SavedRun]:
    """The saved runs in one machine's folder, oldest first; none when the folder does not exist.

    >>> saved_runs("/nonexistent")
    []
    """
    path = Path(folder)
    if not path.is_dir():
        return []
    runs = []
    for entry in path.iterdir():
        match = _FILE.fullmatch(entry.name)
        if match and entry.is_file():
            runs.append(SavedRun(int(match.group(1)), match.group(2), entry))
    return sorted(runs, key=lambda run: (run.number, run.name))


@dataclass(frozen=True)
class RunSpeedups:
    """One saved run's speedup and its interval per comparison, keyed by (test node id, comparison name) as
    reports match rows (an interval end is None where unbounded)."""

    label: str  # the file name without .json: "0003_before-fusion"
    speedups: Mapping[tuple[str, str], float | None]
    intervals: Mapping[tuple[str, str], tuple[float | None, float | None]] = field(default_factory=dict)


def history(folder: str | Path, count: int, skipped: list[str] | None = None) -> tuple[RunSpeedups, ...]:
    """The speedups of the last ``count`` saved runs in ``folder``, oldest first; files that cannot be read as
    reports are left out (history is a view, and a damaged file must not cost the run its report), each with a
    line in ``skipped`` naming the file and the field.

    >>> history("/nonexistent", 5)
    ()
    """
    found = []
    for run in saved_runs(folder)[-count:] if count > 0 else []:
        try:
            typed = ABReport.from_json(report_files.load_report(run.path))  # load_report checked every field
        except report_files.ReportError as exc:
            if skipped is not None:
                skipped.append(str(exc))
            continue
        speedups = {(row.nodeid, row.name): row.speedup for row in typed.comparisons}
        intervals = {(row.nodeid, row.name): row.ci for row in typed.comparisons}
        found.append(RunSpeedups(label=run.path.stem, speedups=speedups, intervals=intervals))
    return tuple(found)


def check_same_machine(spec: str, path: Path, earlier: Mapping[str, Any], now: Mapping[str, Any]) -> None:
    """``StorageError`` when the saved run ``--kernel-ab-compare SPEC`` found (``path``, whose report's environment
    is ``earlier``) was measured on another machine than ``now`` (this machine's, :func:`current_environment`).

    A saved run picked by number, name or ``latest`` is meant to be this machine's: one of another machine in its
    folder (copied there, or of another torch on a CPU) would let the gate pass or fail this run on another
    machine's speeds, so it is refused; a report named by its path is compared on purpose, and only warned of.

    >>> check_same_machine("latest", Path("runs/0001_a.json"), {"cpu_model": "Xeon"}, {"cpu_model": "EPYC"})
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.storage.StorageError: --kernel-ab-compare latest: runs/0001_a.json was measured on another \
machine (CPU Xeon then, EPYC now); compare with a run saved on this machine, or give the file's path to compare \
with it anyway (the report then warns of it)
    """
    differences = machine_differences(earlier, now)
    if differences:
        raise StorageError(f"--kernel-ab-compare {spec}: {path} was measured on another machine "
                           f"({'; '.join(differences)}); compare with a run saved on this machine, or give the file's "
                           f"path to compare with it anyway (the report then warns of it)")


def check_name(name: str) -> str:
    """The name, when it can be a saved run's: letters, digits, ``.``, ``_``, ``-``; not all digits (those are
    numbers to --kernel-ab-compare), not ``latest``, and not ending in ``.json`` (a path to --kernel-ab-compare).

    >>> check_name("before-fusion")
    'before-fusion'
    >>> check_name("0003")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.storage.StorageError: --kernel-ab-save: name '0003' is all digits, which --kernel-ab-compare \
reads as a run number; add a letter
    """
    if not name:  # an empty value on the command line, most often a variable that was never set
        raise StorageError("--kernel-ab-save: name '' is empty; give a name of letters, digits, '.', '_' and '-', or "
                           "use --kernel-ab-autosave to name the run by commit and time")
    if name.isdigit():
        raise StorageError(f"--kernel-ab-save: name {name!r} is all digits, which --kernel-ab-compare reads as a run "
                           f"number; add a letter")
    if name == LATEST:
        raise StorageError(f"--kernel-ab-save: name {LATEST!r} is what --kernel-ab-compare without a value means")
    if name.endswith(".json"):
        raise StorageError(f"--kernel-ab-save: name {name!r} ends in .json, which --kernel-ab-compare reads as a "
                           f"report's path; leave out the .json")
    if not _NAME.fullmatch(name):
        raise StorageError(f"--kernel-ab-save: name {name!r} must start with a letter or digit and hold only "
                           f"letters, digits, '.', '_' and '-'")
    return name


STORAGE_OPTION = "--kernel-ab-storage / kernel_ab_storage"


def check_folder(folder: str | Path, *, writing: bool) -> None:
    """``StorageError`` naming the option when ``folder`` (the storage folder, or a machine's folder in it) is a
    file, or, ``writing``, cannot be created or written: found at start-up, before any comparison is timed, rather
    than when the run is saved at its end.

    >>> check_folder("/dev/null", writing=False)
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.storage.StorageError: --kernel-ab-storage / kernel_ab_storage: '/dev/null' is not a folder; \
give a folder of saved runs (it is created when a run is saved)
    """
    path = Path(folder)
    accepted = "give a folder of saved runs (it is created when a run is saved)"
    if path.exists() and not path.is_dir():
        raise StorageError(f"{STORAGE_OPTION}: {str(path)!r} is not a folder; {accepted}")
    if not writing:
        return
    ancestor = path
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise StorageError(f"{STORAGE_OPTION}: cannot create {str(path)!r}: {str(ancestor)!r} is not a folder; "
                           f"{accepted}")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise StorageError(f"{STORAGE_OPTION}: cannot save runs in {str(path)!r}: {str(ancestor)!r} is not "
                           f"writable; {accepted}")


def save(report: Any, folder: str | Path, name: str) -> Path:
    """Write ``report`` (typed, :class:`.report_record.ABReport`, or its JSON form) as the next numbered run in
    ``folder``; returns its path.

    Every save gets a number of its own and replaces no file, whoever else saves into the folder at once (parallel
    pytest invocations, CI jobs or users sharing it, each with its own temp directory): the number is claimed in
    the folder itself (:func:`_publish`), so no lock elsewhere is needed.

    >>> import tempfile
    >>> from pytest_kernelcheck.results.report import build_report
    >>> folder = tempfile.mkdtemp()
    >>> [save(build_report([], settings={}), folder, n).name for n in ("a", "b")]
    ['0001_a.json', '0002_b.json']
    """
    name = check_name(name)
    folder = Path(folder)
    # Written whole first, under a name no listing takes for a run; only then given its number, in one step.
    staged = folder / f".{name}.{os.getpid()}.{secrets.token_hex(4)}.staged"
    try:
        report_files.write_json(report, staged)
        return _publish(staged, folder, name)
    except report_files.ReportError as exc:
        raise StorageError(f"--kernel-ab-save: {exc}") from None
    except OSError as exc:
        raise StorageError(f"--kernel-ab-save: cannot save the run in {str(folder)!r}: {exc}") from None
    finally:
        try:
            staged.unlink(missing_ok=True)
        except OSError:  # never written (the folder cannot be made): nothing to remove
            pass


def _publish(staged: Path, folder: Path, name: str) -> Path:
    """Give the written file ``staged`` the folder's next free number: ``folder/NNNN_NAME.json``.

    A number is claimed by creating ``.NNNN.claim`` with ``O_EXCL`` (which exactly one process can do) and is
    taken only if no run holds it yet, checked while it is claimed; the claim is removed once the run's file has
    its name. Two savers that listed the folder at once both try the same number and one moves on to the next.
    The file gets its name by a hard link, which fails rather than replace a file of that name. A saver killed
    while holding a claim leaves the number unused (a gap), never a run lost.
    """
    number = max((run.number for run in saved_runs(folder)), default=0) + 1
    while True:
        claim = folder / f".{number:04d}.claim"
        try:
            os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:  # another save holds this number now
            number += 1
            continue
        try:
            target = folder / f"{number:04d}_{name}.json"
            if not any(run.number == number for run in saved_runs(folder)) and _link(staged, target):
                return target
        finally:
            claim.unlink(missing_ok=True)
        number += 1


def _link(staged: Path, target: Path) -> bool:
    """Give ``staged`` the name ``target`` unless a file has it (a case-insensitive file system counts ``A`` and
    ``a`` as one); whether it did."""
    try:
        os.link(staged, target)
        return True
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: the claimed number keeps other savers away
        if target.exists():
            return False
        os.replace(staged, target)
        return True


def git_state(root: str | Path) -> tuple[str | None, bool]:
    """The short commit hash of ``root``'s work tree and whether it has changes; ``(None, False)`` without git
    or outside a repository."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):  # git absent, not a repository, no commit yet
        return None, False
    return commit or None, dirty


def autosave_name(commit: str | None, dirty: bool, when: _datetime.datetime) -> str:
    """The name ``--kernel-ab-autosave`` gives a run: short commit (``-dirty`` with changes, ``nocommit`` without
    git) and UTC time.

    >>> autosave_name("ab12cd3", True, _datetime.datetime(2026, 12, 1, 10, 30, tzinfo=_datetime.timezone.utc))
    'ab12cd3-dirty_20261201T103000Z'
    >>> autosave_name(None, False, _datetime.datetime(2026, 12, 1, 10, 30, tzinfo=_datetime.timezone.utc))
    'nocommit_20261201T103000Z'
    """
    label = (commit + ("-dirty" if dirty else "")) if commit else "nocommit"
    return f"{label}_{when.astimezone(_datetime.timezone.utc).strftime('%Y%m%dT%H%M%SZ')}"


def names_a_file(spec: str) -> bool:
    """Whether ``--kernel-ab-compare SPEC`` names a report file by its path, rather than one of this machine's saved
    runs (``latest``, a number or a saved name): anything that exists, holds a slash or ends in ``.json``
    (:mod:`.run_lookup` refuses a bare spec that exists and also names a saved run).

    >>> names_a_file("out/ab.json"), names_a_file("0003"), names_a_file("before-fusion")
    (True, False, False)
    """
    number = spec.isascii() and spec.isdigit()  # "³".isdigit() is true too, and no run number
    return spec != LATEST and not number and (Path(spec).exists() or "/" in spec or spec.endswith(".json"))
