"""End to end with pytester: measurement modes per test and per run, disagreeing modes flagged in the terminal,
markdown, JSON and plot, outputs compared by default, messages that name a tensor without printing it, and the
model-level comparisons (forward, training step, generation) on the CPU with tiny torch modules."""
from __future__ import annotations

import json

import pytest

pytest_plugins = ["pytester"]

FAST = ["--kernel-ab", "--kernel-ab-max-time", "0.2", "-p", "no:cacheprovider"]

SPLIT_PAIR = """
from pytest_kernelcheck.speed.simulated_timer import SimulatedTimer

def noisy(mean_s):
    return lambda rng, now: mean_s * (1 + 0.01 * rng.gauss(0, 1))

def split_pair():
    # Wins back to back, loses from an idle GPU: the launch cost shows in one call alone.
    candidate, baseline = (lambda: None), (lambda: None)
    timers = {
        "throughput": SimulatedTimer({candidate: noisy(0.9e-3), baseline: noisy(1.0e-3)}),
        "latency": SimulatedTimer({candidate: noisy(1.25e-3), baseline: noisy(1.0e-3)}, seed=1,
                                  device_models={candidate: noisy(0.85e-3), baseline: noisy(0.95e-3)}),
    }
    return candidate, baseline, timers
"""


def test_a_pair_whose_modes_disagree_is_flagged_in_every_output(pytester):
    pytester.makepyfile(SPLIT_PAIR + """
def test_attention(kernel_ab):
    candidate, baseline, timers = split_pair()
    result = kernel_ab.compare(candidate, baseline, timer=timers, modes=("throughput", "latency"), name="attn")
    assert result.verdict == "win" and result.modes["latency"].verdict == "loss"
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "*attn*win (modes disagree)*",
        "Measurement modes*host overhead = latency - device time*",
        "attn*latency*loss*[34][09]? / *",
        "MODES DISAGREE in 1 comparison(s): attn (throughput win, latency loss)*",
    ])
    report = json.loads((pytester.path / "ab.json").read_text())
    row = report["comparisons"][0]
    assert row["modes_disagree"] is True and row["mode"] == "throughput" and report["summary"]["modes_disagree"] == 1
    assert [m["mode"] for m in row["modes"]] == ["throughput", "latency"]
    assert row["modes"][1]["candidate_host_ms"] == pytest.approx(0.4, abs=0.02)
    markdown = (pytester.path / "ab.md").read_text()
    assert "## Measurement modes" in markdown and "**MODES DISAGREE in 1 comparison(s)" in markdown


def test_the_plot_marks_a_row_whose_modes_disagree():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pytest_kernelcheck.results.modes_text import mark_plot
    from pytest_kernelcheck.results.records import ComparisonRecord, ModeRecord

    agree = ComparisonRecord("a", "win", speedup=1.1, modes=(ModeRecord("throughput", "win"),
                                                             ModeRecord("latency", "win")))
    split = ComparisonRecord("b", "win", speedup=1.03, modes=(ModeRecord("throughput", "win"),
                                                              ModeRecord("latency", "loss")))
    figure, axes = plt.subplots()
    handle = mark_plot(axes, [agree, split], [0, 1])
    marked = [line for line in axes.lines if line.get_marker() == "D"]
    assert [tuple(line.get_xdata()) for line in marked] == [(1,)] and handle.get_label().startswith("modes disagree")
    assert mark_plot(axes, [agree], [0]) is None
    plt.close(figure)


def test_modes_per_run_per_test_and_the_cpu_graph_mode(pytester):
    pytester.makepyfile("""
import numpy as np
import pytest

x = np.random.default_rng(0).random(20_000)

def test_run_default(kernel_ab):
    r = kernel_ab.compare(lambda: np.sort(x), lambda: np.sort(np.concatenate([x, x]))[::2], name="run modes")
    assert list(r.modes) == ["throughput", "latency", "graph"]
    assert not r.modes["graph"].available

@pytest.mark.kernel_ab_modes("latency")
def test_marker(kernel_ab):
    r = kernel_ab.compare(lambda: np.sort(x), lambda: np.sort(x), name="marker modes")
    assert list(r.modes) == ["latency"]

def test_keyword_wins(kernel_ab):
    r = kernel_ab.compare(lambda: np.sort(x), lambda: np.sort(x), name="keyword modes", modes="throughput")
    assert list(r.modes) == ["throughput"]
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-modes", "throughput,latency,graph", "--kernel-ab-report",
                                "ab.json")
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines(["run modes*graph*n/a*not available on the CPU*"])
    rows = {row["name"]: row for row in json.loads((pytester.path / "ab.json").read_text())["comparisons"]}
    assert rows["marker modes"]["mode"] == "latency"
    assert "modes" not in rows["keyword modes"]  # throughput alone: the layout of every earlier report
    bad = pytester.runpytest(*FAST, "--kernel-ab-modes", "fastest")
    bad.stderr.fnmatch_lines(["*--kernel-ab-modes / kernel_ab_modes must name measurement modes among throughput, "
                              "latency, graph*"])


