"""Calls whose key length changes every call (decoding: S_q = 1, the key length one longer each step): a plan whose
run reads the sizes from the call's tensors serves every key length, so such a loop validates and plans once, and
every output still matches a float64 reference; what validation checks of the key length is still refused."""
from __future__ import annotations

import pytest
import torch

import flashlite.attn.decide as decide_module
import flashlite.attn.plan as plans_module
from flashlite.attention import attention
from pytest_kernelcheck import assert_close
from tests.flashlite.attn.test_attention_variants import VARIANTS, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def validations(monkeypatch):
    """The number of calls validated from here on (a fresh plan cache)."""
    monkeypatch.setattr(plans_module, "_PLANS", {})
    calls = []
    validate = decide_module.validate
    monkeypatch.setattr(decide_module, "validate", lambda *a, **kw: calls.append(1) or validate(*a, **kw))
    return calls


def _cache(seq_q: int = 1, capacity: int = 90, heads: int = 4, kv_heads: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq_q, 16, generator=gen).to(DEVICE)
    k_cache, v_cache = (torch.randn(2, kv_heads, capacity, 16, generator=gen).to(DEVICE) for _ in range(2))
    return q, k_cache, v_cache


@pytest.mark.parametrize("grow", ["view", "cat"])
def test_a_decoding_loop_is_validated_once_and_every_step_matches_float64(validations, grow):
    # Key lengths 65..80 share a dispatch bucket (128): one plan serves them all, whether the keys are views of
    # one preallocated cache (same strides) or a cache grown by torch.cat (strides change with the length).
    q, k_cache, v_cache = _cache()
    k, v = k_cache[:, :, :64], v_cache[:, :, :64]
    for length in range(65, 81):
        if grow == "view":
            k, v = k_cache[:, :, :length], v_cache[:, :, :length]
        else:
            k = torch.cat([k, k_cache[:, :, length - 1:length]], dim=2)
            v = torch.cat([v, v_cache[:, :, length - 1:length]], dim=2)
        out = attention(q, k, v, causal="lower_right", backend="sdpa")
        assert_close(out, reference(q, k, v, causal="lower_right"), policy="fp32")
    assert len(validations) == 1


@pytest.mark.parametrize("variant", ["window", "alibi-heads", "softcap", "key_lengths"])
def test_masked_calls_of_growing_key_length_share_a_plan_and_align_each_call_bottom_right(validations, variant):
    # Three query rows, bottom-right: each call's diagonal sits at its own S_k - S_q, never at the first call's.
    q, k_cache, v_cache = _cache(seq_q=3)
    options = dict(VARIANTS[variant]) if variant in VARIANTS else dict(key_lengths=torch.tensor([70, 40]))
    options = {name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
               for name, value in options.items()}
    for length in range(66, 76):
        k, v = k_cache[:, :, :length], v_cache[:, :, :length]
        out = attention(q, k, v, causal="lower_right", backend="sdpa", **options)
        assert_close(out, reference(q, k, v, causal="lower_right", **options), policy="fp32")
    assert len(validations) == 1


def test_a_top_left_plan_is_not_served_to_longer_keys_that_no_row_sees(validations):
    # Top-left causal with S_k <= S_q runs SDPA's is_causal as it is; with more keys than rows, the keys past the
    # last row are hidden, and a NaN there must not reach the output, so that call gets its own plan.
    q, k_cache, v_cache = _cache(seq_q=4)
    attention(q, k_cache[:, :, :4], v_cache[:, :, :4], causal=True, backend="sdpa")
    k, v = k_cache[:, :, :6].clone(), v_cache[:, :, :6].clone()
    k[:, :, 4:], v[:, :, 4:] = float("nan"), float("inf")
    out = attention(q, k, v, causal=True, backend="sdpa")
    assert torch.isfinite(out).all()
    assert_close(out, reference(q, k[:, :, :4], v[:, :, :4], causal=True), policy="fp32")
    assert len(validations) == 2


@pytest.mark.parametrize("wrong", ["v_length", "mask_length"])
def test_a_plan_for_every_key_length_still_refuses_what_validation_refuses(validations, wrong):
    q, k_cache, v_cache = _cache()
    mask = torch.ones(2, 90, dtype=torch.bool, device=DEVICE)
    attention(q, k_cache[:, :, :70], v_cache[:, :, :70], causal="lower_right", key_padding_mask=mask[:, :70],
              backend="sdpa")
    k, v, kept = k_cache[:, :, :71], v_cache[:, :, :71], mask[:, :71]
    if wrong == "v_length":
        v = v_cache[:, :, :72]
    else:
        kept = mask[:, :72]
    with pytest.raises(ValueError, match="v must have the same shape" if wrong == "v_length" else "key_padding_mask"):
        attention(q, k, v, causal="lower_right", key_padding_mask=kept, backend="sdpa")


@pytest.mark.parametrize("gqa", [False, True])
def test_bottom_right_causal_with_as_many_keys_as_rows_runs_sdpa_is_causal_without_a_mask(monkeypatch, gqa):
    # A model's prefill passes causal="lower_right" with S_q == S_k, whose diagonal is SDPA's is_causal one: it
    # must reach SDPA's own causal kernels, not a mask built here (which took 2-4x longer in a Llama prefill).
    monkeypatch.setattr(plans_module, "_PLANS", {})
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("is_causal"), kwargs.get("attn_mask", args[3] if len(args) > 3 else None)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 37, 16, generator=gen).to(DEVICE)
    k, v = (torch.randn(2, 2 if gqa else 4, 37, 16, generator=gen).to(DEVICE) for _ in range(2))
    out = attention(q, k, v, causal="lower_right", backend="sdpa")
    assert seen and all(is_causal is True and mask is None for is_causal, mask in seen), seen
    expected = reference(q.double(), k.double(), v.double(), causal=True)
    assert_close(out, expected)
