"""What writing new tokens into a KV cache needs, for ``attention_with_kvcache``: caches whose elements do not
overlap in memory, sources (q, k_new, v_new) read before the write, and block tables whose written blocks are not
used anywhere else.

A write into memory that two cache positions share corrupts the other position silently (an expanded shared-prefix
cache: entry 0 attended to entry 1's new token), so such calls are refused, naming the argument. The memory tests
read shapes, strides and addresses only: O(1) in the cache's size and no device synchronisation (decoding is
host-bound). The block-table test reads the table's values and runs under ``check_values`` only. Imports nothing
from the package.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch


def _elements_distinct(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether no two indices of a view with these sizes and strides name one element.

    Sufficient, not necessary: sorted by stride, each dimension must step past everything the smaller ones reach.
    Every layout made by slicing, permuting or narrowing a dense tensor passes; a stride 0 of a dimension longer
    than 1 (``expand``) fails, as does any ``as_strided`` view whose rows share elements. (An exact answer for
    arbitrary strides is a subset-sum problem; the rare interleavings this refuses are named by the error.)
    """
    if 0 in sizes:
        return True
    reach = 0  # the largest offset the dimensions sorted so far reach
    for stride, size in sorted(zip(strides, sizes)):
        if size > 1:
            if stride <= reach:
                return False
            reach += (size - 1) * stride
    return True


def _storage_range(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the address ranges of a and b (on one device) overlap; their elements may still interleave without
    meeting."""
    if a.numel() == 0 or b.numel() == 0:
        return False
    (a_start, a_end), (b_start, b_end) = _byte_range(a), _byte_range(b)
    return a_start < b_end and b_start < a_end


def _ranges_meet(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    span = 1
    for size, stride in zip(t.shape, t.stride()):
        span += (size - 1) * stride
    return t.data_ptr(), t.data_ptr() + span * t.element_size()


def _caches_disjoint(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether no element of k_cache is an element of v_cache. Two views of one buffer at a fixed distance with
    the same strides (k and v interleaved, [..., 2, D]) are one view with an extra dimension of that distance."""
    if not _ranges_meet(_storage_range(k_cache), _storage_range(v_cache)) or not _share_memory(k_cache, v_cache):
        return True  # separate allocations (the usual case), answered from the storages alone
    distance, rest = divmod(abs(v_cache.data_ptr() - k_cache.data_ptr()), k_cache.element_size())
    if rest or k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        return False  # not one regular layout: refused rather than guessed at
    return _elements_distinct((*k_cache.shape, 2), (*k_cache.stride(), distance))


def check_writable_caches(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """ValueError unless the new tokens can be written into k_cache and v_cache without one write landing on
    another position (of the same cache or of the other one). Only calls that write (k_new/v_new given) need it:
    an expanded cache is fine to read."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        # Shapes and strides only: O(1), no synchronisation; a contiguous cache (the usual one) is answered at once.
        if not cache.is_contiguous() and not _elements_distinct(cache.shape, cache.stride()):
            raise ValueError(
                f"{name} would be written (k_new/v_new given), but its elements overlap in memory (shape "
                f"{list(cache.shape)}, strides {list(cache.stride())}: a stride 0 from expand(), or a view whose "
                f"positions share memory), so a new token written for one entry or position would change "
                f"another. With k_new/v_new pass a cache whose positions are distinct in memory (for a shared "
                f"prefix, {name}.expand(...).contiguous(), or a paged cache whose entries share read-only "
                f"blocks); an expanded cache is accepted without k_new/v_new (reads only)")
    if not _caches_disjoint(k_cache, v_cache):
        raise ValueError(
            "k_cache and v_cache share memory (the same tensor, or overlapping views of one buffer), so writing "
            "k_new and then v_new would overwrite one with the other. With k_new/v_new pass caches whose elements "
            "are distinct (separate tensors, or disjoint views such as kv[0] and kv[1] or kv[..., 0, :] and "
            "kv[..., 1, :]); one tensor for both is accepted without k_new/v_new (reads only)")


def detached_sources(sources: Sequence[Optional[torch.Tensor]], caches: Sequence[torch.Tensor]) -> list:
    """``sources`` (q, k_new, v_new) with each one that shares memory with a cache replaced by a copy, so that
    what the call writes never changes what it still reads (v_new a view of k_cache, read after k_new is
    written; q a view of the positions the write lands on). Others are returned as they are, without a copy."""
    # Storages first: sources in allocations of their own (the usual case) cost a few attribute reads per step.
    storages = [_storage_range(cache) for cache in caches]
    copies = []
    for t in sources:
        if t is not None:
            own = _storage_range(t)
            if any(_ranges_meet(own, storage) and _share_memory(t, cache)
                   for cache, storage in zip(caches, storages)):
                t = t.clone()
        copies.append(t)
    return copies


def check_table_values(block_table: torch.Tensor, cache_seqlens: torch.Tensor, appended: int, blocks: int,
                       block_size: int) -> None:
    """ValueError for a block table whose used entries (those that hold each entry's first cache_seqlens[b] +
    appended positions) name blocks outside [0, blocks), or, when new tokens are appended, for a block that a
    write lands in and that the table uses anywhere else (another entry, or the same entry at another column):
    the write would change what that position reads. Blocks no write lands in may be shared (a read-only prefix).

    Reads the table and the lengths back (a device synchronisation on a GPU): ``check_values`` only.
    """
    table = block_table.to("cpu", torch.int64)
    start = cache_seqlens.to("cpu", torch.int64)
    total = start + appended
    first_position = torch.arange(table.shape[1]) * block_size  # of each column's block
    rows_read = (total[:, None] - first_position).clamp(0, block_size)  # rows of each block the entry holds
    used = rows_read > 0
    outside = used & ((table < 0) | (table >= blocks))
    if bool(outside.any()):
        b = int(outside.any(1).nonzero()[0])
        names = table[b][used[b]].tolist()
        raise ValueError(f"block_table[{b}] names blocks outside [0, {blocks}) among the {len(names)} that hold "
                         f"its {int(total[b])} positions: {names}")
    if not appended:
        return
    # A column is written when its rows read reach past where the write starts (each entry's last S_q positions).
    written = rows_read > (start[:, None] - first_position).clamp(0, block_size)
    written_blocks = table[written]
    shared = used & torch.isin(table, written_blocks)  # every use of a block some write lands in
    if int(shared.sum()) == written_blocks.unique().numel():
        return  # each written block is used once: by the column that writes it
    owners: dict[int, tuple[int, int]] = {}
    for b, j in sorted(shared.nonzero().tolist(), key=lambda bj: not bool(written[bj[0], bj[1]])):
        block = int(table[b, j])
        if block not in owners:
            owners[block] = (b, j)
            continue
        (wb, wj), (ob, oj) = owners[block], (b, j)
        lo, hi = int(start[wb]), int(total[wb]) - 1
        other = "the same entry" if ob == wb else f"entry {ob}"
        raise ValueError(
            f"block_table[{wb}, {wj}] = block {block} receives entry {wb}'s new tokens (k_new/v_new, positions "
            f"{lo}..{hi}), but block_table[{ob}, {oj}] names the same block, used by {other} for positions "
            f"{oj * block_size}..{min(int(total[ob]), (oj + 1) * block_size) - 1}, so the write would change what "
            f"{other} reads there. A block that new tokens are written into must appear once among the used "
            f"entries of the table (the blocks holding each entry's first cache_seqlens[b] + S_q positions); "
            f"blocks that no write lands in may be shared by several entries (a read-only prefix)")
    raise AssertionError("unreachable: a written block used twice was not found")  # pragma: no cover
