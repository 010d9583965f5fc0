"""``flashlite.attention_with_kvcache`` (decoding against a cache filled to a length per batch entry) on both
backends, against a float64 reference written out here from the definition: query i of entry b sits at position
n_b - S_q + i of its n_b keys and sees the keys up to it.

Odd sizes: caches of 45 positions filled to 0, 1, 17 and 44 (the last leaves room for one new token), S_q 1 and 3,
grouped-query heads, so that lengths end inside the kernels' key blocks (16 under the interpreter).
"""
from __future__ import annotations

import importlib
import math

import pytest
import torch

import flashlite
from flashlite.attention import attention_with_kvcache
from pytest_kernelcheck import assert_close
from tests.flashlite.sm90 import SM90_COMPILER, run_script

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, H_KV, S_MAX, D = 4, 4, 2, 45, 16
FILLED = [0, 1, 17, 44]
POLICY = {torch.float32: "tf32", torch.float16: torch.float16}


def inputs(dtype, seed, seq_q=1, filled=FILLED, new=True):
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)
    q = rand(B, H, seq_q, D)
    k_cache, v_cache = rand(B, H_KV, S_MAX, D), rand(B, H_KV, S_MAX, D)
    lengths = torch.tensor([min(n, S_MAX - seq_q) for n in filled], dtype=torch.int32, device=DEVICE)
    k_new, v_new = (rand(B, H_KV, seq_q, D), rand(B, H_KV, seq_q, D)) if new else (None, None)
    return q, k_cache, v_cache, lengths, k_new, v_new


