"""pytest wiring for pytest-kernelcheck's correctness checks: options, markers, fixtures and hooks only.

The logic lives in ``shapes`` (parametrization and ids), ``tolerance`` (policies, overrides, assert_close),
``reference`` (float64 attention references), ``memory`` (estimates, free memory, OOM handling),
``device_memory`` (the ``--kernel-device-memory`` cap), ``intractable`` (cases not to run) and ``gpus`` (one xdist
worker per GPU, ``--kernel-gpus``). torch is imported
inside hooks and fixtures, and only for tests that use a marker needing it, so ``pytest --help`` stays fast.
"""
from __future__ import annotations

import os
from typing import Any, Callable, TypeVar

import pytest

from .check.device_memory import apply_cap, header_line
from .check.intractable import (
    REASON_PROPERTY,
    case_reason,
    listed_cases,
    parse_intractable_marker,
)
from .check.memory import (
    forget_frames,
    is_out_of_memory,
    memory_skip_reason,
    oom_skip_reason,
    parse_memory_marker,
    release_memory,
)
from .check.shapes import Shape, expand_shape_markers, missing_device
from .settings import OOM_CHOICES, settings_of
from .speed import gpus

pytest_plugins = ["pytest_kernelcheck.plugin_ab"]

# Internal argname the shape marker parametrizes; the public ``shape`` fixture reads it.
SHAPE_ARGNAME = "_kernelcheck_shape"
_T = TypeVar("_T")

_had_oom = pytest.StashKey[bool]()
_cap_applied = pytest.StashKey[Any]()  # device_memory.DeviceFraction list where this process applied the cap
_spread_gpus = pytest.StashKey["tuple[str, ...]"]()  # the controller's: GPUs its workers were spread over
_instruction_before = pytest.StashKey["str | None"]()  # the controller's: the variable's value before it set it


class _HookSpecs:
    @pytest.hookspec(firstresult=True)
    def pytest_kernelcheck_visible_gpus(self, config: pytest.Config) -> "list[str] | None":
        """The CUDA devices ``--kernel-gpus`` may spread workers over, as ``CUDA_VISIBLE_DEVICES`` entries; None
        for the default (:func:`pytest_kernelcheck.speed.gpus.visible_gpus`). Called on the xdist controller only; a
        conftest can answer it to fake a multi-GPU host in tests:

        >>> def pytest_kernelcheck_visible_gpus(config):  # doctest: +SKIP
        ...     return ["0", "1"]
        """

