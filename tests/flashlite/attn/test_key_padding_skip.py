"""The forward and dQ kernels start each entry's key loop at the block of the first key its boolean mask shows.

A left-padded batch's mask hides each entry's leading keys from every query row, so the key blocks wholly before
an entry's first True add nothing to any row: the launcher passes each entry's first True (``argmax`` of the mask
row, 0 where the row has none) and the kernel skips those blocks (``attention_common.skip_hidden_prefix``). The
outputs and log-sum-exps are checked against a float64 reference written from the definition, at odd sizes under
the interpreter's 32 x 16 forward blocks: first keys at 0, at a block boundary, inside a block, an entry with no
visible key, an entry with a hole after its first True; every causal mode, grouped-query heads, window and softcap,
split-KV; the gradients too. Since hidden keys never reach an output anyway (even when they hold NaN), the skip
itself is observed through the key start a kernel receives: forged past the mask's first True, it hides the blocks
before it. The dK/dV kernel needs no key start: a program whose key block the mask hides whole visits no query
block and stores zeros, which a NaN query row (whose dS row is NaN, 0 * NaN in every key it visits) makes visible.
"""
from __future__ import annotations

import dataclasses
import math
import types

import pytest
import torch
import triton
import triton.language as tl

import flashlite.attn.plan as plans_module
import flashlite.attn.triton as launch_module
import flashlite.attn.triton_bwd as backward_module
from flashlite.attn.plan import Plan
from flashlite.attn.problem import validate
from flashlite.attention import attention_backward, attention_forward
from flashlite.kernels.attention_common import key_range, skip_hidden_prefix

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, H_KV, D = 4, 2, 16
SCALE = 0.3
# Absolute tolerances relative to the largest reference value, as in test_attention_variants: a few float32 ulps
# summed over the keys with ieee dots; fp16 inputs' and P V operands' own rounding.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 1e-2}
PRECISION = {torch.float32: "ieee", torch.float16: "fp16"}
# Each entry's first visible key (None: the entry shows no key) and whether its mask has a hole after it. With the
# interpreter's 16-key blocks: 0, a block boundary, inside a block, none, a hole; S_k = 77 adds starts past the
# first query block (40, 64), where causal query blocks see no key at all.
STARTS = {45: [(0, False), (16, False), (21, False), (None, False), (5, True)],
          77: [(40, False), (64, False), (0, True), (None, False), (33, True)]}


# The forged or padded key start of the tests that observe the skip: a multiple of every key-block size the kernels
# use (16 in the interpreter; 32 to 256 in the GPU configs), so exactly the keys before it are skipped on any tile.
SKIP_KEYS, SKIP_START = 301, 256


def left_padded_mask(seq_k: int, starts) -> torch.Tensor:
    mask = torch.zeros(len(starts), seq_k, dtype=torch.bool)
    for b, (start, hole) in enumerate(starts):
        if start is not None:
            mask[b, start:] = True
            if hole:  # keys hidden after the first visible one: the skip must not reach them
                mask[b, start + 7:start + 11] = False
    return mask


def random_inputs(batch, seq_q, seq_k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, heads, seq, D, generator=gen).to(DEVICE, dtype)
                 for heads, seq in ((H, seq_q), (H_KV, seq_k), (H_KV, seq_k)))


