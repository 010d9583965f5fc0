"""The Gluon backward (dK/dV and dQ) on an sm_90 GPU against float64 autograd, directly and inside
flashlite.attention's backward.

Every test is skipped without a CUDA device of compute capability 9.0. The kernel takes the forward's out and
base-2 lse (here the pointer forward's, and the Gluon forward's); the reference is float64 autograd of the explicit
softmax attention on the same 16-bit inputs; the baseline error is SDPA's own gradients in the input precision.
"""
import importlib

import pytest
import torch

from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd
from flashlite.attn.gluon import gluon_attention_forward
from flashlite.attention import attention, attention_forward
from pytest_kernelcheck import assert_close

from .test_attention_backward import reference_attention
from .test_attention_gpu import cuda_qkv as qkv

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
                                reason="needs a CUDA GPU of compute capability 9.0 (Hopper)")

CAUSAL = [False, True, "lower_right"]
MODE = {False: 0, True: 1, "lower_right": 2}


def reference_grads(q, k, v, grad_out, causal):
    """(dq, dk, dv) of float64 autograd, and SDPA's (dq, dk, dv) in the inputs' precision (the baseline error)."""
    def grads(fn, *tensors):
        leaves = [t.detach().requires_grad_() for t in tensors]
        fn(*leaves).backward(grad_out.to(leaves[0].dtype))
        return [t.grad for t in leaves]
    ref = grads(lambda *t: reference_attention(*t, causal=causal), q.double(), k.double(), v.double())
    base = grads(lambda *t: attention(*t, causal=causal, backend="sdpa"), q, k, v)
    return ref, base


def check_backward(q, k, v, causal, dkdv_config=None, dq_config=None, forward="pointer", grad_out=None):
    grad_out = torch.randn_like(q) if grad_out is None else grad_out
    scale = q.shape[-1] ** -0.5
    if forward == "gluon":
        out, lse = gluon_attention_forward(q, k, v, causal=causal)
    else:
        precision = "bf16" if q.dtype == torch.bfloat16 else "fp16"
        out, lse = attention_forward(q, k, v, None, None, MODE[causal], scale, precision)
    dk, dv = launch_gluon_bwd.gluon_attention_dkdv(grad_out, q, k, v, out, lse, causal=causal, config=dkdv_config)
    dq = launch_gluon_bwd.gluon_attention_dq(grad_out, q, k, v, out, lse, causal=causal, config=dq_config)
    torch.cuda.synchronize()
    ref, base = reference_grads(q, k, v, grad_out, causal)
    for name, got, r, b in zip(("dq", "dk", "dv"), (dq, dk, dv), ref, base):
        assert got.shape == r.shape and got.dtype == q.dtype and not got.isnan().any(), name
        assert_close(got, r, baseline=b, notes=(name, str(dkdv_config), str(dq_config), f"causal={causal}"))


def _first_configs(D):
    """The first listed dK/dV and dQ configs (the launchers' own)."""
    return [launch_gluon_bwd.bwd_configs_for(D, kind)[0] for kind in launch_gluon_bwd.KERNELS]


@pytest.mark.parametrize("causal", CAUSAL)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B, H, H_kv, S_q, S_k", [(2, 4, 4, 77, 77), (1, 8, 2, 1000, 1000), (2, 4, 2, 300, 1000),
                                                  (1, 4, 4, 1000, 300), (1, 2, 1, 1, 129), (1, 2, 2, 4097, 4097)])
def test_backward_against_float64(B, H, H_kv, S_q, S_k, D, dtype, causal):
    # Odd and unequal lengths (partial blocks of both kinds, S_q > S_k with rows that see no key bottom-right), GQA
    # (every query head of a group adds into the same dK/dV), one query row; each kernel's first config. 300 query
    # rows leave dQ's second consumer 44 of 64 (and 77, 1 and 1000 none in the last program).
    check_backward(*qkv(B, H, S_q, D, dtype, H_kv=H_kv, S_k=S_k), causal, *_first_configs(D))