MARKERS = (
    "shape(*cases, **axes): parametrize over named sizes. Each case is a mapping such as dict(B=4, S=2048, H=16, "
    "D=64); a keyword given as a list (dtype=[torch.float16, torch.bfloat16]) is crossed with every case, a scalar "
    "keyword is added to every case (1-D numpy arrays and tensors cross like lists). Stacked shape markers are "
    "crossed like stacked parametrize. The test takes the `shape` fixture (shape.B, shape.as_dict()); ids read "
    "B4-S2048-H16-D64-bfloat16, booleans as causal/nocausal.",
    "tolerance(policy=None, **fields): override the tolerance of assert_close calls in this test that pass no "
    "policy: a name ('tf32'), a dtype, a TolerancePolicy, fields (atol=, rtol=, baseline_factor=, baseline_floor=) "
    "or a per-dtype mapping {torch.float16: dict(atol=2e-3)}; the policy may be given positionally or as policy=. "
    "It applies to floating-point results: integer and bool results stay exact.",
    "memory(estimate, device=None): bytes the test needs (or a callable of the shape returning them). The test is "
    "skipped when the device's free memory is smaller. device None means the shape's or params' `device`, else "
    "CUDA when available, else the host. Stacked markers (test, class, module) each count; they are not added up.",
    "intractable(when, reason=None): do not run this case. `when` is a bool or a callable of the shape returning a "
    "reason string (or True to use `reason`). Stacked markers (test, class, module) each count. Skipped cases are "
    "listed in the terminal summary.",
)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(_HookSpecs)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kernelcheck", "pytest-kernelcheck: kernel correctness and speed")
    group.addoption(
        "--kernel-oom",
        action="store",
        choices=OOM_CHOICES,
        default=None,
        dest="kernel_oom",
        help="what an out-of-memory error raised by a test becomes: 'skip' (default) or 'fail'. ini: kernel_oom.",
    )
    parser.addini("kernel_oom", "out-of-memory errors in tests: 'skip' (default) or 'fail'", default="skip")
    group.addoption(
        "--kernel-device-memory",
        action="store",
        default=None,
        dest="kernel_device_memory",
        metavar="SIZE",
        help="cap the memory each CUDA device gives the tests (4GiB, 512MiB, 4GB or bytes): a smaller GPU on a "
        "big one; memory markers compare their estimates with it. ini: kernel_device_memory.",
    )
    parser.addini("kernel_device_memory", "device memory cap per CUDA device (see --kernel-device-memory)", default="")
    group.addoption(
        gpus.OPTION, action="store", default=None, dest="kernel_gpus", metavar="SPEC",
        help=f"under pytest-xdist, pin each worker to one GPU, round-robin by worker (gw0, gw1, ...): {gpus.ACCEPTED}. "
        "Default: all visible CUDA devices. Without xdist, or with one GPU, nothing changes. ini: kernel_gpus.",
    )
    parser.addini(gpus.INI, "GPUs to spread xdist workers over (see --kernel-gpus)", default="")


# The earliest hook a worker runs: before its conftest files are imported (one may touch CUDA), and after xdist has
# set PYTEST_XDIST_WORKER. CUDA reads CUDA_VISIBLE_DEVICES once, when it initialises, so the worker's GPU must be
# chosen before anything can initialise it. A plugin loaded by a conftest misses this hook; configure pins then.
@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    gpus.pin_worker(os.environ)


def pytest_configure(config: pytest.Config) -> None:
    """Register the markers, resolve every option once (:mod:`.settings`) and pin or spread the GPUs."""
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    _configure_gpus(config, settings_of(config))


def _configure_gpus(config: pytest.Config, settings: Any) -> None:
    """On an xdist controller, leave its workers the GPUs to pin to (gpus.pin_instruction); in a worker, make sure
    it is pinned before CUDA is used."""
    if hasattr(config, "workerinput"):
        gpu = gpus.pinned_gpu(os.environ)
        if gpu is not None and os.environ.get("CUDA_VISIBLE_DEVICES") != gpu:
            if gpus.cuda_initialised():  # too late: CUDA has read the variable already
                raise pytest.UsageError(f"{gpus.OPTION}: CUDA was initialised in worker "
                                        f"{os.environ.get('PYTEST_XDIST_WORKER')} before it could be pinned to GPU "
                                        f"{gpu} (load pytest_kernelcheck as an installed plugin or with -p)")
            gpus.pin_worker(os.environ)
        return
    if getattr(config.option, "dist", "no") == "no":
        return  # no workers (no xdist, or -n 0): nothing to spread, the option changes nothing
    visible = config.hook.pytest_kernelcheck_visible_gpus(config=config)
    visible = tuple(str(gpu) for gpu in visible) if visible is not None else gpus.visible_gpus()
    given = settings.gpus_given
    try:
        chosen = settings.gpu_spec.resolve(visible) if given or len(visible) > 1 else ()
    except gpus.GpuSpecError as exc:
        raise pytest.UsageError(str(exc)) from None
    if not given and len(chosen) < 2:
        return  # the default on a host of one GPU (or none): the run stays as it was
    config.stash[_spread_gpus] = chosen
    config.stash[_instruction_before] = os.environ.get(gpus.INSTRUCTION_VARIABLE)
    os.environ[gpus.INSTRUCTION_VARIABLE] = gpus.pin_instruction(chosen)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _spread_gpus not in config.stash:
        return
    before = config.stash[_instruction_before]  # an in-process run (pytester) must not leave its instruction behind
    if before is None:
        os.environ.pop(gpus.INSTRUCTION_VARIABLE, None)
    else:
        os.environ[gpus.INSTRUCTION_VARIABLE] = before


