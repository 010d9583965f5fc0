"""What attn_mask, a window or a cache's length hides never reaches the output or the gradients.

The same call gave NaN in every row under ``attn_mask=m`` when m hid a NaN key from every row, and finite rows once
``window=(10, 10)`` (hiding nothing more) or ``causal=True`` was added: SDPA multiplies its zero weights by every
value (0 * NaN = NaN) and adds -inf to a NaN score (NaN). Each mechanism here hides non-finite keys and values:
a bool attn_mask, a float attn_mask's -inf, a window, a KV cache's length (and window), and varlen's sequence
boundaries. Expected: the float64 result of the clean inputs, output and gradients, and the caller's tensors
untouched. Sizes are odd and tiny (the Triton interpreter runs on a CPU).
"""
import math

import pytest
import torch

from flashlite.attention import attention, attention_varlen, attention_with_kvcache
from pytest_kernelcheck import assert_close, attention_reference

BATCH, HEADS, KV_HEADS, SEQ_Q, SEQ_K, DIM = 2, 4, 2, 13, 21, 16
# The Triton backend runs CUDA tensors on a GPU machine (no interpreter there), CPU tensors in the interpreter here.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = [4, 17]  # keys the masks below hide from every row
GARBAGE = {"nan": math.nan, "inf": math.inf}


def rand(*size, seed):
    return torch.randn(*size, generator=torch.Generator().manual_seed(seed))


