"""Gradients of flashlite.attention's Triton kernel against float64 autograd references.

Each test differentiates the kernel's output against a random upstream gradient and compares dq, dk and dv with
float64 gradients of an explicit softmax formula, under the baseline rule: the kernel's error may be at most about
twice that of PyTorch SDPA's own gradients in the input precision.
"""
import math

import pytest
import torch

from flashlite.attention import CAUSAL_MODES, attention, attention_backward, attention_forward
from pytest_kernelcheck import assert_close, policy_for

# Gradients with tf32 dot products: Hopper's tensor cores read tf32 operands by dropping the low 13 mantissa bits
# (truncation, not rounding), and the backward pass chains three such products (dP = dO V^T, dQ = dS K, dK = dS^T Q).
# On an H200 (2026-11-29, benchmarks/results/h200-2026-11-29-gpu-tests at commit 8ca4529) the kernel's tf32 gradients
# measured 2.5x to 5.1x the error of fp16 SDPA's (same 10-bit mantissa, rounded), so they get a factor of 6.
TF32_GRAD_POLICY = policy_for("tf32").replace(baseline_factor=6.0, name="tf32 gradients")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference_attention(q, k, v, *, causal=False, key_mask=None, scale=None):
    """Explicit softmax(q k^T * scale) v, differentiable; rows that see no key give zeros."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(heads // kv_heads, dim=1)
    v = v.repeat_interleave(heads // kv_heads, dim=1)
    seq_q, seq_k = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible.tril(0 if causal is True else seq_k - seq_q)
    visible = visible[None, None]
    if key_mask is not None:
        visible = visible & key_mask[:, None, None, :]
    has_key = visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf).masked_fill(~has_key, 0.0), dim=-1)
    return (weights @ v).masked_fill(~has_key, 0.0)


def inputs(batch, heads, seq_q, head_dim, dtype, *, kv_heads=None, seq_k=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_heads, seq_k = kv_heads or heads, seq_k or seq_q

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)

    q, k, v = rand(batch, heads, seq_q, head_dim), rand(batch, kv_heads, seq_k, head_dim), \
        rand(batch, kv_heads, seq_k, head_dim)
    return q, k, v, rand(batch, heads, seq_q, head_dim)


def grads(fn, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(grad_out)
    return out.detach(), [t.grad for t in leaves]


def check_gradients(shape, *, precision=None, key_padding_mask=None, key_lengths=None):
    q, k, v, grad_out = inputs(shape.B, shape.H, shape.S, shape.D, shape.dtype, kv_heads=shape.get("H_kv"),
                               seq_k=shape.get("S_k"))
    causal = shape.get("causal", False)
    key_mask = key_padding_mask
    if key_lengths is not None:
        key_mask = torch.arange(k.shape[2], device=DEVICE)[None, :] < key_lengths[:, None]
    masks = dict(key_padding_mask=key_padding_mask, key_lengths=key_lengths)

    out, kernel_grads = grads(lambda *t: attention(*t, causal=causal, backend="triton", precision=precision,
                                                   **masks), q, k, v, grad_out)
    _, ref_grads = grads(lambda *t: reference_attention(*t, causal=causal, key_mask=key_mask),
                         q.double(), k.double(), v.double(), grad_out.double())
    # Baseline: PyTorch SDPA's gradients in the precision of the kernel's products (flashlite's SDPA path, which
    # zeroes rows that see no key where SDPA itself gives NaN). tf32 keeps fp16's 10 mantissa bits, so fp16 SDPA
    # is its baseline; bf16 operands get bf16 SDPA. True float32 ("ieee") uses the float32 policy per element.
    mode = precision or ("tf32" if shape.dtype == torch.float32 else None)
    policy = None
    if mode == "ieee":
        sdpa_grads = (None, None, None)
        policy = "fp32"
    else:
        low = {"tf32": torch.float16, "bf16": torch.bfloat16}.get(mode, shape.dtype)
        _, sdpa_grads = grads(lambda *t: attention(*t, causal=causal, backend="sdpa", **masks),
                              q.to(low), k.to(low), v.to(low), grad_out.to(low))
        if shape.dtype == torch.float32:
            policy = TF32_GRAD_POLICY if mode == "tf32" else mode
    for name, got, ref, base in zip(("dq", "dk", "dv"), kernel_grads, ref_grads, sdpa_grads):
        assert got.dtype == shape.dtype and got.shape == ref.shape, name
        assert not got.isnan().any(), f"{name} holds NaN"
        assert_close(got, ref, policy=policy, baseline=base)
    return out, kernel_grads


@pytest.mark.shape(dict(B=1, H=2, S=37, D=32), dict(B=2, H=2, S=48, D=24),
                   dtype=[torch.float16, torch.bfloat16], causal=[False, True])
def test_gradients_half_precision(shape):
    check_gradients(shape)


@pytest.mark.shape(dict(B=1, H=2, S=41, D=40, dtype=torch.float32), precision=["ieee", "tf32", "bf16"],
                   causal=[True])
def test_gradients_float32_precisions(shape):
    check_gradients(shape, precision=shape.precision)


@pytest.mark.shape(dict(B=1, H=2, S=20, S_k=45, D=16), dict(B=1, H=2, S=45, S_k=20, D=16),
                   causal=[True, "lower_right"], dtype=torch.float16)
def test_gradients_query_and_key_lengths_differ(shape):
    out, (dq, _, _) = check_gradients(shape)
    if shape.causal == "lower_right" and shape.S > shape.S_k:
        empty = shape.S - shape.S_k  # rows with no visible key: zero output, zero dq
        assert torch.equal(dq[:, :, :empty], torch.zeros_like(dq[:, :, :empty]))


@pytest.mark.shape(dict(B=2, H=4, S=36, D=32, dtype=torch.float16), H_kv=[2, 1], causal=[False, True])
def test_gradients_grouped_query_attention(shape):
    _, (_, dk, dv) = check_gradients(shape)
    assert dk.shape[1] == shape.H_kv and dv.shape[1] == shape.H_kv


@pytest.mark.shape(dict(B=2, H=2, S=33, S_k=40, D=32, dtype=torch.float16), causal=[False, "lower_right"])
def test_gradients_key_padding_mask_with_an_empty_batch(shape):
    gen = torch.Generator().manual_seed(3)
    mask = (torch.rand(shape.B, shape.S_k, generator=gen) > 0.4).to(DEVICE)
    mask[0] = False  # batch entry 0 sees no key at all
    out, (dq, dk, dv) = check_gradients(shape, key_padding_mask=mask)
    for grad in (dq[0], dk[0], dv[0]):
        assert torch.equal(grad, torch.zeros_like(grad))
    # Masked keys of batch entry 1 get no gradient either.
    assert torch.equal(dk[1][:, ~mask[1]], torch.zeros_like(dk[1][:, ~mask[1]]))


@pytest.mark.shape(dict(B=3, H=2, S=30, D=16, dtype=torch.float32), causal=[False, True])
def test_gradients_key_lengths(shape):
    lengths = torch.tensor([30, 0, 13], device=DEVICE)
    _, (dq, dk, dv) = check_gradients(shape, precision="ieee", key_lengths=lengths)
    assert torch.equal(dk[2, :, 13:], torch.zeros_like(dk[2, :, 13:]))
    assert torch.equal(dv[1], torch.zeros_like(dv[1]))


def test_backward_refuses_a_pairs_per_program_config():
    q, k, v, grad_out = inputs(1, 2, 16, 16, torch.float32)
    out, lse = attention_forward(q, k, v, None, None, 0, 0.25, "ieee")
    with pytest.raises(ValueError, match="only the forward kernel takes a fifth entry"):
        attention_backward(grad_out, q, k, v, out, lse, None, None, 0, 0.25, "ieee", dq_config=(16, 16, 4, 1, 2))


@pytest.mark.parametrize("dkdv_config, dq_config", [((32, 16, 4, 1), (16, 32, 4, 1)),
                                                    ((64, 64, 4, 1), (64, 64, 4, 1))])
def test_backward_block_configs(dkdv_config, dq_config):
    # Tile shapes other than the interpreter default, called through the launchers directly.
    q, k, v, grad_out = inputs(2, 4, 45, 32, torch.float16, kv_heads=2, seq_k=70)
    mask = (torch.rand(2, 70, generator=torch.Generator().manual_seed(5)) > 0.3).to(DEVICE)
    mode = CAUSAL_MODES["lower_right"]
    scale = 32 ** -0.5
    out, lse = attention_forward(q, k, v, mask, None, mode, scale, "fp16")
    got = attention_backward(grad_out, q, k, v, out, lse, mask, None, mode, scale, "fp16",
                             dkdv_config=dkdv_config, dq_config=dq_config)
    _, ref = grads(lambda *t: reference_attention(*t, causal="lower_right", key_mask=mask),
                   q.double(), k.double(), v.double(), grad_out.double())
    _, base = grads(lambda *t: attention(*t, causal="lower_right", key_padding_mask=mask, backend="sdpa"),
                    q, k, v, grad_out)
    for got_grad, ref_grad, base_grad in zip(got, ref, base):
        assert_close(got_grad, ref_grad, baseline=base_grad)


def test_pointer_backward_is_two_launches_with_delta_from_the_dq_kernel(monkeypatch):
    # The dQ kernel computes delta = rowsum(dO * O) of its rows from the forward's output, read through out's own
    # strides (here [B, S, H, D] memory, unlike q's), and stores it for the dK/dV kernel after it: the
    # preprocessing kernel must not run. Gradients against float64, causal and GQA, odd lengths; D=32 is outside the
    # Gluon backward's head dims (that backward keeps the preprocessing kernel), so a GPU runs the pointer kernels.
    from flashlite.kernels import attention_bwd

    def no_delta_kernel(*args, **kwargs):
        raise AssertionError("the pointer backward launched the delta preprocessing kernel")

    monkeypatch.setattr(attention_bwd, "attn_bwd_delta", no_delta_kernel)
    q, k, v, grad_out = inputs(2, 4, 37, 32, torch.float16, kv_heads=2, seq_k=45, seed=8)
    mode, scale = CAUSAL_MODES["lower_right"], 32 ** -0.5
    out, lse = attention_forward(q, k, v, None, None, mode, scale, "fp16")
    out_bshd = out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    got = attention_backward(grad_out, q, k, v, out_bshd, lse, None, None, mode, scale, "fp16")
    _, ref = grads(lambda *t: reference_attention(*t, causal="lower_right"),
                   q.double(), k.double(), v.double(), grad_out.double())
    _, base = grads(lambda *t: attention(*t, causal="lower_right", backend="sdpa"), q, k, v, grad_out)
    for got_grad, ref_grad, base_grad in zip(got, ref, base):
        assert_close(got_grad, ref_grad, baseline=base_grad)


def test_non_contiguous_upstream_gradient():
    q, k, v, grad_out = inputs(1, 2, 26, 16, torch.float32)
    grad_bshd = grad_out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, [B, S, H, D] memory
    _, kernel_grads = grads(lambda *t: attention(*t, causal=True, backend="triton", precision="ieee"),
                            q, k, v, grad_bshd)
    _, ref_grads = grads(lambda *t: reference_attention(*t, causal=True), q.double(), k.double(), v.double(),
                         grad_out.double())
    for got, ref in zip(kernel_grads, ref_grads):
        assert_close(got, ref, policy="fp32")


def test_reference_matches_the_plugin_reference(sdpa_reference):
    # The gradient reference's forward agrees with pytest_kernelcheck's float64 reference, masks included.
    q, k, v, _ = inputs(2, 4, 19, 16, torch.float64, kv_heads=2, seq_k=23)
    mask = torch.rand(2, 23, generator=torch.Generator().manual_seed(1), device="cpu").to(DEVICE) > 0.5
    mask[1] = False
    for causal in (False, True, "lower_right"):
        expected = sdpa_reference(q, k, v, causal=causal, attn_mask=mask[:, None, None, :], enable_gqa=True)
        assert_close(reference_attention(q, k, v, causal=causal, key_mask=mask), expected, policy="fp64")



@pytest.mark.parametrize("with_grad", [False, True])
def test_output_is_laid_out_like_q_so_heads_merge_without_a_copy(with_grad):
    # A layer's q, k, v are views of its [B, S, H, D] projections. SDPA keeps that layout in its output, so merging
    # the heads back into [B, S, H * D] is a view; the kernel's output is laid out like q for the same reason (it
    # was contiguous [B, H, S, D], and the merge then copied). Values and gradients against float64, with SDPA's
    # fp16 output and gradients as the baselines.
    batch, seq, heads, head_dim = 2, 37, 3, 16
    q, k, v, grad_out = (t.transpose(1, 2).contiguous().transpose(1, 2)  # [B, H, S, D] views of [B, S, H, D]
                         for t in inputs(batch, heads, seq, head_dim, torch.float16, seed=7))
    assert q.stride() == (seq * heads * head_dim, head_dim, heads * head_dim, 1)

    def kernel(q, k, v):
        out = attention(q, k, v, causal=True, backend="triton")
        assert out.stride() == q.stride()
        merged = out.transpose(1, 2).reshape(batch, seq, heads * head_dim)
        assert merged._is_view() and merged.data_ptr() == out.data_ptr()  # no copy
        return out

    sdpa = lambda *t: torch.nn.functional.scaled_dot_product_attention(*t, is_causal=True)  # noqa: E731
    if not with_grad:
        with torch.no_grad():
            out = kernel(q, k, v)
        assert_close(out, reference_attention(q.double(), k.double(), v.double(), causal=True),
                     baseline=sdpa(q, k, v))
        return
    # grads() makes leaves of clones, which keep the [B, S, H, D] strides.
    out, kernel_grads = grads(kernel, q, k, v, grad_out)
    expected, ref_grads = grads(lambda *t: reference_attention(*t, causal=True), q.double(), k.double(), v.double(),
                                grad_out.double())
    sdpa_out, sdpa_grads = grads(sdpa, q, k, v, grad_out)
    assert_close(out, expected, baseline=sdpa_out)
    for got, ref, base in zip(kernel_grads, ref_grads, sdpa_grads):
        assert_close(got, ref, baseline=base)


@pytest.mark.parametrize("splits", [1, 2])
def test_launcher_keeps_the_layout_of_q_with_split_keys_too(splits):
    # launch_forward(like_q=True) lays out like q on the split-KV path as well, whose merge writes contiguous rows
    # (attention()'s plans have no key splits today; decoding's plans, which have, ask for contiguous outputs).
    import dataclasses

    from flashlite.attn.triton import launch_forward
    from flashlite.attn.plan import Plan
    from flashlite.attn.problem import validate
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in inputs(2, 3, 37, 16, torch.float16, seed=11)[:3])
    problem = dataclasses.replace(validate(q, k, v, False, None, None, None, "triton", None), key_splits=splits)
    out, _ = launch_forward(q, k, v, None, None, Plan(problem, None), like_q=True)
    assert out.stride() == q.stride()
    assert_close(out, reference_attention(q.double(), k.double(), v.double()),
                 baseline=torch.nn.functional.scaled_dot_product_attention(q, k, v))


BACKWARD_TENSOR_CASES = {
    # name: (which argument, how it is made wrong, the error's words)
    "lse short": ("lse", lambda t: t[:, :1].clone(), r"lse must have shape \[1, 2, 8\], dtype torch.float32"),
    "lse float16": ("lse", lambda t: t.half(), r"lse must have shape .*got shape \[1, 2, 8\], dtype torch.float16"),
    "grad_out short": ("grad_out", lambda t: t[:, :1].clone(), r"grad_out must have shape \[1, 2, 8, 16\]"),
    "out short": ("out", lambda t: t[:, :1].clone(), r"out must have shape \[1, 2, 8, 16\]"),
    "out int32": ("out", lambda t: t.to(torch.int32), r"out must have .*dtype torch.float32.*got .*torch.int32"),
    "out on meta": ("out", lambda t: torch.empty_like(t, device="meta"), r"out must have .*got .*device meta"),
    "lse not a tensor": ("lse", lambda t: t.tolist(), r"lse must be a tensor of shape \[1, 2, 8\]"),
}


@pytest.mark.parametrize("case", BACKWARD_TENSOR_CASES)
def test_backward_launcher_checks_grad_out_out_and_lse(case):
    # The kernels index all three with q's sizes: a shorter tensor was read and written out of bounds (heap
    # corruption), another dtype read as raw bits, so a direct call must refuse them before any launch.
    name, spoil, words = BACKWARD_TENSOR_CASES[case]
    q, k, v = (torch.randn(1, 2, 8, 16, device=DEVICE) for _ in range(3))
    out, lse = attention_forward(q, k, v, None, None, 0, 0.25, "ieee")
    tensors = {"grad_out": torch.randn_like(q), "out": out, "lse": lse}
    tensors[name] = spoil(tensors[name])
    with pytest.raises((ValueError, TypeError), match=words):
        attention_backward(tensors["grad_out"], q, k, v, tensors["out"], tensors["lse"], None, None, 0, 0.25, "ieee")