def reference(q, k_cache, v_cache, lengths, *, window=None, softcap=None, alibi_slopes=None):
    """float64 over the first n_b keys of each entry (the cache after the new tokens were written)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    seq_q = q.shape[2]
    for b, n in enumerate(lengths.tolist()):
        qq = q[b].double().cpu()
        kk = k_cache[b, :, :n].double().cpu().repeat_interleave(H // H_KV, 0)
        vv = v_cache[b, :, :n].double().cpu().repeat_interleave(H // H_KV, 0)
        scores = qq @ kk.transpose(-1, -2) / math.sqrt(D)
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        rows = torch.arange(seq_q)[:, None] + n - seq_q
        keys = torch.arange(n)[None, :]
        if alibi_slopes is not None:
            slopes = (alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[b]).double().cpu()
            scores = scores - slopes[:, None, None] * (rows - keys).abs()
        seen = keys <= rows
        if window is not None and window[0] >= 0:
            seen &= keys >= rows - window[0]
        scores = scores.masked_fill(~seen, float("-inf"))
        weights = torch.where(seen, torch.softmax(scores, -1), 0.0).nan_to_num(0.0)
        out[b] = weights @ vv
    return out


CASES = {
    "decode": (torch.float32, 1, dict()),
    "decode-fp16": (torch.float16, 1, dict()),
    "chunk-of-3": (torch.float32, 3, dict()),
    "window": (torch.float16, 3, dict(window=(5, 0))),
    "softcap-alibi": (torch.float32, 1, dict(softcap=2.0, alibi_slopes="batch")),
    "alibi-heads": (torch.float16, 3, dict(alibi_slopes="heads")),
}


def _slopes(kind):
    if kind == "heads":
        return torch.tensor([0.5, 0.25, 0.125, 0.0625], device=DEVICE)
    return (torch.rand(B, H, generator=torch.Generator().manual_seed(1)) * 0.3 + 0.05).to(DEVICE)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_new_tokens_are_written_and_attention_matches_the_float64_reference(case, backend):
    dtype, seq_q, options = CASES[case]
    options = dict(options)
    if "alibi_slopes" in options:
        options["alibi_slopes"] = _slopes(options["alibi_slopes"])
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(dtype, seed=sum(map(ord, case)), seq_q=seq_q)
    k_before, v_before, lengths_before = k_cache.clone(), v_cache.clone(), lengths.clone()
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                 **options)
    # The new tokens sit at positions lengths[b] .. lengths[b] + S_q - 1; every other position is untouched.
    expected_k, expected_v = k_before.clone(), v_before.clone()
    for b, n in enumerate(lengths_before.tolist()):
        expected_k[b, :, n:n + seq_q], expected_v[b, :, n:n + seq_q] = k_new[b], v_new[b]
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(lengths, lengths_before)  # cache_seqlens is not modified
    assert out.shape == q.shape and out.dtype == dtype
    assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths + seq_q, **options), policy=POLICY[dtype])


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_without_new_tokens_the_queries_are_the_last_cached_positions(backend):
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=3, seq_q=1, filled=[1, 2, 17, 45], new=False)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, backend=backend)
    assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths), policy="tf32")


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_garbage_past_each_length_never_reaches_the_output(backend):
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float16, seed=4)
    clean = attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lengths, k_new=k_new, v_new=v_new,
                                   backend=backend)
    for b, n in enumerate(lengths.tolist()):  # past the new token: NaN and inf
        k_cache[b, :, n + 1:], v_cache[b, :, n + 1:] = float("nan"), float("inf")
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend)
    assert torch.equal(out, clean)


def test_auto_follows_the_dispatch_and_falls_back_to_sdpa(monkeypatch):
    import flashlite.attn.kvcache as kvcache_module
    from flashlite.dispatch import Decision
    used, asked = [], []
    decide_module = importlib.import_module("flashlite.attn.decide")  # where the dispatch is asked
    real_sdpa, real_choose = kvcache_module._sdpa_kvcache, decide_module.choose_backend
    monkeypatch.setattr(kvcache_module, "_sdpa_kvcache", lambda *a: used.append(1) or real_sdpa(*a))

    def choose(q, **keywords):
        asked.append((keywords["variant"], keywords["seq_k"]))
        return real_choose(q, **keywords)
    monkeypatch.setattr(decide_module, "choose_backend", choose)
    plans_module = importlib.import_module("flashlite.attn.plan")
    # A call's plan keeps its decision: each new table below starts from an empty plan cache, as a process does.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=5)
    attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert asked == [("kvcache", S_MAX)] and used == ([1] if DEVICE == "cpu" else [])
    monkeypatch.setattr(decide_module, "choose_backend", lambda *a, **kw: Decision("triton", "a table entry"))
    monkeypatch.setattr(plans_module, "_PLANS", {})
    used.clear()
    attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    assert used == []
    small = [t[..., :8].contiguous() if t.dim() == 4 else t for t in inputs(torch.float32, seed=5)]  # D=8
    monkeypatch.setattr(decide_module, "choose_backend", real_choose)
    monkeypatch.setattr(plans_module, "_PLANS", {})
    attention_with_kvcache(small[0], small[1], small[2], small[3], k_new=small[4], v_new=small[5])
    assert used == [1]


def test_decoding_runs_the_decoding_kernel_and_longer_chunks_the_general_kernel(monkeypatch):
    # One query per entry (and short speculative chunks) go to the decoding kernel, which reads each kv head's
    # cache once for the group's query heads; a chunk longer than it holds, or ALiBi, to the general forward kernel.
    import flashlite.attn.kvcache as kvcache_module
    # A plan derives its decoding layout once: start from an empty plan cache, or a plan that an earlier test made
    # for these shapes would call no decode_layout here.
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    calls = []
    real_decode, real_forward = kvcache_module.decode_layout, kvcache_module.launch_forward
    monkeypatch.setattr(kvcache_module, "decode_layout",
                        lambda q, *a, **kw: calls.append(("decode", tuple(q.shape))) or real_decode(q, *a, **kw))
    monkeypatch.setattr(kvcache_module, "launch_forward",
                        lambda q, *a, **kw: calls.append(("forward", tuple(q.shape))) or real_forward(q, *a, **kw))
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=14)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="triton")
    assert calls == [("decode", tuple(q.shape))]
    assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths + 1), policy="tf32")
    calls.clear()
    chunk = inputs(torch.float32, seed=15, seq_q=kvcache_module.DECODE_MAX_QUERIES + 1, new=False)[:4]
    out = attention_with_kvcache(*chunk, backend="triton")
    assert [c[0] for c in calls] == ["forward"]
    assert_close(out.cpu(), reference(*chunk), policy="tf32")


def test_a_decoding_plan_derives_its_layout_once_and_binds_new_lengths(monkeypatch):
    # A call of a kept signature with new lengths (and a new output) reuses the layout its plan derived: the
    # launcher's shape work is not redone per call, and the new lengths still reach the kernel as data.
    import flashlite.attn.kvcache as kvcache_module
    import flashlite.attn.plan as plans_module
    monkeypatch.setattr(plans_module, "_PLANS", {})
    derived, real_layout = [], kvcache_module.decode_layout
    monkeypatch.setattr(kvcache_module, "decode_layout",
                        lambda q, *a, **kw: derived.append(tuple(q.shape)) or real_layout(q, *a, **kw))
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=16, new=False)
    outputs = []
    for shift in (0, 1, 7):
        step_lengths = (lengths + shift).clamp(max=S_MAX)
        out = attention_with_kvcache(q, k_cache, v_cache, step_lengths, backend="triton", num_splits=3)
        assert_close(out.cpu(), reference(q, k_cache, v_cache, step_lengths), policy="tf32")
        outputs.append(out)
    assert derived == [tuple(q.shape)]
    assert len({out.data_ptr() for out in outputs}) == 3  # each call its own output: none overwrites another


def _spy_on_splits(monkeypatch):
    """The split counts the calls ask for: of the decoding kernel (as passed) and of the general forward kernel's
    split launch (unsplit calls of the general kernel record nothing)."""
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    launch_module = importlib.import_module("flashlite.attn.triton")
    real_split, real_decode, split_launches = launch_module._launch_split_forward, kvcache_module.decode_layout, []
    monkeypatch.setattr(launch_module, "_launch_split_forward",
                        lambda q, *a: split_launches.append(a[4].problem.key_splits) or real_split(q, *a))
    monkeypatch.setattr(kvcache_module, "decode_layout",
                        lambda q, *a, **kw: split_launches.append(kw["num_splits"]) or real_decode(q, *a, **kw))
    return split_launches


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("case", ["decode", "chunk-of-3", "window", "softcap-alibi"])
def test_split_kv_gives_the_float64_result(case, splits, monkeypatch):
    # Lengths 1, 2, 18 and 45 over 16-key blocks (interpreter): shares of whole blocks, empty shares (7 of them
    # for 1 to 3 blocks), a share ending inside a block; GQA-packed rows (S_q = 1) and the causal chunk (S_q = 3).
    split_launches = _spy_on_splits(monkeypatch)
    dtype, seq_q, options = CASES[case]
    options = {key: _slopes(value) if key == "alibi_slopes" else value for key, value in options.items()}
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(dtype, seed=40 + splits, seq_q=seq_q)
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="triton",
                                 num_splits=splits, **options)
    assert out.shape == q.shape and out.dtype == dtype and split_launches == [splits]
    expected = reference(q, k_cache, v_cache, lengths + seq_q, **options)
    assert_close(out.cpu(), expected, policy=POLICY[dtype])
    unsplit = attention_with_kvcache(q, k_cache, v_cache, lengths + seq_q, backend="triton", **options)
    assert_close(out.cpu(), expected, policy=POLICY[dtype], baseline=unsplit.cpu())


def test_split_kv_reads_a_paged_cache_and_leaves_rows_without_keys_zero():
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=44, new=False)
    k_cache, v_cache = k_cache[:, :, :32], v_cache[:, :, :32]
    lengths = torch.tensor([0, 31, 16, 5], dtype=torch.int32, device=DEVICE)  # entry 0 has no key at all
    k_blocks, table = paged(k_cache, seed=45)
    v_blocks, _ = paged(v_cache, seed=45)
    out = attention_with_kvcache(q, k_blocks, v_blocks, lengths, block_table=table, backend="triton", num_splits=3)
    assert torch.equal(out[0].cpu(), torch.zeros_like(out[0].cpu()))
    assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths), policy="tf32")


def test_default_num_splits_follows_the_cache_capacity(monkeypatch):
    # num_splits=None on the general forward kernel (ALiBi here): no split below SPLIT_MIN_KEYS positions,
    # SPLITS_LONG shares from there (the measured rule); the threshold is lowered to this test's cache so that both
    # sides run at interpreter sizes. The decoding kernel gets None and applies its own rule (choose_splits).
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    assert kvcache_module.default_splits(kvcache_module.SPLIT_MIN_KEYS - 1) == 1
    assert kvcache_module.default_splits(kvcache_module.SPLIT_MIN_KEYS) == kvcache_module.SPLITS_LONG == 8
    split_launches = _spy_on_splits(monkeypatch)
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=47, new=False)
    slopes = _slopes("batch")
    expected = reference(q, k_cache, v_cache, lengths, alibi_slopes=slopes)
    unsplit = attention_with_kvcache(q, k_cache, v_cache, lengths, alibi_slopes=slopes, backend="triton")
    assert split_launches == []
    monkeypatch.setattr(kvcache_module, "SPLIT_MIN_KEYS", S_MAX)
    # The rule is fixed for a process, and a signature's plan keeps its shares: start from an empty plan cache.
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, alibi_slopes=slopes, backend="triton")
    assert split_launches == [8]
    assert_close(out.cpu(), expected, policy="tf32", baseline=unsplit.cpu())
    split_launches.clear()
    decoded = attention_with_kvcache(q, k_cache, v_cache, lengths, backend="triton")
    assert split_launches == [None]
    assert_close(decoded.cpu(), reference(q, k_cache, v_cache, lengths), policy="tf32")


@pytest.mark.parametrize("num_splits", [0, 65, 2.0, True])
def test_num_splits_outside_1_to_64_is_named(num_splits):
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=46, new=False)
    with pytest.raises(ValueError, match="num_splits must be None or an integer from 1 to 64"):
        attention_with_kvcache(q, k_cache, v_cache, lengths, num_splits=num_splits)


def test_public_name():
    assert flashlite.attention_with_kvcache is attention_with_kvcache


@pytest.mark.parametrize("change, error, match", [
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"].long()}, TypeError, "cache_seqlens must be an int32"),
    (lambda a: {**a, "cache_seqlens": a["cache_seqlens"][:2]}, ValueError, r"cache_seqlens must have shape \[B\]"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([0, 1, 17, 45], dtype=torch.int32, device=DEVICE)},
     ValueError, "overflows the cache of S_max = 45"),
    (lambda a: {**a, "cache_seqlens": torch.tensor([0, -1, 17, 3], dtype=torch.int32, device=DEVICE)},
     ValueError, "must be >= 0"),
    (lambda a: {**a, "v_new": None}, ValueError, "k_new and v_new together"),
    (lambda a: {**a, "k_new": a["k_new"][:, :, :0]}, ValueError, "k_new must have shape"),
    (lambda a: {**a, "k_new": a["k_new"].double()}, TypeError, "k_new must match the cache's dtype"),
    (lambda a: {**a, "block_table": torch.zeros(4, 3, dtype=torch.int64, device=DEVICE)}, TypeError,
     "block_table must be an int32"),
    (lambda a: {**a, "block_table": torch.zeros(3, 3, dtype=torch.int32, device=DEVICE)}, ValueError,
     r"block_table must have shape \[B, max blocks\]"),
    (lambda a: {**a, "q": a["q"][0]}, ValueError, "q must be a 4-D tensor"),
    (lambda a: {**a, "softcap": -1.0}, ValueError, "softcap must be finite and > 0"),
])
def test_bad_input_is_named(change, error, match):
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=6)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_seqlens=lengths, k_new=k_new, v_new=v_new)
    # check_values=True: on a GPU cache_seqlens and the block table are read back only on request.
    args = {**change(args), "check_values": True}
    with pytest.raises(error, match=match):
        attention_with_kvcache(args.pop("q"), args.pop("k_cache"), args.pop("v_cache"), args.pop("cache_seqlens"),
                               **args)


def paged(cache, seed, block_size=16, spare=3):
    """The same cache as [blocks, H_kv, block size, D] blocks in shuffled order (spare blocks hold noise), and the
    block table that finds them."""
    batch, heads, capacity, dim = cache.shape
    per_entry = capacity // block_size
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(batch * per_entry + spare, generator=gen)
    table = order[:batch * per_entry].view(batch, per_entry).to(device=DEVICE, dtype=torch.int32)
    blocks = torch.randn(batch * per_entry + spare, heads, block_size, dim, generator=gen).to(cache)
    for b in range(batch):
        for j in range(per_entry):
            blocks[table[b, j]] = cache[b, :, j * block_size:(j + 1) * block_size]
    return blocks, table


def gathered(blocks, table):
    return torch.cat([blocks[table[:, j].long()] for j in range(table.shape[1])], dim=2)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("seq_q, options", [(1, dict()), (3, dict(window=(7, 0), alibi_slopes="heads"))])
def test_a_paged_cache_gives_the_contiguous_result(backend, seq_q, options):
    options = {key: _slopes(value) if key == "alibi_slopes" else value for key, value in options.items()}
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=8, seq_q=seq_q)
    k_cache, v_cache = k_cache[:, :, :32], v_cache[:, :, :32]  # two blocks of 16 per entry
    lengths = lengths.clamp(max=32 - seq_q)
    k_blocks, table = paged(k_cache, seed=9)
    v_blocks, _ = paged(v_cache, seed=9)
    contiguous = attention_with_kvcache(q, k_cache.clone(), v_cache.clone(), lengths, k_new=k_new, v_new=v_new,
                                        backend=backend, **options)
    out = attention_with_kvcache(q, k_blocks, v_blocks, lengths, k_new=k_new, v_new=v_new, block_table=table,
                                 backend=backend, **options)
    # The new tokens went to the right block rows: the paged cache, read through its table, is the written one.
    written_k, written_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        written_k[b, :, n:n + seq_q], written_v[b, :, n:n + seq_q] = k_new[b], v_new[b]
    assert torch.equal(gathered(k_blocks, table), written_k) and torch.equal(gathered(v_blocks, table), written_v)
    assert_close(out.cpu(), reference(q, written_k, written_v, lengths + seq_q, **options), policy="tf32")
    assert_close(out.cpu(), contiguous.cpu().double(), policy="tf32")


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("layout", ["transposed", "every_other_column"])
def test_a_block_table_of_any_layout_finds_the_same_blocks(layout, backend):
    # The kernel walks a row of the table at unit column stride: a table whose columns are not adjacent (a
    # transposed storage, or every other column of a wider one) must still name the blocks its values name.
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=12)
    k_cache, v_cache = k_cache[:, :, :32], v_cache[:, :, :32]
    lengths = lengths.clamp(max=31)
    k_blocks, table = paged(k_cache, seed=13)
    v_blocks, _ = paged(v_cache, seed=13)
    if layout == "transposed":
        strided = table.t().contiguous().t()
    else:
        wide = torch.full((table.shape[0], 2 * table.shape[1]), k_blocks.shape[0] - 1, dtype=torch.int32,
                          device=DEVICE)
        wide[:, ::2] = table
        strided = wide[:, ::2]
    assert torch.equal(strided, table) and strided.stride(1) != 1
    out = attention_with_kvcache(q, k_blocks, v_blocks, lengths, k_new=k_new, v_new=v_new, block_table=strided,
                                 backend=backend)
    written_k, written_v = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        written_k[b, :, n], written_v[b, :, n] = k_new[b, :, 0], v_new[b, :, 0]
    assert torch.equal(gathered(k_blocks, table), written_k) and torch.equal(gathered(v_blocks, table), written_v)
    assert_close(out.cpu(), reference(q, written_k, written_v, lengths + 1), policy="tf32")


def test_block_table_entries_outside_the_cache_are_named():
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=10)
    k_blocks, table = paged(k_cache[:, :, :32], seed=11)
    v_blocks, _ = paged(v_cache[:, :, :32], seed=11)
    bad = table.clone()
    bad[2, 1] = k_blocks.shape[0]  # entry 2 holds 17 + 1 positions: its second block is used
    with pytest.raises(ValueError, match=r"block_table\[2\] names blocks outside"):
        attention_with_kvcache(q, k_blocks, v_blocks, lengths.clamp(max=31), k_new=k_new, v_new=v_new,
                               block_table=bad, check_values=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        attention_with_kvcache(q, k_blocks[:, :, :8], v_blocks[:, :, :8], lengths.clamp(max=7), block_table=table)


def test_calls_that_need_a_gradient_are_refused():
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=7)
    with pytest.raises(ValueError, match="forward only"):
        attention_with_kvcache(q.requires_grad_(), k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)
    with torch.no_grad():
        attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new)


_COMPILE_DECODE = SM90_COMPILER + r'''
import torch
from flashlite.kernels import tuning
# Every decoding config the forward's pruning keeps, with the causal mode aligned to each key length and every
# variant on, contiguous and paged (blocks of 256 positions): bf16 at D=128, float32 at D=256 (the largest tiles).
for dtype, operand, dot, head_dim in ((torch.bfloat16, "*bf16", "bf16", 128), (torch.float32, "*fp32", "tf32", 256)):
    named = {"Q": torch.empty(0, dtype=dtype), "SEQ_Q_BUCKET": 16}
    for config in attention_fwd.prune_fwd_configs(tuning.make_configs(attention_fwd.FWD_DECODE_BLOCKS), named,
                                                  BLOCK_D=head_dim):
        for page_size in (0, 256):
            print(config.kwargs["BLOCK_M"], shared_memory_for_sm90(
                attention_fwd._attn_fwd, dict(config.kwargs), head_dim=head_dim, block_d=head_dim, causal=3,
                key_mask="lengths", warps=config.num_warps, stages=config.num_stages, operand=operand, dot=dot,
                flags=dict(WINDOW=True, SOFTCAP=True, ALIBI=True, PAGE_SIZE=page_size)))
# Split-KV (four shares per query block) with the first bf16 D=128 config, paged.
named = {"Q": torch.empty(0, dtype=torch.bfloat16), "SEQ_Q_BUCKET": 16}
config = attention_fwd.prune_fwd_configs(tuning.make_configs(attention_fwd.FWD_DECODE_BLOCKS), named, BLOCK_D=128)[0]
print(config.kwargs["BLOCK_M"], shared_memory_for_sm90(
    attention_fwd._attn_fwd, dict(config.kwargs), head_dim=128, block_d=128, causal=3, key_mask="lengths",
    warps=config.num_warps, stages=config.num_stages, flags=dict(WINDOW=True, PAGE_SIZE=256, NUM_SPLITS=4)))
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles the kernels for real")
def test_the_decoding_configs_compile_for_hopper_within_its_shared_memory():
    pytest.importorskip("triton.backends.nvidia")
    rows = [tuple(map(int, line.split())) for line in run_script(_COMPILE_DECODE).splitlines()]
    assert rows and all(block_m == 16 for block_m, _ in rows)  # decoding-sized queries take 16-row blocks only
    assert all(0 < shared <= 232448 for _, shared in rows), rows  # sm_90's 227 KiB per block


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; the CPU runs the same "
                                                                      "checks at tiny sizes above")


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("paged_cache", [False, True])
def test_real_sizes_decoding_on_the_gpu_and_under_cuda_graph_capture(paged_cache, num_splits):
    # B=8, H=32 over H_kv=8, D=128, bf16, a cache of 8,192 positions filled to odd lengths; then the same step
    # captured in a CUDA graph and replayed with the next lengths (no synchronisation inside the call).
    batch, heads, kv_heads, capacity, dim = 8, 32, 8, 8192, 128
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*size):
        return torch.randn(*size, device="cuda", dtype=torch.bfloat16, generator=gen)
    q, k_cache, v_cache = rand(batch, heads, 1, dim), rand(batch, kv_heads, capacity, dim), rand(batch, kv_heads,
                                                                                                   capacity, dim)
    lengths = torch.tensor([8190, 7000, 4097, 2049, 1025, 300, 17, 0], dtype=torch.int32, device="cuda")
    k_new, v_new = rand(batch, kv_heads, 1, dim), rand(batch, kv_heads, 1, dim)
    cache_args = {}
    if paged_cache:
        blocks_k, table = paged(k_cache, seed=1, block_size=256)
        blocks_v, _ = paged(v_cache, seed=1, block_size=256)
        k_store, v_store, cache_args = blocks_k, blocks_v, dict(block_table=table)
    else:
        k_store, v_store = k_cache, v_cache
    cache_args["num_splits"] = num_splits
    out = attention_with_kvcache(q, k_store, v_store, lengths, k_new=k_new, v_new=v_new, **cache_args)
    written_k = gathered(k_store, table) if paged_cache else k_store
    written_v = gathered(v_store, table) if paged_cache else v_store
    expected = torch.stack([reference_entry(q[b], written_k[b], written_v[b], n + 1)
                            for b, n in enumerate(lengths.tolist())])
    assert_close(out, expected, policy=torch.bfloat16)
    # One decoding step captured, replayed with every entry one token longer.
    step_lengths = lengths + 1
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = attention_with_kvcache(q, k_store, v_store, step_lengths, k_new=k_new, v_new=v_new, **cache_args)
    graph.replay()
    eager = attention_with_kvcache(q, k_store.clone(), v_store.clone(), step_lengths, k_new=k_new, v_new=v_new,
                                   **cache_args)
    assert torch.equal(captured, eager)


@needs_cuda
@pytest.mark.parametrize("num_splits", [1, 4])
def test_decoding_peak_memory_is_the_output_and_the_split_partials_only(num_splits):
    # B=32, H=32 over H_kv=8, D=128, bf16, a cache of 32,768 positions: beyond the cache and q, a decode step
    # allocates its output, and with split-KV the float32 partials, num_splits * B * H * (D + 1) floats (5% slack
    # for allocator rounding); nothing the size of the cache, no mask.
    batch, heads, kv_heads, capacity, dim = 32, 32, 8, 32768, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(batch, heads, 1, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, dim, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
    lengths = torch.randint(capacity // 2, capacity, (batch,), device="cuda", dtype=torch.int32, generator=gen)
    attention_with_kvcache(q, k_cache, v_cache, lengths, backend="triton", num_splits=num_splits)  # compile, tune
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = attention_with_kvcache(q, k_cache, v_cache, lengths, backend="triton", num_splits=num_splits)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    partials = 0 if num_splits == 1 else num_splits * batch * heads * (dim + 1) * 4
    allowed = out.numel() * out.element_size() + partials
    assert extra <= 1.05 * allowed, f"{extra} bytes beyond the inputs; output and partials are {allowed}"


def reference_entry(q, k, v, n):
    """float64 attention of one entry's queries [H, 1, D] over its first n keys [H_kv, S, D]."""
    group = q.shape[0] // k.shape[0]
    kk = k[:, :n].double().repeat_interleave(group, 0)
    vv = v[:, :n].double().repeat_interleave(group, 0)
    weights = torch.softmax(q.double() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
    return weights @ vv


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_compiles_into_one_graph_with_the_custom_op_and_matches_eager(backend):
    # torch.compile sees one opaque op that writes the caches: the same output and the same caches as eager.
    torch._dynamo.reset()
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=15, seq_q=3)
    slopes = _slopes("heads")

    def step(q, k_cache, v_cache, k_new, v_new):
        return attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, window=(9, 0),
                                      softcap=2.0, alibi_slopes=slopes, backend=backend)

    caches = [(k_cache.clone(), v_cache.clone()) for _ in range(2)]
    eager = step(q, *caches[0], k_new, v_new)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, *caches[1], k_new, v_new)
    torch._dynamo.reset()
    assert torch.equal(eager, compiled)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert not torch.equal(caches[1][0], k_cache)  # the compiled call did write the new tokens


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("filled, match", [([0, -1, 17, 3], "must be >= 0"),
                                           ([0, 1, 17, 44], "overflows the cache of S_max = 45")])
