"""dQ added in by the dK/dV kernel through TMA bulk reductions (``launch.dq_by_reduction``, FLASHLITE_DQ_REDUCE=1),
against float64.

The one-kernel backward computes dQ from the same tiles as dK and dV (scale * dS K per key block, added into float32
rows through a tensor descriptor), so every mask, causal mode and variant that shapes dS must give the dQ the dQ
kernel gives: checked here through the launchers at the variant tests' small odd sizes, with the switch forced on.
On the CPU the interpreter runs it with the descriptor adds of ``tma_reduce_shim`` (it has none of its own); on a
GPU, the copy engine's. Also: where the switch keeps the dQ kernel (deterministic algorithms, packed sequences,
"0"), that a device without TMA reductions is refused by name, and so is a bad switch value.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from flashlite import _runtime
from flashlite._attention import launch
from flashlite._attention.validation import validate
from tests.flashlite.test_attention_variants_kernel import (CASES, assert_matches, random_inputs, reference,
                                                            run_kernels)
from tests.flashlite.tma_reduce_shim import with_descriptor_adds

# Dense calls beside the variant cases: each causal mode with S_q != S_k, a head dim below its tile width (24 in a
# 32-wide tile), a query length that leaves a partial query block (the descriptor clips its rows), and one query
# head per key head.
DENSE_CASES = {
    "noncausal-d24": (torch.float32, dict(causal=0), dict(head_dim=24)),
    "topleft-longer-keys": (torch.float16, dict(causal=1), dict(seq_q=29, seq_k=53)),
    "lowerright-longer-queries": (torch.float32, dict(causal=2), dict(seq_q=53, seq_k=29)),
    "lowerright-mha": (torch.float16, dict(causal=2), dict(heads=2, kv_heads=2)),
}


@pytest.fixture
def descriptor_adds():
    """The interpreter's descriptor reductions for the test (nothing to add on a GPU)."""
    if _runtime.interpreting():
        with with_descriptor_adds():
            yield
    else:
        yield


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
def test_dq_by_reduction_matches_float64_reference(case, monkeypatch, descriptor_adds):
    monkeypatch.setattr(launch, "DQ_REDUCE", "1")
    _refuse(monkeypatch, "_DQ")  # the dQ kernel must not run: dQ comes from the dK/dV kernel alone
    if case in CASES:
        (dtype, variant), sizes = CASES[case], {}
    else:
        dtype, variant, sizes = DENSE_CASES[case]
    q, k, v, grad_out = random_inputs(dtype, seed=sum(map(ord, case)) + 1, **sizes)
    got = run_kernels(q, k, v, grad_out, **variant)
    assert got[2].dtype == q.dtype and got[2].shape == q.shape and got[2].is_contiguous()
    assert_matches(got, reference(q, k, v, grad_out, **variant), dtype)


@pytest.mark.skipif(not _runtime.interpreting(), reason="drops the interpreter's descriptor adds")
def test_without_its_share_of_dq_the_gradient_is_wrong(monkeypatch, descriptor_adds):
    # The check above can fail: with the kernel's adds dropped, dQ stays zero and is caught.
    from triton.runtime.interpreter import InterpreterBuilder

    monkeypatch.setattr(launch, "DQ_REDUCE", "1")
    adds = InterpreterBuilder.create_descriptor_reduce  # the fixture's; put back before the fixture removes it
    InterpreterBuilder.create_descriptor_reduce = lambda self, kind, desc, value, indices: None
    try:
        dtype, variant = torch.float32, dict(causal=1)
        q, k, v, grad_out = random_inputs(dtype, seed=11)
        got = run_kernels(q, k, v, grad_out, **variant)
    finally:
        InterpreterBuilder.create_descriptor_reduce = adds
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    with pytest.raises(AssertionError, match="dq: max error"):
        assert_matches(got, reference(q, k, v, grad_out, **variant), dtype)


