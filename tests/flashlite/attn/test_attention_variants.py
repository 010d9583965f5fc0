"""Sliding windows, softcapping and ALiBi through the public ``flashlite.attention``, on both backends, against a
float64 reference written out here; their validation; and how the dispatch names and routes them.

The kernel-level checks (the launchers, block skipping, the dense kernels unchanged) live in the kernels folder's
test_attention_variants_kernel.py. Shapes are tiny and odd on purpose: the CPU runs the kernel through the Triton
interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashlite.attn.plan as plans_module
from flashlite import dispatch
from flashlite.attention import attention, explain_dispatch
from pytest_kernelcheck import assert_close
from tests.flashlite.attn.compiled import eager_and_compiled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def reference(q, k, v, *, causal=False, scale=None, window=None, softcap=None, alibi_slopes=None,
              key_lengths=None, bias=None):
    """float64 attention with the documented order: scale * q.k, softcap, ALiBi, then every mask (``bias``: a
    float attn_mask, added, its -inf hiding a key as a mask does)."""
    q, k, v = (t.double() for t in (q, k, v))
    batch, heads, seq_q, head_dim = q.shape
    group = heads // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    seq_k = k.shape[2]
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(seq_q, device=q.device)[:, None] + (seq_k - seq_q if causal == "lower_right" else 0)
    cols = torch.arange(seq_k, device=q.device)[None, :]
    if alibi_slopes is not None:
        slopes = alibi_slopes.double() if alibi_slopes.dim() == 2 else alibi_slopes.double()[None]
        scores = scores - slopes[:, :, None, None] * (rows - cols).abs()
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)[None, None]
    if causal:
        visible = visible & (cols <= rows)
    if window is not None:
        left, right = window
        if left >= 0:
            visible = visible & (cols >= rows - left)
        if right >= 0:
            visible = visible & (cols <= rows + right)
    if key_lengths is not None:
        visible = visible & (cols < key_lengths.to(q.device)[:, None, None, None])
    if bias is not None:
        scores = scores + bias.double()
        visible = visible & ~torch.isneginf(bias)
    empty = ~visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")).masked_fill(empty, 0.0), dim=-1)
    return (weights @ v).masked_fill(empty, 0.0)


def make(batch=2, heads=4, kv_heads=2, seq_q=19, seq_k=23, head_dim=16, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, heads, seq_q, head_dim, generator=gen)
    k, v = (torch.randn(batch, kv_heads, seq_k, head_dim, generator=gen) for _ in range(2))
    return tuple(t.to(device=DEVICE, dtype=dtype) for t in (q, k, v))


VARIANTS = {
    "window": dict(window=(5, 3)),
    "window-left-only": dict(window=(4, -1)),
    "softcap": dict(softcap=2.5),
    "alibi-heads": dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])),
    "alibi-batch-heads": dict(alibi_slopes=torch.tensor([[0.5, 0.3, 0.2, 0.1], [0.05, 0.4, 0.6, 0.9]])),
    "all": dict(window=(6, 2), softcap=3.0, alibi_slopes=torch.tensor([0.3, 0.2, 0.1, 0.05])),
}


def _on_device(options):
    return {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value for name, value in options.items()}


def _assert_close_with_gradients(out, expected, inputs, inputs64, seed):
    """out against its float64 expectation, then dq, dk, dv against the float64 ones for one random gradient."""
    assert_close(out.detach(), expected.detach(), policy="fp32")
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    out.backward(grad)
    expected.backward(grad.double())
    for name, got, want in zip(("dq", "dk", "dv"), inputs, inputs64):
        assert_close(got.grad, want.grad, policy="fp32", notes=(name,))


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_the_float64_reference_forward_and_backward(variant, causal, backend):
    options = _on_device(VARIANTS[variant])
    q, k, v = (t.requires_grad_() for t in make(seed=len(variant)))
    lengths = torch.tensor([23, 17], device=DEVICE)
    out = attention(q, k, v, causal=causal, key_lengths=lengths, backend=backend, precision="ieee", **options)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, causal=causal, key_lengths=lengths, **options)
    _assert_close_with_gradients(out, expected, (q, k, v), (q64, k64, v64), seed=3)


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_a_window_that_hides_every_key_of_a_row_gives_zeros_and_hidden_nan_never_shows(backend):
    # window (0, 0) without causal: row i sees key i only, so rows past S_k see nothing and give zeros.
    q, k, v = make(seq_q=21, seq_k=13)
    out = attention(q, k, v, window=(0, 0), backend=backend, precision="ieee")
    assert_close(out, reference(q, k, v, window=(0, 0)), policy="fp32")
    assert torch.equal(out[:, :, 13:], torch.zeros_like(out[:, :, 13:]))
    # Bottom-right alignment with S_k - S_q = 14 and 3 keys to the left: row 0 sees keys 11-14, so keys 0-10
    # are outside every row's window. They hold NaN and inf, which must reach no row (nor the gradients).
    q, k, v = make(seq_q=9, seq_k=23)
    k, v = k.clone(), v.clone()
    k[:, :, :11], v[:, :, :11] = float("nan"), float("inf")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = attention(q, k, v, causal="lower_right", window=(3, -1), backend=backend, precision="ieee")
    clean = [t.detach().clone() for t in (k, v)]
    for t in clean:
        t[:, :, :11] = 0.0
    assert_close(out.detach(), reference(q.detach(), *clean, causal="lower_right", window=(3, -1)), policy="fp32")
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    assert torch.equal(k.grad[:, :, :11], torch.zeros_like(k.grad[:, :, :11]))


@pytest.mark.parametrize("alibi", [False, True])
def test_a_softcapped_call_with_a_bias_that_hides_a_whole_row_gives_zeros_there(alibi):
    # A float attn_mask's -inf hides a key as a False entry does, so a row it hides whole sees no key and gives
    # zeros, with zero gradients (attention's docstring). SDPA cannot softcap: flashlite computes such calls from
    # explicit scores, where that row was a softmax over -inf only (NaN).
    q, k, v = (t.requires_grad_() for t in make(seq_q=11, seq_k=13, seed=5))
    bias = torch.randn(2, 4, 11, 13, generator=torch.Generator().manual_seed(6))
    bias[0, :, 4] = float("-inf")
    bias[1, 2, 7] = float("-inf")
    bias[:, :, 9, ::2] = float("-inf")
    bias = bias.to(DEVICE)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE) if alibi else None
    options = dict(softcap=2.5, alibi_slopes=slopes)
    out = attention(q, k, v, causal="lower_right", key_lengths=torch.tensor([13, 10], device=DEVICE),
                    attn_mask=bias, **options)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = reference(q64, k64, v64, causal="lower_right", key_lengths=torch.tensor([13, 10]), bias=bias,
                         **options)
    _assert_close_with_gradients(out, expected, (q, k, v), (q64, k64, v64), seed=7)


def test_bad_variant_arguments_are_refused_by_name():
    q, k, v = make()
    cases = [
        (dict(window=(-2, 0)), ValueError, "window sides must be >= 0, or -1"),
        (dict(window=(3,)), TypeError, "window must be None or"),
        (dict(window=(1.5, 2)), TypeError, "window must be None or"),
        (dict(window=(True, 2)), TypeError, "window must be None or"),
        (dict(softcap=0.0), ValueError, "softcap must be finite and > 0"),
        (dict(softcap=-1), ValueError, "softcap must be finite and > 0"),
        (dict(softcap=float("inf")), ValueError, "softcap must be finite and > 0"),
        (dict(softcap="30"), TypeError, "softcap must be a real number"),
        (dict(alibi_slopes=torch.ones(3, device=DEVICE)), ValueError, r"alibi_slopes must have shape \[H\]"),
        (dict(alibi_slopes=torch.ones(4, dtype=torch.float64, device=DEVICE)), TypeError,
         "alibi_slopes must be float32"),
        (dict(alibi_slopes=[0.1] * 4), TypeError, "alibi_slopes must be a float32 tensor"),
    ]
    for options, error, message in cases:
        for backend in ("auto", "sdpa", "triton"):
            with pytest.raises(error, match=message):
                attention(q, k, v, backend=backend, **options)
            with pytest.raises(error, match=message):
                explain_dispatch(q, k, v, backend=backend, **options)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "triton"])
@pytest.mark.parametrize("q_needs_grad", [False, True])
def test_slopes_that_require_grad_are_refused_on_every_call_of_every_backend(backend, q_needs_grad, monkeypatch):
    # The kernel computes no gradient for the slopes: on the Triton backend a slopes tensor that required grad got
    # none (.grad None beside q's gradient, or an output without a gradient at all), while the SDPA path, which
    # adds the slopes as a bias, gave it one. Refused alike now, the replay of a kept plan included (requires_grad
    # is not part of the plan key); detached, or under no_grad, the slopes are the constants they always were.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k, v = make(seed=13)
    q.requires_grad_(q_needs_grad)
    slopes = torch.rand(4, generator=torch.Generator().manual_seed(14)).to(DEVICE)
    options = dict(causal=True, backend=backend, precision="ieee")
    expected = reference(q.detach(), k, v, causal=True, alibi_slopes=slopes)
    assert_close(attention(q, k, v, alibi_slopes=slopes, **options).detach(), expected, policy="fp32")  # kept plan
    learned = slopes.clone().requires_grad_()
    for call in (attention, explain_dispatch):
        with pytest.raises(ValueError, match=r"alibi_slopes requires grad.*alibi_slopes\.detach\(\)"):
            call(q, k, v, alibi_slopes=learned, **options)
    with pytest.raises(ValueError, match="alibi_slopes requires grad"):  # with an attn_mask too: always SDPA
        attention(q, k, v, alibi_slopes=learned, attn_mask=torch.ones(19, 23, dtype=torch.bool, device=DEVICE),
                  causal=True, backend="auto" if backend == "triton" else backend)
    with torch.no_grad():
        assert_close(attention(q, k, v, alibi_slopes=learned, **options), expected, policy="fp32")
    assert_close(attention(q, k, v, alibi_slopes=learned.detach(), **options).detach(), expected, policy="fp32")


def test_the_dispatch_names_the_variant_and_sends_it_to_the_kernel_where_no_entry_says_otherwise(monkeypatch):
    # On a GPU without a table entry for the variant, the rule sends variants to the kernel (SDPA can only take
    # them as a dense mask or bias); pretend these CPU tensors live on an H200 to see the rule here.
    q, k, v = make()
    monkeypatch.setattr(dispatch, "_slug_of", lambda q: "nvidia-h200")
    slopes = torch.rand(4, device=DEVICE)
    decision = explain_dispatch(q, k, v, causal=True, window=(8, 0), alibi_slopes=slopes)
    assert decision.backend == "triton" and "window+alibi" in decision.reason
    padded = explain_dispatch(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True,
                              key_lengths=torch.tensor([20, 9], device=DEVICE))
    assert padded.backend == "triton" and "key_padding" in padded.reason
    dense = explain_dispatch(q.bfloat16(), k.bfloat16(), v.bfloat16(), causal=True)
    assert "key_padding" not in dense.reason and "window" not in dense.reason
    assert dispatch.table_key(torch.bfloat16, 16, True, 2, 23, "window") == "bfloat16/D16/causal/B2/S64/window"


def test_variant_calls_get_their_own_plans(monkeypatch):
    # A window, softcap or slopes of another value is another signature: never answered by a stale plan.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k, v = make()
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    results = {}
    for options in (dict(window=(3, 0)), dict(window=(4, 0)), dict(softcap=2.0), dict(softcap=3.0),
                    dict(alibi_slopes=slopes), dict(alibi_slopes=slopes * 2), dict()):
        for _ in range(2):  # the second call replays the plan
            out = attention(q, k, v, causal=True, backend="sdpa", **options)
            assert_close(out, reference(q, k, v, causal=True, **options), policy="fp32")
        results[repr(options)] = out
    # The slopes are a per-call tensor: both slope values share a plan. (Plans that serve every key length are kept by
    # their length-free key too: those are not signatures.)
    assert len([key for key in plans_module._PLANS if plans_module.entry_of(key) == "attention"]) == 6


def test_variants_compile_into_one_graph_and_match_eager():
    # torch.compile sees the custom op with the variant arguments: no graph break, eager's results and gradients.
    q, k, v = (t.requires_grad_() for t in make(seed=9))
    slopes = torch.tensor([0.4, 0.3, 0.2, 0.1], device=DEVICE)

    def block(q, k, v):
        return attention(q, k, v, causal="lower_right", window=(6, 1), softcap=2.0, alibi_slopes=slopes,
                         backend="triton", precision="ieee")

    weight = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(q)
    results = eager_and_compiled(block, (q, k, v), weight)  # one dense incoming gradient on both sides
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
    expected = reference(q.detach(), k.detach(), v.detach(), causal="lower_right", window=(6, 1), softcap=2.0,
                         alibi_slopes=slopes)
    assert_close(results[0][0], expected, policy="fp32")


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU runs the same "
                                                                      "checks at tiny sizes above")


@needs_cuda
@pytest.mark.parametrize("options", [dict(window=(1024, 0)), dict(softcap=30.0), dict(alibi=True),
                                     dict(window=(700, 0), softcap=30.0, alibi=True)], ids=repr)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_variants_at_real_sizes_against_the_plugin_reference(options, dtype, sdpa_reference):
    # B=2, S=4099 (not a multiple of any block), H=16 over 4 kv heads, D=64, causal, forward and backward.
    options = dict(options)
    if options.pop("alibi", False):
        options["alibi_slopes"] = torch.tensor([2.0 ** (-8.0 * (i + 1) / 16) for i in range(16)], device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(4)
    q = torch.randn(2, 16, 4099, 64, device="cuda", dtype=dtype, generator=gen)
    k, v = (torch.randn(2, 4, 4099, 64, device="cuda", dtype=dtype, generator=gen) for _ in range(2))
    out = attention(q, k, v, causal=True, backend="triton", **options)
    sdpa_reference.check(out, q, k, v, causal=True, enable_gqa=True, **options)


@needs_cuda
def test_sliding_window_peak_memory_is_output_and_statistics_only():
    # At S=65,536 a dense mask alone would be 4 GiB: the windowed forward allocates its output and lse only.
    q, k, v = (torch.randn(1, 16, 65536, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    attention(q, k, v, causal=True, window=(1024, 0), backend="triton")  # compile and tune outside
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = attention(q, k, v, causal=True, window=(1024, 0), backend="triton")
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    allowed = out.numel() * out.element_size() + 16 * 65536 * 4
    assert extra <= 1.05 * allowed, f"forward used {extra} bytes beyond its inputs; output + lse are {allowed}"
