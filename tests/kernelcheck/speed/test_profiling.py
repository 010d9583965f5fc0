"""Profile mode: --kernel-ab-profile runs each compared callable once after a warm-up inside its NVTX range and times
nothing; --kernel-ab-trace writes a torch.profiler Chrome trace per comparison."""
from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from pytest_kernelcheck.speed.profiling import (
    WARMUP_CALLS,
    ProfileMode,
    ProfilingKernelAB,
    profile_callables,
    range_name,
    trace_file_name,
)

pytest_plugins = ["pytester"]


@pytest.fixture
def nvtx_log(monkeypatch):
    """torch.cuda.nvtx push and pop recorded (a CPU build of torch has none to call)."""
    events: list[tuple[str, str]] = []
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: events.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append(("pop", "")))
    return events


def _logging(events, side):
    def call():
        events.append(("call", side))
        return side

    return call


def test_range_and_trace_names_carry_the_test_the_comparison_and_the_side():
    nodeid = "tests/perf/test_a.py::test_fwd[B4-S2048-bfloat16-causal]"
    assert range_name(nodeid, "fwd vs sdpa", "baseline") == f"kernelcheck:{nodeid}:fwd vs sdpa:baseline"
    name = trace_file_name(nodeid, "fwd vs sdpa")
    assert re.fullmatch(r"[A-Za-z0-9._-]+\.json", name), name
    assert name.startswith("tests_perf_test_a.py_test_fwd_B4-S2048-bfloat16-causal_--fwd_vs_sdpa-")
    # Ids that sanitize alike still get files of their own, and a long id is cut to a usable file name.
    assert trace_file_name("t.py::a/b", "n") != trace_file_name("t.py::a_b", "n")
    assert len(trace_file_name("t.py::" + "x" * 1000, "n")) < 200


def test_every_callable_is_warmed_up_then_run_once_inside_its_own_range(nvtx_log):
    run = profile_callables({"candidate": _logging(nvtx_log, "candidate"), "baseline": _logging(nvtx_log, "baseline")},
                            nodeid="t.py::t", name="pair")
    first_push = nvtx_log.index(("push", "kernelcheck:t.py::t:pair:candidate"))
    warm = nvtx_log[:first_push]
    assert warm.count(("call", "candidate")) == warm.count(("call", "baseline")) == WARMUP_CALLS
    assert nvtx_log[first_push:] == [
        ("push", "kernelcheck:t.py::t:pair:candidate"), ("call", "candidate"), ("pop", ""),
        ("push", "kernelcheck:t.py::t:pair:baseline"), ("call", "baseline"), ("pop", ""),
    ]
    assert run.nvtx and run.sides == ("candidate", "baseline") and run.trace is None
    assert "nothing timed" in run.describe()


def test_without_nvtx_the_calls_still_run_and_the_run_says_the_ranges_were_not_emitted(monkeypatch):
    def no_nvtx(name):
        raise RuntimeError("NVTX functions not installed. Are you sure you have a CUDA build?")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", no_nvtx)
    calls: list[tuple[str, str]] = []
    run = profile_callables({"measured": _logging(calls, "measured")}, nodeid="t.py::t", name="m")
    assert calls.count(("call", "measured")) == WARMUP_CALLS + 1
    assert not run.nvtx and "NVTX functions not installed" in run.nvtx_note
    assert "NVTX ranges not emitted" in run.describe()
    assert "were not emitted (RuntimeError: NVTX functions" in ProfileMode().summary_lines([run.to_json()])[0]


def test_a_failing_callable_names_its_side_and_closes_its_range(nvtx_log):
    state = {"calls": 0}

    def fails_when_profiled():
        state["calls"] += 1
        if state["calls"] > WARMUP_CALLS:
            raise ValueError("boom")

    with pytest.raises(Exception, match="baseline") as failure:
        profile_callables({"candidate": lambda: 1, "baseline": fails_when_profiled}, nodeid="t.py::t", name="n")
    assert "boom" in str(failure.value.__cause__)
    pushes = sum(1 for kind, _ in nvtx_log if kind == "push")
    assert pushes == 2 and pushes == sum(1 for kind, _ in nvtx_log if kind == "pop")


