"""pytest wiring for A/B speed comparisons: options, the ``kernel_ab`` fixture, report, pytest-xdist transport.

The work lives in :mod:`pytest_kernelcheck.speed.ab` (comparisons), :mod:`.stats` and :mod:`.report`; this module only
connects them to pytest. Results travel on the test report as the ``kernel_ab_records`` attribute (a JSON
string of :mod:`.records` in their JSON form), which pytest-xdist serialises with the report, so the controller's
summary sees every worker's results; the collector types them on arrival, and the report stays typed until it is
written.
"""
from __future__ import annotations

import json
from typing import Any

import pytest

from .ab_session import ABSession, finish, report_so_far, start, summarise
from .ab_settings import INI_DEFAULTS, NUMBER_SETTINGS, budget_from
from .settings import settings_of

RECORDS_ATTRIBUTE = "kernel_ab_records"
_PENDING = pytest.StashKey[list]()
_PROFILED = pytest.StashKey[list]()  # profile mode: profiling.ProfiledRun entries, as RECORDS_ATTRIBUTE's records
PROFILE_ATTRIBUTE = "kernel_ab_profiled"
_SESSION = pytest.StashKey["ABSession"]()
_COLLECTOR_NAME = "kernelcheck-ab-collector"

ENABLE_HINT = "A/B speed comparisons are off; pass --kernel-ab (or set kernel_ab = true in the ini file) to run them"



