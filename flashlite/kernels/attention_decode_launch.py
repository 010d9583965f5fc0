"""Launcher of the decoding kernels (``attention_decode``): the split rule, the tile choice, and the launch.

No validation: the caller (``attention_with_kvcache``) has checked shapes, dtypes, devices and values. The launch
allocates the output (and the split-KV partials) and starts one or two kernels; nothing is read back from the
device, so a call with new ``cache_seqlens`` costs no synchronisation and the call can be captured in a CUDA graph.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Optional, Union

import torch
import triton

from flashlite.kernels.attention_decode import _decode_merge, _decode_split

LOG2E = 1.4426950408889634


@dataclasses.dataclass(frozen=True)
class SplitRule:
    """How many shares each entry's keys are cut into when ``num_splits`` is None.

    The constants are a first guess from the hardware's shape, NOT measurements: they must be re-derived from the
    ``num_splits`` sweep of ``tools/decode_bench.py`` on an H100/H200. The reasoning: one program per (entry, kv
    head, share) must give every SM a few programs to hide memory latency (``programs_per_sm``), but a share too
    short costs more in its fixed part (the query load, the partial's store, the merge) than it streams
    (``min_keys_per_split``).
    """
    programs_per_sm: float = 2.0  # programs wanted per SM
    min_keys_per_split: int = 512  # fewest cache positions a share should stream
    max_splits: int = 64  # at most this many shares (the merge loads them all at once)
    sm_count_without_gpu: int = 132  # an H100/H200, for a CPU (interpreter) call


SPLIT_RULE = SplitRule()


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """The kernel's tile and launch options. ``use_dot``: tensor-core products (rows padded to 16) or a broadcast
    multiply and sum on the CUDA cores (rows padded to a power of two), which holds a [rows, block_n, D] float32
    product in registers: meant for at most 8 rows (at D = 128 and 4 warps, block_n 32 compiles without spills
    for 4 rows, 64 spills). Also a first guess to re-derive on a GPU."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = True
    fused_merge: bool = False  # the last share of each (entry, kv head) merges: no second launch (see _arrivals)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return SPLIT_RULE.sm_count_without_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count


_ARRIVALS: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, pairs: int) -> torch.Tensor:
    """The fused merge's arrival counters, int32 [pairs], zero: one buffer per device, kept (every call leaves it
    zero again), so a call costs no memset and a captured graph replays with the buffer it was captured with.
    Calls in flight on two streams at once would share it: the fused merge is for one stream (decoding's case)."""
    counters = _ARRIVALS.get(device)
    if counters is None or counters.numel() < pairs:
        counters = _ARRIVALS[device] = torch.zeros(max(pairs, 1024), dtype=torch.int32, device=device)
    return counters