# Before the terminal reporter's (trylast) sessionstart prints the header, so the header can say what was set. An
# xdist controller runs no tests: it leaves CUDA alone, and each worker sets the cap in its own process.
def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    cap = settings_of(config).device_memory.value
    distributing = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if cap is not None and not distributing:
        config.stash[_cap_applied] = apply_cap(cap)


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = []
    if config.option.verbose > 0:  # -v: every option not left at its default, and where it came from
        lines += [f"kernelcheck setting: {line}" for line in settings_of(config).lines()]
    cap = settings_of(config).device_memory.value
    if cap is not None:
        lines.append(header_line(cap, config.stash.get(_cap_applied, None)))
    spread = config.stash.get(_spread_gpus, None)
    if spread is not None:
        lines.append(f"kernelcheck: one xdist worker per GPU, round-robin over CUDA devices {', '.join(spread)} "
                     f"({gpus.OPTION})")
    return lines


@pytest.fixture
def _kernelcheck_shape(request: pytest.FixtureRequest) -> Shape | None:
    return getattr(request, "param", None)


@pytest.fixture
def shape(_kernelcheck_shape: Shape | None) -> Shape:
    """The test's case from ``@pytest.mark.shape``: ``shape.B``, ``shape.get("causal", False)``, ``shape.as_dict()``."""
    if _kernelcheck_shape is None:
        pytest.fail("the `shape` fixture needs @pytest.mark.shape(...) on the test", pytrace=False)
    return _kernelcheck_shape


@pytest.fixture
def sdpa_reference():
    """A float64 attention reference with SDPA's semantics, and ``.check(out, q, k, v, ...)`` against it."""
    from .check.reference import SdpaReference

    return SdpaReference()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    definition = metafunc.definition
    # Every shape marker, closest to the test first (function, class, module), as stacked parametrize sees them.
    markers = [(marker.args, marker.kwargs) for marker in definition.iter_markers("shape")]

    def checked_shapes() -> list[Shape]:
        _check_markers(definition, has_shape=bool(markers))
        return expand_shape_markers(markers) if markers else []

    shapes = _failing_on_bad_marker(checked_shapes, f"{definition.nodeid}: ")
    if not markers:
        return
    if SHAPE_ARGNAME not in metafunc.fixturenames:
        pytest.fail(
            f"{definition.nodeid}: @pytest.mark.shape needs the test to take the `shape` fixture", pytrace=False
        )
    metafunc.parametrize(SHAPE_ARGNAME, shapes, ids=[s.id for s in shapes], indirect=True)


def _check_markers(definition: pytest.Function, has_shape: bool) -> None:
    """Surface bad marker arguments at collection rather than when each test runs."""
    tolerance = definition.get_closest_marker("tolerance")
    if tolerance is not None:
        from .check.tolerance import parse_tolerance_marker

        parse_tolerance_marker(tolerance.args, tolerance.kwargs)
    for memory in definition.iter_markers("memory"):  # every one counts (memory_skip_reason), so check each
        parse_memory_marker(memory.args, memory.kwargs, has_shape)
    for intractable in definition.iter_markers("intractable"):  # every one counts (case_reason), so check each
        parse_intractable_marker(intractable.args, intractable.kwargs, has_shape)


def _marked_shape(item: pytest.Item) -> Shape | None:
    """The Shape the shape marker parametrized this test with, or None for a test without one."""
    callspec = getattr(item, "callspec", None)
    return callspec.params.get(SHAPE_ARGNAME) if callspec is not None else None