def test_the_autotuner_zeroes_the_float32_dq_and_sets_the_tile_before_each_launch():
    # Every benchmarked launch adds into the buffer: without the reset, the launch that counts would add onto the
    # sums of the configs timed before it. Each config sets the descriptor's block shape to its own BLOCK_M (the
    # GPU test below runs both end to end; the interpreter has one config, so it never benchmarks).
    from flashlite.kernels import attention_bwd
    assert attention_bwd.attn_bwd_dkdv_dq.reset_to_zero == ["DqAcc"]
    assert all(c.pre_hook is attention_bwd.set_dq_block_shape for c in attention_bwd.attn_bwd_dkdv_dq.configs)

    class Descriptor:
        block_shape = [1, 16, 64]
    nargs = {"DqDesc": Descriptor(), "BLOCK_M": 32, "BLOCK_D": 64}
    attention_bwd.set_dq_block_shape(nargs)
    assert nargs["DqDesc"].block_shape == [1, 32, 64]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="autotuning benchmarks several configs on a GPU only")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_autotuned_dq_by_reduction_matches_float64_reference(head_dim, monkeypatch):
    monkeypatch.setattr(launch, "DQ_REDUCE", "1")
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "1")
    _refuse(monkeypatch, "_DQ")
    dtype, variant = torch.float16, dict(causal=1)
    q, k, v, grad_out = random_inputs(dtype, seed=head_dim, seq_q=300, seq_k=300, head_dim=head_dim)
    assert_matches(run_kernels(q, k, v, grad_out, **variant), reference(q, k, v, grad_out, **variant), dtype)


@pytest.mark.parametrize("setting", ["0", "deterministic"])
def test_the_dq_kernel_runs_where_the_reduction_is_off(setting, monkeypatch):
    monkeypatch.setattr(launch, "DQ_REDUCE", "0" if setting == "0" else "1")
    _refuse(monkeypatch, "_DKDV_DQ")
    q, k, v, grad_out = random_inputs(torch.float32, seed=5)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(setting == "deterministic")
    try:
        got = run_kernels(q, k, v, grad_out, causal=1)
    finally:
        torch.use_deterministic_algorithms(deterministic)
    assert_matches(got, reference(q, k, v, grad_out, causal=1), torch.float32)


def test_packed_sequences_keep_the_dq_kernel(monkeypatch, descriptor_adds):
    monkeypatch.setattr(launch, "DQ_REDUCE", "1")
    q = torch.randn(2, 2, 16, 16)
    dense = validate(q, q, q, True, None, None, None, "triton", None)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert launch.dq_by_reduction(dense, device)
    assert not launch.dq_by_reduction(dataclasses.replace(dense, varlen=True), device)


@pytest.mark.skipif(not _runtime.interpreting(), reason="the interpreter is the device without TMA reductions here")
def test_a_device_without_tma_reductions_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(launch, "DQ_REDUCE", "1")
    q = torch.randn(1, 2, 16, 16)
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    with pytest.raises(ValueError, match=r"FLASHLITE_DQ_REDUCE=1 needs TMA bulk reductions .* interpreter"):
        launch.dq_by_reduction(problem, q.device)


def test_a_bad_switch_value_is_refused_by_name(monkeypatch):
    q = torch.randn(1, 2, 16, 16)
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    monkeypatch.setattr(launch, "DQ_REDUCE", "yes")
    with pytest.raises(ValueError, match=r"DQ_REDUCE must be one of 0, 1, got 'yes'"):
        launch.dq_by_reduction(problem, q.device)
    result = subprocess.run([sys.executable, "-c", "import flashlite._attention.launch"], capture_output=True,
                            text=True, env={**os.environ, "FLASHLITE_DQ_REDUCE": "on"})
    assert result.returncode != 0
    assert "FLASHLITE_DQ_REDUCE must be one of 0, 1, got 'on'" in result.stderr
