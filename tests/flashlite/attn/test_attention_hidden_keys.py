"""What the masks hide never reaches attention's output, on every backend.

A key hidden by ``key_padding_mask``, ``key_lengths`` or the causal mask may hold anything: a KV cache filled past
its end holds garbage, often NaN. The output and the gradients must be what the visible keys alone give, and a
non-finite value a row does see must still show in that row (NaN never hides). Shapes are tiny (the interpreter
runs the kernels on a CPU) and odd, so that key blocks straddle both the padding and the diagonal.

The kernel's guarantee is per tile: keys that no row of a query tile may see load as zeros and never reach it.
A non-finite key that some rows of a tile see turns those rows non-finite, and may turn the tile's other rows
NaN too (the product P V sums 0 * NaN over the tile); rows of earlier tiles stay clean. flashlite's SDPA path with
masks keeps every row that does not see such a key clean.
"""
import math

import pytest
import torch

from flashlite.attention import attention
from pytest_kernelcheck import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BATCH, HEADS, KV_HEADS, SEQ_Q, SEQ_K, HEAD_DIM = 3, 4, 2, 37, 45, 16
LENGTHS = [45, 20, 33]
GARBAGE = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}
# The dense causal call on SDPA runs SDPA's own causal kernels, which flashlite does not touch (see ``attention``);
# every other call of these tests runs flashlite's code on both backends.
BACKENDS = ["triton", "sdpa"]


def rand(*size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)


