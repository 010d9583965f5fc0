"""``attention_with_kvcache`` on fp8 (e4m3) caches with a float32 scale per kv head, against the float64 reference of
``test_attention_kvcache`` on the DEQUANTIZED cache (``stored.double() * scale[g]``): what the call promises to
compute. The decoding kernel reads the fp8 cache in place; SDPA and the general forward kernel run on a
dequantized copy. New tokens come in q's dtype and must be stored as their quantized values.

Sizes as in ``test_attention_kvcache`` (caches of 45 positions filled to 0, 1, 17 and 44, grouped-query heads), q in
float16: the interpreter's bfloat16 product is not the GPU's, so bfloat16 runs on SDPA only here.
"""
from __future__ import annotations

import importlib

import pytest
import torch

from flashlite.attention import attention_with_kvcache
from flashlite.attn.kvcache_fp8 import FP8_MAX, quantized
from pytest_kernelcheck import assert_close
from tests.flashlite.attn.test_attention_kvcache import (B, DEVICE, FILLED, H, H_KV, S_MAX, D, _slopes, gathered,
                                                         paged, reference)

FP8 = torch.float8_e4m3fn


def fp8_inputs(seed, seq_q=1, dtype=torch.float16, new=True):
    """q, the fp8 caches and their scales, the lengths, and new tokens in q's dtype (or None). Each kv head's scale
    maps its largest magnitude to 448, times a random factor in [1, 2) so that heads and K/V differ."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)

    def stored(cache):
        scale = cache.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX
        scale = scale * (1 + torch.rand(H_KV, generator=gen)).to(DEVICE)
        return (cache.float() / scale[None, :, None, None]).to(FP8), scale

    q = rand(B, H, seq_q, D)
    (k_cache, k_scale), (v_cache, v_scale) = stored(rand(B, H_KV, S_MAX, D)), stored(rand(B, H_KV, S_MAX, D))
    lengths = torch.tensor([min(n, S_MAX - seq_q) for n in FILLED], dtype=torch.int32, device=DEVICE)
    k_new, v_new = (rand(B, H_KV, seq_q, D), rand(B, H_KV, seq_q, D)) if new else (None, None)
    return q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new


def dequantized(cache, scale):
    return cache.double() * scale.double()[None, :, None, None]


def expected_written(cache, new, scale, lengths):
    """The cache after the new tokens were written: their e4m3 values (new / scale) at lengths[b] .. + S_q - 1."""
    written = cache.clone()
    for b, n in enumerate(lengths.tolist()):
        written[b, :, n:n + new.shape[2]] = (new[b].float() / scale[:, None, None]).to(FP8)
    return written


@pytest.mark.parametrize("new", [True, False], ids=["k_new", "no_new"])
@pytest.mark.parametrize("paged_cache", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("seq_q", [1, 3])
@pytest.mark.parametrize("backend, splits", [("triton", 1), ("triton", 3), ("sdpa", None), ("auto", None)])
def test_fp8_cache_matches_float64_on_the_dequantized_cache(backend, splits, seq_q, paged_cache, new):
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(
        seed=100 + 10 * seq_q + 2 * paged_cache + new, seq_q=seq_q, new=new)
    expected_k = expected_written(k_cache, k_new, k_scale, lengths) if new else k_cache
    expected_v = expected_written(v_cache, v_new, v_scale, lengths) if new else v_cache
    table = None
    if paged_cache:  # 48 positions per entry: three blocks of 16
        pad = torch.zeros(B, H_KV, 48 - S_MAX, D, dtype=FP8, device=DEVICE)
        k_cache, table = paged(torch.cat([k_cache, pad], 2), seed=7)
        v_cache, _ = paged(torch.cat([v_cache, pad], 2), seed=7)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, block_table=table,
                                 backend=backend, num_splits=splits, k_scale=k_scale, v_scale=v_scale)
    written_k = gathered(k_cache, table)[:, :, :S_MAX] if paged_cache else k_cache
    written_v = gathered(v_cache, table)[:, :, :S_MAX] if paged_cache else v_cache
    # The new tokens are stored as their quantized values (compared bit for bit), nothing else changed.
    assert torch.equal(written_k.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(written_v.view(torch.uint8), expected_v.view(torch.uint8))
    assert out.shape == q.shape and out.dtype == q.dtype
    seen = lengths + seq_q if new else lengths
    expected = reference(q, dequantized(written_k, k_scale), dequantized(written_v, v_scale), seen)
    assert_close(out.cpu(), expected, policy=torch.float16)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("seq_q, options", [(3, dict(alibi_slopes="heads", window=(7, 0))), (9, dict(softcap=2.0))])
def test_the_general_kernel_and_sdpa_run_on_the_dequantized_cache(backend, seq_q, options, monkeypatch):
    # ALiBi and chunks longer than 8 queries are beyond the decoding kernel: backend="triton" dequantizes for the
    # general forward kernel, as SDPA's path does, and the plan's reason says which path read the fp8 cache.
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    plans_module = importlib.import_module("flashlite.attn.plan")
    monkeypatch.setattr(plans_module, "_PLANS", {})
    options = {key: _slopes(value) if key == "alibi_slopes" else value for key, value in options.items()}
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=200 + seq_q, seq_q=seq_q)
    calls = []
    real_forward = kvcache_module.launch_forward
    monkeypatch.setattr(kvcache_module, "launch_forward",
                        lambda q, k, *a, **kw: calls.append(k.dtype) or real_forward(q, k, *a, **kw))
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                 k_scale=k_scale, v_scale=v_scale, **options)
    assert calls == ([torch.float16] if backend == "triton" else [])
    (plan,) = plans_module._PLANS.values()
    path = "SDPA" if backend == "sdpa" else "the general forward kernel"
    assert plan.decision.reason.endswith(f"fp8 cache: dequantized for {path} (ALiBi or more than 8 queries)"
                                         if backend == "triton" else f"fp8 cache: dequantized for {path}")
    expected = reference(q, dequantized(k_cache, k_scale), dequantized(v_cache, v_scale), lengths + seq_q,
                         **options)
    assert_close(out.cpu(), expected, policy=torch.float16)


def test_the_decoding_kernel_reads_the_fp8_cache_in_place(monkeypatch):
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    plans_module = importlib.import_module("flashlite.attn.plan")
    monkeypatch.setattr(plans_module, "_PLANS", {})
    copies = []
    real = kvcache_module.dequantized
    monkeypatch.setattr(kvcache_module, "dequantized", lambda *a: copies.append(1) or real(*a))
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=300)
    attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="triton",
                           k_scale=k_scale, v_scale=v_scale)
    (plan,) = plans_module._PLANS.values()
    assert copies == [] and plan.layouts["decode"].split_options["DEQUANT"]
    assert plan.decision.reason.endswith("fp8 cache: read in place by the decoding kernel")


@pytest.mark.parametrize("dtype, backend", [(torch.float32, "triton"), (torch.bfloat16, "sdpa")])
def test_float32_and_bfloat16_queries(dtype, backend):
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=400, seq_q=3, dtype=dtype)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                 k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == dtype
    expected = reference(q, dequantized(k_cache, k_scale), dequantized(v_cache, v_scale), lengths + 3)
    assert_close(out.cpu(), expected, policy="tf32" if dtype == torch.float32 else torch.bfloat16)


def test_a_replayed_plan_takes_each_calls_scales(monkeypatch):
    # The scales are data of each call, as the lengths are: a second call of the same signature (its plan and
    # decoding layout kept) with other scales attends to its own dequantized cache. An fp8 call and a float16 one
    # of the same shapes never share a plan.
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    q, k_cache, v_cache, k_scale, v_scale, lengths, _, _ = fp8_inputs(seed=500, new=False)
    for factor in (1.0, 3.0):
        ks, vs = k_scale * factor, v_scale / factor
        out = attention_with_kvcache(q, k_cache, v_cache, lengths, backend="triton", k_scale=ks, v_scale=vs)
        expected = reference(q, dequantized(k_cache, ks), dequantized(v_cache, vs), lengths)
        assert_close(out.cpu(), expected, policy=torch.float16)
    k16, v16 = k_cache.to(torch.float16), v_cache.to(torch.float16)
    call = (None, None, None, None, None, None, None, "triton", None)
    assert kvcache_module._plan_key(q, k16, v16, lengths, *call) != kvcache_module._plan_key(
        q, k_cache, v_cache, lengths, *call, k_scale, v_scale)
    out = attention_with_kvcache(q, k16, v16, lengths, backend="triton")
    assert_close(out.cpu(), reference(q, k16, v16, lengths), policy=torch.float16)


def test_new_tokens_beyond_e4m3s_range_saturate_at_448():
    # e4m3 has no infinity: the cast's overflow rule is the device's (torch 2.13 on the CPU saturates, but a cast
    # may give NaN), so new tokens are clamped to [-448, 448] first. Values far past the range, and infinities,
    # are stored as +-448; a NaN stays NaN.
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=600)
    k_new[0, 0, 0, :4] = torch.tensor([1e4, -1e4, float("inf"), float("-inf")], dtype=k_new.dtype)
    attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="sdpa",
                           k_scale=k_scale, v_scale=v_scale)
    n = int(lengths[0])
    assert k_cache[0, 0, n, :4].float().tolist() == [448.0, -448.0, 448.0, -448.0]
    assert not k_cache.float().isnan().any()
    nan = quantized(torch.full((1, H_KV, 1, 2), float("nan"), dtype=torch.float16), k_scale.cpu())
    assert nan.float().isnan().all()


def test_the_accuracy_cost_of_an_fp8_cache_is_bounded():
    # The same cache in float16 and quantized to e4m3 (each head's largest magnitude at 448): the outputs differ by
    # e4m3's rounding of keys and values (3 mantissa bits: up to |x| / 16 per element). Measured with this test's
    # scheme over seeds 1000..1009 (decoding and S_q = 3, the decoding kernel and SDPA, unit-normal float16
    # inputs; tools/kvcache_cpu_probe.py, benchmarks/results/cpu-host-2026-12-08-kvcache-host-work/): max
    # |out_fp8 - out_fp16| = 0.143 (seed 1008, S_q = 3; entries of one key read one value: its rounding in full),
    # typical 0.05-0.10. Bound: 0.2, a margin of 1.40x over the largest measured.
    for seed in (1000, 1003, 1008):
        gen = torch.Generator().manual_seed(seed)
        for seq_q in (1, 3):
            def rand(*size):
                return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=torch.float16)
            q, k16, v16 = rand(B, H, seq_q, D), rand(B, H_KV, S_MAX, D), rand(B, H_KV, S_MAX, D)
            lengths = torch.tensor([0, 1, 17, S_MAX - seq_q], dtype=torch.int32, device=DEVICE)
            k_scale = k16.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX
            v_scale = v16.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX
            k8, v8 = quantized(k16, k_scale), quantized(v16, v_scale)
            for backend in ("triton", "sdpa"):
                fp8 = attention_with_kvcache(q, k8, v8, lengths, backend=backend, k_scale=k_scale, v_scale=v_scale)
                fp16 = attention_with_kvcache(q, k16, v16, lengths, backend=backend)
                assert (fp8.double() - fp16.double()).abs().max().item() <= 0.2


def _call(**changes):
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=700)
    args = dict(k_new=k_new, v_new=v_new, k_scale=k_scale, v_scale=v_scale, backend="sdpa")
    args.update({key: value(args) if callable(value) else value for key, value in changes.items()})
    q, k_cache, v_cache = args.pop("q", q), args.pop("k_cache", k_cache), args.pop("v_cache", v_cache)
    return attention_with_kvcache(q, k_cache, v_cache, lengths, **args)


def _cache_as(dtype):
    return lambda args: torch.zeros(B, H_KV, S_MAX, D, device=DEVICE).to(dtype)


@pytest.mark.parametrize("changes, error, match", [
    (dict(k_scale=None, v_scale=None), ValueError, "float8_e4m3fn cache needs k_scale and v_scale"),
    (dict(v_scale=None), ValueError, "pass k_scale and v_scale together"),
    (dict(k_cache=_cache_as(torch.float16), v_cache=_cache_as(torch.float16), k_new=None, v_new=None),
     ValueError, "k_scale and v_scale are for a torch.float8_e4m3fn cache; this cache has dtype torch.float16"),
    (dict(k_scale=lambda a: a["k_scale"].double()), TypeError, "k_scale must be a float32 tensor"),
    (dict(v_scale=lambda a: a["v_scale"][:1]), ValueError, r"v_scale must have shape \[H_kv\] = \[2\]"),
    (dict(k_scale=lambda a: a["k_scale"].to("meta")), ValueError, "k_scale is on meta"),
    (dict(v_scale=lambda a: torch.tensor([1.0, 0.0], device=DEVICE), check_values=True),
     ValueError, "v_scale must be finite and > 0"),
    (dict(k_scale=lambda a: torch.tensor([-1.0, 1.0], device=DEVICE), check_values=True),
     ValueError, "k_scale must be finite and > 0"),
    (dict(k_scale=lambda a: torch.tensor([float("nan"), 1.0], device=DEVICE), check_values=True),
     ValueError, "k_scale must be finite"),
    (dict(v_scale=lambda a: torch.tensor([1.0, float("inf")], device=DEVICE), check_values=True),
     ValueError, "v_scale must be finite"),
    (dict(k_cache=_cache_as(torch.float8_e5m2), v_cache=_cache_as(torch.float8_e5m2)), TypeError,
     "k_cache has dtype torch.float8_e5m2; the fp8 cache accepted is torch.float8_e4m3fn"),
    (dict(v_cache=_cache_as(torch.float16)), TypeError, "k_cache and v_cache must both be torch.float8_e4m3fn"),
    (dict(k_new=lambda a: a["k_new"].to(FP8)), TypeError, r"k_new must match q's dtype \(the cache is fp8\)"),
    (dict(v_new=lambda a: a["v_new"].float()), TypeError, r"v_new must match q's dtype \(the cache is fp8\)"),
])
def test_bad_fp8_arguments_are_named(changes, error, match):
    # The scales' values are checked as check_values says (CUDA: off by default, since reading them synchronises),
    # so the cases of bad values ask for the check.
    with pytest.raises(error, match=match):
        _call(**changes)


def test_scale_values_are_checked_as_the_lengths_are():
    # check_values=False: the values are the caller's (on a GPU the default, since reading them synchronises).
    _call(k_scale=lambda a: torch.tensor([0.0, 1.0], device=DEVICE), check_values=False)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        _call(k_scale=lambda a: torch.tensor([0.0, 1.0], device=DEVICE), check_values=True)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_compiles_with_the_scales_and_matches_eager(backend):
    torch._dynamo.reset()
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=800, seq_q=2)

    def step(q, k_cache, v_cache, k_new, v_new, k_scale, v_scale):
        return attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                      k_scale=k_scale, v_scale=v_scale)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    eager = step(q, *caches[0], k_new, v_new, k_scale, v_scale)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[1], k_new, v_new, k_scale,
                                                                          v_scale)
    torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    for a, b in zip(*caches):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    expected = reference(q, dequantized(caches[1][0], k_scale), dequantized(caches[1][1], v_scale), lengths + 2)
    assert_close(compiled.cpu(), expected, policy=torch.float16)


def test_a_compiled_call_checks_the_scale_values_when_it_runs():
    # Traced tensors have no values: the graph's op checks the scales per call, as check_values asks.
    torch._dynamo.reset()
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=810)

    def step(q, k_cache, v_cache, k_scale, v_scale):
        return attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="sdpa",
                                      k_scale=k_scale, v_scale=v_scale, check_values=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled(q, k_cache.clone(), v_cache.clone(), k_scale, v_scale)
    with pytest.raises(ValueError, match="v_scale must be finite and > 0"):
        compiled(q, k_cache.clone(), v_cache.clone(), k_scale, torch.zeros_like(v_scale))
    torch._dynamo.reset()


def test_the_custom_op_with_scales_passes_opcheck():
    # The fake (meta) implementation with the scales. Not "test_schema": torch's schema check multiplies the
    # tensors to see what was mutated, which fp8 tensors do not support on the CPU ("mul_cpu_reduced_float");
    # the declared mutations do not depend on the dtype and test_attention_kvcache checks them in float32.
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    q, k_cache, v_cache, k_scale, v_scale, lengths, k_new, v_new = fp8_inputs(seed=900)
    args = (q, k_cache, v_cache, lengths, k_new, v_new, None, None, 0.25, -1, -1, 0.0, False, 1, None, k_scale,
            v_scale)
    torch.library.opcheck(kvcache_module.attention_with_kvcache_op, args,
                          test_utils=("test_faketensor",))
