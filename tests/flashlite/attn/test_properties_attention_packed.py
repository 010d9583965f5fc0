"""Property-based sweep of ``flashlite.attention_varlen`` (packed sequences) and ``flashlite.attention_with_kvcache``
against the float64 reference of test_properties_attention.py, applied per sequence / per cache entry.

Hypothesis (a well-kept library made for property-based testing) draws the calls as there: both backends, float32 and
float16, causal modes, windows, softcaps, ALiBi, grouped heads, transposed layouts, a tensor passed as both k and v,
empty sequences, split-KV shares, caches with and without new tokens. Besides the values (and for packed calls the
first and second derivatives), a KV-cache call must change its caches exactly at the new positions and nothing else.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("hypothesis")  # in the dev extras

from hypothesis import given, note  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashlite  # noqa: E402
from tests.conftest import examples  # noqa: E402
from .test_properties_attention import (DEVICE, _bits, _derivatives, _leaves, _nothing,  # noqa: E402
                                        check_against_reference, floor_for, reference)


@st.composite
def packed_calls(draw) -> dict:
    backend = draw(st.sampled_from(["sdpa", "triton"]))
    kv_heads, group = draw(st.integers(1, 2)), draw(st.sampled_from([1, 2]))
    alias = draw(st.sampled_from(["none", "k_is_v"]))
    orders = [0, 1, 2]
    return dict(backend=backend, dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                lengths_q=[draw(st.integers(1, 9))] + draw(st.lists(st.integers(0, 9), max_size=2)), kv_heads=kv_heads, group=group,
                head_dim=draw(st.sampled_from([16, 24])), causal=draw(st.sampled_from([False, True, "lower_right"])),
                window=draw(st.none() | st.tuples(st.integers(-1, 6), st.integers(-1, 6))),
                softcap=draw(st.none() | st.just(2.5)), alibi=draw(st.sampled_from(["none", "heads", "batch_heads"])),
                alias=alias, transposed=draw(st.booleans()), order=draw(st.sampled_from(orders)),
                seed=draw(st.integers(0, 2 ** 16)), extra_keys=draw(st.lists(st.integers(-3, 4), min_size=3,
                                                                             max_size=3)))


def _packed_reference(q, k, v, cu_q, cu_k, heads, options, alibi, compute_dtype):
    """Each sequence through ``reference`` on its own; [total_q, H, D]."""
    rows = []
    for b in range(len(cu_q) - 1):
        qb = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        kb, vb = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b])
        rows.append(reference(qb, kb, vb, alibi_slopes=slopes, compute_dtype=compute_dtype, **options)[0]
                    .transpose(0, 1))
    return torch.cat(rows)


@examples(12)
@given(packed_calls())
def test_attention_varlen_matches_the_float64_reference_per_sequence(call):
    note(repr(call))
    gen = torch.Generator().manual_seed(call["seed"])
    lengths_q = call["lengths_q"]
    lengths_k = [max(int(i == 0), n + call["extra_keys"][i]) for i, n in enumerate(lengths_q)]  # tokens in all
    heads, d = call["kv_heads"] * call["group"], call["head_dim"]
    cu_q, cu_k = ([0] + torch.tensor(n).cumsum(0).tolist() for n in (lengths_q, lengths_k))

    def tokens(total, h):  # [total, h, d], or a transposed [h, total, d] base
        base = torch.randn(*((h, total, d) if call["transposed"] else (total, h, d)), generator=gen,
                           dtype=torch.float64)
        return base

    leaves = [tokens(cu_q[-1], heads), tokens(cu_k[-1], call["kv_heads"])]
    if call["alias"] == "none":
        leaves.append(tokens(cu_k[-1], call["kv_heads"]))

    def views(ls):
        ts = [t.transpose(0, 1) if call["transposed"] else t for t in ls]
        return (ts[0], ts[1], ts[1]) if call["alias"] == "k_is_v" else tuple(ts)

    options = dict(causal=call["causal"], window=call["window"], softcap=call["softcap"])
    alibi = None if call["alibi"] == "none" else (
        torch.rand(*((heads,) if call["alibi"] == "heads" else (len(lengths_q), heads)), generator=gen) * 0.5)
    cu = [torch.tensor(c, dtype=torch.int32, device=DEVICE) for c in (cu_q, cu_k)]

    def run(*ls):
        q, k, v = views(list(ls))
        return flashlite.attention_varlen(q, k, v, *cu, max(lengths_q), max(max(lengths_k), 1),
                                          alibi_slopes=None if alibi is None else alibi.to(DEVICE),
                                          backend=call["backend"], **options)

    def ref(dtype):
        def fn(*ls):
            q, k, v = views(list(ls))
            return _packed_reference(q, k, v, cu_q, cu_k, heads, options,
                                     None if alibi is None else alibi.to(DEVICE), dtype)
        return fn

    low = [t.to(device=DEVICE, dtype=call["dtype"]) for t in leaves]
    given_leaves = _leaves(low, call["order"])
    before = [_bits(t) for t in given_leaves]
    weight = torch.randn(cu_q[-1], heads, d, generator=gen, dtype=torch.float64).to(DEVICE)
    with sdpa_kernel(SDPBackend.MATH) if call["backend"] == "sdpa" and call["order"] == 2 else _nothing():
        got = _derivatives(run, given_leaves, weight, call["order"])
    assert all(torch.equal(b, _bits(t)) for b, t in zip(before, given_leaves)), "attention_varlen modified an input"
    expected = _derivatives(ref(torch.float64), _leaves([t.to(DEVICE) for t in leaves], call["order"]), weight,
                            call["order"])
    baseline = _derivatives(ref(call["dtype"]), _leaves(low, call["order"]), weight.to(call["dtype"]),
                            call["order"])
    check_against_reference(repr(call), got, expected, baseline, floor_for(call["dtype"], None))


@st.composite
def cache_calls(draw) -> dict:
    backend = draw(st.sampled_from(["sdpa", "triton"]))
    return dict(backend=backend, dtype=draw(st.sampled_from([torch.float32, torch.float16])),
                batch=draw(st.integers(1, 3)), kv_heads=draw(st.integers(1, 2)), group=draw(st.sampled_from([1, 2])),
                seq_q=draw(st.integers(1, 4)), capacity=draw(st.integers(8, 40)), head_dim=draw(st.sampled_from([16, 32])),
                append=draw(st.booleans()), window=draw(st.none() | st.tuples(st.integers(-1, 9), st.integers(-1, 3))),
                softcap=draw(st.none() | st.just(3.0)), alibi=draw(st.sampled_from(["none", "heads", "batch_heads"])),
                num_splits=draw(st.sampled_from([None, 1, 2, 3])) if backend == "triton" else None,
                transposed_cache=draw(st.booleans()), seed=draw(st.integers(0, 2 ** 16)))


@examples(12)
@given(cache_calls())
def test_attention_with_kvcache_matches_the_float64_reference_and_writes_only_the_new_positions(call):
    note(repr(call))
    gen = torch.Generator().manual_seed(call["seed"])
    b, hk, s, d, cap = call["batch"], call["kv_heads"], call["seq_q"], call["head_dim"], call["capacity"]
    heads = hk * call["group"]
    room = cap - (s if call["append"] else 0)
    lengths = torch.randint(0, room + 1, (b,), generator=gen, dtype=torch.int32)

    def cache():
        if call["transposed_cache"]:  # [B, S_max, H_kv, D] memory, as many serving stacks keep it
            return torch.randn(b, cap, hk, d, generator=gen).transpose(1, 2)
        return torch.randn(b, hk, cap, d, generator=gen)

    q = torch.randn(b, heads, s, d, generator=gen)
    k_cache, v_cache = cache(), cache()
    new = [torch.randn(b, hk, s, d, generator=gen) for _ in range(2)] if call["append"] else [None, None]
    alibi = None if call["alibi"] == "none" else (
        torch.rand(*((heads,) if call["alibi"] == "heads" else (b, heads)), generator=gen) * 0.5)
    cast = lambda t: None if t is None else t.to(device=DEVICE, dtype=call["dtype"])  # noqa: E731
    q_low, k_low, v_low, kn_low, vn_low = (cast(t) for t in (q, k_cache, v_cache, *new))
    after_k, after_v = k_low.clone(), v_low.clone()
    if call["append"]:
        for i in range(b):
            n = int(lengths[i])
            after_k[i, :, n:n + s], after_v[i, :, n:n + s] = kn_low[i], vn_low[i]
    untouched = [_bits(t) for t in (q_low, lengths) + ((kn_low, vn_low) if call["append"] else ())]
    out = flashlite.attention_with_kvcache(
        q_low, k_low, v_low, lengths.to(DEVICE), k_new=kn_low, v_new=vn_low, window=call["window"],
        softcap=call["softcap"], alibi_slopes=None if alibi is None else alibi.to(DEVICE), backend=call["backend"],
        num_splits=call["num_splits"])
    assert torch.equal(_bits(k_low), _bits(after_k)) and torch.equal(_bits(v_low), _bits(after_v)), \
        "the caches changed elsewhere than at the new positions"
    assert all(torch.equal(u, _bits(t)) for u, t in zip(untouched, (q_low, lengths, kn_low, vn_low))), \
        "attention_with_kvcache modified q, cache_seqlens, k_new or v_new"

    def ref(dtype):
        rows = []
        for i in range(b):
            n = int(lengths[i]) + (s if call["append"] else 0)
            slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[i])
            rows.append(reference(q_low[i:i + 1], after_k[i:i + 1, :, :n], after_v[i:i + 1, :, :n],
                                  causal="lower_right", window=call["window"], softcap=call["softcap"],
                                  alibi_slopes=None if slopes is None else slopes.to(DEVICE), compute_dtype=dtype))
        return torch.cat(rows)

    check_against_reference(repr(call), [out], [ref(torch.float64)], [ref(call["dtype"])],
                            floor_for(call["dtype"], None))