# Between pytest's skip/skipif evaluation and fixture set-up. After skipif, because a test skipped for a more
# basic reason (no GPU) should say that, not that its memory does not fit; before fixtures, because they may
# allocate what the estimate says does not fit. A plain hookimpl gets exactly that slot: the skipping plugin's
# setup is tryfirst, and the runner's (which sets up fixtures) is a builtin plain hookimpl registered before any
# installed plugin, and pluggy calls later registrations first. test_memory pins both orders.
def pytest_runtest_setup(item: pytest.Item) -> None:
    shape = _marked_shape(item)
    reason = missing_device(shape)  # the most basic reason first: a case for a device this machine lacks
    if reason is not None:
        raise _skip(reason)
    intractable = [(marker.args, marker.kwargs) for marker in item.iter_markers("intractable")]
    if intractable:
        reason = _failing_on_bad_marker(lambda: case_reason(intractable, shape))
        if reason is not None:
            item.user_properties.append((REASON_PROPERTY, reason))
            raise _skip(f"intractable: {reason}")
    memory = [(marker.args, marker.kwargs) for marker in item.iter_markers("memory")]
    if memory:
        params = dict(item.callspec.params) if hasattr(item, "callspec") else {}
        cap = settings_of(item.config).device_memory.value
        reason = _failing_on_bad_marker(lambda: memory_skip_reason(memory, shape, params, cap))
        if reason is not None:
            raise _skip(reason)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    marker = item.get_closest_marker("tolerance")
    if marker is None:
        return (yield)
    from .check.tolerance import parse_tolerance_marker, use_override

    with use_override(parse_tolerance_marker(marker.args, marker.kwargs)):
        return (yield)


# Out-of-memory errors are judged on the report, not caught in the call: that covers fixtures (setup) as well
# as the test body, and lets pytest decide first. tryfirst makes this wrapper the outermost, so the skipping
# plugin has already turned an OOM that an xfail marker expects into an xfail; such a report is left alone. An
# OOM caught by pytest.raises never reaches a report.
@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    report = yield
    error = call.excinfo.value if call.excinfo is not None else None
    if error is None or not is_out_of_memory(error):
        return report
    # Tensors referenced from the failed frames would otherwise live on in the traceback (and in
    # sys.last_traceback), holding the memory the next test needs. The report's text is already built.
    forget_frames(error)
    item.stash[_had_oom] = True
    release_memory()
    # At teardown the test has already been reported; a skip would count it twice, so that stays an error.
    if hasattr(report, "wasxfail") or call.when == "teardown" or settings_of(item.config).oom.value == "fail":
        return report
    try:
        raise _skip(oom_skip_reason(error, settings_of(item.config).device_memory.value))
    except pytest.skip.Exception:
        # The call now holds the skip, as if the test had raised it: pytest reports it at the test's location
        # and does not offer --pdb for it.
        call.excinfo = pytest.ExceptionInfo.from_current()
    skipped = pytest.TestReport.from_item_and_call(item, call)
    report.outcome, report.longrepr = skipped.outcome, skipped.longrepr
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    try:
        return (yield)
    finally:
        if item.stash.get(_had_oom, False):
            release_memory()  # fixtures are gone now; give their memory back too


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    entries = listed_cases(terminalreporter.stats.get("skipped", []))
    if entries:
        terminalreporter.section("kernelcheck: intractable cases", sep="-")
        for nodeid, reason in entries:
            terminalreporter.line(f"{nodeid}: {reason}")


def _failing_on_bad_marker(compute: Callable[[], _T], prefix: str = "") -> _T:
    """``compute()``; a TypeError or ValueError from it (bad marker arguments) fails the test with its message."""
    try:
        return compute()
    except (TypeError, ValueError) as exc:
        problem = f"{prefix}{exc}"
    pytest.fail(problem, pytrace=False)  # outside the except block, so no chained traceback is shown


def _skip(reason: str) -> BaseException:
    """A skip reported at the test's own location, as pytest's skipif marker does."""
    try:
        return pytest.skip.Exception(reason, _use_item_location=True)
    except TypeError:  # pytest without the keyword: the location is this module's, the reason is intact
        return pytest.skip.Exception(reason)
