"""Bad calls to flashlite.attention fail with an error that names the problem; dispatch explains itself."""
import importlib
import logging

import pytest
import torch

from flashlite import _runtime
from flashlite.attention import attention, explain_dispatch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def qkv(batch=2, heads=4, seq=16, dim=32, *, kv_heads=None, seq_k=None, dtype=torch.float16):
    def rand(*size):
        return torch.randn(*size, device=DEVICE).to(dtype)

    kv_heads, seq_k = kv_heads or heads, seq_k or seq
    return rand(batch, heads, seq, dim), rand(batch, kv_heads, seq_k, dim), rand(batch, kv_heads, seq_k, dim)


CASES = {
    "rank": (lambda: (torch.randn(2, 16, 32), *qkv()[1:]), {}, ValueError, r"q must have 4 dimensions"),
    "not a tensor": (lambda: ([[1.0]], *qkv()[1:]), {}, TypeError, r"q must be a torch.Tensor"),
    "batch": (lambda: (qkv()[0], *qkv(batch=3)[1:]), {}, ValueError, r"batch size differs: q has 2, k and v have 3"),
    "head dim": (lambda: (qkv()[0], *qkv(dim=16)[1:]), {}, ValueError, r"head dim differs"),
    "k vs v": (lambda: (*qkv()[:2], qkv(seq=9)[2]), {}, ValueError, r"k and v must have the same shape"),
    "gqa": (lambda: (qkv()[0], *qkv(kv_heads=3)[1:]), {}, ValueError, r"multiple of the k/v heads"),
    "dtype mix": (lambda: (qkv()[0], *qkv(dtype=torch.float32)[1:]), {}, TypeError, r"share one dtype"),
    "dtype": (lambda: qkv(dtype=torch.float64), {}, TypeError, r"float64.*supported: float16, bfloat16, float32"),
    "device": (lambda: (qkv()[0].to("meta"), *qkv()[1:]), {}, ValueError, r"must be on one device"),
    "empty": (lambda: qkv(seq=0), {}, ValueError, r"empty input"),
    "causal": (lambda: qkv(), {"causal": "upper"}, ValueError, r"causal must be False, True .* 'lower_right'"),
    "scale": (lambda: qkv(), {"scale": "big"}, TypeError, r"scale must be a finite real number"),
    # The kernels and SDPA scale in float32, where 1e39 is an infinity (all-NaN output before).
    "scale beyond float32": (lambda: qkv(), {"scale": 1e39}, TypeError, r"scale must be .* within float32's range"),
    "softcap beyond float32": (lambda: qkv(), {"softcap": 1e39}, ValueError,
                               r"softcap must be finite and > 0, within float32's range"),
    "backend": (lambda: qkv(), {"backend": "cudnn"}, ValueError, r"backend must be one of"),
    "precision for fp16": (lambda: qkv(), {"precision": "tf32"}, ValueError,
                           r"precision applies to float32 inputs only"),
    "precision for fp32": (lambda: qkv(dtype=torch.float32), {"precision": "fp8"}, ValueError,
                           r"precision for float32 inputs must be one of"),
    "mask dtype": (lambda: qkv(), {"key_padding_mask": torch.ones(2, 16, device=DEVICE)}, TypeError,
                   r"key_padding_mask must be a bool tensor"),
    "mask shape": (lambda: qkv(), {"key_padding_mask": torch.ones(2, 1, 1, 16, dtype=torch.bool, device=DEVICE)},
                   ValueError, r"key_padding_mask must have shape \[B, S_k\] = \[2, 16\], got \[2, 1, 1, 16\]"),
    "mask device": (lambda: qkv(), {"key_padding_mask": torch.ones(2, 16, dtype=torch.bool, device="meta")},
                    ValueError, r"key_padding_mask is on meta"),
    "lengths dtype": (lambda: qkv(), {"key_lengths": torch.ones(2, device=DEVICE)}, TypeError,
                      r"key_lengths must be an int32 or int64 tensor"),
    "lengths shape": (lambda: qkv(), {"key_lengths": torch.ones(2, 1, dtype=torch.long, device=DEVICE)},
                      ValueError, r"key_lengths must have shape \[B\] = \[2\]"),
    "both masks": (lambda: qkv(), {"key_padding_mask": torch.ones(2, 16, dtype=torch.bool, device=DEVICE),
                                   "key_lengths": torch.ones(2, dtype=torch.long, device=DEVICE)},
                   ValueError, r"not both"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named(case):
    make, kwargs, error, message = CASES[case]
    q, k, v = make()
    with pytest.raises(error, match=message):
        attention(q, k, v, **kwargs)
    with pytest.raises(error, match=message):
        explain_dispatch(q, k, v, **kwargs)


@pytest.mark.parametrize("head_dim", [8, 300])
def test_unsupported_head_dim(head_dim):
    q, k, v = qkv(dim=head_dim, seq=8, heads=1)
    with pytest.raises(ValueError, match=rf"backend='triton' cannot run this call: head dim {head_dim} is outside"):
        attention(q, k, v, backend="triton")
    # "auto" falls back to SDPA, and says why.
    decision = explain_dispatch(q, k, v)
    assert decision.backend == "sdpa" and f"head dim {head_dim}" in decision.reason
    out = attention(q, k, v)
    assert out.shape == q.shape and not out.isnan().any()


def test_forced_backends_are_explained():
    q, k, v = qkv()
    assert explain_dispatch(q, k, v, backend="sdpa").reason == "forced by backend='sdpa'"
    decision = explain_dispatch(q, k, v, backend="triton")
    assert (decision.backend, decision.reason) == ("triton", "forced by backend='triton'")


def test_auto_reason_comes_from_the_dispatch_rule():
    q, k, v = qkv()
    decision = explain_dispatch(q, k, v, causal=True)
    assert decision.backend in ("triton", "sdpa") and decision.reason
    if DEVICE == "cpu":
        assert decision.backend == "sdpa" and "CPU tensors" in decision.reason


def test_cpu_without_interpreter_is_unsupported(monkeypatch):
    monkeypatch.setattr(_runtime, "interpreting", lambda: False)
    q, k, v = (t.cpu() for t in qkv())
    with pytest.raises(ValueError, match=r"Triton kernel runs on CUDA devices, or on the CPU only through"):
        attention(q, k, v, backend="triton")
    decision = explain_dispatch(q, k, v)
    assert decision.backend == "sdpa" and "kernel cannot run this call: tensors on cpu" in decision.reason


def test_debug_dispatch_logging(monkeypatch, caplog):
    q, k, v = qkv()
    # Start with no replayable plans, so the first attention() call of this signature decides (and logs).
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    with caplog.at_level(logging.DEBUG, logger="flashlite.attention"):
        explain_dispatch(q, k, v)
        assert not caplog.records  # silent unless asked
        monkeypatch.setenv("FLASHLITE_DEBUG_DISPATCH", "1")
        decision = explain_dispatch(q, k, v, causal=True)
        attention(q, k, v, causal=True)
        attention(q, k, v, causal=True)  # replayed from its plan: decided, and logged, once per signature
    assert len(caplog.records) == 2
    assert all(r.levelno == logging.DEBUG and decision.reason in r.getMessage() for r in caplog.records)


def test_custom_op_checks_its_own_arguments():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"causal_mode must be 0, 1 or 2, got 5"):
        torch.ops.flashlite.attention_forward(q, k, v, None, None, 5, 0.1, "fp16")
    with pytest.raises(ValueError, match=r"precision 'tf32' does not fit torch.float16 inputs"):
        torch.ops.flashlite.attention_forward(q, k, v, None, None, 0, 0.1, "tf32")
    with pytest.raises(ValueError, match=r"batch size differs"):
        torch.ops.flashlite.attention_forward(q, *qkv(batch=1)[1:], None, None, 0, 0.1, "fp16")


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_a_list_window_works_as_the_tuple(backend):
    # Validation takes [left, right]; the plan cache keyed the list itself and failed on hashing it.
    q, k, v = qkv(seq=12, dtype=torch.float32)
    expected = attention(q, k, v, window=(3, 1), backend=backend)
    for _ in range(2):  # the first call keeps a plan, the second replays it
        torch.testing.assert_close(attention(q, k, v, window=[3, 1], backend=backend), expected, rtol=0, atol=0)
