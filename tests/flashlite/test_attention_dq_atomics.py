"""dQ added in by float32 atomics from the dK/dV kernel (``launch.dq_by_atomics``), against float64.

The atomic path computes dQ from the same tiles as dK and dV (scale * dS K per key block, added into a float32
buffer), so every mask, causal mode and variant that shapes dS must give the dQ the dQ kernel gives: checked here
through the launchers at the variant tests' small odd sizes (interpreter on the CPU, the kernels on a GPU), with
the switch forced on. Also: where the switch keeps the dQ kernel (deterministic algorithms, packed sequences, "0"),
and that a bad switch value is refused by name.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from flashlite._attention import launch
from flashlite._attention.validation import validate
from tests.flashlite.test_attention_variants_kernel import (CASES, DEVICE, assert_matches, random_inputs, reference,
                                                            run_kernels)

# Dense calls beside the variant cases: each causal mode with S_q != S_k, a head dim below its tile width (24 in a
# 32-wide tile: the atomic store masks columns), and one query head per key head.
DENSE_CASES = {
    "noncausal-d24": (torch.float32, dict(causal=0), dict(head_dim=24)),
    "topleft-longer-keys": (torch.float16, dict(causal=1), dict(seq_q=29, seq_k=53)),
    "lowerright-longer-queries": (torch.float32, dict(causal=2), dict(seq_q=53, seq_k=29)),
    "lowerright-mha": (torch.float16, dict(causal=2), dict(heads=2, kv_heads=2)),
}


class _Refused:
    """A kernel entry that fails the test if launched."""

    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        raise AssertionError(f"the {self.name} kernel ran")

    @property
    def best_config(self):
        raise AssertionError(f"the {self.name} kernel ran")


def _refuse(monkeypatch, kernel_name):
    kernel = getattr(launch, kernel_name)
    monkeypatch.setattr(launch, kernel_name, launch._Kernel(kernel.name, _Refused(kernel.name),
                                                            _Refused(kernel.name), kernel.gpu_blocks, kernel.prune))
    monkeypatch.setattr(launch.plans, "_PLANS", {})  # no plan recorded with the real one


@pytest.mark.parametrize("case", list(CASES) + list(DENSE_CASES))
def test_dq_by_atomics_matches_float64_reference(case, monkeypatch):
    monkeypatch.setattr(launch, "DQ_ATOMICS", "1")
    _refuse(monkeypatch, "_DQ")  # the dQ kernel must not run: dQ comes from the dK/dV kernel alone
    if case in CASES:
        (dtype, variant), sizes = CASES[case], {}
    else:
        dtype, variant, sizes = DENSE_CASES[case]
    q, k, v, grad_out = random_inputs(dtype, seed=sum(map(ord, case)) + 1, **sizes)
    got = run_kernels(q, k, v, grad_out, **variant)
    assert got[2].dtype == q.dtype and got[2].shape == q.shape
    assert_matches(got, reference(q, k, v, grad_out, **variant), dtype)


def test_the_autotuner_zeroes_the_float32_dq_before_each_launch():
    # Every benchmarked launch adds into the buffer: without the reset, the launch that counts would add onto the
    # sums of the configs timed before it (the GPU test below catches that end to end; the interpreter has one
    # config, so it never benchmarks).
    from flashlite.kernels import attention_bwd
    assert attention_bwd.attn_bwd_dkdv_dq.reset_to_zero == ["DqAcc"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning benchmarks several configs on a GPU only")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_autotuned_dq_by_atomics_matches_float64_reference(head_dim, monkeypatch):
    monkeypatch.setattr(launch, "DQ_ATOMICS", "1")
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "1")
    _refuse(monkeypatch, "_DQ")
    dtype, variant = torch.float16, dict(causal=1)
    q, k, v, grad_out = random_inputs(dtype, seed=head_dim, seq_q=300, seq_k=300, head_dim=head_dim)
    assert_matches(run_kernels(q, k, v, grad_out, **variant), reference(q, k, v, grad_out, **variant), dtype)


@pytest.mark.parametrize("setting", ["0", "deterministic"])
def test_the_dq_kernel_runs_where_atomics_are_off(setting, monkeypatch):
    monkeypatch.setattr(launch, "DQ_ATOMICS", "0" if setting == "0" else "1")
    _refuse(monkeypatch, "_DKDV_DQ")
    q, k, v, grad_out = random_inputs(torch.float32, seed=5)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(setting == "deterministic")
    try:
        got = run_kernels(q, k, v, grad_out, causal=1)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert_matches(got, reference(q, k, v, grad_out, causal=1), torch.float32)


def test_packed_sequences_keep_the_dq_kernel(monkeypatch):
    monkeypatch.setattr(launch, "DQ_ATOMICS", "1")
    q = torch.randn(2, 2, 16, 16)
    dense = validate(q, q, q, True, None, None, None, "triton", None)
    assert launch.dq_by_atomics(dense)
    assert not launch.dq_by_atomics(dataclasses.replace(dense, varlen=True))


def test_a_bad_switch_value_is_refused_by_name(monkeypatch):
    q = torch.randn(1, 2, 16, 16)
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    monkeypatch.setattr(launch, "DQ_ATOMICS", "yes")
    with pytest.raises(ValueError, match=r"DQ_ATOMICS must be one of auto, 0, 1, got 'yes'"):
        launch.dq_by_atomics(problem)
    result = subprocess.run([sys.executable, "-c", "import flashlite._attention.launch"], capture_output=True,
                            text=True, env={**os.environ, "FLASHLITE_DQ_ATOMICS": "on"})
    assert result.returncode != 0
    assert "FLASHLITE_DQ_ATOMICS must be one of auto, 0, 1, got 'on'" in result.stderr