def test_inputs_are_made_once_and_given_to_every_side(nvtx_log):
    made: list[int] = []

    def make():
        made.append(1)
        return (torch.ones(3), 2.0)

    seen: list[float] = []
    ab = ProfilingKernelAB(ProfileMode(), nodeid="t.py::t", test_name="t")
    ab.compare(lambda x, s: seen.append(float((x * s).sum())), lambda x, s: seen.append(float(x.sum() * s)),
               inputs=make)
    assert made == [1] and seen == [6.0] * (2 * (WARMUP_CALLS + 1))
    with pytest.raises(TypeError, match="candidate must accept the inputs"):
        ab.compare(lambda: None, lambda x, s: None, inputs=make, name="wrong arity")


def test_the_fixture_object_keeps_the_timed_rules_for_names_and_budget_keywords(nvtx_log):
    entries: list[dict] = []
    ab = ProfilingKernelAB(ProfileMode(), nodeid="t.py::t", test_name="t", record=entries.append)
    tournament = ab.tournament({"a": lambda: 1, "b": lambda: 2, "c": lambda: 3}, max_time=5.0, flops=1e9)
    assert tournament.ranges == tuple(f"kernelcheck:t.py::t:t:{v}" for v in "abc")
    assert ab.measure(lambda: 1).ranges == ("kernelcheck:t.py::t:t #2:measured",)
    with pytest.raises(ValueError, match="already used"):
        ab.compare(lambda: 1, lambda: 2, name="t")
    with pytest.raises(TypeError, match="unknown budget keyword 'max_tme'"):
        ab.compare(lambda: 1, lambda: 2, name="typo", max_tme=1)
    assert [entry["callables"] for entry in entries] == [3, 1]
    assert ab.assert_faster(lambda: 1, lambda: 2, name="no verdict to assert").name == "no verdict to assert"


def test_reading_a_timed_result_field_skips_the_test_saying_nothing_was_timed(nvtx_log):
    run = profile_callables({"a": lambda: 1, "b": lambda: 2}, nodeid="t.py::t", name="pair")
    with pytest.raises(pytest.skip.Exception, match="'pair' was run, not timed, so it has no 'best'"):
        run.best  # noqa: B018
    with pytest.raises(AttributeError):  # protocols (copy, pickle) still see an ordinary object
        run.__deepcopy_helper__  # noqa: B018


def test_a_trace_is_a_chrome_trace_with_each_range_in_it(tmp_path, nvtx_log):
    x = torch.randn(32, 32)
    run = profile_callables({"candidate": lambda: x @ x, "baseline": lambda: torch.mm(x, x)}, nodeid="t.py::t[a/b]",
                            name="mm", trace_dir=tmp_path)
    assert run.trace == str(tmp_path / trace_file_name("t.py::t[a/b]", "mm"))
    events = json.loads((tmp_path / trace_file_name("t.py::t[a/b]", "mm")).read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert set(run.ranges) <= names
    assert "aten::mm" in names  # the profiled calls' own work, not only the labels


def test_mode_from_options_creates_the_trace_folder(tmp_path):
    assert ProfileMode.from_options(False, None) is None
    mode = ProfileMode.from_options(False, str(tmp_path / "deep" / "traces"))
    assert mode is not None and mode.trace_dir == (tmp_path / "deep" / "traces").resolve()
    assert mode.trace_dir.is_dir()


PROFILED_TESTS = """
import torch

x = torch.randn(64, 64)

def test_pair(kernel_ab):
    kernel_ab.compare(lambda: x @ x, lambda: torch.mm(x, x), name="mm", max_time=0.1)
    kernel_ab.assert_faster(lambda: torch.mm(x, x).sum(), lambda: x.sum(), name="a loser passes: no verdict")

def test_tournament_and_measure(kernel_ab):
    kernel_ab.tournament({"mm": lambda: x @ x, "einsum": lambda: torch.einsum("ij,jk->ik", x, x), "t": lambda: x.t()})
    kernel_ab.measure(lambda: x.sum())

def test_reads_a_verdict(kernel_ab):
    assert kernel_ab.compare(lambda: 1, lambda: 2).verdict == "win"
"""


def test_profile_run_times_nothing_writes_no_report_and_says_so(pytester):
    pytester.makepyfile(PROFILED_TESTS)
    # --kernel-ab-profile turns the A/B tests on by itself.
    result = pytester.runpytest("--kernel-ab-profile", "--kernel-ab-report", "ab.json", "-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "*kernel A/B profile*",
        "kernelcheck: profile mode, 10 callables run*nothing timed*",
        "*test_reads_a_verdict* was run, not timed, so it has no 'verdict'",
    ])
    assert "verdict" not in result.stdout.str().split("kernel A/B profile")[1].split("short test summary")[0]
    assert not (pytester.path / "ab.json").exists()