def test_compiled_call_checks_the_lengths_as_eager_does(backend, filled, match):
    # Traced tensors have no values, so the graph's op checks cache_seqlens when it runs, by the eager rule (CPU
    # tensors always, else check_values=True). Unchecked, a length of -1 wrote the new tokens at the cache's last
    # position and returned an output, and an overflow raised an IndexError. A good call after the bad one, through
    # the same graph, still matches float64.
    torch._dynamo.reset()
    q, k_cache, v_cache, good, k_new, v_new = inputs(torch.float32, seed=17, seq_q=2)
    bad = torch.tensor(filled, dtype=torch.int32, device=DEVICE)
    check = None if DEVICE == "cpu" else True

    def step(q, k_cache, v_cache, lengths, k_new, v_new):
        return attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                      check_values=check)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    with pytest.raises(ValueError, match=match):
        step(q, k_cache.clone(), v_cache.clone(), bad, k_new, v_new)
    caches = (k_cache.clone(), v_cache.clone())
    with pytest.raises(ValueError, match=match):
        compiled(q, *caches, bad, k_new, v_new)
    assert torch.equal(caches[0], k_cache) and torch.equal(caches[1], v_cache)  # nothing written
    out = compiled(q, *caches, good, k_new, v_new)
    torch._dynamo.reset()
    assert_close(out.cpu(), reference(q, *caches, good + 2), policy=POLICY[torch.float32])


