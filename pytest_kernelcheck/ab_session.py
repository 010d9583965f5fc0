"""The A/B run's state in one process and its end: the report built from every record, judged by the gate's
rules, written and saved, and the summary at the end of the terminal output."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ABSession:
    enabled: bool
    settings: dict[str, Any]
    report_path: str | None
    previous: dict[str, Any] | None
    records: list[dict[str, Any]] = field(default_factory=list)  # JSON records, as every worker sent them
    finished: bool = False  # the report is built (and written) once, at session finish
    built: dict[str, Any] | None = None  # None when no comparison ran
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
    session.built = report.build_report(
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


def report_so_far(session: ABSession) -> dict[str, Any]:
    """The JSON report of the records so far, marked unfinished (no comparison with an earlier run yet); its
    environment is read once, at the first rewrite."""
    from .results import report

    if session.environment is None:
        session.environment = _environment(session)
    return report.build_report(session.records, settings=_report_settings(session),
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
        differences = session.built.get("machine_differences") or ()
        for line in gate.regression_lines(session.regressions, differences):
            terminalreporter.write_line(line, red=not line.startswith(" "), bold=line.startswith("WARNING"))
        terminalreporter.write_line(gate.failing_line(session.regressions))