def exact(q, k, v, visible, bias=None):
    """float64 softmax(q k^T / sqrt(D) + bias) v over ``visible``, differentiable; rows seeing no key give 0."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if bias is not None:
        visible = visible & ~torch.isneginf(bias)
        scores = scores + torch.where(visible, bias.double(), 0.0)
    scores = torch.where(visible, scores, -math.inf)
    sees = visible.any(dim=-1, keepdim=True)
    weights = torch.where(visible, torch.softmax(torch.where(sees, scores, 0.0), dim=-1), 0.0)
    return weights @ v


def hiding_masks():
    """(bool attn_mask, float attn_mask) that both hide HIDDEN from every row."""
    keep = torch.ones(SEQ_Q, SEQ_K, dtype=torch.bool)
    keep[:, HIDDEN] = False
    return keep, (rand(SEQ_Q, SEQ_K, seed=9) * 2).masked_fill(~keep, -math.inf)


def poisoned(t, keys, value, column):
    """A copy of t [B, H_kv, S_k, D] with ``value`` at ``column`` of ``keys``."""
    t = t.clone()
    t[:, :, keys, column] = value
    return t


def check_call(call, visible, bias, k_bad, v_bad, hidden, seed):
    """Run call(q, k, v) with gradients on fresh q and poisoned k, v; compare with the clean float64 result."""
    q = rand(BATCH, HEADS, SEQ_Q, DIM, seed=seed).requires_grad_()
    k_clean, v_clean = rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=seed + 1), rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=seed + 2)
    grad_out = rand(BATCH, HEADS, SEQ_Q, DIM, seed=seed + 3)
    k = (poisoned(k_clean, hidden, k_bad, 3) if k_bad is not None else k_clean.clone()).requires_grad_()
    v = (poisoned(v_clean, hidden, v_bad, 5) if v_bad is not None else v_clean.clone()).requires_grad_()
    k_before, v_before = k.detach().clone(), v.detach().clone()
    out = call(q, k, v)
    out.backward(grad_out)
    # The caller's tensors are not modified (NaN compares unequal: compare with NaN as equal).
    assert torch.equal(k.detach().nan_to_num(), k_before.nan_to_num()) and torch.isnan(k.detach()).sum() == \
        torch.isnan(k_before).sum()
    assert torch.equal(v.detach().nan_to_num(), v_before.nan_to_num())
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), f"{name} has {int((~torch.isfinite(t)).sum())} non-finite elements"
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k_clean, v_clean)]
    expected = exact(*leaves, visible, bias)
    expected.backward(grad_out.double())
    assert_close(out, expected, policy="fp32")
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert_close(got, want, policy="fp32")
    assert (k.grad[:, :, hidden] == 0).all() and (v.grad[:, :, hidden] == 0).all()


POISON = {"k nan": ("nan", None), "v nan": (None, "nan"), "k and v inf": ("inf", "inf"), "k inf v nan": ("inf", "nan")}


@pytest.mark.parametrize("backend", ["sdpa", "auto"])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("poison", POISON)
def test_keys_an_attn_mask_hides_from_every_row_never_reach_the_output_or_gradients(backend, kind, poison):
    keep, additive = hiding_masks()
    mask = keep if kind == "bool" else additive
    k_bad, v_bad = (None if p is None else GARBAGE[p] for p in POISON[poison])
    check_call(lambda q, k, v: attention(q, k, v, attn_mask=mask, backend=backend), keep[None, None],
               None if kind == "bool" else additive, k_bad, v_bad, HIDDEN, seed=1)


@pytest.mark.parametrize("extra", [{}, {"window": (10, 10)}, {"causal": "lower_right"}, {"softcap": 5.0},
                                   {"alibi_slopes": torch.tensor([0.3, 0.7, 0.05, 0.2])}])
def test_an_argument_that_hides_nothing_more_gives_the_same_finite_result(extra):
    # The reported symptom: NaN in every row without the window, finite rows with it.
    keep, additive = hiding_masks()
    q, k, v = rand(BATCH, HEADS, SEQ_Q, DIM, seed=3), rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=4), \
        rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=5)
    k_bad = poisoned(k, HIDDEN, math.nan, 0)
    out = attention(q, k_bad, v, attn_mask=additive, backend="sdpa", **extra)
    assert torch.isfinite(out).all()
    expected = attention_reference(q, k, v, attn_mask=additive, enable_gqa=True, **extra)
    assert_close(out, expected, policy="fp32")


def test_a_key_the_mask_hides_from_some_rows_shows_only_in_the_rows_that_see_it():
    mask = rand(SEQ_Q, SEQ_K, seed=6) > -0.5
    mask[:, 0] = True
    q, k, v = rand(BATCH, HEADS, SEQ_Q, DIM, seed=7), rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=8), \
        rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=9)
    bad_key = 6
    out = attention(q, poisoned(k, [bad_key], math.nan, 2), v, attn_mask=mask, backend="sdpa")
    sees = mask[:, bad_key]
    assert sees.any() and (~sees).any()
    assert torch.isnan(out[:, :, sees]).all(), "a NaN key a row sees makes that row NaN, as the exact sum is"
    expected = attention_reference(q, k, v, attn_mask=mask, enable_gqa=True)
    assert_close(out[:, :, ~sees], expected[:, :, ~sees], policy="fp32")


def test_a_nan_query_in_a_row_that_sees_no_key_reaches_no_gradient():
    # Row 4 sees no key (its output is zeros): its query reaches nothing, its NaN neither.
    mask = torch.ones(SEQ_Q, SEQ_K, dtype=torch.bool)
    mask[4] = False
    q = rand(BATCH, HEADS, SEQ_Q, DIM, seed=11)
    q[:, :, 4, 1] = math.nan
    q.requires_grad_()
    k, v = (rand(BATCH, KV_HEADS, SEQ_K, DIM, seed=s).requires_grad_() for s in (12, 13))
    out = attention(q, k, v, attn_mask=mask, backend="sdpa")
    out.backward(rand(BATCH, HEADS, SEQ_Q, DIM, seed=14))
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), f"{name} has {int((~torch.isfinite(t)).sum())} non-finite elements"
    assert (out[:, :, 4] == 0).all() and (q.grad[:, :, 4] == 0).all()


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("window", [None, (4, -1)])
def test_a_cache_past_its_length_and_outside_the_window_may_hold_nan(backend, window):
    q = rand(3, 4, 2, DIM, seed=21)
    k_cache, v_cache = rand(3, 2, 40, DIM, seed=22), rand(3, 2, 40, DIM, seed=23)
    lengths = torch.tensor([17, 3, 33], dtype=torch.int32)
    k_bad, v_bad = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        k_bad[b, :, n:, 1], v_bad[b, :, n:, 2] = math.nan, math.inf
        if window is not None:  # keys older than the window of the first query row (position n - 2)
            k_bad[b, :, :max(0, n - 2 - window[0]), 0] = math.nan
            v_bad[b, :, :max(0, n - 2 - window[0]), 3] = math.nan
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    out = attention_with_kvcache(*(t.to(device) for t in (q, k_bad, v_bad, lengths)), window=window,
                                 backend=backend).cpu()
    assert torch.isfinite(out).all()
    for b, n in enumerate(lengths.tolist()):
        expected = attention_reference(q[b:b + 1], k_cache[b:b + 1, :, :n], v_cache[b:b + 1, :, :n],
                                       causal="lower_right", window=window, enable_gqa=True)
        assert_close(out[b:b + 1], expected, policy="fp32" if backend == "sdpa" else "tf32")


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_varlen_keys_hidden_by_causal_and_window_may_hold_nan(backend):
    # Two sequences, each with more keys than queries: top-left causal hides their last keys from every row (the
    # window (3, -1) hides older keys from the later rows, not from every row).
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 9, 20], dtype=torch.int32)
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    q = rand(12, HEADS, DIM, seed=31).to(device).requires_grad_()
    k_clean, v_clean = rand(20, KV_HEADS, DIM, seed=32), rand(20, KV_HEADS, DIM, seed=33)
    hidden = [5, 6, 7, 8, 16, 17, 18, 19]  # keys past each sequence's last query row
    k, v = k_clean.clone().to(device), v_clean.clone().to(device)
    k[hidden, :, 3], v[hidden, :, 5] = math.nan, math.inf
    k.requires_grad_(), v.requires_grad_()
    precision = {"precision": "ieee"} if backend == "triton" else {}
    out = attention_varlen(q, k, v, cu_q.to(device), cu_k.to(device), 7, 11, causal=True, window=(3, -1),
                           backend=backend, **precision)
    grad_out = rand(12, HEADS, DIM, seed=34)
    out.backward(grad_out.to(device))
    for name, t in (("out", out), ("dq", q.grad), ("dk", k.grad), ("dv", v.grad)):
        assert torch.isfinite(t).all(), f"{name} has {int((~torch.isfinite(t)).sum())} non-finite elements"
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k_clean, v_clean)]
    parts = []
    for (q0, q1), (k0, k1) in zip(((0, 5), (5, 12)), ((0, 9), (9, 20))):
        rows, keys = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
        visible = (keys <= rows) & (keys >= rows - 3)
        parts.append(exact(*(t[a:b].transpose(0, 1)[None] for t, (a, b) in
                             zip(leaves, ((q0, q1), (k0, k1), (k0, k1)))), visible)[0].transpose(0, 1))
    expected = torch.cat(parts)
    expected.backward(grad_out.double())
    assert_close(out.cpu(), expected, policy="fp32")
    for got, want in zip((q.grad, k.grad, v.grad), (t.grad for t in leaves)):
        assert_close(got.cpu(), want, policy="fp32")
    assert (k.grad[hidden] == 0).all() and (v.grad[hidden] == 0).all()
