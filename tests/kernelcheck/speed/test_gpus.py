"""--kernel-gpus: spec parsing, round-robin assignment, the visible GPUs, what each xdist worker sees, the lock key,
records naming their GPU, the per-GPU summary, verdict disagreements, and earlier runs matched per GPU model."""
from __future__ import annotations

import json

import pytest

from pytest_kernelcheck.speed import gpus
from pytest_kernelcheck.speed.gpu_lock import cuda_lock_key
from pytest_kernelcheck.results.records import ComparisonRecord, GpuIdentity, RunDetails
from pytest_kernelcheck.results.report_record import ABReport
from pytest_kernelcheck.results.report import build_report, gpu_lines
from pytest_kernelcheck.results.storage import machine_slug

pytest_plugins = ["pytester"]


@pytest.mark.parametrize("text, expected", [
    ("all", ("0", "1", "2", "3")), ("ALL", ("0", "1", "2", "3")), ("2", ("0", "1")), ("3,1", ("3", "1")),
    ("2,", ("2",)), (" 0 , 2 ", ("0", "2")),
])
def test_spec_forms_resolve_against_the_visible_gpus(text, expected):
    assert gpus.parse_spec(text).resolve(("0", "1", "2", "3")) == expected


@pytest.mark.parametrize("text, message", [
    ("gpu0", "is not 'all', a count"), ("0", "at least 1"), ("-1", "is not 'all'"), ("1,,2", "is not 'all'"),
    ("1,1", "lists a device twice"), ("", "is not 'all'"),
])
def test_bad_specs_name_the_option_and_the_accepted_forms(text, message):
    with pytest.raises(gpus.GpuSpecError, match="--kernel-gpus / kernel_gpus") as info:
        gpus.parse_spec(text)
    assert message in str(info.value)


def test_asking_for_more_gpus_than_visible_says_how_many_are():
    with pytest.raises(gpus.GpuSpecError, match="3 GPUs asked for, 2 visible"):
        gpus.parse_spec("3").resolve(("0", "1"))
    with pytest.raises(gpus.GpuSpecError, match="CUDA device 5 is not visible"):
        gpus.parse_spec("0,5").resolve(("0", "1"))


def test_workers_get_gpus_round_robin_by_worker_index():
    assert [gpus.assign(f"gw{i}", ("4", "6", "7")) for i in range(7)] == ["4", "6", "7", "4", "6", "7", "4"]
    with pytest.raises(ValueError, match="worker id"):
        gpus.assign("master", ("0",))


def test_visible_gpus_respect_cuda_visible_devices_and_else_ask_nvml():
    class FakeNvml:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetCount(self):
            return 3

    class BrokenNvml:
        def nvmlInit(self):
            raise RuntimeError("no driver")

    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": "5,GPU-ab,,7"}, nvml=FakeNvml()) == ("5", "GPU-ab")
    assert gpus.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, nvml=FakeNvml()) == ()
    assert gpus.visible_gpus({}, nvml=FakeNvml()) == ("0", "1", "2")
    assert gpus.visible_gpus({}, nvml=BrokenNvml()) == ()


def test_only_a_direct_worker_of_the_instructing_controller_is_pinned():
    instruction = gpus.pin_instruction(("2", "3"), controller_pid=100)
    worker = {"PYTEST_XDIST_WORKER": "gw1", gpus.INSTRUCTION_VARIABLE: instruction, "CUDA_DEVICE_ORDER": "X"}
    assert gpus.pin_worker(worker, parent_pid=100) == "3"
    assert worker["CUDA_VISIBLE_DEVICES"] == "3" and worker["CUDA_DEVICE_ORDER"] == "X"  # a set order is kept
    grandchild = {"PYTEST_XDIST_WORKER": "gw1", gpus.INSTRUCTION_VARIABLE: instruction}
    assert gpus.pin_worker(grandchild, parent_pid=555) is None and "CUDA_VISIBLE_DEVICES" not in grandchild
    controller = {gpus.INSTRUCTION_VARIABLE: instruction}
    assert gpus.pin_worker(controller, parent_pid=100) is None


def test_the_lock_follows_the_physical_gpu_not_the_renumbered_index():
    # Two pinned workers both call their GPU cuda:0; without a UUID their keys must still differ.
    assert cuda_lock_key(None, 0, {"CUDA_VISIBLE_DEVICES": "2"}) != cuda_lock_key(None, 0, {"CUDA_VISIBLE_DEVICES": "3"})
    assert cuda_lock_key(None, 0, {"CUDA_VISIBLE_DEVICES": "3"}) == cuda_lock_key(None, 3, {})
    assert cuda_lock_key("GPU-a", 0, {"CUDA_VISIBLE_DEVICES": "3"}) == "cuda-GPU-a"