def test_the_custom_op_passes_opcheck():
    import flashlite.attn.kvcache as kvcache_module
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(torch.float32, seed=16)
    args = (q, k_cache, v_cache, lengths, k_new, v_new, None, None, 0.25, -1, -1, 0.0, False)
    torch.library.opcheck(kvcache_module.attention_with_kvcache_op, args,
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("case", ["decode", "softcap-alibi"])
def test_a_replayed_plan_takes_each_calls_lengths(case, backend, monkeypatch):
    # A cache call's plan is kept by what does not vary per call (shapes, strides, dtypes, devices, options): a
    # later call with other lengths finds it, is neither validated nor decided again, and attends to its own
    # lengths (the decoding kernel and, with ALiBi, the general forward kernel; SDPA's mask).
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    monkeypatch.setattr(importlib.import_module("flashlite.attn.plan"), "_PLANS", {})
    dtype, seq_q, options = CASES[case]
    options = {**options, **({"alibi_slopes": _slopes(options["alibi_slopes"])} if "alibi_slopes" in options else {})}
    q, k_cache, v_cache, lengths, k_new, v_new = inputs(dtype, seed=60, seq_q=seq_q)
    attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend, **options)
    validated = []
    monkeypatch.setattr(kvcache_module, "validate", lambda *a, **kw: validated.append(1))
    for step, filled in enumerate(([3, 30, 9, 0], [44, 2, 0, 21])):
        q, _, _, _, k_new, v_new = inputs(dtype, seed=61 + step, seq_q=seq_q)
        lengths = torch.tensor(filled, dtype=torch.int32, device=DEVICE)
        out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend,
                                     **options)
        assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths + seq_q, **options), policy=POLICY[dtype])
    assert validated == []
    # Value checks stay per call (CPU tensors): a replayed plan still refuses lengths that overflow the cache.
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="cache_seqlens"):
            attention_with_kvcache(q, k_cache, v_cache, torch.full((B,), S_MAX, dtype=torch.int32), k_new=k_new,
                                   v_new=v_new, backend=backend, **options)