def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelcheck", "GPU kernel correctness and A/B speed checks")
    group.addoption(
        "--kernel-ab", action="store_true", default=None, dest="kernel_ab",
        help="run A/B speed comparisons (tests using the kernel_ab fixture); without it they are skipped",
    )
    parser.addini("kernel_ab", "run A/B speed comparisons without --kernel-ab", type="bool",
                  default=INI_DEFAULTS[""])
    for name, (_, _, text) in NUMBER_SETTINGS.items():
        group.addoption(f"--kernel-ab-{name.replace('_', '-')}", dest=f"kernel_ab_{name}", default=None, help=text)
        parser.addini(f"kernel_ab_{name}", text, default=INI_DEFAULTS[name])
    group.addoption(
        "--kernel-ab-hold-gpu", action="store_true", default=None, dest="kernel_ab_hold_gpu",
        help="hold the GPU with a spin kernel while each round is queued, so CUDA events time device work alone "
             "(host launch cost excluded); default: rounds queued back to back",
    )
    parser.addini("kernel_ab_hold_gpu", "hold the GPU while each A/B round is queued (device time alone)",
                  type="bool", default=INI_DEFAULTS["hold_gpu"])
    group.addoption(
        "--kernel-ab-throttle", dest="kernel_ab_throttle", default=None, metavar="flag|discard|fail",
        help="rounds taken with the SM clock more than 10%% below the session's highest: flag (default: keep "
             "them, note it), discard (drop them, decide on the rest) or fail (fail the comparison)",
    )
    parser.addini("kernel_ab_throttle", "throttled A/B rounds: flag, discard or fail (see --kernel-ab-throttle)",
                  default=INI_DEFAULTS["throttle"])
    group.addoption(
        "--kernel-ab-calls-per-sample", dest="kernel_ab_calls_per_sample", default=None, metavar="N",
        help="calls per timed sample for every comparison: auto (default: batch calls shorter than 50 us, so the "
             "count can differ between runs) or a count; a comparison's own calls_per_sample= still wins. Pin it "
             "when runs are compared (--kernel-ab-compare) at sizes near 50 us",
    )
    parser.addini("kernel_ab_calls_per_sample", "calls per timed sample (see --kernel-ab-calls-per-sample)",
                  default=INI_DEFAULTS["calls_per_sample"])
    group.addoption(
        "--kernel-ab-report", dest="kernel_ab_report", default=None, metavar="PATH",
        help="write the A/B report as JSON to PATH, with a markdown table (.md) and a plot (.png) beside it",
    )
    parser.addini("kernel_ab_report", "path of the A/B JSON report", default=INI_DEFAULTS["report"])
    group.addoption(
        # nargs="?": the option alone means the latest saved run ("latest", storage.LATEST).
        "--kernel-ab-compare", dest="kernel_ab_compare", default=None, metavar="RUN", nargs="?", const="latest",
        help="compare with an earlier run: alone, this machine's latest saved run; a saved run's number (0003), "
             "file stem (0003_NAME) or name (its latest run); or the path of an A/B JSON report. Adds a 'vs last "
             "run' column and flags regressions",
    )
    parser.addini("kernel_ab_compare", "earlier run to compare with: latest, a saved number or name, or a path",
                  default=INI_DEFAULTS["compare"])
    group.addoption(
        "--kernel-ab-save", dest="kernel_ab_save", default=None, metavar="NAME",
        help="save this run's JSON report in the storage folder, as this machine's next numbered run NNNN_NAME.json",
    )
    group.addoption(
        "--kernel-ab-autosave", action="store_true", default=None, dest="kernel_ab_autosave",
        help="save every run (as --kernel-ab-save), named by short commit hash (-dirty with changes) and UTC time",
    )
    parser.addini("kernel_ab_autosave", "save every A/B run (see --kernel-ab-autosave)", type="bool",
                  default=INI_DEFAULTS["autosave"])
    group.addoption(
        "--kernel-ab-storage", dest="kernel_ab_storage", default=None, metavar="PATH",
        help="folder of saved A/B runs, one subfolder per machine (default: .kernelcheck in the rootdir)",
    )
    parser.addini("kernel_ab_storage", "folder of saved A/B runs (relative to the rootdir)",
                  default=INI_DEFAULTS["storage"])
    group.addoption(
        "--kernel-ab-history", dest="kernel_ab_history", default=None, metavar="N",
        help="the markdown report shows each comparison's speedup in this machine's last N saved runs "
             "(default 5; 0: none)",
    )
    parser.addini("kernel_ab_history", "saved runs whose speedups the markdown report shows",
                  default=INI_DEFAULTS["history"])
    group.addoption(
        "--kernel-ab-compare-fail", dest="kernel_ab_compare_fail", action="append", default=None, metavar="EXPR",
        help="fail the session on A/B regressions (repeatable): 'verdict' (verdict worse than in the compared "
             "run: win > tie = inconclusive > loss), 'speedup:X%%' (interval wholly more than X%% below the "
             "earlier speedup) or 'loss' (any loss in this run)",
    )
    parser.addini("kernel_ab_compare_fail", "A/B gate rules, one a line (see --kernel-ab-compare-fail)",
                  type="linelist", default=INI_DEFAULTS["compare_fail"])
    group.addoption(
        "--kernel-ab-ceilings", dest="kernel_ab_ceilings", default=None, choices=("on", "off"),
        help="on (default): measure this GPU's matmul FLOP/s and copy GB/s once per session, for the share of "
             "the ceiling of comparisons given flops=/bytes=; off: skip the measurement",
    )
    parser.addini("kernel_ab_ceilings", "measure throughput ceilings: on or off (see --kernel-ab-ceilings)",
                  default=INI_DEFAULTS["ceilings"])
    group.addoption(
        "--kernel-ab-cpu-threads", dest="kernel_ab_cpu_threads", default=None, metavar="N",
        help="torch.set_num_threads(N) while each A/B comparison runs (restored after); 1 gives stable CPU times",
    )
    parser.addini("kernel_ab_cpu_threads", "torch threads during A/B comparisons (see --kernel-ab-cpu-threads)",
                  default=INI_DEFAULTS["cpu_threads"])
    group.addoption(
        "--kernel-ab-modes", dest="kernel_ab_modes", default=None, metavar="MODES",
        help="measurement modes of every comparison, comma-separated: throughput (default: back to back, host "
             "cost hidden), latency (one call from an idle GPU, host launch cost included), graph (CUDA graph "
             "replay); each gets its own samples and verdict, the first gives the row's verdict. A test's "
             "modes= or kernel_ab_modes marker wins",
    )
    parser.addini("kernel_ab_modes", "measurement modes of every comparison (see --kernel-ab-modes)",
                  default=INI_DEFAULTS["modes"])
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
def pytest_configure(config: pytest.Config) -> None:
    """Resolve the A/B options once, start this process's A/B session and register its collector."""
    config.addinivalue_line(
        "markers", "kernel_ab_modes(*modes): measurement modes of this test's kernel_ab comparisons (throughput, "
        "latency, graph), in place of --kernel-ab-modes; a comparison's own modes= still wins")
    session = start(settings_of(config).ab, config)  # every option resolved once, with the correctness options
    config.stash[_SESSION] = session
    config.pluginmanager.register(_Collector(session), _COLLECTOR_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    collector = config.pluginmanager.get_plugin(_COLLECTOR_NAME)
    if collector is not None:
        config.pluginmanager.unregister(collector)


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

        return ProfilingKernelAB(session.profile, budget_from(session.settings), nodeid=request.node.nodeid,
                                 test_name=request.node.name, shape=lambda: _shape_value(request),
                                 record=request.node.stash.setdefault(_PROFILED, []).append)
    return KernelAB(
        budget_from(session.settings),
        modes=_modes(request, session),
        nodeid=request.node.nodeid,
        test_name=request.node.name,
        shape=lambda: _shape_value(request),
        record=pending.append,
        ceilings=request.getfixturevalue("kernel_ab_ceilings"),
        cpu_threads=session.cpu_threads,
    )


def _modes(request: pytest.FixtureRequest, session: ABSession) -> Any:
    """The test's default modes: its ``kernel_ab_modes`` marker, else --kernel-ab-modes (throughput alone)."""
    marker = request.node.get_closest_marker("kernel_ab_modes")
    if marker is None:
        return session.options.modes if session.options is not None else ("throughput",)
    from .speed import modes

    try:
        given = marker.args[0] if len(marker.args) == 1 else (marker.args or marker.kwargs.get("modes", ()))
        return modes.parse_modes(given, "the kernel_ab_modes marker")
    except ValueError as exc:
        raise pytest.UsageError(f"{request.node.nodeid}: {exc}") from None


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
            from .results.records import record_from_json

            # JSON only on the hop (the same string in one process as from an xdist worker); typed from here on.
            self.session.records.extend(record for record in map(record_from_json, json.loads(payload)) if record)
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


