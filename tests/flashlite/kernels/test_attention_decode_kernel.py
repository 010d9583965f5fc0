"""The decoding kernel (``flashlite.kernels.attention_decode``) against float64: on a CUDA GPU where there is one,
else under the interpreter.

Query i of entry b sits at position n_b - S_q + i of its n_b keys and sees the keys up to it (a query that sees none
gets zeros). Odd sizes on purpose: a cache of 301 positions filled to 1, 17, 300 and 0 keys, so that lengths end
inside key tiles and shares; grouped-query groups 1, 4 and 8; S_q 1 and 3; head dims 64, 80 and 128; share counts
above the key tiles an entry has; paged caches of 16- and 32-row blocks through a shuffled block table, read both row
by row and a page per tile; caches and queries in other memory layouts; fp8 caches with a scale per kv head. fp16
and fp32 queries only: ``tl.dot`` on bf16 is wrong in the interpreter.
"""
from __future__ import annotations

import math

import pytest
import torch

import flashlite
from flashlite.kernels.attention_decode_launch import DecodeConfig, choose_splits, decode_attention, prepare_decode

# The kernel runs CUDA tensors on a GPU machine (no interpreter there) and CPU tensors in the interpreter; the
# inputs are drawn on the CPU either way, so both see the same values, and the references are computed there.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H_KV, S_MAX = 4, 2, 301
FILLED = [1, 17, 300, 0]
TOLERANCE = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.float32: dict(atol=1e-5, rtol=1e-5)}


def make_inputs(seed, dtype, group, seq_q, head_dim, filled=FILLED):
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(dtype)
    q = rand(len(filled), H_KV * group, seq_q, head_dim)
    k_cache, v_cache = rand(len(filled), H_KV, S_MAX, head_dim), rand(len(filled), H_KV, S_MAX, head_dim)
    return tuple(t.to(DEVICE) for t in (q, k_cache, v_cache, torch.tensor(filled, dtype=torch.int32)))


def reference(q, k_cache, v_cache, lengths, *, softcap=None, window_left=-1):
    """float64 output [B, H, S_q, D] and natural log-sum-exp [B, H, S_q], written out from the definition."""
    q, k_cache, v_cache, lengths = (t.cpu() for t in (q, k_cache, v_cache, lengths))
    batch, heads, seq_q, head_dim = q.shape
    group = heads // k_cache.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((batch, heads, seq_q), float("-inf"), dtype=torch.float64)
    for b, n in enumerate(lengths.tolist()):
        keys = k_cache[b, :, :n].double().repeat_interleave(group, 0)
        values = v_cache[b, :, :n].double().repeat_interleave(group, 0)
        scores = q[b].double() @ keys.transpose(-1, -2) / math.sqrt(head_dim)  # [H, S_q, n]
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        position = torch.arange(seq_q)[:, None] + n - seq_q
        seen = torch.arange(n)[None, :] <= position
        if window_left >= 0:
            seen &= torch.arange(n)[None, :] >= position - window_left
        scores = scores.masked_fill(~seen, float("-inf"))
        row_lse = torch.logsumexp(scores, -1)
        weights = torch.exp(scores - torch.where(row_lse.isinf(), 0.0, row_lse)[..., None])
        out[b] = weights @ values
        lse[b] = row_lse
    return out, lse


def paged(caches, block_size, gen):
    """Each cache [B, H_kv, S_max, D] as blocks [blocks, H_kv, block size, D] in one shuffled order with two spare
    blocks, the rows past S_max and the spare blocks NaN (never read), and the int32 table [B, max blocks]."""
    device = caches[0].device
    caches = [cache.cpu() for cache in caches]
    batch, kv_heads, capacity, head_dim = caches[0].shape
    per_entry = -(-capacity // block_size)
    order = torch.randperm(batch * per_entry + 2, generator=gen)
    stores = []
    for cache in caches:
        padded = torch.full((batch, kv_heads, per_entry * block_size, head_dim), float("nan"), dtype=cache.dtype)
        padded[:, :, :capacity] = cache
        blocks = padded.reshape(batch, kv_heads, per_entry, block_size, head_dim).permute(0, 2, 1, 3, 4)
        store = torch.full((batch * per_entry + 2, kv_heads, block_size, head_dim), float("nan"), dtype=cache.dtype)
        store[order[:batch * per_entry]] = blocks.reshape(batch * per_entry, kv_heads, block_size, head_dim)
        stores.append(store.to(device))
    return stores, order[:batch * per_entry].reshape(batch, per_entry).to(device=device, dtype=torch.int32)


def check(out, expected, dtype):
    assert not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype,group,seq_q,head_dim,splits,use_dot", [
    (torch.float16, 1, 1, 64, 1, True),
    (torch.float16, 4, 1, 128, None, True),
    (torch.float16, 8, 3, 64, 4, True),
    (torch.float32, 4, 3, 128, 3, True),
    (torch.float16, 4, 1, 64, 2, False),
    (torch.float32, 1, 3, 64, 1, False),
    (torch.float16, 4, 1, 80, 2, True),  # a head dim padded to the 128-wide tile
])
def test_contiguous_cache_matches_float64(dtype, group, seq_q, head_dim, splits, use_dot):
    q, k_cache, v_cache, lengths = make_inputs(1, dtype, group, seq_q, head_dim)
    k_cache[:, :, 300:] = float("nan")  # past every length: never reaches the output
    v_cache[:, :, 300:] = float("nan")
    out = decode_attention(q, k_cache, v_cache, lengths, num_splits=splits,
                           config=DecodeConfig(block_n=32, use_dot=use_dot))
    check(out, reference(q, k_cache, v_cache, lengths)[0], dtype)
    assert out.dtype == dtype and out.shape == q.shape