def test_trace_run_writes_one_chrome_trace_per_comparison_under_xdist(pytester):
    pytest.importorskip("xdist")
    pytester.makepyfile(PROFILED_TESTS)
    result = pytester.runpytest_subprocess("--kernel-ab-trace", "traces", "-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=2, skipped=1)
    result.stdout.fnmatch_lines([
        "kernelcheck: profile mode, 10 callables run*nothing timed*",  # workers' runs reach the controller
        f"kernelcheck: 5 torch.profiler traces in {pytester.path / 'traces'}",
    ])
    files = sorted(path.name for path in (pytester.path / "traces").iterdir())
    assert len(files) == 5 and all(name.startswith("test_trace_run_writes_one_chrome_trace") for name in files)
    expected = trace_file_name("test_trace_run_writes_one_chrome_trace_per_comparison_under_xdist.py::test_pair", "mm")
    trace = json.loads((pytester.path / "traces" / expected).read_text())
    assert any(str(event.get("name", "")).endswith(":mm:baseline") for event in trace["traceEvents"])



def test_a_profiled_tournament_refuses_the_variants_a_timed_one_refuses(nvtx_log):
    # {1: f, "1": g} became {"1": g}: one variant was silently never run inside a range, while the timed run of the
    # same test refuses it; so were one variant and one callable under two names.
    import random

    from pytest_kernelcheck import run_tournament

    key = random.randrange(100)
    shared = lambda: key  # noqa: E731
    bad = [{key: lambda: 1, str(key): lambda: 2, "b": lambda: 3}, {"only": lambda: 1}, {"a": shared, "b": shared}]
    ab = ProfilingKernelAB(ProfileMode(), nodeid="t.py::t", test_name="t")
    for variants in bad:
        with pytest.raises(ValueError) as timed:
            run_tournament(variants)
        with pytest.raises(ValueError) as profiled:
            ab.tournament(variants)
        assert str(profiled.value) == str(timed.value)
    assert nvtx_log == []  # refused before anything ran


def test_profiled_comparisons_refuse_the_inputs_and_check_a_timed_one_refuses(nvtx_log):
    # a check of the wrong type, a non-callable inputs= and a check of the wrong type with inputs= ran in profile
    # mode, while the timed run of the same test refuses them.
    from pytest_kernelcheck import run_comparison

    rng = np.random.default_rng()
    x = rng.random(8)
    ab = ProfilingKernelAB(ProfileMode(), nodeid="t.py::t", test_name="t")
    bad = [dict(check=3), dict(inputs=(x,)), dict(inputs=lambda: (x,), check=3)]
    for arguments in bad:
        with pytest.raises(TypeError) as timed:
            run_comparison(lambda *a: x * 2, lambda *a: x + x, **arguments)
        with pytest.raises(TypeError) as profiled:
            ab.compare(lambda *a: x * 2, lambda *a: x + x, **arguments)
        assert str(profiled.value) == str(timed.value)
        with pytest.raises(TypeError):
            ab.tournament({"a": lambda *a: x * 2, "b": lambda *a: x + x}, **arguments)
    assert nvtx_log == []  # refused before anything ran
