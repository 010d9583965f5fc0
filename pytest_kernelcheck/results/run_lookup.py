"""Which saved run ``--kernel-ab-compare SPEC`` means, where names, numbers, file stems and paths could collide.

The forms, in the order they are tried:

- ``latest`` (the option alone): the run with the highest number.
- ASCII digits (``0003``, ``3``): the run with that number.
- a spec holding ``/`` or ending in ``.json``: a report file, by its path.
- anything else: the saved run whose file stem it is (``0003_base``, as the history table labels runs), or else
  the latest run saved under that name (``base``; a name saved twice means its later run). Names are matched
  exactly, case included, on every file system (they are read from the file names, never looked up by the file
  system), so ``Nightly`` and ``nightly`` are two names; a bare spec that is also a file or folder here is a path.

Ambiguity is refused, listing the candidates, rather than settled by a rule the user cannot see: several files of
one number (copied in by hand, or saved by an older version racing another save), a spec that is one run's stem
and another's name, a spec that is a saved run and a file here. A spec that matches no name but one that differs
only in case says so.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Sequence

from ..option_values import count_text, shown
from .storage import LATEST, SavedRun, StorageError, names_a_file, saved_runs


def resolve(spec: str, machine_folder: Callable[[], Path]) -> Path:
    """The report file ``spec`` means (see the module's docstring); ``StorageError`` naming the option, the spec and
    the candidates when it means none, or more than one. ``machine_folder`` is called only when saved runs must
    be looked at."""
    if names_a_file(spec) and not Path(spec).exists():
        return Path(spec)  # a slash or .json: a path, whether or not it exists (load_report says it does not)
    folder = machine_folder()
    runs = saved_runs(folder)
    if names_a_file(spec):  # a bare spec that exists here: a path, unless it also names a saved run
        named = _by_stem_or_name(runs, spec)
        if named:
            raise StorageError(f"--kernel-ab-compare {spec}: ambiguous: both a saved run ({_names(named)}) and a file "
                               f"or folder here ({spec!r}); give the run's number ({named[0].number:04d}) for the "
                               f"saved run, or ./{spec} for the file")
        return Path(spec)
    if not runs:
        raise StorageError(f"--kernel-ab-compare {spec}: no saved runs for this machine in '{folder}'; save one "
                           f"with --kernel-ab-save NAME or --kernel-ab-autosave")
    saved = ", ".join(run.path.name for run in runs[-5:])
    if spec == LATEST or (spec.isascii() and spec.isdigit()):
        wanted = runs[-1].number if spec == LATEST else count_text(spec)  # None: more digits than any run has
        matches = [run for run in runs if run.number == wanted]
        what = "the latest number" if spec == LATEST else "run number"
        if not matches:
            short = spec if len(spec) <= 60 else shown(spec)  # thousands of digits are not echoed whole
            raise StorageError(f"--kernel-ab-compare {short}: no saved run number "
                               f"{short if wanted is None else format(wanted, '04d')} for this machine in "
                               f"'{folder}' (latest saved: {saved})")
        if len(matches) > 1:
            raise StorageError(f"--kernel-ab-compare {spec}: ambiguous: {what} {wanted:04d} is held by "
                               f"{len(matches)} saved runs ({_names(matches)}); give the path of the one to compare "
                               f"with ({matches[0].path})")
        return matches[0].path
    matches = _by_stem_or_name(runs, spec)
    if len(matches) > 1:
        raise StorageError(f"--kernel-ab-compare {spec}: ambiguous: it is the file stem of {matches[0].path.name} "
                           f"and the name of {_names(matches[1:])}; give the run's number "
                           f"({' or '.join(f'{run.number:04d}' for run in matches)})")
    if matches:
        return matches[0].path
    other_case = [run for run in runs if run.name.lower() == spec.lower()]
    if other_case:
        raise StorageError(f"--kernel-ab-compare {spec}: no saved run named {spec!r} for this machine in '{folder}'; "
                           f"names are matched exactly, case included, and these differ only in case: "
                           f"{_names(other_case)}")
    raise StorageError(f"--kernel-ab-compare {spec}: no saved run named {spec!r} for this machine in '{folder}' "
                       f"(latest saved: {saved}); accepted: 'latest', a run number in ASCII digits (0003), a saved "
                       f"run's name or file stem (0003_NAME), or a report's path (holding '/' or ending in .json)")


def _by_stem_or_name(runs: Sequence[SavedRun], spec: str) -> list[SavedRun]:
    """The run whose file stem is ``spec`` first, then the latest run named ``spec``: one entry when both are the
    same file (or only one exists), none when neither."""
    by_stem = [run for run in runs if run.path.stem == spec]
    by_name = [run for run in runs if run.name == spec][-1:]
    return list(dict.fromkeys(by_stem + by_name))


def _names(runs: Sequence[SavedRun]) -> str:
    return ", ".join(run.path.name for run in runs)


def resolve_compare(spec: str, machine_folder: Callable[[], Path]) -> Path:
    """The report file ``--kernel-ab-compare SPEC`` means: ``latest`` (the option alone), a number (``0003`` or
    ``3``), a saved run's file stem or name in this machine's folder, else a path; ambiguity is refused naming the
    candidates (:mod:`.run_lookup` says how each form is read).

    ``machine_folder`` is called only when saved runs must be looked at, so that comparing with a path never needs
    the machine's slug (which loads torch).

    >>> resolve_compare("out/ab.json", lambda: Path("unused"))
    PosixPath('out/ab.json')
    """
    return resolve(spec, machine_folder)