def reference(q, k, v, mask, causal_mode, window=(-1, -1), softcap=0.0):
    """(out, natural log-sum-exp) in float64 from the definition; rows that see no key give 0 and -inf. q, k, v
    may be float64 leaves that require gradients: rows that see no key then give zero gradients, not NaN."""
    k, v = (t.repeat_interleave(H // H_KV, dim=1) for t in (k, v))
    seq_q, seq_k = q.shape[2], k.shape[2]
    scores = q @ k.transpose(-2, -1) * SCALE
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(seq_q)[:, None] + (seq_k - seq_q if causal_mode == 2 else 0)
    j = torch.arange(seq_k)[None, :]
    seen = torch.ones(seq_q, seq_k, dtype=torch.bool)
    if causal_mode:
        seen &= j <= i
    if window[0] >= 0:
        seen &= j >= i - window[0]
    if window[1] >= 0:
        seen &= j <= i + window[1]
    seen = seen[None, None] & mask.cpu()[:, None, None, :]
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores.detach(), dim=-1)
    # A row without a visible key softmaxes zeros instead of -infs (no NaN), then its weights are zeroed.
    weights = torch.softmax(scores.masked_fill(~seen.any(-1, keepdim=True), 0.0), dim=-1) * seen
    return weights @ v, lse


def float64(*tensors):
    return tuple(t.detach().cpu().double() for t in tensors)


def check(out, lse, q, k, v, mask, causal_mode, **variants):
    expected, expected_lse = reference(*float64(q, k, v), mask, causal_mode, **variants)
    out, lse = out.cpu().double(), lse.cpu().double() / math.log2(math.e)  # the kernel's lse is base 2
    bound = TOLERANCE[q.dtype] * expected.abs().max()
    assert (out - expected).abs().max() <= bound
    empty = torch.isinf(expected_lse)
    assert torch.equal(torch.isinf(lse), empty) and torch.equal(out[empty], torch.zeros_like(out[empty]))
    assert (lse[~empty] - expected_lse[~empty]).abs().max() <= TOLERANCE[q.dtype] * expected_lse.abs().max()


def forward(q, k, v, mask, causal_mode, window=(-1, -1), softcap=0.0):
    return attention_forward(q, k, v, mask.to(DEVICE), None, causal_mode, SCALE, PRECISION[q.dtype], *window,
                             softcap)


@pytest.mark.parametrize("seq_q, seq_k", [(45, 45), (37, 45), (77, 77)])
@pytest.mark.parametrize("causal_mode", [0, 1, 2])
def test_left_padded_masks_match_float64(seq_q, seq_k, causal_mode):
    q, k, v = random_inputs(5, seq_q, seq_k, torch.float32, seed=seq_q + 10 * causal_mode)
    mask = left_padded_mask(seq_k, STARTS[seq_k])
    check(*forward(q, k, v, mask, causal_mode), q, k, v, mask, causal_mode)


@pytest.mark.parametrize("causal_mode", [0, 1, 2])
@pytest.mark.parametrize("window", [(6, 2), (20, -1)])
def test_left_padded_masks_with_window_and_softcap_match_float64(causal_mode, window):
    q, k, v = random_inputs(5, 70, 77, torch.float32, seed=3 + causal_mode)
    mask = left_padded_mask(77, STARTS[77])
    check(*forward(q, k, v, mask, causal_mode, window, 3.0), q, k, v, mask, causal_mode, window=window, softcap=3.0)


def test_left_padded_masks_in_float16_match_float64():
    q, k, v = random_inputs(5, 77, 77, torch.float16, seed=7)
    mask = left_padded_mask(77, STARTS[77])
    check(*forward(q, k, v, mask, 1), q, k, v, mask, 1)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("causal_mode", [0, 2])
def test_split_kv_shares_start_at_the_first_visible_block(splits, causal_mode):
    q, k, v = random_inputs(5, 9, 77, torch.float32, seed=splits)
    mask = left_padded_mask(77, STARTS[77]).to(DEVICE)
    problem = validate(q, k, v, {0: False, 2: "lower_right"}[causal_mode], SCALE, mask, None, "triton", "ieee")
    plan = Plan(dataclasses.replace(problem, key_splits=splits), None)
    check(*launch_module.launch_forward(q, k, v, mask, None, plan), q, k, v, mask, causal_mode)


# Where each kernel's leading tensors hold the key start.
KEY_START_INDEX = {"forward": 7, "dq": 10}


@pytest.fixture
def launches(monkeypatch):
    """The leading tensors of every launch from here on (``.tensors``; a fresh plan cache); a tensor set in
    ``.forge["forward"]`` or ``.forge["dq"]`` replaces the key start that kernel receives."""
    monkeypatch.setattr(plans_module, "_PLANS", {})
    seen = types.SimpleNamespace(tensors=[], forge={})
    original = launch_module._launch

    def spy(kernel, site, plan, grid, tensors, scalars, meta, **keywords):
        seen.tensors.append(tensors)
        name = "dq" if isinstance(site, tuple) and site[0] == "dq" else "forward" if site == "forward" else None
        if seen.forge.get(name) is not None:
            at = KEY_START_INDEX[name]
            tensors = (*tensors[:at], seen.forge[name], *tensors[at + 1:])
        return original(kernel, site, plan, grid, tensors, scalars, meta, **keywords)

    monkeypatch.setattr(launch_module, "_launch", spy)
    monkeypatch.setattr(backward_module, "_launch", spy)
    return seen


def test_the_launcher_passes_each_entrys_first_visible_key(launches):
    mask = left_padded_mask(77, STARTS[77])
    q, k, v = random_inputs(5, 8, 77, torch.float32, seed=1)
    forward(q, k, v, mask, 0)
    # The first True of each row, counted here by hand; 0 for the row without one.
    expected = [next((j for j in range(77) if mask[b, j]), 0) for b in range(5)]
    assert launches.tensors[-1][7].tolist() == expected == [40, 64, 0, 0, 33]
    # Other key masks compute nothing: the slot holds the placeholder (q), as the other unused pointers do.
    attention_forward(q, k, v, None, torch.tensor([77, 3, 9, 0, 50], device=DEVICE), 0, SCALE, "ieee")
    assert launches.tensors[-1][7] is launches.tensors[-1][0]


@pytest.mark.parametrize("causal_mode", [0, 2])
def test_the_kernel_skips_the_key_blocks_before_the_key_start(launches, causal_mode):
    # A key start past the mask's first True (here: every key visible) hides every whole block before it. Key 256
    # begins a block for every key-block size the kernels use (16 in the interpreter, 32 to 256 on a GPU), so the
    # loop starts there whatever the tile. A kernel that ignored its key start would give the full mask's result.
    mask = torch.ones(2, SKIP_KEYS, dtype=torch.bool)
    q, k, v = random_inputs(2, 20, SKIP_KEYS, torch.float32, seed=5)
    launches.forge["forward"] = torch.tensor([SKIP_START, 0], device=DEVICE)
    out, lse = forward(q, k, v, mask, causal_mode)
    skipped = mask.clone()
    skipped[0, :SKIP_START] = False
    check(out, lse, q, k, v, skipped, causal_mode)
    assert (out[0].cpu() - reference(*float64(q, k, v), mask, causal_mode)[0][0]).abs().max() > 1e-2


@triton.jit
def _key_range_probe(KeyStart, Out, start_m, seq_q, seq_k, window_left, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):  # KeyStart [1], Out [4]
    _, _, _, lo, full_start, full_end, hi = key_range(KeyStart, 0, start_m, seq_q, seq_k, window_left, 0, BLOCK_M,
                                                      BLOCK_N, CAUSAL, "bool", WINDOW)
    lo, full_start, full_end, hi = skip_hidden_prefix(KeyStart, 0, lo, full_start, full_end, hi, BLOCK_N)
    tl.store(Out + 0, lo)
    tl.store(Out + 1, full_start)
    tl.store(Out + 2, full_end)
    tl.store(Out + 3, hi)


@pytest.mark.parametrize("causal, window_left, start_m, expected", [
    (0, -1, 0, [32, 32, 64, 77]),  # dense: from the block of key 40, unmasked blocks to 64, the tail masked
    (1, -1, 0, [32, 32, 32, 32]),  # causal rows 0-31 reach key 31 at most: nothing left to visit
    (1, -1, 32, [32, 32, 32, 64]),  # rows 32-63: the diagonal block only
    (1, 5, 64, [48, 48, 48, 77]),  # the window starts later than the padding: unchanged
])
def test_key_range_starts_at_the_block_of_the_first_visible_key(causal, window_left, start_m, expected):
    out = torch.full((4,), -1, dtype=torch.int32, device=DEVICE)
    _key_range_probe[(1,)](torch.tensor([40], dtype=torch.int32, device=DEVICE), out, start_m, 77, 77,
                           max(window_left, 0), BLOCK_M=32, BLOCK_N=16, CAUSAL=causal, WINDOW=window_left >= 0)
    assert out.tolist() == expected


def gradients(q, k, v, grad_out, mask, causal_mode, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv) of the kernels, the forward's out and lse from the kernel too."""
    out, lse = forward(q, k, v, mask, causal_mode, window, softcap)
    return attention_backward(grad_out, q, k, v, out, lse, mask.to(DEVICE), None, causal_mode, SCALE, "ieee",
                              *window, softcap)


@pytest.mark.parametrize("causal_mode, window, softcap", [(0, (-1, -1), 0.0), (1, (-1, -1), 0.0),
                                                          (2, (-1, -1), 0.0), (1, (20, -1), 3.0),
                                                          (0, (6, 2), 0.0)])
def test_gradients_of_left_padded_masks_match_float64(causal_mode, window, softcap):
    q, k, v = random_inputs(5, 70, 77, torch.float32, seed=11 + causal_mode)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = left_padded_mask(77, STARTS[77])
    leaves = tuple(t.requires_grad_() for t in float64(q, k, v))
    reference(*leaves, mask, causal_mode, window, softcap)[0].backward(grad_out.cpu().double())
    for got, leaf in zip(gradients(q, k, v, grad_out, mask, causal_mode, window, softcap), leaves):
        assert (got.cpu().double() - leaf.grad).abs().max() <= TOLERANCE[torch.float32] * leaf.grad.abs().max()


def test_dq_skips_the_key_blocks_before_the_key_start(launches):
    # As for the forward: a key start forged past the mask's first True (every key visible) changes dQ, which it
    # cannot unless dQ's key loop starts at its block. dK and dV do not read it.
    mask = torch.ones(2, SKIP_KEYS, dtype=torch.bool)
    q, k, v = random_inputs(2, 20, SKIP_KEYS, torch.float32, seed=8)
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    honest = gradients(q, k, v, grad_out, mask, 0)
    plans_module._PLANS.clear()  # on CUDA the kept plan would replay its recorded launch, past the spy
    launches.forge["dq"] = torch.tensor([SKIP_START, 0], device=DEVICE)
    forged = gradients(q, k, v, grad_out, mask, 0)
    assert (forged[0][0] - honest[0][0]).abs().max() > 1e-2
    assert torch.equal(forged[0][1], honest[0][1])  # the entry whose key start is still its first True
    assert torch.equal(forged[1], honest[1]) and torch.equal(forged[2], honest[2])


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")  # the interpreter's row maximum of the NaN row
def test_dkdv_of_key_blocks_the_mask_hides_whole_are_zero_even_beside_a_nan_query():
    # A NaN query row makes its own dS row NaN, and dK = dS^T Q takes 0 * NaN = NaN into every key its program
    # visits, hidden ones included. A key block the mask hides whole visits no query block: its dK and dV stay
    # exactly zero (keys 0-255 here, whole blocks for every key-block size, before the first visible key 256).
    mask = left_padded_mask(SKIP_KEYS, [(SKIP_START, False), (0, False)])
    q, k, v = random_inputs(2, 33, SKIP_KEYS, torch.float32, seed=6)
    q[:, :, 5] = float("nan")
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _, dk, dv = gradients(q, k, v, grad_out, mask, 0)
    assert torch.equal(dk[0, :, :SKIP_START], torch.zeros_like(dk[0, :, :SKIP_START]))
    assert torch.equal(dv[0, :, :SKIP_START], torch.zeros_like(dv[0, :, :SKIP_START]))