@pytest.mark.parametrize("block_size,block_n,seq_q,splits", [
    (16, 32, 1, 1),  # pages shorter than the tile: read row by row through the table
    (16, 16, 3, 5),  # a page per tile
    (32, 16, 1, 7),  # two tiles per page
    (32, 64, 3, 2),
])
def test_paged_cache_through_a_shuffled_table_matches_float64(block_size, block_n, seq_q, splits):
    q, k_cache, v_cache, lengths = make_inputs(2, torch.float16, 4, seq_q, 64)
    gen = torch.Generator().manual_seed(block_size + block_n)
    (k_blocks, v_blocks), table = paged((k_cache, v_cache), block_size, gen)
    out = decode_attention(q, k_blocks, v_blocks, lengths, block_table=table, num_splits=splits,
                           config=DecodeConfig(block_n=block_n))
    check(out, reference(q, k_cache, v_cache, lengths)[0], torch.float16)


def test_more_shares_than_key_tiles_and_lengths_that_vary():
    """64 shares of 16-key tiles over entries of 1 to 300 keys: most shares see nothing and must weigh nothing."""
    filled = [300, 1, 2, 16, 17, 33]
    q, k_cache, v_cache, lengths = make_inputs(3, torch.float32, 4, 1, 64, filled=filled)
    for splits in (64, 17):
        out = decode_attention(q, k_cache, v_cache, lengths, num_splits=splits, config=DecodeConfig(block_n=16))
        check(out, reference(q, k_cache, v_cache, lengths)[0], torch.float32)


def test_other_memory_layouts_and_the_log_sum_exp():
    """Caches stored [B, S_max, H_kv, D] and queries [B, S_q, H, D], passed as transposed views; the natural
    log-sum-exp against float64, -inf where a query sees no key (the empty entry, and query 0 of the 1-key one)."""
    q0, k0, v0, lengths = make_inputs(4, torch.float32, 4, 3, 64)
    q = q0.transpose(1, 2).contiguous().transpose(1, 2)
    k_cache, v_cache = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (k0, v0))
    expected, expected_lse = reference(q0, k0, v0, lengths)
    for splits in (1, 4):
        out, lse = decode_attention(q, k_cache, v_cache, lengths, num_splits=splits, return_lse=True)
        check(out, expected, torch.float32)
        lse = lse.cpu()
        assert torch.equal(lse.isinf(), expected_lse.isinf()) and lse.isinf().any()
        finite = ~expected_lse.isinf()
        torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softcap,window_left,splits", [(3.0, -1, 3), (None, 20, 1), (2.0, 100, 4)])
def test_softcap_and_sliding_window_match_float64(softcap, window_left, splits):
    q, k_cache, v_cache, lengths = make_inputs(5, torch.float32, 4, 3, 64)
    out = decode_attention(q, k_cache, v_cache, lengths, num_splits=splits, softcap=softcap,
                           window_left=window_left, config=DecodeConfig(block_n=16))
    check(out, reference(q, k_cache, v_cache, lengths, softcap=softcap, window_left=window_left)[0],
          torch.float32)


@pytest.mark.parametrize("seq_q", [1, 3])
def test_agrees_with_attention_with_kvcache(seq_q):
    """Same cache, same lengths (an empty entry included): the kernel and the public API give the same output."""
    q, k_cache, v_cache, lengths = make_inputs(6, torch.float16, 4, seq_q, 64)
    api = flashlite.attention_with_kvcache(q, k_cache, v_cache, lengths)
    out = decode_attention(q, k_cache, v_cache, lengths, num_splits=3)
    torch.testing.assert_close(out, api, atol=2e-3, rtol=2e-3)
    check(out, reference(q, k_cache, v_cache, lengths)[0], torch.float16)


