"""``attention_with_kvcache``: decoding and chunked prefill against a KV cache filled to a length per batch entry.

The queries are the last S_q positions of each entry's sequence: entry b holds ``cache_seqlens[b]`` cached tokens
(plus the S_q new ones when ``k_new``/``v_new`` are given, written into the cache first), and query i sits at
position ``n_b - S_q + i`` of its ``n_b`` keys, seeing the keys up to its own position. The kernel takes that as its
causal mode aligned to each key length (``CAUSAL == 3``, ``kernels/attention_common``) with the lengths as key
lengths: no mask is built, the cache is read in place and nothing past an entry's length is touched. The SDPA path
builds the equivalent [B, 1, S_q, S_max] mask or bias. A paged cache ([blocks, H_kv, block size, D] with a block
table) is read by the kernel through the table (``PAGE_SIZE``); the SDPA path gathers it first. An fp8 (e4m3)
cache with a scale per kv head is read in place by the decoding kernel; the other paths run on its dequantized
copy (``kvcache_fp8``). Forward only.
Under torch.compile the call is one custom op that declares the caches mutated. Imports ``problem``,
``plan``, ``triton``, ``api``, ``kvcache_writes`` (what a write into a cache needs), ``kvcache_fp8`` and
``flashlite.dispatch``.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from flashlite import _direct_launch
from flashlite.attn import plan as plans
from flashlite.attn.api import attention
from flashlite.attn.triton import launch_forward
from flashlite.attn.plan import Plan
from flashlite.attn.decide import decide
from flashlite.dispatch import Decision
from flashlite.attn.kvcache_fp8 import check_scale_values, check_scales, dequantized, is_fp8, quantized
from flashlite.attn.kvcache_writes import check_table_values, check_writable_caches, detached_sources
from flashlite.attn.problem import (_TRITON_ERROR, CAUSAL_KEY_LENGTH, Problem, check_block_table,
                                    check_cache_args, check_lengths, validate, value_checks_asked)

if _TRITON_ERROR is None:  # without Triton every call is decided for SDPA before the kernels are reached
    from flashlite.kernels.attention_decode_launch import decode_layout


# Split-KV shares per query block: the merge unrolls one load per share.
MAX_SPLITS = 64
# num_splits=None: SPLITS_LONG shares for caches of at least SPLIT_MIN_KEYS positions, none below. The split-KV
# tournament (H200, 2026-12-01, B=32 H=32 H_kv=8 D=128 bf16, tests/perf/test_kvcache_ab.py,
# benchmarks/results/h200-2026-12-01-session5/run2_gluon_step3_split_profile/split at commit 8ca4529) ranked, against
# 1, 2, 4 and 8
# shares: at 131,072 positions 8 first (1.152x over unsplit, contiguous; 1.076x paged); at 16,384 2 first
# contiguous (8 within 0.6%, a tie) and 8 first paged (unsplit a tie, 0.9% behind); at 4,096 unsplit first
# (1.05-1.14x ahead). This rule is within 0.6% of the best at every point measured.
SPLIT_MIN_KEYS = 16384
SPLITS_LONG = 8


def default_splits(capacity: int) -> int:
    """The split-KV shares ``num_splits=None`` gives a cache of ``capacity`` positions per entry (the measured rule).

    Example:
        >>> default_splits(4096), default_splits(131072)
        (1, 8)
    """
    return SPLITS_LONG if capacity >= SPLIT_MIN_KEYS else 1


def _virtual_cache(cache: torch.Tensor, batch: int, capacity: int, dtype: torch.dtype) -> torch.Tensor:
    """A [B, H_kv, capacity, D] view (stride 0, no copy) of ``dtype`` that stands for a paged cache, or for an fp8
    cache (validated as the cache in q's dtype that the kernels and SDPA read), in validation."""
    if cache.dtype != dtype:
        cache = torch.empty((1, cache.shape[1], 1, cache.shape[3]), dtype=dtype, device=cache.device)
    return cache[:1, :, :1].expand(batch, cache.shape[1], capacity, cache.shape[3])


def _gathered(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """A paged cache's entries as a contiguous [B, H_kv, max blocks * block size, D] copy (the SDPA path). Table
    entries past an entry's length may be anything: they are clamped, and the positions they give are masked."""
    blocks = cache[block_table.clamp(0, cache.shape[0] - 1).long()]  # [B, max blocks, H_kv, block size, D]
    batch, count, heads, size, dim = blocks.shape
    return blocks.permute(0, 2, 1, 3, 4).reshape(batch, heads, count * size, dim)


def _append(cache: torch.Tensor, new: torch.Tensor, cache_seqlens: torch.Tensor,
            block_table: Optional[torch.Tensor]) -> None:
    """Write new [B, H_kv, S_q, D] into the cache at positions cache_seqlens[b] + i, in place, on the device (no
    synchronisation): cache [B, H_kv, S_max, D], or paged [blocks, H_kv, block size, D] through ``block_table``."""
    batch, _, seq_new, _ = new.shape
    positions = cache_seqlens.long()[:, None] + torch.arange(seq_new, device=cache.device)[None, :]
    if block_table is None:
        rows = torch.arange(batch, device=cache.device)[:, None].expand(batch, seq_new)
    else:
        size = cache.shape[2]
        rows = block_table.long().gather(1, positions // size)
        positions = positions % size
    cache.transpose(1, 2).index_put_((rows, positions), new.transpose(1, 2))


def _sdpa_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
                  scale: Optional[float], window: Optional[tuple[int, int]], softcap: Optional[float],
                  alibi_slopes: Optional[torch.Tensor]) -> torch.Tensor:
    """The same call on SDPA: a bool mask [B, 1, S_q, S_max] of the visible keys (not past the entry's length,
    nor past the query's own position, nor outside the window), or with ALiBi a float bias [B or 1, H, S_q, S_max]
    of the distances per entry with -inf where a key is hidden."""
    seq_q, capacity = q.shape[2], k_cache.shape[2]
    rows = (lengths.long()[:, None] - seq_q + torch.arange(seq_q, device=q.device)[None, :])[:, :, None]  # i'
    keys = torch.arange(capacity, device=q.device)[None, None, :]
    visible = (keys <= rows) & (keys < lengths.long()[:, None, None])
    if window is not None and window[0] >= 0:  # the right side: closed by the causal rule
        visible &= keys >= rows - window[0]
    if alibi_slopes is None:  # a bool mask: a float32 one would make a half-precision call run in float32
        bias = visible[:, None]
    else:
        slopes = alibi_slopes if alibi_slopes.dim() == 2 else alibi_slopes[None]
        bias = -slopes[:, :, None, None] * (rows - keys).abs()[:, None].to(torch.float32)
        bias = bias.masked_fill(~visible[:, None], float("-inf"))
    # The lengths again as key_lengths: what lies past them (a cache filled past its end) never reaches the output.
    return attention(q, k_cache, v_cache, attn_mask=bias, key_lengths=lengths, scale=scale, softcap=softcap,
                     backend="sdpa")


def attention_with_kvcache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           cache_seqlens: torch.Tensor, *, k_new: Optional[torch.Tensor] = None,
                           v_new: Optional[torch.Tensor] = None, block_table: Optional[torch.Tensor] = None,
                           scale: Optional[float] = None, window: Optional[tuple[int, int]] = None,
                           softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None,
                           backend: str = "auto", check_values: Optional[bool] = None,
                           num_splits: Optional[int] = None, k_scale: Optional[torch.Tensor] = None,
                           v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of the newest S_q positions of each batch entry against its KV cache (decoding: S_q = 1).

    Args:
        q: [B, H, S_q, D]; k_cache, v_cache: [B, H_kv, S_max, D] (H a multiple of H_kv), any strides. A cache
            that is read only may share memory between entries (an expanded shared prefix, ``expand(B, ...)``) or
            be one tensor for both; one that k_new/v_new are written into may not: ValueError for a cache whose
            elements overlap in memory (a stride 0, a self-overlapping view) or for k_cache and v_cache that
            overlap each other, since a write would change other positions. (Under torch.compile the graph's op
            checks this when it runs; an expanded cache is refused first by torch's own RuntimeError, "more than
            one element of the written-to tensor refers to a single memory location".)
        cache_seqlens: int32 [B], the tokens already in each entry's cache.
        k_new, v_new: [B, H_kv, S_q, D], or None. When given they are written into the caches at positions
            ``cache_seqlens[b] .. cache_seqlens[b] + S_q - 1`` before attending (the caches are modified in place;
            ``cache_seqlens`` is not). The keys of entry b are then its first ``cache_seqlens[b] + S_q``
            positions, else its first ``cache_seqlens[b]``; query i sits at the last S_q of them. q, k_new and
            v_new may be views of the caches: they are read as they were before the write (copied when they
            share memory with a cache).
        block_table: int32 [B, max blocks], any strides, for a paged cache: k_cache and v_cache are then
            [blocks, H_kv, block size, D] (block size a multiple of 16), and position j of entry b lives at row
            j % block size of block ``block_table[b, j // block size]``. Entries past an entry's length are never
            read. Entries may share blocks that no write lands in (a read-only prefix); a block that k_new/v_new
            are written into must belong to one entry at one column (see check_values).
        scale, softcap, alibi_slopes: as in ``flashlite.attention``, with i' the query's own position.
        window: (left, right) as in ``flashlite.attention``; the right side is always closed by the causal rule.
        backend: "auto" (``flashlite.dispatch``: the table's entry for "kvcache" or "kvcache_paged", else the
            kernel where it can run on CUDA; SDPA with the equivalent mask otherwise), "triton" or "sdpa".
        check_values: check cache_seqlens (>= 0, no overflow of S_max) and the block table's used entries (within
            [0, blocks); with k_new/v_new, every block a write lands in used by no other entry and by no other
            column of its own entry, else the write would change what that position reads). Default: on for CPU
            tensors; on CUDA off, since reading them synchronises the device, unless FLASHLITE_CHECK_VALUES=1.
            Unchecked, these values are the caller's responsibility: an overflowing write is an out-of-range
            index on the device, and a write into a shared block silently changes what the other entries read.
            Under torch.compile the graph's op checks them by the same rule each time it runs.
        num_splits: split-KV for the kernel, 1 to 64: each entry's keys are shared out over this many programs
            (whole key blocks each), whose float32 partial results a second kernel merges. More programs fill
            the GPU when B * H_kv is small against its SMs and each cache is short; the partials cost
            num_splits * B * H * S_q * (D + 1) floats. 1: no split. None (the default): on the decoding kernel
            (up to 8 queries per entry, no ALiBi) its own rule, ``choose_splits`` (enough programs for twice the
            SMs, at least 512 keys each); on the general kernel 8 for caches of at least 16,384 positions per entry
            (S_max, or the block table's blocks times the block size), else 1 (``default_splits``, measured on an
            H200). Ignored by SDPA.
        k_scale, v_scale: for an fp8 cache (k_cache and v_cache of dtype ``torch.float8_e4m3fn``, q in float16,
            bfloat16 or float32): float32 [H_kv] on q's device, both given, none for a cache in q's dtype. Key
            position j of kv head g is ``k_cache[..., g, j, :].float() * k_scale[g]``, likewise for values.
            k_new/v_new then come in q's dtype and are stored as ``new / scale`` per kv head, clamped to e4m3's
            range [-448, 448] (a larger value saturates, never NaN) and rounded to e4m3. The decoding kernel
            reads the fp8 cache in place; SDPA and the general forward kernel (ALiBi, more than 8 queries, also
            under backend="triton") run on a dequantized copy of the whole cache in q's dtype, the decision's
            reason saying so. Checked as the lengths are (``check_values``): finite and > 0. Other fp8 dtypes
            (e5m2, the fnuz ones) are refused. The cost in accuracy is the e4m3 rounding of the cache: 3 mantissa
            bits, a relative error up to 1/16 per element.

    Returns:
        [B, H, S_q, D] in q's dtype. Forward only: calls that need a gradient are refused. Under torch.compile
        the call is one opaque custom op, ``flashlite::attention_with_kvcache``, that declares the caches mutated.

    Example:
        >>> q = torch.randn(2, 4, 1, 16)
        >>> k_cache, v_cache = torch.zeros(2, 2, 8, 16), torch.zeros(2, 2, 8, 16)
        >>> lengths = torch.tensor([3, 0], dtype=torch.int32)
        >>> k_new, v_new = torch.randn(2, 2, 1, 16), torch.randn(2, 2, 1, 16)
        >>> out = attention_with_kvcache(q, k_cache, v_cache, lengths, k_new=k_new, v_new=v_new, backend="sdpa")
        >>> out.shape, torch.equal(k_cache[0, :, 3], k_new[0, :, 0])
        (torch.Size([2, 4, 1, 16]), True)

        An fp8 cache, its new tokens stored as ``new / scale`` in e4m3:

        >>> k8, v8 = (torch.zeros(2, 2, 8, 16, dtype=torch.float8_e4m3fn) for _ in range(2))
        >>> k_scale, v_scale = torch.tensor([0.01, 0.02]), torch.tensor([0.02, 0.01])
        >>> out = attention_with_kvcache(q, k8, v8, lengths, k_new=k_new, v_new=v_new, k_scale=k_scale,
        ...                              v_scale=v_scale, backend="sdpa")
        >>> stored = (k_new[0, :, 0] / k_scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
        >>> torch.equal(k8[0, :, 3].float(), stored.float())
        True
    """
    compiling = torch.compiler.is_compiling()
    key = None if compiling else _plan_key(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale,
                                           window, softcap, alibi_slopes, backend, num_splits, k_scale, v_scale)
    plan = None if key is None else plans._PLANS.get(key)
    new_plan = plan is None
    if new_plan:
        plan = _make_plan(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, scale, window, softcap,
                          alibi_slopes, backend, num_splits, k_scale, v_scale)
    # Every call pays this check: the three tensors every call has are read directly, the optional ones only when
    # given (a generator over all seven cost about a microsecond more per decoding step).
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad or any(
            t is not None and t.requires_grad for t in (k_new, v_new, k_scale, v_scale))):
        raise ValueError("attention_with_kvcache is forward only (decoding); call it under torch.no_grad() or "
                         "pass tensors that do not require grad")
    if compiling:  # validated and decided at trace time; the graph holds the opaque op
        # check_values goes into the op, which checks the values when it runs: traced tensors have none to read, and
        # without the check a negative length silently wrote the new tokens at the cache's last position and an
        # overflow became an IndexError, where the eager call names both (CPU tensors, or check_values=True).
        p = plan.problem
        return attention_with_kvcache_op(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes,
                                         p.scale, p.window_left, p.window_right, p.softcap,
                                         plan.decision.backend == "triton", p.key_splits, check_values, k_scale,
                                         v_scale)
    if new_plan:
        plan = plans.keep(key, plan)
    # Per call: what depends on the tensors' addresses or values, never on the signature the plan was made for.
    appended = 0 if k_new is None else q.shape[2]
    if k_new is not None:
        check_writable_caches(k_cache, v_cache)
    if value_checks_asked(check_values, cache_seqlens):  # value_checks_wanted's rule: not compiling, known here
        check_lengths(cache_seqlens, appended, _capacity(k_cache, block_table))
        if block_table is not None:
            check_table_values(block_table, cache_seqlens, appended, k_cache.shape[0], k_cache.shape[2])
        if k_scale is not None:
            check_scale_values(k_scale, v_scale)
    lengths = cache_seqlens + appended if appended else cache_seqlens
    if k_new is not None:
        # Read before anything is written: a source that is a view of a cache (v_new of k_cache's positions, q of
        # the positions the write lands on) would otherwise be read after the write changed it.
        q, k_new, v_new = detached_sources((q, k_new, v_new), (k_cache, v_cache))
        if k_scale is not None:  # tokens in q's dtype, stored as the fp8 cache holds them
            k_new, v_new = quantized(k_new, k_scale), quantized(v_new, v_scale)
        _append(k_cache, k_new, cache_seqlens, block_table)
        _append(v_cache, v_new, cache_seqlens, block_table)
    problem = plan.problem
    if plan.decision.backend == "sdpa":
        if block_table is not None:
            k_cache, v_cache = _gathered(k_cache, block_table), _gathered(v_cache, block_table)
        if k_scale is not None:  # SDPA reads no fp8: the (gathered) cache dequantized into q's dtype
            k_cache, v_cache = dequantized(k_cache, k_scale, q.dtype), dequantized(v_cache, v_scale, q.dtype)
        return _sdpa_kvcache(q, k_cache, v_cache, lengths, scale, window, softcap, alibi_slopes)
    if "decode" in plan.layouts or decode_kernel_serves(problem):  # a layout: a plan the decoding kernel ran
        # One program per (entry, kv head, share) reads each K/V tile once for the group's query heads; lengths and
        # the table stay on the device (no host read), so the call is capturable in a CUDA graph.
        return _decode(plan, q, k_cache, v_cache, lengths, block_table, num_splits, k_scale, v_scale)
    if k_scale is not None:  # the general kernel reads no fp8: a dequantized copy (every block of a paged pool)
        k_cache, v_cache = dequantized(k_cache, k_scale, q.dtype), dequantized(v_cache, v_scale, q.dtype)
    if block_table is not None and block_table.shape[1] > 1 and block_table.stride(1) != 1:
        # The kernel takes the table's row stride only and walks a row at unit column stride: a table whose
        # columns are not adjacent (transposed, or every other column of a wider one) would name other blocks.
        block_table = block_table.contiguous()  # [B, max blocks] int32: small
    return launch_forward(q, k_cache, v_cache, lengths, alibi_slopes, plan, need_lse=False,
                          block_table=block_table)[0]


def _capacity(k_cache: torch.Tensor, block_table: Optional[torch.Tensor]) -> int:
    """The positions each entry's cache holds: S_max, or the table's blocks times the block size."""
    return k_cache.shape[2] if block_table is None else block_table.shape[1] * k_cache.shape[2]


def _plan_key(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
              k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
              scale: Optional[float], window: Optional[tuple[int, int]], softcap: Optional[float],
              alibi_slopes: Optional[torch.Tensor], backend: str, num_splits: Optional[int],
              k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
              ) -> Optional[plans.PlanKey]:
    """The plan key of a cache call, the plan cache's "kvcache" entry (``plans.key_of``, so never equal to an
    ``attention()`` key): every tensor's shape, strides, dtype and device, and the other arguments with their
    classes (validation refuses scale=True, which equals 1); not the values of cache_seqlens, the block table or
    the fp8 scales, which are data of each call (the caches' dtypes and the scales' layouts are keyed, so a plan
    never serves both an fp8 and a q-dtype cache). None where the arguments cannot be keyed (not hashable):
    validation then names them.

    Example:
        >>> q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 32, 16)
        >>> lengths = torch.tensor([5], dtype=torch.int32)
        >>> call = (None, None, None, None, None, None, None, "auto", None)
        >>> _plan_key(q, k, k, lengths, *call) == _plan_key(q, k, k, lengths + 9, *call)
        True
    """
    return plans.key_of("kvcache", q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes, scale,
                        window, softcap, backend, num_splits, k_scale, v_scale)


def _make_plan(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
               k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
               scale: Optional[float], window: Optional[tuple[int, int]], softcap: Optional[float],
               alibi_slopes: Optional[torch.Tensor], backend: str, num_splits: Optional[int],
               k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]) -> Plan:
    """Validate and decide a cache call: a plan whose problem is the one the kernels launch (causal to each key
    length, the page size, the split-KV shares). The Gluon kernels take no cache calls: gluon and gluon_bwd stay
    False. An fp8 cache is validated and decided as the cache in q's dtype that it stands for."""
    check_scales(q, k_cache, v_cache, k_scale, v_scale)
    check_cache_args(q, k_cache, v_cache, cache_seqlens, k_new, v_new)
    if num_splits is not None and (isinstance(num_splits, bool) or not isinstance(num_splits, int)
                                   or not 1 <= num_splits <= MAX_SPLITS):
        raise ValueError(f"num_splits must be None or an integer from 1 to {MAX_SPLITS}, got {num_splits!r}")
    capacity = k_cache.shape[2] if block_table is None else check_block_table(q, k_cache, v_cache, block_table)
    appended = 0 if k_new is None else q.shape[2]
    lengths = cache_seqlens + appended if appended else cache_seqlens
    keys, values = (k_cache, v_cache) if block_table is None and not is_fp8(k_cache) else (
        _virtual_cache(k_cache, q.shape[0], capacity, q.dtype),
        _virtual_cache(v_cache, q.shape[0], capacity, q.dtype))
    problem = validate(q, keys, values, "lower_right", scale, None, lengths, backend, None, window, softcap,
                       alibi_slopes)
    # "auto": the table's entry for the cache's kind at (B, S_max), else the kernel where it can run on CUDA.
    decision = decide(q, keys, values, None, problem, backend,
                      variant="kvcache" if block_table is None else "kvcache_paged")
    # The kernel's causal mode aligned to each key length: query i sees keys j <= i + n_b - S_q.
    page_size = 0 if block_table is None else k_cache.shape[2]
    launched = dataclasses.replace(problem, causal_mode=CAUSAL_KEY_LENGTH, page_size=page_size,
                                   key_splits=default_splits(capacity) if num_splits is None else num_splits)
    if is_fp8(k_cache):
        decision = dataclasses.replace(decision, reason=f"{decision.reason}; {_fp8_path(decision, launched)}")
    return Plan(launched, decision, record=decision.backend == "triton" and plans.records_launches(q))


def _fp8_path(decision: Decision, problem: Problem) -> str:
    """How a decided call reads its fp8 cache, for the decision's reason."""
    if decision.backend == "sdpa":
        return "fp8 cache: dequantized for SDPA"
    if decode_kernel_serves(problem):
        return "fp8 cache: read in place by the decoding kernel"
    return "fp8 cache: dequantized for the general forward kernel (ALiBi or more than 8 queries)"


def _decode(plan: Plan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, lengths: torch.Tensor,
            block_table: Optional[torch.Tensor], requested_splits: Optional[int],
            k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A call on the decoding kernel. Its layout (grids, scalars, buffer shapes: ``decode_layout``) is derived once
    per plan; a recording plan records each launch at its first call and later replays it with the call's
    tensors (Triton's argument binding skipped), so a replayed call allocates its output and binds its tensors,
    nothing else: lengths and the block table are tensor arguments, data of the call; everything else the launch
    takes (strides, grid, scale, splits) is fixed by the plan's key. An fp8 cache's scales are tensors of the
    call too; the layout reads the cache in place (DEQUANT) since the cache's dtype is not q's."""
    layout = plan.layouts.get("decode")
    if layout is None:
        p = plan.problem
        layout = plan.layouts["decode"] = decode_layout(
            q, k_cache, v_cache, lengths, block_table=block_table, scale=p.scale, softcap=p.softcap or None,
            window_left=p.window_left, num_splits=requested_splits)
    out, _, tensors = layout.bind(q, k_cache, v_cache, lengths, block_table, k_scale, v_scale)
    launches = None  # built only where a launch is not replayed
    for site, site_tensors in enumerate(tensors):
        recorded = plan.recorded.get(site)
        if recorded is not None and recorded.launch(*site_tensors):
            continue
        launches = launches or layout.launches(tensors)
        launch = launches[site]
        if plan.record and site not in plan.recorded:
            plan.recorded[site] = _direct_launch.record(launch.kernel, launch.grid, launch.args, launch.kwargs,
                                                        launch.n_tensors)
        else:
            launch()
    return out


# The decoding kernel (kernels/attention_decode.py) holds group size x S_q query rows per program; ALiBi and
# longer query chunks (chunked prefill) stay on the general forward kernel.
DECODE_MAX_QUERIES = 8
DECODE_MAX_ROWS = 64


def decode_kernel_serves(problem) -> bool:
    """Whether ``attention_with_kvcache`` runs ``problem`` on the decoding kernel (else the general forward kernel).

    Example:
        >>> import torch
        >>> from flashlite.attn.problem import validate
        >>> q, k = torch.randn(2, 8, 1, 64), torch.randn(2, 2, 40, 64)
        >>> p = validate(q, k, k, "lower_right", None, None, torch.tensor([40, 9], dtype=torch.int32), "auto",
        ...              None, None, None, None)
        >>> decode_kernel_serves(p)
        True
    """
    return (problem.alibi == "none" and problem.seq_q <= DECODE_MAX_QUERIES
            and problem.seq_q * problem.group_size <= DECODE_MAX_ROWS and problem.head_dim <= 256)


@torch.library.custom_op("flashlite::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def attention_with_kvcache_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              cache_seqlens: torch.Tensor, k_new: Optional[torch.Tensor],
                              v_new: Optional[torch.Tensor], block_table: Optional[torch.Tensor],
                              alibi_slopes: Optional[torch.Tensor], scale: float, window_left: int,
                              window_right: int, softcap: float, use_kernel: bool, num_splits: int = 1,
                              check_values: Optional[bool] = None, k_scale: Optional[torch.Tensor] = None,
                              v_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A KV-cache call as one opaque op for torch.compile'd graphs, the caches declared as mutated (the new tokens
    are written into them). Its arguments were validated when the graph was traced, but not the values of
    cache_seqlens and the block table: they are checked here, per call, as ``check_values`` says (the eager call's
    rule: None checks CPU tensors; the fp8 scales' values likewise); ``softcap`` 0.0 is off."""
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    return attention_with_kvcache(q, k_cache, v_cache, cache_seqlens, k_new=k_new, v_new=v_new,
                                  block_table=block_table, scale=scale, window=window, softcap=softcap or None,
                                  alibi_slopes=alibi_slopes, backend="triton" if use_kernel else "sdpa",
                                  check_values=check_values, num_splits=num_splits, k_scale=k_scale,
                                  v_scale=v_scale)


@attention_with_kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k_new, v_new, block_table, alibi_slopes, scale, window_left,
                  window_right, softcap, use_kernel, num_splits=1, check_values=None, k_scale=None, v_scale=None):
    return q.new_empty(q.shape)