def test_a_gpu_is_described_from_nvml_by_index_or_uuid():
    class FakeNvml:
        def nvmlInit(self):
            pass

        def nvmlDeviceGetHandleByUUID(self, uuid):
            return {"GPU-9": 5}[uuid]

        def nvmlDeviceGetIndex(self, handle):
            return handle

        def nvmlDeviceGetName(self, handle):
            return "NVIDIA H100"

        def nvmlDeviceGetUUID(self, handle):
            return f"GPU-{handle + 4}"

    assert gpus.describe_gpu("GPU-9", nvml=FakeNvml()) == GpuIdentity(5, "NVIDIA H100", "GPU-9")
    assert gpus.describe_gpu("GPU-x", nvml=object()) == GpuIdentity(None, None, "GPU-x")


def _row(name, verdict, index, model="NVIDIA H200", nodeid="t.py::a", clock=None, elapsed_s=1.0):
    row = {"kind": "comparison", "nodeid": nodeid, "name": name, "verdict": verdict, "speedup": 1.1,
           "ci": [1.05, 1.15], "p_value": 0.01, "elapsed_s": elapsed_s,
           "gpu": {"index": index, "name": model, "uuid": f"GPU-{index}"}}
    if clock:
        row["clock"] = {"available": True, "sm_clock_mhz": {"start": clock[1], "min": clock[0], "end": clock[1]}}
    return row


def test_rows_keep_their_gpu_through_the_report_and_old_rows_load_without_one():
    failed = ComparisonRecord.of_error("f", RuntimeError("boom"))
    failed = ComparisonRecord(**{**failed.__dict__, "run": RunDetails(gpu=GpuIdentity(1, "NVIDIA H200", "GPU-1"))})
    built = build_report([_row("a", "win", 0), failed.to_json()], settings={})
    typed = ABReport.from_json(json.loads(json.dumps(built)))
    assert sorted(row.run.gpu.index for row in typed.comparisons) == [0, 1]
    old = ComparisonRecord.from_json({"kind": "comparison", "name": "a", "verdict": "tie"})
    assert old.run.gpu is None and "gpu" not in old.to_json()


def test_per_gpu_summary_counts_time_and_clock_range_per_gpu():
    built = build_report([_row("a", "win", 1, clock=(1700, 1980)), _row("b", "tie", 1, clock=(1900, 1950)),
                          _row("a", "win", 0, elapsed_s=2.5)], settings={})
    assert gpu_lines(built) == [
        "Per GPU (2):",
        "GPU 0 (NVIDIA H200, GPU-0): 1 comparison(s) (1 win), 2.5 s timing",
        "GPU 1 (NVIDIA H200, GPU-1): 2 comparison(s) (1 win, 1 tie), 2.0 s timing, SM clock 1700-1980 MHz",
    ]
    assert gpu_lines(build_report([{"kind": "comparison", "name": "a", "verdict": "tie"}], settings={})) == []


def test_a_verdict_that_differs_between_gpus_of_one_model_is_a_warning_and_across_models_it_is_not():
    same_model = build_report([_row("a", "win", 0), _row("a", "loss", 1), _row("b", "tie", 0),
                               _row("b", "tie", 1)], settings={})
    warnings = [line for line in gpu_lines(same_model) if line.startswith("WARNING")]
    assert warnings == ["WARNING: t.py::a a: verdicts differ across NVIDIA H200 GPUs: win on GPU 0, loss on GPU 1"]
    mixed = build_report([_row("a", "win", 0), _row("a", "loss", 1, model="NVIDIA A100")], settings={})
    assert not [line for line in gpu_lines(mixed) if line.startswith("WARNING")]