@pytest.mark.parametrize("D", [64, 128])
def test_every_listed_config(D):
    dkdv_configs = launch_gluon_bwd.bwd_configs_for(D, "dkdv")
    dq_configs = launch_gluon_bwd.bwd_configs_for(D, "dq")
    for i in range(max(len(dkdv_configs), len(dq_configs))):
        dkdv_config, dq_config = dkdv_configs[min(i, len(dkdv_configs) - 1)], dq_configs[min(i, len(dq_configs) - 1)]
        for causal in CAUSAL:
            check_backward(*qkv(2, 4, 333, D, torch.bfloat16, H_kv=2, S_k=333), causal, dkdv_config, dq_config)


@pytest.mark.parametrize("D", [64, 128])
def test_takes_the_gluon_forwards_out_and_lse(D):
    check_backward(*qkv(2, 4, 1000, D, torch.bfloat16, H_kv=2), True, *_first_configs(D), forward="gluon")


def test_strided_layouts_and_a_transposed_gradient():
    # [B, S, H, D] storage seen as [B, H, S, D], and a gradient whose layout TMA cannot describe (copied first).
    q = torch.randn(2, 300, 4, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 300, 2, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    grad_out = torch.randn(2, 4, 64, 300, device="cuda", dtype=torch.bfloat16).transpose(2, 3)
    check_backward(q, k, v, True, *_first_configs(64), grad_out=grad_out)


@pytest.mark.parametrize("causal", CAUSAL)
def test_attention_backward_on_the_gluon_kernels_where_the_rule_takes_them(causal, monkeypatch):
    # flashlite.attention end to end with the rule's size floor stood in, so that a call of odd length takes the
    # Gluon backward (the plan says so): dK/dV and dQ on the Gluon kernels after the pointer delta kernel, all
    # three against float64.
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)
    monkeypatch.setattr(launch_gluon_bwd, "measured_faster", lambda problem: True)
    # A plan decides its backward kernels when it is made, under the rule of that moment: start with none kept.
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    launched = []
    for name in ("launch_dkdv", "launch_dq"):
        real = getattr(launch_gluon_bwd, name)
        monkeypatch.setattr(launch_gluon_bwd, name,
                            lambda *a, real=real, name=name, **kw: launched.append(name) or real(*a, **kw))
    q, k, v = (t.requires_grad_() for t in qkv(2, 8, 777, 128, torch.bfloat16, H_kv=2, S_k=777))
    grad_out = torch.randn_like(q)
    attention(q, k, v, causal=causal, backend="triton").backward(grad_out)
    assert launched == ["launch_dkdv", "launch_dq"]
    ref, base = reference_grads(q, k, v, grad_out, causal)
    for name, got, r, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, base):
        assert_close(got, r, baseline=b, notes=(name, "Gluon backward"))


@pytest.mark.parametrize("S, D, runs_gluon", [(4096, 128, True), (2048, 128, False), (4096, 64, False)])
def test_the_default_rule_end_to_end(S, D, runs_gluon, monkeypatch):
    # FLASHLITE_GLUON on (set here whatever the environment says): flashlite.attention's backward runs on the Gluon
    # kernels where measured_faster says (bf16, D=128, causal, S_q == S_k >= 4,096) and the pointer kernels
    # elsewhere; explain_dispatch says which; the gradients are right in float64 either way.
    from flashlite.attention import explain_dispatch
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})  # plans made with it on
    launched = []
    for name in ("launch_dkdv", "launch_dq"):
        real = getattr(launch_gluon_bwd, name)
        monkeypatch.setattr(launch_gluon_bwd, name,
                            lambda *a, real=real, name=name, **kw: launched.append(name) or real(*a, **kw))
    q, k, v = (t.requires_grad_() for t in qkv(1, 4, S, D, torch.bfloat16))
    reason = explain_dispatch(q, k, v, causal=True, backend="triton").reason
    assert ("backward: dK/dV on the Gluon kernel, dQ on the warp-specialized Gluon kernel" in reason) == runs_gluon, \
        reason
    grad_out = torch.randn_like(q)
    attention(q, k, v, causal=True, backend="triton").backward(grad_out)
    assert launched == (["launch_dkdv", "launch_dq"] if runs_gluon else [])
    ref, base = reference_grads(q, k, v, grad_out, True)
    for name, got, r, b in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), ref, base):
        assert_close(got, r, baseline=b, notes=(name, "default rule"))
