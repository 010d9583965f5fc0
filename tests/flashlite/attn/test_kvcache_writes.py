"""Writes of new tokens into a KV cache (``attention_with_kvcache`` with k_new/v_new) where memory is shared: an
expanded (stride 0) or self-overlapping cache, k_cache and v_cache in one buffer, sources that are views of a cache,
and paged caches whose block tables share a block that a write lands in. Each is refused naming the argument, or
gives the float64 result of the call as documented; the shared memory that only reads touch (an expanded
shared-prefix cache without k_new, blocks shared as a read-only prefix) stays allowed and correct.

Tiny odd sizes, fresh random inputs, float64 references written out here from the definition.
"""
from __future__ import annotations

import math

import pytest
import torch

from flashlite.attention import attention_with_kvcache
from pytest_kernelcheck import assert_close

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
B, H, H_KV, D = 3, 4, 2, 16
S_MAX = 37
BLOCK = 16


def rand(gen, *size):
    return torch.randn(*size, generator=gen).to(DEVICE)


def reference(q, keys, values):
    """float64 attention of q [B, H, S_q, D] over per-entry key lists ([H_kv, n_b, D] each); query i sits at
    position n_b - S_q + i and sees the keys up to it."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, seq_q = q.shape[1], q.shape[2]
    for b, (kk, vv) in enumerate(zip(keys, values)):
        n = kk.shape[1]
        group = heads // kk.shape[0]
        kk = kk.double().cpu().repeat_interleave(group, 0)
        vv = vv.double().cpu().repeat_interleave(group, 0)
        scores = q[b].double().cpu() @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
        seen = torch.arange(n)[None, :] <= torch.arange(seq_q)[:, None] + n - seq_q
        out[b] = torch.softmax(scores.masked_fill(~seen, float("-inf")), -1) @ vv
    return out


def lengths_of(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def call(q, k_cache, v_cache, lengths, **options):
    return attention_with_kvcache(q, k_cache, v_cache, lengths, check_values=True, **options)


# --- caches whose memory overlaps ---------------------------------------------------------------------------------

def _self_overlapping(kind, gen):
    """A [B, H_kv, S_MAX, D] cache whose elements overlap in memory, and the buffer behind it."""
    if kind == "expanded_batch":  # a shared-prefix cache: one entry's memory for all
        base = rand(gen, 1, H_KV, S_MAX, D)
        return base.expand(B, H_KV, S_MAX, D), base
    if kind == "expanded_heads":
        base = rand(gen, B, 1, S_MAX, D)
        return base.expand(B, H_KV, S_MAX, D), base
    # positions half a row apart: position j + 1 starts in the middle of position j
    base = rand(gen, B * H_KV * S_MAX * D)
    return base.as_strided((B, H_KV, S_MAX, D), (H_KV * S_MAX * D, S_MAX * D, D // 2, 1)), base


@pytest.mark.parametrize("kind", ["expanded_batch", "expanded_heads", "rows_overlap"])
@pytest.mark.parametrize("which", ["k_cache", "v_cache"])
def test_a_cache_whose_elements_overlap_is_refused_when_new_tokens_would_be_written(kind, which):
    # Before: the expanded cache took every entry's new token at the same place; entry 0 attended to entry 1's.
    gen = torch.Generator().manual_seed(100 + len(kind) + len(which))
    q, k_new, v_new = rand(gen, B, H, 1, D), rand(gen, B, H_KV, 1, D), rand(gen, B, H_KV, 1, D)
    shared, base = _self_overlapping(kind, gen)
    other = rand(gen, B, H_KV, S_MAX, D)
    caches = {"k_cache": shared, "v_cache": other} if which == "k_cache" else {"k_cache": other, "v_cache": shared}
    base_before, other_before = base.clone(), other.clone()
    with pytest.raises(ValueError, match=rf"{which} would be written .* overlap in memory.*accepted without k_new"):
        call(q, caches["k_cache"], caches["v_cache"], lengths_of([5, 5, 20]), k_new=k_new, v_new=v_new,
             backend="sdpa")
    assert torch.equal(base, base_before) and torch.equal(other, other_before)  # refused before any write


def test_an_expanded_paged_cache_is_refused_when_new_tokens_would_be_written():
    gen = torch.Generator().manual_seed(110)
    q, k_new, v_new = rand(gen, B, H, 1, D), rand(gen, B, H_KV, 1, D), rand(gen, B, H_KV, 1, D)
    block = rand(gen, 1, H_KV, BLOCK, D)
    k_blocks, v_blocks = block.expand(5, H_KV, BLOCK, D), rand(gen, 5, H_KV, BLOCK, D)
    table = torch.tensor([[0, 1], [2, 3], [4, 0]], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="k_cache would be written"):
        call(q, k_blocks, v_blocks, lengths_of([3, 20, 9]), k_new=k_new, v_new=v_new, block_table=table,
             backend="sdpa")


@pytest.mark.parametrize("layout", ["same_tensor", "overlapping_views"])
def test_k_and_v_caches_sharing_memory_are_refused_when_new_tokens_would_be_written(layout):
    gen = torch.Generator().manual_seed(120 + len(layout))
    q, k_new, v_new = rand(gen, B, H, 1, D), rand(gen, B, H_KV, 1, D), rand(gen, B, H_KV, 1, D)
    buffer = rand(gen, B, H_KV, S_MAX + 1, D)
    if layout == "same_tensor":
        k_cache = v_cache = buffer[:, :, :S_MAX]
    else:  # v is k one position on
        k_cache, v_cache = buffer[:, :, :S_MAX], buffer[:, :, 1:]
    before = buffer.clone()
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        call(q, k_cache, v_cache, lengths_of([4, 0, 30]), k_new=k_new, v_new=v_new, backend="sdpa")
    assert torch.equal(buffer, before)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("layout", ["stacked", "interleaved"])
def test_disjoint_views_of_one_buffer_take_new_tokens(layout, backend):
    # k and v in one allocation without sharing an element: kv[0] / kv[1], or kv[..., 0, :] / kv[..., 1, :].
    gen = torch.Generator().manual_seed(130 + len(layout))
    q, k_new, v_new = rand(gen, B, H, 2, D), rand(gen, B, H_KV, 2, D), rand(gen, B, H_KV, 2, D)
    if layout == "stacked":
        kv = rand(gen, 2, B, H_KV, S_MAX, D)
        k_cache, v_cache = kv[0], kv[1]
    else:
        kv = rand(gen, B, H_KV, S_MAX, 2, D)
        k_cache, v_cache = kv[..., 0, :], kv[..., 1, :]
    lengths = lengths_of([0, 13, 35])
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        k_expected[b, :, n:n + 2], v_expected[b, :, n:n + 2] = k_new[b], v_new[b]
    out = call(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    ends = (lengths + 2).tolist()
    assert_close(out.cpu(), reference(q, [k_expected[b, :, :n] for b, n in enumerate(ends)],
                                      [v_expected[b, :, :n] for b, n in enumerate(ends)]), policy="tf32")


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("paged", [False, True])
def test_an_expanded_shared_prefix_cache_is_read_without_new_tokens(paged, backend):
    # Reads of memory shared between entries stay allowed: nothing is written.
    gen = torch.Generator().manual_seed(140 + paged)
    q = rand(gen, B, H, 3, D)
    lengths = lengths_of([3, 32, 17])
    if paged:
        k_cache = rand(gen, 4, 1, BLOCK, D).expand(4, H_KV, BLOCK, D)  # heads sharing one block's memory
        v_cache = rand(gen, 4, H_KV, BLOCK, D)
        table = torch.tensor([[2, 0], [1, 3], [1, 0]], dtype=torch.int32, device=DEVICE)
        k_before = k_cache.clone()
        out = call(q, k_cache, v_cache, lengths, block_table=table, backend=backend)
        assert torch.equal(k_cache, k_before)
        keys = [torch.cat([k_cache[j] for j in row], 1) for row in table.tolist()]
        values = [torch.cat([v_cache[j] for j in row], 1) for row in table.tolist()]
    else:
        k_cache = rand(gen, 1, H_KV, S_MAX, D).expand(B, H_KV, S_MAX, D)
        v_cache = k_cache  # one tensor for both: allowed for reads
        out = call(q, k_cache, v_cache, lengths, backend=backend)
        keys = values = [k_cache[b] for b in range(B)]
    ends = lengths.tolist()
    assert_close(out.cpu(), reference(q, [k[:, :n] for k, n in zip(keys, ends)],
                                      [v[:, :n] for v, n in zip(values, ends)]), policy="tf32")


# --- sources that are views of a cache ----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["triton", "sdpa"])
def test_sources_that_are_views_of_a_cache_are_read_before_the_write(backend):
    # v_new is k_cache's position 5, where entry 0's k_new lands; q is v_cache's position 20, where entry 2's
    # v_new lands. Before: both were read after the write (v_cache got k_new, q became v_new).
    gen = torch.Generator().manual_seed(150)
    k_cache, v_cache = rand(gen, B, H_KV, S_MAX, D), rand(gen, B, H_KV, S_MAX, D)
    k_new = rand(gen, B, H_KV, 1, D)
    v_new, q = k_cache[:, :, 5:6], v_cache[:, :, 20:21]  # H = H_KV here
    v_values, q_values = v_new.clone(), q.clone()
    lengths = lengths_of([5, 11, 20])
    k_expected, v_expected = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths.tolist()):
        k_expected[b, :, n], v_expected[b, :, n] = k_new[b, :, 0], v_values[b, :, 0]
    out = call(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend=backend)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    ends = (lengths + 1).tolist()
    assert_close(out.cpu(), reference(q_values, [k_expected[b, :, :n] for b, n in enumerate(ends)],
                                      [v_expected[b, :, :n] for b, n in enumerate(ends)]), policy="tf32")


# --- paged caches whose tables share blocks -----------------------------------------------------------------------

def _paged_inputs(seed, seq_q=1, blocks=6):
    gen = torch.Generator().manual_seed(seed)
    return (rand(gen, B, H, seq_q, D), rand(gen, blocks, H_KV, BLOCK, D), rand(gen, blocks, H_KV, BLOCK, D),
            rand(gen, B, H_KV, seq_q, D), rand(gen, B, H_KV, seq_q, D))


COLLISIONS = {
    # both entries write position 20 of the same block 1 (the issue's [[0, 1], [0, 1]])
    "two_entries_write_one_block": ([[0, 1], [0, 1], [2, 3]], [20, 20, 4], r"block_table\[0, 1\] = block 1 .* "
                                    r"block_table\[1, 1\] names the same block, used by entry 1"),
    # entry 1 writes position 5 of block 0, which entry 0 reads as its prefix (position 5)
    "write_into_another_entrys_prefix": ([[0, 1], [0, 2], [3, 4]], [20, 5, 9], r"block_table\[1, 0\] = block 0 "
                                         r".* block_table\[0, 0\] names the same block, used by entry 0"),
    # entry 2 repeats block 3: its write at position 17 (block 3, row 1) would overwrite its own position 1
    "block_repeated_within_an_entry": ([[0, 1], [2, 5], [3, 3]], [4, 9, 17], r"block_table\[2, 1\] = block 3 .* "
                                       r"block_table\[2, 0\] names the same block, used by the same entry"),
    # an expanded table: every entry's row is one row's memory
    "expanded_table": (None, [20, 21, 25], r"block_table\[0, 1\] = block 1 .* names the same block"),
}


@pytest.mark.parametrize("case", list(COLLISIONS))
def test_a_write_into_a_block_that_another_position_uses_is_refused(case):
    rows, filled, match = COLLISIONS[case]
    q, k_blocks, v_blocks, k_new, v_new = _paged_inputs(seed=160 + len(case))
    if rows is None:
        table = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE).expand(B, 2)
    else:
        table = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    k_before, v_before = k_blocks.clone(), v_blocks.clone()
    with pytest.raises(ValueError, match=match + ".*read-only prefix"):
        call(q, k_blocks, v_blocks, lengths_of(filled), k_new=k_new, v_new=v_new, block_table=table,
             backend="sdpa")
    assert torch.equal(k_blocks, k_before) and torch.equal(v_blocks, v_before)


@pytest.mark.parametrize("backend", ["triton", "sdpa"])
@pytest.mark.parametrize("seq_q", [1, 3])
def test_blocks_shared_as_a_read_only_prefix_take_writes_elsewhere(seq_q, backend):
    # Block 0 is every entry's full first block (positions 0..15), read only; the writes land in blocks of their
    # own. Columns past an entry's length may name anything, shared blocks included.
    q, k_blocks, v_blocks, k_new, v_new = _paged_inputs(seed=170 + seq_q, seq_q=seq_q)
    table = torch.tensor([[0, 4, 0], [0, 1, 4], [0, 2, 0]], dtype=torch.int32, device=DEVICE)
    lengths = lengths_of([16, 29, 16 + 16 - seq_q])
    k_expected, v_expected = k_blocks.clone(), v_blocks.clone()
    for b, n in enumerate(lengths.tolist()):
        for i in range(seq_q):
            block, row = table[b, (n + i) // BLOCK], (n + i) % BLOCK
            k_expected[block, :, row], v_expected[block, :, row] = k_new[b, :, i], v_new[b, :, i]
    out = call(q, k_blocks, v_blocks, lengths, k_new=k_new, v_new=v_new, block_table=table, backend=backend)
    assert torch.equal(k_blocks, k_expected) and torch.equal(v_blocks, v_expected)
    ends = (lengths + seq_q).tolist()
    keys = [torch.cat([k_expected[j] for j in row], 1)[:, :n] for row, n in zip(table.tolist(), ends)]
    values = [torch.cat([v_expected[j] for j in row], 1)[:, :n] for row, n in zip(table.tolist(), ends)]
    assert_close(out.cpu(), reference(q, keys, values), policy="tf32")


def test_a_negative_block_under_a_write_is_named():
    q, k_blocks, v_blocks, k_new, v_new = _paged_inputs(seed=180)
    table = torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32, device=DEVICE)
    k_before = k_blocks.clone()
    with pytest.raises(ValueError, match=r"block_table\[1\] names blocks outside \[0, 6\)"):
        call(q, k_blocks, v_blocks, lengths_of([3, 16, 9]), k_new=k_new, v_new=v_new, block_table=table,
             backend="sdpa")
    assert torch.equal(k_blocks, k_before)


def test_a_compiled_call_refuses_one_tensor_for_both_caches_when_it_writes():
    # Traced tensors have no addresses: the graph's op checks the caches when it runs, as the eager call does.
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(190)
    q, k_new, v_new = rand(gen, B, H, 1, D), rand(gen, B, H_KV, 1, D), rand(gen, B, H_KV, 1, D)
    cache = rand(gen, B, H_KV, S_MAX, D)
    before = cache.clone()

    def step(q, k_cache, v_cache, k_new, v_new):
        return attention_with_kvcache(q, k_cache, v_cache, lengths_of([2, 9, 30]), k_new=k_new, v_new=v_new,
                                      backend="sdpa")

    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        torch.compile(step, fullgraph=True, backend="aot_eager")(q, cache, cache, k_new, v_new)
    torch._dynamo.reset()
    assert torch.equal(cache, before)