def reference(q, k, v, visible):
    """float64 softmax(q k^T / sqrt(D)) v over ``visible`` [B or 1, 1, S_q, S_k] (grouped heads repeated), with
    the masks applied by `where`; rows that see no key give zeros."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.where(visible, q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -math.inf)
    has_key = visible.any(dim=-1, keepdim=True)
    weights = torch.softmax(torch.where(has_key, scores, 0.0), dim=-1)
    return torch.where(has_key, torch.where(visible, weights, 0.0) @ v, 0.0)


def visibility(causal, key_mask):
    seq_q, seq_k = SEQ_Q, SEQ_K
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=DEVICE)
    if causal is True:
        visible = visible.tril(0)
    elif causal == "lower_right":
        visible = visible.tril(seq_k - seq_q)
    visible = visible[None, None]
    return visible if key_mask is None else visible & key_mask[:, None, None, :]


def padding(kind):
    """(keyword arguments, bool [B, S_k] of the keys they let through)."""
    lengths = torch.tensor(LENGTHS, device=DEVICE)
    keep = torch.arange(SEQ_K, device=DEVICE)[None, :] < lengths[:, None]
    if kind == "key_lengths":
        return {"key_lengths": lengths}, keep
    # Holes inside the sequence too, not only a padded tail.
    keep = keep & (rand(BATCH, SEQ_K, dtype=torch.float32, seed=7) > -0.8)
    keep[:, 0] = True
    return {"key_padding_mask": keep}, keep


def inputs(seed, dtype=torch.float32):
    """Fresh q [B, H, S_q, D], k, v [B, H_kv, S_k, D] and an upstream gradient like q."""
    return (rand(BATCH, HEADS, SEQ_Q, HEAD_DIM, dtype=dtype, seed=seed),
            rand(BATCH, KV_HEADS, SEQ_K, HEAD_DIM, dtype=dtype, seed=seed + 1),
            rand(BATCH, KV_HEADS, SEQ_K, HEAD_DIM, dtype=dtype, seed=seed + 2),
            rand(BATCH, HEADS, SEQ_Q, HEAD_DIM, dtype=dtype, seed=seed + 3))


def with_garbage(t, hidden, value):
    """t with ``value`` in every key position where ``hidden`` [B, S_k] is True (a copy)."""
    return t.masked_fill(hidden[:, None, :, None], value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["key_padding_mask", "key_lengths"])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("garbage", ["nan", "inf"])
def test_padded_keys_never_reach_the_output_or_the_gradients(backend, kind, causal, garbage):
    q, k, v, grad_out = inputs(seed=1)
    masks, keep = padding(kind)
    k_bad, v_bad = (with_garbage(t, ~keep, GARBAGE[garbage]).requires_grad_() for t in (k, v))
    q = q.requires_grad_()

    out = attention(q, k_bad, v_bad, causal=causal, backend=backend, precision="ieee", **masks)
    out.backward(grad_out)
    assert torch.isfinite(out).all(), f"{int((~torch.isfinite(out)).sum())} non-finite outputs"
    for name, grad in (("q", q.grad), ("k", k_bad.grad), ("v", v_bad.grad)):
        assert torch.isfinite(grad).all(), f"d{name} has {int((~torch.isfinite(grad)).sum())} non-finite elements"

    # The same call on clean inputs, in float64: what the visible keys alone give.
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, visibility(causal, keep))
    expected.backward(grad_out.double())
    assert_close(out, expected, policy="fp32")
    assert_close(q.grad, leaves[0].grad, policy="fp32")
    assert_close(k_bad.grad, leaves[1].grad, policy="fp32")
    assert_close(v_bad.grad, leaves[2].grad, policy="fp32")
    # Hidden keys get exactly zero gradient.
    hidden = (~keep)[:, None, :, None].expand_as(k_bad.grad)
    assert (k_bad.grad[hidden] == 0).all() and (v_bad.grad[hidden] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_mask_hides_garbage_in_half_precision(backend):
    masks, keep = padding("key_padding_mask")
    q = rand(BATCH, HEADS, SEQ_Q, HEAD_DIM, dtype=torch.float16, seed=11)
    k, v = (rand(BATCH, KV_HEADS, SEQ_K, HEAD_DIM, dtype=torch.float16, seed=s) for s in (12, 13))
    out = attention(q, with_garbage(k, ~keep, math.nan), with_garbage(v, ~keep, math.inf), causal=True,
                    backend=backend, **masks)
    assert torch.isfinite(out).all()
    assert_close(out, reference(q, k, v, visibility(True, keep)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("garbage", ["nan", "inf"])
def test_keys_past_every_rows_causal_frontier_never_reach_the_output(backend, garbage):
    # Top-left causal with more keys than queries: keys S_q.. are hidden from every row, as a cache's unfilled end.
    q, k, v, grad_out = inputs(seed=21)
    hidden = torch.zeros(BATCH, SEQ_K, dtype=torch.bool, device=DEVICE)
    hidden[:, SEQ_Q:] = True
    k_bad, v_bad = (with_garbage(t, hidden, GARBAGE[garbage]).requires_grad_() for t in (k, v))
    q = q.requires_grad_()
    out = attention(q, k_bad, v_bad, causal=True, backend=backend, precision="ieee")
    out.backward(grad_out)
    for name, t in (("out", out), ("dq", q.grad), ("dk", k_bad.grad), ("dv", v_bad.grad)):
        assert torch.isfinite(t).all(), f"{name} has {int((~torch.isfinite(t)).sum())} non-finite elements"
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, visibility(True, None))
    expected.backward(grad_out.double())
    assert_close(out, expected, policy="fp32")
    for got, want in zip((q.grad, k_bad.grad, v_bad.grad), (t.grad for t in leaves)):
        assert_close(got, want, policy="fp32")


# The largest query tile of any kernel config: a key some rows see can turn the other rows of their tile NaN.
MAX_BLOCK_M = 128


@pytest.mark.parametrize("causal, backend", [(True, "triton"), ("lower_right", "triton"), ("lower_right", "sdpa")])
@pytest.mark.parametrize("garbage", ["nan", "inf"])
def test_a_non_finite_key_some_rows_see_reaches_those_rows_and_never_a_row_tiles_away(causal, backend, garbage):
    # One long head, so that rows a whole tile or more before the bad key exist whatever the config.
    seq_q, seq_k, bad_key = 301, 311, 287
    gen = torch.Generator().manual_seed(61)
    q, k, v, grad_out = (torch.randn(1, 2, s, HEAD_DIM, generator=gen).to(DEVICE)
                         for s in (seq_q, seq_k, seq_k, seq_q))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, :, bad_key, 3] = GARBAGE[garbage]
    v_bad[0, :, bad_key, 5] = GARBAGE[garbage]
    q = q.requires_grad_()
    out = attention(q, k_bad, v_bad, causal=causal, backend=backend, precision="ieee")
    out.backward(grad_out)
    shift = 0 if causal is True else seq_k - seq_q
    rows = torch.arange(seq_q, device=DEVICE)
    sees = rows + shift >= bad_key
    # A row that sees the non-finite key is not finite, as the exact sum is not.
    assert (~torch.isfinite(out[0][:, sees])).any(dim=-1).all()
    # Rows a tile or more before it never process its key block: finite and right, output and dQ. flashlite's
    # SDPA path keeps every row that does not see the key clean.
    clean = (rows + shift < bad_key - MAX_BLOCK_M) if backend == "triton" else ~sees
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=DEVICE).tril(shift)[None, None]
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    expected = reference(*leaves, visible)
    expected.backward(grad_out.double())
    assert_close(out.detach()[0][:, clean], expected.detach()[0][:, clean], policy="fp32")
    assert_close(q.grad[0][:, clean], leaves[0].grad[0][:, clean], policy="fp32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_visible_nan_still_shows(backend):
    masks, keep = padding("key_padding_mask")
    q = rand(BATCH, HEADS, SEQ_Q, HEAD_DIM, dtype=torch.float32, seed=31)
    k, v = (rand(BATCH, KV_HEADS, SEQ_K, HEAD_DIM, dtype=torch.float32, seed=s) for s in (32, 33))
    v[2, 1, 0, 7] = math.nan  # key 0 is always kept: every row of batch 2, heads 2 and 3, sees it
    out = attention(q, k, v, backend=backend, precision="ieee", **masks)
    assert torch.isnan(out[2, 2:, :, 7]).all()
    others = torch.ones_like(out, dtype=torch.bool)
    others[2, 2:, :, 7] = False
    assert torch.isfinite(out[others]).all()


def test_strided_key_lengths_are_read_as_their_values():
    # Every second element of a longer tensor: the kernels must read the view's elements, not the storage's.
    q = rand(BATCH, HEADS, SEQ_Q, HEAD_DIM, dtype=torch.float32, seed=41)
    k, v = (rand(BATCH, KV_HEADS, SEQ_K, HEAD_DIM, dtype=torch.float32, seed=s) for s in (42, 43))
    storage = torch.tensor([LENGTHS[0], 1, LENGTHS[1], 2, LENGTHS[2], 3], device=DEVICE)
    lengths = storage[::2]
    assert lengths.stride() == (2,)
    keep = torch.arange(SEQ_K, device=DEVICE)[None, :] < lengths[:, None]
    for backend in BACKENDS:
        out = attention(q, k, v, key_lengths=lengths, backend=backend, precision="ieee")
        assert_close(out, reference(q, k, v, visibility(False, keep)), policy="fp32")


@pytest.mark.parametrize("backend", ["triton", "sdpa", "auto"])
def test_validation_gives_the_same_answer_on_every_call(backend):
    # A call with valid arguments caches a plan; an invalid call whose arguments compare equal to them (1 == True,
    # True == 1.0) must still be refused, before and after.
    q = rand(1, 2, 20, 16, dtype=torch.float32, seed=51)
    for _ in range(2):
        with pytest.raises(ValueError, match="causal must be False, True"):
            attention(q, q, q, causal=1, backend=backend)
        with pytest.raises(TypeError, match="scale must be a finite real number"):
            attention(q, q, q, scale=True, backend=backend)
        attention(q, q, q, causal=True, backend=backend)
        attention(q, q, q, scale=1.0, backend=backend)