def choose_splits(batch: int, kv_heads: int, capacity: int, sm_count: int, rule: SplitRule = SPLIT_RULE) -> int:
    """Shares per entry: enough that ``batch * kv_heads * splits`` reaches ``programs_per_sm * sm_count``, none
    shorter than ``min_keys_per_split`` positions of the cache's capacity, at most ``max_splits``. From shapes only
    (the capacity, not the lengths), so that lengths stay data.

    Example:
        >>> choose_splits(1, 8, 32768, 132), choose_splits(64, 8, 2048, 132), choose_splits(16, 8, 32768, 132)
        (33, 1, 3)
    """
    wanted = math.ceil(rule.programs_per_sm * sm_count / max(1, batch * kv_heads))
    longest = max(1, capacity // rule.min_keys_per_split)
    return max(1, min(wanted, longest, rule.max_splits))


def default_config(head_dim: int, rows: int, dtype: torch.dtype) -> DecodeConfig:
    """The tile for a head dim, a row count (GROUP * S_q) and a dtype: 64 keys per tile up to D = 128, 32 above
    (registers: a [rows, 64, D] float32 product on the CUDA cores, or two [64, D] tiles in flight per stage)."""
    wide = head_dim > 128 or dtype == torch.float32
    return DecodeConfig(block_n=32 if wide else 64, num_warps=4, num_stages=3 if not wide else 2, use_dot=True)


@dataclasses.dataclass(frozen=True)
class KernelLaunch:
    """One launch, ``kernel[grid](*args, **kwargs)``; its first ``n_tensors`` arguments are the tensors."""
    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict
    n_tensors: int

    def __call__(self) -> Any:
        return self.kernel[self.grid](*self.args, **self.kwargs)


@dataclasses.dataclass(frozen=True)
class DecodeCall:
    """A prepared decoding call: the output [B, H, S_q, D], the base-2 lse [B, H, S_q] when asked for, and the
    launches (the split kernel, then the merge when there are several shares) that fill them. ``layout``: what
    the launches take that depends on the call's signature only, to bind another call of that signature with."""
    out: torch.Tensor
    lse: Optional[torch.Tensor]
    launches: list[KernelLaunch]
    layout: "DecodeLayout"


@dataclasses.dataclass(frozen=True)
class DecodeLayout:
    """Everything a decoding call's launches take that its signature fixes (shapes, strides, dtypes, scalars, the
    split count, the grids and compile options), so that another call of that signature only allocates its
    buffers and binds its tensors (``bind``): a caller that replays recorded launches skips the rest of
    ``prepare_decode``. The lengths and the block table are tensors of each call: data, never part of a layout.

    Example:
        >>> q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 64, 32)
        >>> layout = prepare_decode(q, k, k, torch.tensor([50], dtype=torch.int32), num_splits=4).layout
        >>> out, lse, tensors = layout.bind(q, k, k, torch.tensor([9], dtype=torch.int32), None, None, None)
        >>> out.shape, [len(t) for t in tensors]
        (torch.Size([1, 4, 1, 32]), [11, 3])
    """
    out_shape: tuple[int, ...]
    out_dtype: torch.dtype
    device: torch.device
    part_shape: Optional[tuple[int, int, int]]  # (shares, rows, D): the partials' float32 outputs; None unsplit
    return_lse: bool
    fused: bool
    arrivals_pairs: int
    split_grid: tuple[int, ...]
    split_scalars: tuple
    split_options: dict
    merge_grid: Optional[tuple[int, ...]]
    merge_scalars: tuple
    merge_options: dict

    def bind(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
             block_table: Optional[torch.Tensor], k_scale: Optional[torch.Tensor], v_scale: Optional[torch.Tensor]
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], list[tuple]]:
        """A new call's buffers and each launch's tensor arguments: (out, lse or None, [split tensors, merge
        tensors]). The tensors must have the signature the layout was made for (the caller's plan key)."""
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        lse = torch.empty(self.out_shape[:3], dtype=torch.float32, device=self.device) if self.return_lse else out
        if self.part_shape is not None:  # one buffer: the outputs [shares, rows, D], then the lse [shares, rows]
            splits, rows, dim = self.part_shape
            parts = torch.empty(splits * rows * (dim + 1), dtype=torch.float32, device=self.device)
        else:
            parts = out  # unused
        table = block_table if block_table is not None else cache_seqlens  # unused when not paged
        arrivals = _arrivals(self.device, self.arrivals_pairs) if self.fused else table
        tensors = [(q, k_cache, v_cache, cache_seqlens, table, table if k_scale is None else k_scale,
                    table if v_scale is None else v_scale, out, lse, parts, arrivals)]
        if self.merge_grid is not None:
            tensors.append((parts, out, lse))
        return out, lse if self.return_lse else None, tensors

    def launches(self, tensors: list[tuple]) -> list[KernelLaunch]:
        """The launches of a bound call (``bind``'s tensors), for Triton's ordinary launch or recording."""
        calls = [KernelLaunch(_decode_split, self.split_grid, tensors[0] + self.split_scalars, self.split_options,
                              n_tensors=len(tensors[0]))]
        if self.merge_grid is not None:
            calls.append(KernelLaunch(_decode_merge, self.merge_grid, tensors[1] + self.merge_scalars,
                                      self.merge_options, n_tensors=len(tensors[1])))
        return calls


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                     block_table: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                     softcap: Optional[float] = None, window_left: int = -1, num_splits: Optional[int] = None,
                     return_lse: bool = False, config: Optional[DecodeConfig] = None,
                     k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None
                     ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """Attention of the last S_q positions of each entry against its cache, one program per (entry, kv head, share).

    Args:
        q: [B, H, S_q, D], any strides; H a multiple of H_kv. S_q small (decoding 1, speculative a few): the
            kernel holds H / H_kv * S_q rows per program.
        k_cache, v_cache: [B, H_kv, S_max, D], or with ``block_table`` paged [blocks, H_kv, block size, D]; any
            strides (a [B, S_max, H_kv, D] cache goes in as its ``transpose(1, 2)`` view).
        cache_seqlens: int32 [B] on q's device: the keys entry b holds (any tokens just written included). Query i
            sees keys ``j < cache_seqlens[b] - S_q + i + 1`` (and with ``window_left`` >= 0 only
            ``j >= cache_seqlens[b] - S_q + i - window_left``); a query that sees none gets zeros.
        block_table: int32 [B, max blocks], any strides: key j of entry b is row j % block size of block
            ``block_table[b, j // block size]``.
        scale: of the scores, default D ** -0.5. softcap: scores become softcap * tanh(scores / softcap).
        num_splits: shares per entry; None: ``choose_splits`` on the cache's capacity (S_max, or max blocks *
            block size) and the GPU's SM count.
        return_lse: also return the natural log-sum-exp [B, H, S_q] float32 (-inf for a query that sees no key).
        config: the tile (``DecodeConfig``); None: ``default_config``.
        k_scale, v_scale: float32 [H_kv] on q's device, for a cache of another dtype than q (fp8 e4m3,
            ``torch.float8_e4m3fn``): key j of kv head g is ``k_cache[..., g, j, :] * k_scale[g]`` in q's dtype,
            likewise for values. None for a cache in q's dtype.

    Returns:
        out [B, H, S_q, D] contiguous in q's dtype, or (out, lse) with ``return_lse``.

    Example:
        >>> q = torch.randn(2, 8, 1, 64)
        >>> k, v = torch.randn(2, 2, 40, 64), torch.randn(2, 2, 40, 64)
        >>> decode_attention(q, k, v, torch.tensor([40, 7], dtype=torch.int32), num_splits=2).shape
        torch.Size([2, 8, 1, 64])
    """
    call = prepare_decode(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale, softcap=softcap,
                          window_left=window_left, num_splits=num_splits, return_lse=return_lse, config=config,
                          k_scale=k_scale, v_scale=v_scale)
    for launch in call.launches:
        launch()
    if return_lse:
        return call.out, call.lse * (1.0 / LOG2E)
    return call.out