class _ReplayingRecording:
    """A stand-in for ``_direct_launch.RecordedLaunch`` that replays as the real one does: the recorded launch's
    non-tensor arguments with the replay's tensors (the real one needs a CUDA device)."""

    def __init__(self, kernel, grid, args, kwargs, n_tensors):
        self.kernel, self.grid, self.rest, self.kwargs, self.replays = kernel, grid, args[n_tensors:], kwargs, []

    def launch(self, *tensors):
        self.replays.append(tensors)
        self.kernel[self.grid](*tensors, *self.rest, **self.kwargs)
        return True


@pytest.mark.parametrize("splits", [None, 3])
def test_recorded_decoding_launches_replay_with_new_lengths(splits, monkeypatch):
    # The decoding kernel's launches are recorded at a plan's first call and replayed after with each call's
    # tensors: the lengths are one of them, never baked into the recording, so a replay with new lengths gives
    # the float64 result for those lengths.
    from flashlite.attn.plan import Plan
    from flashlite.attn.problem import validate
    from flashlite.dispatch import Decision
    kvcache_module = importlib.import_module("flashlite.attn.kvcache")
    recordings = []

    def record(kernel, grid, args, kwargs, n_tensors):
        kernel[grid](*args, **kwargs)
        recordings.append(_ReplayingRecording(kernel, grid, args, kwargs, n_tensors))
        return recordings[-1]
    monkeypatch.setattr(kvcache_module._direct_launch, "record", record)
    q, k_cache, v_cache, lengths, _, _ = inputs(torch.float32, seed=70, new=False)
    problem = validate(q, k_cache, v_cache, "lower_right", None, None, lengths, "triton", None, None, None, None)
    plan = Plan(problem, Decision("triton", "a test"), record=True)  # as a kept plan on CUDA
    for step, filled in enumerate(([40, 1, 17, 0], [5, 45, 0, 33], [45, 44, 1, 2])):
        q = inputs(torch.float32, seed=71 + step, new=False)[0]
        lengths = torch.tensor(filled, dtype=torch.int32, device=DEVICE)
        out = kvcache_module._decode(plan, q, k_cache, v_cache, lengths, None, splits)
        assert_close(out.cpu(), reference(q, k_cache, v_cache, lengths), policy="tf32")
    launches = 1 if splits is None else 2  # split-KV: the split kernel, then the merge
    assert len(recordings) == launches and all(len(r.replays) == 2 for r in recordings)
    assert recordings[0].replays[-1][3] is lengths  # the lengths went in as a tensor of this call
