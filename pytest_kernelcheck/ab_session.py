"""The A/B run's state in one process and its end: the report built from every record, judged by the gate's
rules, written and saved, and the summary at the end of the terminal output."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest


@dataclass
class ABSession:
    enabled: bool
    settings: dict[str, Any]
    report_path: str | None
    previous: Any  # report_record.ABReport: the earlier report to compare with (--kernel-ab-compare), or None
    records: list[Any] = field(default_factory=list)  # records.ABRecord of every test, typed on arrival
    finished: bool = False  # the report is built (and written) once, at session finish
    built: Any = None  # report_record.ABReport, built at session finish; None when no comparison ran
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # report files that could not be written
    rules: tuple[Any, ...] = ()  # gate.Rule: --kernel-ab-compare-fail
    save_folder: Path | None = None  # this machine's folder of saved runs, when this run is saved
    save_name: str | None = None  # None with save_folder set: --kernel-ab-autosave names it at the end
    rootpath: Path | None = None  # where autosave asks git for the commit
    history_count: int = 0  # --kernel-ab-history: earlier saved runs shown in the markdown report
    storage_root: Path | None = None
    machine_folder: Any = None  # () -> Path, see ThisMachine
    regressions: tuple[Any, ...] = ()  # gate.Regression: what the rules found, at session finish
    ceilings: Any = None  # throughput.CeilingMeter of this process (--kernel-ab-ceilings)
    cpu_threads: int | None = None  # --kernel-ab-cpu-threads
    profile: Any = None  # profiling.ProfileMode: --kernel-ab-profile / --kernel-ab-trace; None: a timed run
    profiled: list[dict[str, Any]] = field(default_factory=list)  # profile mode: what every process ran
    gpu: Any = ()  # records.GpuIdentity of this worker's GPU (--kernel-gpus), None when not pinned; () not asked yet
    progress: Any = None  # report.ProgressWriter: the JSON report rewritten while the run goes (the reporting process)
    environment: dict[str, Any] | None = None  # the rewrites' environment block, read at the first rewrite
    options: Any = None  # ab_settings.ABSettings: every option's value and where it came from


class ThisMachine:
    """This machine's environment and, called, its folder of saved runs under ``root``: each worked out once and
    only when first asked for (both load torch)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._environment: dict[str, Any] | None = None

    def environment(self) -> dict[str, Any]:
        from .results import storage

        if self._environment is None:
            self._environment = storage.current_environment()
        return self._environment

    def __call__(self) -> Path:
        from .results import storage

        return self.root / storage.machine_slug(self.environment())


def finish(session: ABSession) -> None:
    """Build the report from every record, judge it by the gate's rules and write its files, once; notes and
    errors wait for the summary."""
    from .results import gate, report

    if session.finished:
        return
    session.finished = True
    if session.progress is not None and session.progress.error is not None:
        session.notes.append(f"A/B report not rewritten while the run went: {session.progress.error}")
    if not session.records:
        return
    session.built = report.assemble_report(
        session.records, settings=_report_settings(session), environment=_environment(session),
        previous=session.previous
    )
    session.regressions = gate.evaluate(session.rules, session.built)
    history = _history(session) if session.report_path else ()  # read before this run is saved among them
    if session.save_folder is not None:
        _save(session)
    if not session.report_path:
        return
    try:
        written = report.write_all(session.built, session.report_path, history)
    except report.ReportError as exc:
        session.errors.append(f"A/B report not written: {exc}")
        return
    session.notes.append(f"A/B report: {', '.join(str(path) for path in written.paths)}")
    if written.note:
        session.notes.append(f"A/B plot skipped: {written.note}")


def _environment(session: ABSession) -> dict[str, Any]:
    """The report's environment block (it asks git for the commit; its date is now)."""
    from .results import report, storage

    if session.previous is not None:
        # Read even without a file to write, since the report says when the earlier run's machine was another; with
        # the GPU described though no test (or, under pytest-xdist, no test in this process) loaded torch, as in
        # the saved runs, lest an undescribed GPU read as another machine.
        environment = storage.current_environment()
    else:
        environment = report.environment_info() if session.report_path or session.save_folder else {}
    if session.cpu_threads is not None:
        environment = {**environment, "cpu_threads": session.cpu_threads}
    return environment


def _report_settings(session: ABSession) -> dict[str, Any]:
    return {**session.settings, "ceilings": "on" if session.ceilings.enabled else "off"}


def report_so_far(session: ABSession) -> Any:
    """The typed report of the records so far, marked unfinished (no comparison with an earlier run yet); its
    environment is read once, at the first rewrite."""
    from .results import report

    if session.environment is None:
        session.environment = _environment(session)
    return report.assemble_report(session.records, settings=_report_settings(session),
                                  environment=session.environment, finished=False)