def prepare_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                   block_table: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                   softcap: Optional[float] = None, window_left: int = -1, num_splits: Optional[int] = None,
                   return_lse: bool = False, config: Optional[DecodeConfig] = None,
                   k_scale: Optional[torch.Tensor] = None, v_scale: Optional[torch.Tensor] = None) -> DecodeCall:
    """``decode_attention``'s output buffers and kernel launches, allocated and built but not launched (the
    arguments as there). A caller that replays launches (``flashlite._direct_launch.record`` on each
    ``KernelLaunch``, then ``launch(*launch.args[:launch.n_tensors])``) or captures them in a CUDA graph keeps
    ``out`` and the launches; new lengths are written into ``cache_seqlens`` in place.

    Example:
        >>> q, k = torch.randn(1, 4, 1, 32), torch.randn(1, 2, 64, 32)
        >>> call = prepare_decode(q, k, k, torch.tensor([50], dtype=torch.int32), num_splits=4)
        >>> [launch.kernel.__name__ for launch in call.launches], call.out.shape
        (['_decode_split', '_decode_merge'], torch.Size([1, 4, 1, 32]))
    """
    layout = decode_layout(q, k_cache, v_cache, cache_seqlens, block_table=block_table, scale=scale,
                           softcap=softcap, window_left=window_left, num_splits=num_splits, return_lse=return_lse,
                           config=config)
    out, lse, tensors = layout.bind(q, k_cache, v_cache, cache_seqlens, block_table, k_scale, v_scale)
    return DecodeCall(out, lse, layout.launches(tensors), layout)


def decode_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor, *,
                  block_table: Optional[torch.Tensor] = None, scale: Optional[float] = None,
                  softcap: Optional[float] = None, window_left: int = -1, num_splits: Optional[int] = None,
                  return_lse: bool = False, config: Optional[DecodeConfig] = None) -> DecodeLayout:
    """The ``DecodeLayout`` of a call (the arguments as in ``decode_attention``): read from the tensors' shapes,
    strides and dtypes only, never their values."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    rows = group * seq_q
    page_size = 0 if block_table is None else k_cache.shape[2]
    capacity = k_cache.shape[2] if block_table is None else block_table.shape[1] * page_size
    if num_splits is None:
        num_splits = choose_splits(batch, kv_heads, capacity, _sm_count(q.device))
    cfg = config or default_config(head_dim, rows, q.dtype)
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_r = max(16 if cfg.use_dot else 1, triton.next_power_of_2(rows))
    out_shape = (batch, heads, seq_q, head_dim)
    out_strides = (heads * seq_q * head_dim, seq_q * head_dim, head_dim, 1)  # torch.empty's: contiguous
    table_strides = block_table.stride() if block_table is not None else (0, 0)
    scale = head_dim ** -0.5 if scale is None else scale
    dequant = k_cache.dtype != q.dtype
    fused = cfg.fused_merge and num_splits > 1
    split_options = dict(
        SEQ_Q=seq_q, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, BLOCK_N=cfg.block_n,
        PAGE_SIZE=page_size, SPLIT=num_splits > 1, USE_DOT=cfg.use_dot, IEEE=q.dtype == torch.float32,
        SOFTCAP=bool(softcap), WINDOW=window_left >= 0, STORE_LSE=return_lse, DEQUANT=dequant,
        FUSED_MERGE=fused, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    split_scalars = (*q.stride(), *k_cache.stride(), *v_cache.stride(), *out_strides, *table_strides,
                     kv_heads, num_splits, scale * LOG2E, (softcap or 1.0) * LOG2E, window_left)
    rows_total = batch * kv_heads * rows
    merged = num_splits > 1 and not fused
    return DecodeLayout(
        out_shape=out_shape, out_dtype=q.dtype, device=q.device,
        part_shape=(num_splits, rows_total, head_dim) if num_splits > 1 else None, return_lse=return_lse,
        fused=fused, arrivals_pairs=batch * kv_heads, split_grid=(batch * kv_heads, num_splits),
        split_scalars=split_scalars, split_options=split_options,
        merge_grid=(rows_total,) if merged else None,
        merge_scalars=(*out_strides, kv_heads, rows_total, num_splits) if merged else (),
        merge_options=dict(SEQ_Q=seq_q, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
                           BLOCK_S=triton.next_power_of_2(num_splits), STORE_LSE=return_lse, num_warps=4)
        if merged else {})