def test_earlier_runs_are_matched_within_one_gpu_model_only():
    previous = build_report([_row("a", "win", 0, model="NVIDIA H100"), _row("a", "win", 1)], settings={})
    old_layout = build_report([{"kind": "comparison", "nodeid": "t.py::a", "name": "a", "verdict": "win",
                                "speedup": 1.2, "ci": [1.1, 1.3], "p_value": 0.01}], settings={})
    now = [_row("a", "loss", 3), _row("a", "tie", 4, model="NVIDIA A100")]
    rows = {row.run.gpu.model: row for row in ABReport.from_json(
        build_report(now, settings={}, previous=previous)).comparisons}
    assert rows["NVIDIA H200"].vs_last is not None and rows["NVIDIA H200"].vs_last.verdict == "win"
    assert rows["NVIDIA H200"].vs_last.regression  # win -> loss on the same model
    assert rows["NVIDIA A100"].vs_last is None  # never compared with an H100's or H200's row
    # A report from before rows named their GPU was saved per machine (model): its rows still match.
    assert ABReport.from_json(build_report(now[:1], settings={}, previous=old_layout)).comparisons[0].vs_last
    h200 = {"gpu": {"available": True, "devices": ["NVIDIA H200"] * 8}}
    assert machine_slug(h200) == machine_slug({"gpu": {"available": True, "devices": ["NVIDIA H200"]}})
    assert machine_slug({"gpu": {"available": True, "devices": ["NVIDIA H200", "NVIDIA H100"]}}) not in (
        machine_slug(h200), machine_slug({"gpu": {"available": True, "devices": ["NVIDIA H100"]}}))


CONFTEST = """
def pytest_kernelcheck_visible_gpus(config):
    return {gpus!r}
"""

WORKER_ENV = """
import json, os, pathlib

def test_where(kernel_ab):
    worker = os.environ["PYTEST_XDIST_WORKER"]
    seen = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "order": os.environ.get("CUDA_DEVICE_ORDER")}
    pathlib.Path(f"seen_{worker}.json").write_text(json.dumps(seen))
    kernel_ab.compare(lambda: sum(range(2000)), lambda: sum(range(4000)), name="sums")
"""


def test_each_worker_sees_only_its_own_gpu_and_its_records_name_it(pytester):
    pytester.makeconftest(CONFTEST.format(gpus=["4", "6"]))
    pytester.makepyfile(test_where=WORKER_ENV)
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "each", "--kernel-gpus", "all", "--kernel-ab",
                                           "--kernel-ab-max-time", "0.1", "--kernel-ab-report", "r.json",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    seen = {worker: json.loads((pytester.path / f"seen_{worker}.json").read_text()) for worker in ("gw0", "gw1")}
    assert seen == {"gw0": {"visible": "4", "order": "PCI_BUS_ID"}, "gw1": {"visible": "6", "order": "PCI_BUS_ID"}}
    rows = json.loads((pytester.path / "r.json").read_text())["comparisons"]
    assert sorted(row["gpu"]["index"] for row in rows) == [4, 6]
    result.stdout.fnmatch_lines(["*one xdist worker per GPU, round-robin over CUDA devices 4, 6*",
                                 "Per GPU (2):", "GPU 4*: 1 comparison(s)*", "GPU 6*: 1 comparison(s)*"])


def test_one_gpu_or_no_xdist_changes_nothing_and_bad_specs_are_usage_errors(pytester):
    pytester.makeconftest(CONFTEST.format(gpus=["0"]))
    pytester.makepyfile(test_env="import os\ndef test_env():\n    assert 'CUDA_VISIBLE_DEVICES' not in os.environ\n")
    pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider").assert_outcomes(passed=1)
    # Without workers the option is checked but nothing is pinned, whatever it asks for.
    pytester.runpytest("--kernel-gpus", "3", "-p", "no:cacheprovider", "-p", "no:xdist").assert_outcomes(passed=1)
    result = pytester.runpytest("--kernel-gpus", "two", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-gpus / kernel_gpus: 'two' is not 'all', a count of GPUs*"])
    result = pytester.runpytest("-n", "2", "--kernel-gpus", "2", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-gpus: 2 GPUs asked for, 1 visible*"])


@pytest.mark.parametrize("text", ["²", "0,²", "٣", "1,٣"])
def test_digits_other_than_ascii_are_refused_naming_the_option(text):
    # "²".isdigit() is true but int() refuses it (an INTERNALERROR); int("٣") is 3, a count nobody typed.
    with pytest.raises(gpus.GpuSpecError, match="--kernel-gpus / kernel_gpus: .* is not 'all', a count"):
        gpus.parse_spec(text)


def test_an_empty_kernel_gpus_on_the_command_line_is_a_usage_error(pytester):
    # An unset variable (--kernel-gpus "$GPUS") read as "not given", so every visible GPU was used.
    pytester.makepyfile(test_env="def test_env():\n    pass\n")
    result = pytester.runpytest("--kernel-gpus", "", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--kernel-gpus / kernel_gpus: '' is not 'all', a count of GPUs*"])
