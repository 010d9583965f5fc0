"""pytest wiring for A/B speed comparisons: options, the ``kernel_ab`` fixture, report, pytest-xdist transport.

The work lives in :mod:`pytest_kernelcheck.speed.ab` (comparisons), :mod:`.stats` and :mod:`.report`; this module only
connects them to pytest. Results travel on the test report as the ``kernel_ab_records`` attribute (a JSON
string of :mod:`.records` in their JSON form), which pytest-xdist serialises with the report, so the controller's
summary sees every worker's results.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .ab_session import ABSession, ThisMachine, finish, report_so_far, summarise

RECORDS_ATTRIBUTE = "kernel_ab_records"
_PENDING = pytest.StashKey[list]()
_PROFILED = pytest.StashKey[list]()  # profile mode: profiling.ProfiledRun entries, as RECORDS_ATTRIBUTE's records
PROFILE_ATTRIBUTE = "kernel_ab_profiled"
_SESSION = pytest.StashKey["ABSession"]()
_COLLECTOR_NAME = "kernelcheck-ab-collector"

ENABLE_HINT = "A/B speed comparisons are off; pass --kernel-ab (or set kernel_ab = true in the ini file) to run them"

# name: (type, default, help); each has a --kernel-ab-NAME option and a kernel_ab_NAME ini key.
_NUMBER_SETTINGS = {
    "alpha": (float, 0.05, "false win/loss rate per comparison, over all its looks (default 0.05)"),
    "margin": (float, 0.02, "equivalence margin: a speedup interval inside [1/(1+m), 1+m] is a tie (default 0.02)"),
    "max_time": (float, 2.0, "seconds of sampling per comparison after warm-up (default 2.0)"),
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelcheck", "GPU kernel correctness and A/B speed checks")
    group.addoption(
        "--kernel-ab", action="store_true", default=None, dest="kernel_ab",
        help="run A/B speed comparisons (tests using the kernel_ab fixture); without it they are skipped",
    )
    parser.addini("kernel_ab", "run A/B speed comparisons without --kernel-ab", type="bool", default=False)
    for name, (_, default, text) in _NUMBER_SETTINGS.items():
        group.addoption(f"--kernel-ab-{name.replace('_', '-')}", dest=f"kernel_ab_{name}", default=None, help=text)
        parser.addini(f"kernel_ab_{name}", text, default=str(default))
    group.addoption(
        "--kernel-ab-hold-gpu", action="store_true", default=None, dest="kernel_ab_hold_gpu",
        help="hold the GPU with a spin kernel while each round is queued, so CUDA events time device work alone "
             "(host launch cost excluded); default: rounds queued back to back",
    )
    parser.addini("kernel_ab_hold_gpu", "hold the GPU while each A/B round is queued (device time alone)",
                  type="bool", default=False)
    group.addoption(
        "--kernel-ab-throttle", dest="kernel_ab_throttle", default=None, metavar="flag|discard|fail",
        help="rounds taken with the SM clock more than 10%% below the session's highest: flag (default: keep "
             "them, note it), discard (drop them, decide on the rest) or fail (fail the comparison)",
    )
    parser.addini("kernel_ab_throttle", "throttled A/B rounds: flag, discard or fail (see --kernel-ab-throttle)",
                  default="flag")
    group.addoption(
        "--kernel-ab-calls-per-sample", dest="kernel_ab_calls_per_sample", default=None, metavar="N",
        help="calls per timed sample for every comparison: auto (default: batch calls shorter than 50 us, so the "
             "count can differ between runs) or a count; a comparison's own calls_per_sample= still wins. Pin it "
             "when runs are compared (--kernel-ab-compare) at sizes near 50 us",
    )
    parser.addini("kernel_ab_calls_per_sample", "calls per timed sample (see --kernel-ab-calls-per-sample)",
                  default="auto")
    group.addoption(
        "--kernel-ab-report", dest="kernel_ab_report", default=None, metavar="PATH",
        help="write the A/B report as JSON to PATH, with a markdown table (.md) and a plot (.png) beside it",
    )
    parser.addini("kernel_ab_report", "path of the A/B JSON report", default="")
    group.addoption(
        # nargs="?": the option alone means the latest saved run ("latest", storage.LATEST).
        "--kernel-ab-compare", dest="kernel_ab_compare", default=None, metavar="RUN", nargs="?", const="latest",
        help="compare with an earlier run: alone, this machine's latest saved run; a saved run's number (0003), "
             "file stem (0003_NAME) or name (its latest run); or the path of an A/B JSON report. Adds a 'vs last "
             "run' column and flags regressions",
    )
    parser.addini("kernel_ab_compare", "earlier run to compare with: latest, a saved number or name, or a path",
                  default="")
    group.addoption(
        "--kernel-ab-save", dest="kernel_ab_save", default=None, metavar="NAME",
        help="save this run's JSON report in the storage folder, as this machine's next numbered run NNNN_NAME.json",
    )
    group.addoption(
        "--kernel-ab-autosave", action="store_true", default=None, dest="kernel_ab_autosave",
        help="save every run (as --kernel-ab-save), named by short commit hash (-dirty with changes) and UTC time",
    )
    parser.addini("kernel_ab_autosave", "save every A/B run (see --kernel-ab-autosave)", type="bool", default=False)
    group.addoption(
        "--kernel-ab-storage", dest="kernel_ab_storage", default=None, metavar="PATH",
        help="folder of saved A/B runs, one subfolder per machine (default: .kernelcheck in the rootdir)",
    )
    parser.addini("kernel_ab_storage", "folder of saved A/B runs (relative to the rootdir)", default="")
    group.addoption(
        "--kernel-ab-history", dest="kernel_ab_history", default=None, metavar="N",
        help="the markdown report shows each comparison's speedup in this machine's last N saved runs "
             "(default 5; 0: none)",
    )
    parser.addini("kernel_ab_history", "saved runs whose speedups the markdown report shows", default="5")
    group.addoption(
        "--kernel-ab-compare-fail", dest="kernel_ab_compare_fail", action="append", default=None, metavar="EXPR",
        help="fail the session on A/B regressions (repeatable): 'verdict' (verdict worse than in the compared "
             "run: win > tie = inconclusive > loss), 'speedup:X%%' (interval wholly more than X%% below the "
             "earlier speedup) or 'loss' (any loss in this run)",
    )
    parser.addini("kernel_ab_compare_fail", "A/B gate rules, one a line (see --kernel-ab-compare-fail)",
                  type="linelist", default=[])
    group.addoption(
        "--kernel-ab-ceilings", dest="kernel_ab_ceilings", default=None, choices=("on", "off"),
        help="on (default): measure this GPU's matmul FLOP/s and copy GB/s once per session, for the share of "
             "the ceiling of comparisons given flops=/bytes=; off: skip the measurement",
    )
    parser.addini("kernel_ab_ceilings", "measure throughput ceilings: on or off (see --kernel-ab-ceilings)",
                  default="on")
    group.addoption(
        "--kernel-ab-cpu-threads", dest="kernel_ab_cpu_threads", default=None, metavar="N",
        help="torch.set_num_threads(N) while each A/B comparison runs (restored after); 1 gives stable CPU times",
    )
    parser.addini("kernel_ab_cpu_threads", "torch threads during A/B comparisons (see --kernel-ab-cpu-threads)",
                  default="")
    # Profile runs are asked for one at a time, under a profiler: command-line options only, no ini keys.
    group.addoption(
        "--kernel-ab-profile", action="store_true", default=None, dest="kernel_ab_profile",
        help="profile mode (turns on --kernel-ab): run each compared callable once after a warm-up inside an NVTX "
             "range kernelcheck:<test id>:<name>:<side>, for nsys or ncu --nvtx; nothing is timed, no verdicts",
    )
    group.addoption(
        "--kernel-ab-trace", dest="kernel_ab_trace", default=None, metavar="DIR",
        help="profile mode (as --kernel-ab-profile) that also writes a torch.profiler Chrome trace per comparison "
             "into DIR",
    )


# Options that name something, and what they accept. Given empty on the command line (most often a variable that was
# never set: --kernel-ab-trace "$TRACES") each would read as not given and the run would go on without its report,
# trace, storage, comparison or thread count, saying nothing; so an empty value is refused, as --kernel-ab-save's is.
_NAMING_OPTIONS = {
    "report": "a report path (ab.json)", "trace": "a folder for the traces", "storage": "a folder of saved runs",
    "compare": "a saved run (number or name) or a report's path", "cpu_threads": "a count >= 1",
}


def _refuse_empty_options(config: pytest.Config) -> None:
    for name, accepted in _NAMING_OPTIONS.items():
        value = config.getoption(f"kernel_ab_{name}")
        if value is not None and not str(value).strip():
            raise pytest.UsageError(f"--kernel-ab-{name.replace('_', '-')}: the value is empty; give {accepted}, "
                                    f"or leave the option out")


def _option(name: str) -> str:
    """How a message names a setting: its option and its ini key."""
    return f"--kernel-ab-{name.replace('_', '-')} / kernel_ab_{name}"


def _setting(config: pytest.Config, name: str) -> Any:
    value = config.getoption(f"kernel_ab_{name}")
    return value if value is not None else config.getini(f"kernel_ab_{name}")


def _storage_root(config: pytest.Config) -> Path:
    from .results import storage

    option = config.getoption("kernel_ab_storage")
    return Path(option) if option else config.rootpath / (config.getini("kernel_ab_storage") or storage.DEFAULT_FOLDER)


def pytest_configure(config: pytest.Config) -> None:
    from . import option_rules, option_values
    from .results import gate, report, run_lookup, storage
    from .speed import throughput

    _refuse_empty_options(config)
    settings: dict[str, Any] = {}
    for name in _NUMBER_SETTINGS:
        try:
            settings[name] = option_values.parse_decimal(_setting(config, name), _option(name))
        except option_values.OptionValueError as exc:
            raise pytest.UsageError(str(exc)) from None
    settings["hold_gpu"] = bool(config.getoption("kernel_ab_hold_gpu") or config.getini("kernel_ab_hold_gpu"))
    throttle = _setting(config, "throttle")
    if throttle not in ("flag", "discard", "fail"):
        raise pytest.UsageError(f"--kernel-ab-throttle / kernel_ab_throttle: one of flag, discard, fail; "
                                f"got {throttle!r}")
    if throttle != "flag":  # the default leaves the report's settings as they were before the option
        settings["throttle"] = throttle
    calls = str(_setting(config, "calls_per_sample")).strip()
    if calls != "auto":  # as throttle: the default leaves the report's settings as they were
        count = option_values.count_text(calls)  # 0 is left to the budget, which says why it is refused
        if count is None or count > option_values.MAX_COUNT:
            raise pytest.UsageError(f"{_option('calls_per_sample')}: 'auto' or a whole number of calls, got "
                                    f"{option_values.shown(calls)}; accepted: 'auto', or a whole number from 1 to "
                                    f"{option_values.MAX_COUNT}, in ASCII digits")
        settings["calls_per_sample"] = count
    try:
        _budget_from(settings)
    except ValueError as exc:
        # The budget names its field ("budget alpha must be ..."): say which option set it.
        options = [_option(name) for name in settings if f"budget {name} " in str(exc)]
        raise pytest.UsageError(f"kernel A/B settings: {exc}" + (f" ({options[0]})" if options else "")) from None
    enabled = bool(config.getoption("kernel_ab") or config.getini("kernel_ab"))
    profile = None
    if config.getoption("kernel_ab_profile") or config.getoption("kernel_ab_trace"):
        from .speed import profiling

        try:
            profile = profiling.ProfileMode.from_options(True, config.getoption("kernel_ab_trace"))
        except OSError as exc:
            raise pytest.UsageError(f"--kernel-ab-trace: cannot create the trace folder: {exc}") from None
        enabled = True
    ceilings_mode = _setting(config, "ceilings")
    if ceilings_mode not in ("on", "off"):
        raise pytest.UsageError(f"--kernel-ab-ceilings / kernel_ab_ceilings: 'on' or 'off', got {ceilings_mode!r}")
    report_path = _setting(config, "report") or None
    compare_spec = _setting(config, "compare") or None
    storage_root = _storage_root(config)
    machine_folder = ThisMachine(storage_root)
    try:
        history_count = option_values.parse_count(_setting(config, "history"), _option("history"), minimum=0,
                                                  problem="not a count >= 0")
    except option_values.OptionValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    save_name = config.getoption("kernel_ab_save")
    # None: not given; an empty name is given, and refused by check_name rather than taken for "not saving".
    saving = save_name is not None or bool(config.getoption("kernel_ab_autosave") or
                                           config.getini("kernel_ab_autosave"))
    option_rules.check(config, ab=enabled, profiling=profile is not None, saving=saving,
                       comparing=compare_spec is not None, reporting=report_path is not None, history=history_count)
    previous = None
    save_folder = None
    try:
        if report_path:
            report.check_writable(report_path)
        # A storage folder that is a file, or cannot be written, is found now: at the end every result would be lost.
        if enabled and (saving or compare_spec and not storage.names_a_file(compare_spec) or
                        report_path and history_count):
            storage.check_folder(storage_root, writing=False)
        if save_name is not None:
            storage.check_name(save_name)
        if compare_spec:
            compare_path = run_lookup.resolve_compare(compare_spec, machine_folder)
            previous = report.load_report(compare_path)
            # A saved run of another machine is refused; a path is the user's explicit choice, compared with a
            # warning in the report and the summary (report.machine_lines), which is read at the end.
            if not storage.names_a_file(compare_spec):
                storage.check_same_machine(compare_spec, compare_path, previous.get("environment") or {},
                                           machine_folder.environment())
        if saving and enabled:
            save_folder = machine_folder()
            storage.check_folder(save_folder, writing=True)
    except (report.ReportError, storage.StorageError) as exc:
        raise pytest.UsageError(f"kernel A/B: {exc}") from None
    try:
        expressions = config.getoption("kernel_ab_compare_fail") or config.getini("kernel_ab_compare_fail")
        rules = gate.parse_rules(expressions)
        gate.check_rules(rules, comparing=previous is not None)
    except gate.GateError as exc:
        raise pytest.UsageError(f"kernel A/B: {exc}") from None
    raw_threads = _setting(config, "cpu_threads")
    try:
        cpu_threads = option_values.parse_count(raw_threads, _option("cpu_threads"), minimum=1,
                                                problem="not a count >= 1") if raw_threads not in (None, "") else None
    except option_values.OptionValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    session = ABSession(enabled, settings, report_path, previous, rules=rules, save_folder=save_folder,
                         save_name=save_name, rootpath=config.rootpath, history_count=history_count,
                         storage_root=storage_root, machine_folder=machine_folder,
                         ceilings=throughput.CeilingMeter(enabled=ceilings_mode == "on"), cpu_threads=cpu_threads,
                         profile=profile)
    if report_path and profile is None and not hasattr(config, "workerinput"):
        session.progress = report.ProgressWriter(report_path)
    if previous is not None and previous.get("finished") is False:
        session.notes.append(f"--kernel-ab-compare: the earlier report is of a run that did not finish "
                             f"({len(previous.get('comparisons') or ())} comparisons); only those are compared")
    config.stash[_SESSION] = session
    config.pluginmanager.register(_Collector(session), _COLLECTOR_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    collector = config.pluginmanager.get_plugin(_COLLECTOR_NAME)
    if collector is not None:
        config.pluginmanager.unregister(collector)


def _budget_from(settings: dict[str, Any]) -> Any:
    from .speed.ab import Budget

    return Budget().replace(**settings)


@pytest.fixture(scope="session")
def kernel_ab_ceilings(request: pytest.FixtureRequest) -> Any:
    """This process's :class:`pytest_kernelcheck.speed.throughput.CeilingMeter`: ceilings measured once per device and
    dtype. Override it in a conftest to inject other ceilings (a fake measurement in tests):

    >>> @pytest.fixture(scope="session")  # doctest: +SKIP
    ... def kernel_ab_ceilings():
    ...     return CeilingMeter(measure=lambda timer, dtype: CeilingRecord("gpu", dtype, tflops=900.0, gbps=4000.0))
    """
    return request.config.stash[_SESSION].ceilings


@pytest.fixture
def kernel_ab(request: pytest.FixtureRequest) -> Any:
    """Statistically tested speed comparisons: ``compare``, ``assert_faster``, ``assert_not_slower``,
    ``tournament`` and ``measure``.

    Skipped unless the run has ``--kernel-ab``.
    """
    session = request.config.stash[_SESSION]
    if not session.enabled:
        pytest.skip(ENABLE_HINT)
    from .speed.ab import KernelAB

    pending = request.node.stash.setdefault(_PENDING, [])
    if session.profile is not None:
        from .speed.profiling import ProfilingKernelAB

        return ProfilingKernelAB(session.profile, _budget_from(session.settings), nodeid=request.node.nodeid,
                                 test_name=request.node.name, shape=lambda: _shape_value(request),
                                 record=request.node.stash.setdefault(_PROFILED, []).append)
    return KernelAB(
        _budget_from(session.settings),
        nodeid=request.node.nodeid,
        test_name=request.node.name,
        shape=lambda: _shape_value(request),
        record=pending.append,
        ceilings=request.getfixturevalue("kernel_ab_ceilings"),
        cpu_threads=session.cpu_threads,
    )


def _shape_value(request: pytest.FixtureRequest) -> Any:
    """The test's ``shape`` (fixture or parameter), when the test has one."""
    funcargs = getattr(request.node, "funcargs", {})
    if "shape" in funcargs:
        return funcargs["shape"]
    if "shape" in request.fixturenames:
        return request.getfixturevalue("shape")
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    outcome = yield
    pending = item.stash.get(_PENDING, None)
    if pending:
        gpu = _worker_gpu(item.config.stash[_SESSION])
        if gpu is not None:  # a worker pinned to one GPU: its records say which, for the per-GPU summary
            for record in pending:
                record.setdefault("gpu", gpu.to_json())
        # A JSON string survives every transport (xdist's execnet included) whatever the records hold.
        setattr(outcome.get_result(), RECORDS_ATTRIBUTE, json.dumps(pending, default=str))
        pending.clear()
    profiled = item.stash.get(_PROFILED, None)
    if profiled:
        setattr(outcome.get_result(), PROFILE_ATTRIBUTE, json.dumps(profiled, default=str))
        profiled.clear()