def test_split_rule_fills_the_gpu_without_short_shares():
    assert choose_splits(1, 8, 32768, 132) == 33  # 8 pairs: 33 shares each give 264 programs, two per SM
    assert choose_splits(64, 8, 2048, 132) == 1  # 512 pairs already fill 132 SMs twice
    assert choose_splits(1, 8, 1024, 132) == 2  # capped: no share under 512 positions
    assert choose_splits(1, 1, 10 ** 6, 132) == 64  # capped at the most the merge takes


def quantized(cache, gen):
    """cache [B, H_kv, S, D] as fp8 e4m3 with a float32 scale per kv head (the largest magnitude to 448, times a
    random factor so that the scales differ), and the dequantized cache in float64."""
    scale = cache.abs().amax(dim=(0, 2, 3)).float() / 448 * (1 + torch.rand(cache.shape[1], generator=gen)).to(
        cache.device)
    stored = (cache.float() / scale[None, :, None, None]).to(torch.float8_e4m3fn)
    return stored, scale, stored.double() * scale.double()[None, :, None, None]


@pytest.mark.parametrize("block_size,seq_q,splits", [(0, 1, 3), (16, 3, 2)])
def test_fp8_cache_with_per_head_scales_matches_float64_on_the_dequantized_cache(block_size, seq_q, splits):
    q, k_cache, v_cache, lengths = make_inputs(7, torch.float16, 4, seq_q, 64)
    gen = torch.Generator().manual_seed(70)
    (k8, k_scale, k_deq), (v8, v_scale, v_deq) = quantized(k_cache, gen), quantized(v_cache, gen)
    assert not torch.equal(k_scale, v_scale)
    table = None
    if block_size:
        (k8, v8), table = paged((k8, v8), block_size, gen)
    out = decode_attention(q, k8, v8, lengths, block_table=table, num_splits=splits, k_scale=k_scale,
                           v_scale=v_scale)
    check(out, reference(q, k_deq, v_deq, lengths)[0], torch.float16)


def test_preparing_a_call_reads_no_tensor_value_on_the_host(monkeypatch):
    """Lengths and block tables are data: building a call (what a CUDA graph captures, or a replay skips) never
    reads a tensor's values back to the host, which on a GPU would synchronise and break graph capture."""
    q, k_cache, v_cache, lengths = make_inputs(8, torch.float16, 4, 1, 64)
    (k_blocks, v_blocks), table = paged((k_cache, v_cache), 16, torch.Generator().manual_seed(8))

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor's value was read on the host")
    for name in ("item", "tolist", "__bool__", "__int__", "__index__", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    calls = [prepare_decode(q, k_cache, v_cache, lengths, num_splits=None),
             prepare_decode(q, k_blocks, v_blocks, lengths, block_table=table, num_splits=5, return_lse=True)]
    monkeypatch.undo()
    assert [len(call.launches) for call in calls] == [1, 2]  # 301 positions: one share; 5 shares and their merge
    for call in calls:
        for launch in call.launches:
            launch()
    check(calls[0].out, reference(q, k_cache, v_cache, lengths)[0], torch.float16)
    check(calls[1].out, reference(q, k_cache, v_cache, lengths)[0], torch.float16)


@pytest.mark.parametrize("block_size,seq_q,splits", [(0, 1, 3), (0, 3, 64), (16, 1, 5)])
def test_fused_merge_matches_float64_and_leaves_its_counters_zero(block_size, seq_q, splits):
    """The last share of each (entry, kv head) merges: the same output and lse as the separate merge, one launch,
    and the arrival counters zero again afterwards (the next call, or a replayed graph, starts from them)."""
    q, k_cache, v_cache, lengths = make_inputs(9, torch.float32, 4, seq_q, 64)
    expected, expected_lse = reference(q, k_cache, v_cache, lengths)
    table = None
    k_in, v_in = k_cache, v_cache
    if block_size:
        (k_in, v_in), table = paged((k_cache, v_cache), block_size, torch.Generator().manual_seed(9))
    config = DecodeConfig(block_n=16, fused_merge=True)
    call = prepare_decode(q, k_in, v_in, lengths, block_table=table, num_splits=splits, return_lse=True,
                          config=config)
    assert len(call.launches) == 1
    counters = call.launches[0].args[10]
    for _ in range(2):  # twice: the second call starts from the counters the first left
        call.launches[0]()
        assert counters.dtype == torch.int32 and not counters.any()
        check(call.out, expected, torch.float32)
        lse = call.lse.cpu() / math.log2(math.e)
        assert torch.equal(lse.isinf(), expected_lse.isinf())
        finite = ~expected_lse.isinf()
        torch.testing.assert_close(lse.double()[finite], expected_lse[finite], atol=1e-5, rtol=1e-5)
