"""Second-order gradients (``create_graph=True``) through flashlite's kernels against float64 PyTorch.

Each test takes a gradient penalty, as WGAN-GP or R1 regularisation do: the first gradients of a data loss with
``create_graph=True``, then the backward of the data loss plus the squared gradients. The kernels' backward passes
write plain tensors, so a second differentiation through them must not treat those gradients as constants: the
result is compared with the same penalty through an explicit float64 PyTorch formula (differentiable twice), under
the dtype's policy: float32 per element, fp16 under the baseline rule (at most about twice the error of the same
computation by PyTorch in fp16).
Paths that cannot differentiate twice must say so.

Tiny odd sizes, fp32 and fp16: on the CPU the kernels run through the Triton interpreter.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from flashlite import _double_backward
from flashlite.attention import attention, attention_varlen
from flashlite.layer import TransformerLayer
from flashlite.norm import add_layer_norm, bias_gelu, layer_norm
from pytest_kernelcheck import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]


def _random(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(device=DEVICE, dtype=dtype)


def penalized_gradients(fn, inputs, out_weight):
    """The gradients of ``(fn(*inputs) * out_weight).sum() + sum(|d loss / d input|^2)`` with respect to each
    input, the penalty differentiated through the first gradients (``create_graph=True``)."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    loss = (out.to(out_weight.dtype) * out_weight).sum()
    first = torch.autograd.grad(loss, leaves, create_graph=True)
    penalty = sum(g.to(out_weight.dtype).pow(2).sum() for g in first)
    return torch.autograd.grad(loss + penalty, leaves)


def check_penalty(fn, reference, inputs, out_shape, *, seed=7):
    """``fn``'s penalized gradients against ``reference``'s on float64 copies: float32 under the float32 policy
    per element, fp16 under the baseline rule with ``reference`` run in fp16 as the baseline."""
    weight = _random(*out_shape, seed=seed, dtype=torch.float64)
    got = penalized_gradients(fn, inputs, weight)
    expected = penalized_gradients(reference, [t.double() for t in inputs], weight)
    low = inputs[0].dtype != torch.float32
    baseline = penalized_gradients(reference, inputs, weight.to(inputs[0].dtype)) if low else [None] * len(got)
    for i, (g, e, b) in enumerate(zip(got, expected, baseline)):
        assert g.dtype == inputs[i].dtype and not g.isnan().any(), f"input {i}"
        assert_close(g, e, baseline=b, notes=(f"gradient of input {i}",))


def reference_attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None, key_keep=None):
    """softmax(mask(softcap(q k^T / sqrt(D)) - slope * |i' - j|)) v as explicit tensor operations (differentiable
    twice); rows that see no key give zeros. ``key_keep``: bool [B, S_k], True = attend."""
    heads, kv_heads = q.shape[1], k.shape[1]
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    seq_q, seq_k = q.shape[2], k.shape[2]
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q if causal == "lower_right" else 0)
    cols = torch.arange(seq_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.to(scores.dtype)[None, :, None, None] * (rows - cols).abs()
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & (cols <= rows)
    if window is not None:
        if window[0] >= 0:
            visible = visible & (cols >= rows - window[0])
        if window[1] >= 0:
            visible = visible & (cols <= rows + window[1])
    visible = visible[None, None]
    if key_keep is not None:
        visible = visible & key_keep[:, None, None, :]
    has_key = visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~visible, -math.inf).masked_fill(~has_key, 0.0), dim=-1)
    return (weights @ v).masked_fill(~has_key, 0.0)