def _worker_gpu(session: ABSession) -> Any:
    """This process's GPU under --kernel-gpus (records.GpuIdentity), looked up once; None when not pinned."""
    if session.gpu == ():
        import os

        from .speed import gpus

        pinned = gpus.pinned_gpu(os.environ)
        session.gpu = gpus.describe_gpu(pinned) if pinned is not None else None
    return session.gpu


class _Collector:
    """Per-run plugin object: gathers records from test reports (local or from xdist workers) and reports them."""

    def __init__(self, session: ABSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        payload = getattr(report, RECORDS_ATTRIBUTE, None)
        if payload:
            self.session.records.extend(json.loads(payload))
            if self.session.progress is not None and not self.session.finished:
                self.session.progress.maybe_write(lambda: report_so_far(self.session))
        profiled = getattr(report, PROFILE_ATTRIBUTE, None)
        if profiled:
            self.session.profiled.extend(json.loads(profiled))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        # Plain sessionfinish hooks run before the terminal reporter's wrapper prints the summary, and pytest exits
        # with the status as it stands after them: the last point where an unwritable report can fail the run.
        if not _reports_here(self.session, session.config):
            return
        finish(self.session)
        if self.session.errors and session.exitstatus == pytest.ExitCode.OK:  # a failed run keeps its own status
            session.exitstatus = pytest.ExitCode.USAGE_ERROR  # as for a report path refused at start-up
            self.session.errors = [f"{error} (exit status {int(session.exitstatus)})" for error in self.session.errors]
        if self.session.regressions and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a regression fails CI as a failed test would

    def pytest_terminal_summary(self, terminalreporter: Any, config: pytest.Config) -> None:
        if not _reports_here(self.session, config):
            return
        finish(self.session)  # done at session finish already; this covers a summary without it
        summarise(self.session, terminalreporter)


def _reports_here(session: ABSession, config: pytest.Config) -> bool:
    return session.enabled and not hasattr(config, "workerinput")  # xdist workers send, the controller reports