def test_outputs_are_compared_by_default_and_a_tensor_is_named_not_printed(pytester):
    pytester.makepyfile("""
import torch

x = torch.randn(64, 512)

def rms(t):
    return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

def test_wrong_output(kernel_ab):
    kernel_ab.compare(lambda: rms(x) * 2, lambda: rms(x), name="wrong")

def test_opt_out(kernel_ab):
    kernel_ab.compare(lambda: rms(x) * 2, lambda: rms(x), name="by design", check=False)

def test_tensors_not_callables(kernel_ab):
    kernel_ab.compare(rms(x), rms(x), name="tensors")
""")
    result = pytester.runpytest(*FAST)
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    result.stdout.fnmatch_lines([
        "*OutputMismatch: candidate output differs from the baseline's before timing (outputs are compared by "
        "default when both sides return tensors)*",
        "*candidate must be a callable taking no arguments, got Tensor of shape (64, 512), float32 on cpu (pass a "
        "callable such as lambda: f(x), not its result)*",
    ])
    assert "tensor([[" not in text  # no tensor's values anywhere
    assert "Pass check=False to time callables whose outputs differ by design" in text


STACKS = """
import copy
import pytest
import torch
from pytest_kernelcheck.speed.simulated_timer import SimulatedTimer

torch.manual_seed(0)

class Stack(torch.nn.Module):
    def __init__(self, extra=0):
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.extra = extra  # repeats of the same work whose results are thrown away: slower, same output

    def forward(self, x):
        for _ in range(self.extra):
            self.layers(x)
        return self.layers(x)

fast = Stack()
slow = copy.deepcopy(fast)
slow.extra = 8
x = torch.randn(32, 64)
y = torch.randn(32, 64)
"""


def test_model_level_comparisons_on_the_cpu(pytester):
    pytester.makepyfile(STACKS + """
def test_forward_loss(kernel_ab):
    r = kernel_ab.compare_modules(slow, fast, (x,), name="forward")
    assert r.verdict == "loss" and r.speedup < 0.5, r.describe()
    assert any(note.startswith("model forward") for note in r.notes)

def test_training_steps_leave_the_modules_unchanged(kernel_ab):
    before = {k: v.clone() for k, v in slow.state_dict().items()}
    r = kernel_ab.compare_training_steps(
        slow, fast, (x,), loss=lambda out: torch.nn.functional.mse_loss(out, y),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), name="train")
    assert r.verdict == "loss", r.describe()
    assert all(torch.equal(before[k], v) for k, v in slow.state_dict().items())
    assert any("one optimizer step" in note for note in r.notes)

def test_generation_tokens_per_second(kernel_ab):
    def generate(model):
        return lambda: torch.stack([model(x).argmax(-1) for _ in range(4)])
    candidate, baseline = generate(fast), generate(slow)
    timer = SimulatedTimer({candidate: lambda rng, now: 8e-3 * (1 + 0.01 * rng.random()),
                            baseline: lambda rng, now: 10e-3 * (1 + 0.01 * rng.random())})
    r = kernel_ab.compare_generation(candidate, baseline, tokens=4, timer=timer, name="generate")
    assert r.verdict == "win"
    assert r.tokens_per_s[0] == pytest.approx(4 / 8.05e-3, rel=0.02)
    assert r.tokens_per_s[0] / r.tokens_per_s[1] == pytest.approx(r.baseline_ms / r.candidate_ms)

def test_different_forward_outputs_fail_before_timing(kernel_ab):
    other = Stack()
    kernel_ab.compare_modules(other, fast, (x,), name="other weights")
""")
    result = pytester.runpytest(*FAST, "--kernel-ab-cpu-threads", "1", "--kernel-ab-report", "ab.json")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*other weights*OutputMismatch*"])
    rows = {row["name"]: row for row in json.loads((pytester.path / "ab.json").read_text())["comparisons"]}
    assert rows["forward"]["verdict"] == "loss" and rows["train"]["verdict"] == "loss"
    assert any("tokens per second" in note for note in rows["generate"]["notes"])