# (name, sizes B, H, H_kv, S_q, S_k, D, attention() arguments beyond q, k, v)
VARIANTS = [
    ("dense", (1, 2, 2, 5, 7, 16), {}),
    ("causal", (2, 2, 2, 7, 5, 16), dict(causal=True)),
    ("lower_right", (1, 2, 2, 5, 7, 16), dict(causal="lower_right")),
    ("window", (1, 2, 2, 7, 7, 16), dict(window=(2, 1))),
    ("softcap", (1, 2, 2, 5, 6, 16), dict(softcap=2.0)),
    ("alibi", (1, 2, 2, 5, 7, 16), dict(causal=True, alibi_slopes="slopes")),
    ("gqa", (1, 4, 2, 5, 7, 16), dict(causal="lower_right")),
    ("key_padding_mask", (2, 2, 2, 5, 7, 16), dict(key_padding_mask="mask")),
    ("key_lengths", (3, 2, 1, 5, 7, 16), dict(causal=True, key_lengths="lengths")),
]


def _variant_arguments(batch, heads, seq_k, arguments):
    """attention()'s arguments with the placeholders filled, and the reference's key mask."""
    arguments = dict(arguments)
    key_keep = None
    if arguments.get("alibi_slopes") == "slopes":
        arguments["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625][:heads], device=DEVICE)
    if arguments.get("key_padding_mask") == "mask":
        key_keep = torch.rand(batch, seq_k, generator=torch.Generator().manual_seed(3)).to(DEVICE) < 0.6
        key_keep[0, 0] = True
        arguments["key_padding_mask"] = key_keep
    if arguments.get("key_lengths") == "lengths":
        lengths = torch.tensor([seq_k, 3, 0][:batch], device=DEVICE)  # 0: every row sees no key
        arguments["key_lengths"] = lengths
        key_keep = torch.arange(seq_k, device=DEVICE)[None, :] < lengths[:, None]
    return arguments, key_keep


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name, sizes, arguments", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_attention_gradient_penalty_matches_float64(name, sizes, arguments, dtype):
    batch, heads, kv_heads, seq_q, seq_k, head_dim = sizes
    arguments, key_keep = _variant_arguments(batch, heads, seq_k, arguments)
    q = _random(batch, heads, seq_q, head_dim, dtype=dtype, seed=0)
    k = _random(batch, kv_heads, seq_k, head_dim, dtype=dtype, seed=1)
    v = _random(batch, kv_heads, seq_k, head_dim, dtype=dtype, seed=2)
    precision = "ieee" if dtype == torch.float32 else None  # true float32 dots on a GPU too
    reference_arguments = {key: value for key, value in arguments.items()
                           if key not in ("key_padding_mask", "key_lengths")}
    check_penalty(lambda *t: attention(*t, backend="triton", precision=precision, **arguments),
                  lambda *t: reference_attention(*t, key_keep=key_keep, **reference_arguments),
                  [q, k, v], (batch, heads, seq_q, head_dim))


def test_attention_direct_op_gradient_penalty_matches_float64():
    # torch.ops.flashlite.attention_forward (what compiled graphs hold) called eagerly: its registered autograd.
    q, k, v = (_random(1, 2, 5, 16, seed=s) for s in range(3))
    lengths = torch.tensor([6], device=DEVICE)
    key_keep = torch.arange(7, device=DEVICE)[None, :] < lengths[:, None]
    k, v = (torch.cat([t, _random(1, 2, 2, 16, seed=9)], dim=2) for t in (k, v))
    check_penalty(lambda *t: torch.ops.flashlite.attention_forward(*t, None, lengths, 2, 0.25, "ieee")[0],
                  lambda *t: reference_attention(*t, causal="lower_right", key_keep=key_keep), [q, k, v],
                  (1, 2, 5, 16))


def test_gradgrad_wrt_upstream_gradient():
    # The first gradients are linear in the upstream gradient: d(dq)/d(grad_out) must flow too (as
    # torch.autograd.gradgradcheck checks; float64, which it needs, is not a dtype the kernel takes).
    q, k, v = (_random(1, 2, 5, 16, seed=s).requires_grad_() for s in range(3))
    grad_out = _random(1, 2, 5, 16, seed=5).requires_grad_()
    out = attention(q, k, v, causal=True, backend="triton", precision="ieee")
    dq, = torch.autograd.grad(out, q, grad_out, create_graph=True)
    got, = torch.autograd.grad(dq.pow(2).sum(), grad_out)
    q64, k64, v64, g64 = (t.detach().double().requires_grad_() for t in (q, k, v, grad_out))
    dq64, = torch.autograd.grad(reference_attention(q64, k64, v64, causal=True), q64, g64, create_graph=True)
    expected, = torch.autograd.grad(dq64.pow(2).sum(), g64)
    assert_close(got, expected, policy="fp32")


VARLEN_CASES = [
    ("dense", (2, 2, 16), {}),
    ("causal_gqa", (4, 2, 16), dict(causal=True)),
    ("lower_right_window", (2, 2, 16), dict(causal="lower_right", window=(2, 0))),
    ("softcap_alibi", (2, 2, 16), dict(softcap=3.0, alibi_slopes="slopes")),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name, sizes, arguments", VARLEN_CASES, ids=[c[0] for c in VARLEN_CASES])
def test_varlen_gradient_penalty_matches_float64(name, sizes, arguments, dtype):
    heads, kv_heads, head_dim = sizes
    arguments = dict(arguments)
    if arguments.get("alibi_slopes") == "slopes":
        arguments["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625][:heads], device=DEVICE)
    lengths_q, lengths_k = [3, 0, 5], [4, 2, 6]  # an empty query sequence; S_q != S_k
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 6, 12], dtype=torch.int32, device=DEVICE)
    q = _random(8, heads, head_dim, dtype=dtype, seed=0)
    k = _random(12, kv_heads, head_dim, dtype=dtype, seed=1)
    v = _random(12, kv_heads, head_dim, dtype=dtype, seed=2)
    precision = "ieee" if dtype == torch.float32 else None

    def reference(q, k, v):
        # Each sequence on its own, through the dense reference ([1, H, S, D] views).
        outs = []
        for b in range(len(lengths_q)):
            qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
            ks, vs = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
            outs.append(reference_attention(qs, ks, vs, **arguments)[0].transpose(0, 1))
        return torch.cat(outs)

    check_penalty(lambda *t: attention_varlen(*t, cu_q, cu_k, max(lengths_q), max(lengths_k), backend="triton",
                                              precision=precision, **arguments),
                  reference, [q, k, v], (8, heads, head_dim))


def test_varlen_direct_op_gradient_penalty_matches_float64():
    cu_q = torch.tensor([0, 2, 7], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    q, k, v = _random(7, 2, 16, seed=0), _random(7, 2, 16, seed=1), _random(7, 2, 16, seed=2)

    def reference(q, k, v):
        outs = []
        for b in range(2):
            qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
            ks, vs = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
            outs.append(reference_attention(qs, ks, vs, causal=True)[0].transpose(0, 1))
        return torch.cat(outs)

    check_penalty(lambda *t: torch.ops.flashlite.attention_varlen_forward(*t, cu_q, cu_k, 5, 4, 1, 0.25, "ieee",
                                                                          -1, -1, 0.0, None)[0],
                  reference, [q, k, v], (7, 2, 16))


NORM_CASES = {
    "layer_norm": (lambda x, r, w, b: layer_norm(x, w, b, 1e-5),
                   lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
    "add_layer_norm": (lambda x, r, w, b: torch.cat(add_layer_norm(x, r, w, b, 1e-5), dim=-1),
                       lambda x, r, w, b: torch.cat([F.layer_norm(x + r, (x.shape[-1],), w, b, 1e-5), x + r],
                                                    dim=-1)),
    "bias_gelu": (lambda x, r, w, b: bias_gelu(x, b), lambda x, r, w, b: F.gelu(x + b)),
    "layer_norm_op": (lambda x, r, w, b: torch.ops.flashlite.layer_norm(x, w, b, 1e-5, None)[0],
                      lambda x, r, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
@pytest.mark.parametrize("name", sorted(NORM_CASES))
def test_norm_gradient_penalty_matches_float64(name, dtype):
    fn, reference = NORM_CASES[name]
    n = 13
    x, r = _random(3, 2, n, dtype=dtype, seed=0, scale=2.0), _random(3, 2, n, dtype=dtype, seed=1)
    w, b = 1.0 + _random(n, dtype=dtype, seed=2, scale=0.5), _random(n, dtype=dtype, seed=3)
    out_shape = (3, 2, 2 * n) if name == "add_layer_norm" else (3, 2, n)
    used = [x, r, w, b] if name == "add_layer_norm" else [x, w, b] if "layer_norm" in name else [x, b]
    positions = {"x": 0, "r": 1, "w": 2, "b": 3}
    names = ["x", "r", "w", "b"] if name == "add_layer_norm" else ["x", "w", "b"] if "layer_norm" in name \
        else ["x", "b"]

    def spread(f):
        def call(*tensors):
            full = [x, r, w, b]
            for label, t in zip(names, tensors):
                full[positions[label]] = t
            return f(*full)
        return call

    check_penalty(spread(fn), spread(reference), used, out_shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16"])
def test_layer_gradient_penalty_matches_float64(dtype):
    # TransformerLayer with attention on the Triton kernel and every fused kernel (LayerNorm, residual add +
    # LayerNorm, bias + GELU); the reference is the same weights in PyTorch's own block, in float64.
    torch.manual_seed(0)
    settings = dict(precision="fp32", attention_precision="ieee") if dtype == torch.float32 else \
        dict(precision="mixed", compute_dtype=torch.float16)
    layer = TransformerLayer(32, 2, n_kv_heads=1, d_ff=48, attention_backend="triton",
                             fusions={"triton_layer_norm", "add_layer_norm", "bias_gelu"}, device=DEVICE, **settings)
    plain = layer.to_plain(torch.float64)
    x = _random(2, 5, 32, seed=0)
    weight = _random(2, 5, 32, seed=1, dtype=torch.float64)

    def penalized(module, x):
        x = x.detach().clone().requires_grad_()
        out = module(x)
        loss = (out.double() * weight).sum()
        g, = torch.autograd.grad(loss, x, create_graph=True)
        (loss + g.double().pow(2).sum()).backward()
        return x.grad

    got = penalized(layer, x)
    # Baseline for "mixed" (fp16 operands): the same layer on PyTorch's attention and norms, in the same precision.
    baseline_layer = copy.deepcopy(layer)
    baseline_layer.attention_backend, baseline_layer.fusions = "sdpa", frozenset()
    with sdpa_kernel(SDPBackend.MATH):  # SDPA's fused CPU kernel has no second derivative
        expected = penalized(plain, x.double())
        baseline = penalized(baseline_layer, x) if dtype != torch.float32 else None
    names = {"ln1.weight": "ln1.weight", "ln2.weight": "ln2.weight", "fc1.weight": "fc1.weight",
             "fc1.bias": "fc1.bias", "out.weight": "out_proj.weight"}
    plain_parameters = dict(plain.named_parameters())

    def base(name):
        return None if baseline is None else baseline_layer.get_parameter(name).grad

    assert_close(got, expected, baseline=baseline, notes=("x",))
    for mine, theirs in names.items():
        assert_close(layer.get_parameter(mine).grad, plain_parameters[theirs].grad, baseline=base(mine),
                     notes=(mine,))
    query_rows = slice(0, 32)  # qkv.weight's query rows are the plain block's q_proj.weight
    assert_close(layer.qkv.weight.grad[query_rows], plain.q_proj.weight.grad,
                 baseline=None if baseline is None else base("qkv.weight")[query_rows], notes=("qkv.weight",))


def test_ordinary_backward_does_not_recompute(monkeypatch):
    # create_graph=False keeps the kernels' backward: the differentiable recompute must not run (nor cost).
    def refuse(*args, **kwargs):
        raise AssertionError("recompute ran for an ordinary backward")

    import flashlite.attn.run as run
    import flashlite.attn.varlen as varlen
    import flashlite.norm as norm
    monkeypatch.setattr(run, "recomputed_gradients", refuse)
    monkeypatch.setattr(varlen, "recomputed_gradients", refuse)
    monkeypatch.setattr(norm, "layer_norm_gradients", refuse)
    monkeypatch.setattr(norm, "bias_gelu_gradients", refuse)
    q, k, v = (_random(1, 2, 5, 16, seed=s).requires_grad_() for s in range(3))
    attention(q, k, v, causal=True, backend="triton").sum().backward()
    x = _random(2, 8, seed=4).requires_grad_()
    w, b = _random(8, seed=5).requires_grad_(), _random(8, seed=6).requires_grad_()
    (layer_norm(x, w, b).sum() + add_layer_norm(x, x, w, b)[0].sum() + bias_gelu(x, b).sum()).backward()
    assert q.grad is not None and x.grad is not None


def test_sdpa_backend_under_the_math_backend_matches_float64():
    # The documented recipe for second-order gradients on the SDPA path (whose fused kernels have none).
    q, k, v = (_random(1, 2, 5, 16, seed=s) for s in range(3))
    with sdpa_kernel(SDPBackend.MATH):
        check_penalty(lambda *t: attention(*t, causal=True, window=(3, -1), backend="sdpa"),
                      lambda *t: reference_attention(*t, causal=True, window=(3, -1)), [q, k, v], (1, 2, 5, 16))


def test_compiled_double_backward_raises():
    # Under torch.compile the kernels are custom ops inside AOTAutograd, which refuses a double backward: an
    # error, never silently wrong gradients.
    torch._dynamo.reset()
    q, k, v = (_random(1, 2, 5, 16, seed=s).requires_grad_() for s in range(3))
    compiled = torch.compile(lambda q, k, v: attention(q, k, v, causal=True, backend="triton"),
                             backend="aot_eager", fullgraph=True)
    g, = torch.autograd.grad(compiled(q, k, v).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        g.pow(2).sum().backward()
    torch._dynamo.reset()


@pytest.mark.parametrize("case", ["layer_norm", "layer_norm_residual", "bias_gelu"])
def test_gradient_formulas_gradcheck_float64(case):
    # The differentiable backward formulas, differentiated once more against finite differences in float64
    # (gradcheck of the first gradients = gradgradcheck of the functions), and equal to autograd's first
    # gradients of the functions they stand for.
    x, dy = _random(3, 5, dtype=torch.float64, seed=0), _random(3, 5, dtype=torch.float64, seed=1)
    w, b = 1.0 + _random(5, dtype=torch.float64, seed=2, scale=0.3), _random(5, dtype=torch.float64, seed=3)
    dsum = _random(3, 5, dtype=torch.float64, seed=4)
    leaves = [t.clone().requires_grad_() for t in (x, w, b, dy, dsum)]
    if case == "bias_gelu":
        formula = lambda x, w, b, dy, dsum: _double_backward.bias_gelu_gradients(dy, x, b)  # noqa: E731
        function = lambda x, w, b: F.gelu(x + b)  # noqa: E731
        extra = 0
    else:
        residual = case == "layer_norm_residual"
        formula = lambda x, w, b, dy, dsum: _double_backward.layer_norm_gradients(  # noqa: E731
            dy, x, w, 1e-5, dsum if residual else None)
        function = lambda x, w, b: F.layer_norm(x, (5,), w, b, 1e-5)  # noqa: E731
        extra = 1 if residual else 0
    assert torch.autograd.gradcheck(formula, leaves)
    out = function(*leaves[:3])
    expected = torch.autograd.grad(out, leaves[:3], dy, allow_unused=True, materialize_grads=True)
    got = formula(*leaves)
    if case == "bias_gelu":
        got, expected = got, (expected[0], expected[2])
    assert_close(got[0], expected[0] + extra * dsum, policy="fp64")
    for g, e in zip(got[1:], expected[1:]):
        assert_close(g, e, policy="fp64")