def _history(session: ABSession) -> tuple[Any, ...]:
    """This machine's last saved runs for the markdown report (--kernel-ab-history); none without storage."""
    from .results import storage

    # Without a storage folder there is nothing to show, and no reason to load torch for the machine's slug.
    if session.history_count <= 0 or session.storage_root is None or not session.storage_root.is_dir():
        return ()
    skipped: list[str] = []
    found = storage.history(session.machine_folder(), session.history_count, skipped)
    session.notes.extend(f"WARNING: A/B history: a damaged saved run left out: {reason}" for reason in skipped)
    return found


def _save(session: ABSession) -> None:
    """Save the built report as this machine's next run (--kernel-ab-save / --kernel-ab-autosave)."""
    import datetime

    from .results import storage

    name = session.save_name
    if name is None:
        commit, dirty = storage.git_state(session.rootpath or Path.cwd())
        name = storage.autosave_name(commit, dirty, datetime.datetime.now(datetime.timezone.utc))
    try:
        path = storage.save(session.built, session.save_folder, name)
    except storage.StorageError as exc:
        session.errors.append(f"A/B run not saved: {exc}")
        return
    session.notes.append(f"A/B run saved: {path}")


def summarise(session: ABSession, terminalreporter: Any) -> None:
    from .results import report

    if session.profile is not None:  # nothing was timed: no report, only what ran and where its ranges went
        terminalreporter.write_sep("=", "kernel A/B profile")
        for line in session.profile.summary_lines(session.profiled):
            terminalreporter.write_line(line)
        return
    if session.built is None:
        terminalreporter.write_sep("=", "kernel A/B comparisons")
        terminalreporter.write_line("no A/B comparisons ran")
        return
    report.write_terminal(terminalreporter, session.built, session.notes, errors=session.errors)
    from .results import gate

    for line in gate.unchecked_lines(session.rules, session.built):
        terminalreporter.write_line(line, yellow=True)
    if session.regressions:
        terminalreporter.write_sep("=", "kernelcheck: regressions", red=True, bold=True)
        for line in gate.regression_lines(session.regressions, session.built.machine_differences):
            terminalreporter.write_line(line, red=not line.startswith(" "), bold=line.startswith("WARNING"))
        terminalreporter.write_line(gate.failing_line(session.regressions))


def start(settings: Any, config: pytest.Config) -> ABSession:
    """This process's A/B session from the resolved options (``ab_settings.ABSettings``): the report path checked
    writable, the storage folder usable, the earlier run to compare with read and checked against this machine,
    the gate's rules checked against it, before any test runs (at the end every result would be lost)."""
    from .results import gate, report, run_lookup, storage
    from .speed import throughput

    machine_folder = ThisMachine(settings.storage_root)
    compare_spec, report_path = settings.compare_spec, settings.report_path
    previous = None
    save_folder = None
    try:
        if report_path:
            report.check_writable(report_path)
        # A storage folder that is a file, or cannot be written, is found now: at the end every result would be lost.
        if settings.enabled and (settings.saving or compare_spec and not storage.names_a_file(compare_spec) or
                                 report_path and settings.history_count):
            storage.check_folder(settings.storage_root, writing=False)
        if settings.save_name is not None:
            storage.check_name(settings.save_name)
        if compare_spec:
            compare_path = run_lookup.resolve_compare(compare_spec, machine_folder)
            previous = report.read_report(compare_path)
            # A saved run of another machine is refused; a path is the user's explicit choice, compared with a
            # warning in the report and the summary (report.machine_lines), which is read at the end.
            if not storage.names_a_file(compare_spec):
                storage.check_same_machine(compare_spec, compare_path, previous.environment,
                                           machine_folder.environment())
        if settings.saving and settings.enabled:
            save_folder = machine_folder()
            storage.check_folder(save_folder, writing=True)
    except (report.ReportError, storage.StorageError) as exc:
        raise pytest.UsageError(f"kernel A/B: {exc}") from None
    try:
        gate.check_rules(settings.rules, comparing=previous is not None)
    except gate.GateError as exc:
        raise pytest.UsageError(f"kernel A/B: {exc}") from None
    session = ABSession(settings.enabled, settings.budget, report_path, previous, rules=settings.rules,
                        save_folder=save_folder, save_name=settings.save_name, rootpath=config.rootpath,
                        history_count=settings.history_count, storage_root=settings.storage_root,
                        machine_folder=machine_folder, ceilings=throughput.CeilingMeter(enabled=settings.ceilings),
                        cpu_threads=settings.cpu_threads, profile=settings.profile, options=settings)
    if report_path and settings.profile is None and not hasattr(config, "workerinput"):
        session.progress = report.ProgressWriter(report_path)
    if previous is not None and not previous.finished:
        session.notes.append(f"--kernel-ab-compare: the earlier report is of a run that did not finish "
                             f"({len(previous.comparisons)} comparisons); only those are compared")
    return session
