"""Launch the attention kernels: check what they assume, allocate, build grids and tuning keys, and launch.

The launchers ``attention_forward`` / ``attention_backward`` (public) check their arguments; the ``_launch_*``
functions behind them assume a validated call. A launch takes a forced config, a tuned one (``_TUNED_CONFIGS``) or
the autotuner, and goes through the launch cache ``_LAUNCHES``. Imports ``validation`` only.
"""
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from flashlite import _direct_launch, _runtime
from flashlite._attention.validation import _CAUSAL_ARGUMENT, _TRITON_ERROR, _kernel_unsupported, _validate
from flashlite._intmath import cdiv, next_power_of_2

if _TRITON_ERROR is None:  # without Triton, _kernel_unsupported keeps every call away from these launchers
    import triton

    from flashlite.kernels import attention_bwd as _bwd
    from flashlite.kernels import attention_fwd as _fwd
    from flashlite.kernels import tuning as _tuning

# Grid axis 1 holds batch * heads; past CUDA's cap the kernels use a flattened 1-D grid (a module name, so that tests
# can lower it).
_GRID_AXIS1_LIMIT = _runtime.GRID_AXIS1_LIMIT

# (BLOCK_M, BLOCK_N, num_warps, num_stages), and for the forward kernel optionally BH_PER_PROGRAM fifth
BlockConfig = tuple[int, ...]


def _dot_mode(precision: str) -> str:
    # The interpreter's tl.dot on bf16 operands is broken: round operands to bf16, multiply in fp32 instead.
    if precision == "bf16" and _runtime.interpreting():
        return "bf16_emulated"
    return precision


def _key_mask_args(q: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                   key_lengths: Optional[torch.Tensor]) -> tuple[str, torch.Tensor, torch.Tensor, int, int]:
    """(KEY_MASK mode, mask pointer, lengths pointer, mask strides); unused pointers get a placeholder tensor."""
    if key_padding_mask is not None:
        mask = key_padding_mask.view(torch.uint8)  # same bytes; Triton loads bytes more predictably than i1
        return "bool", mask, q, mask.stride(0), mask.stride(1)
    if key_lengths is not None:
        # The kernels read lengths[b] at offset b: a strided view (lengths[::2]) is copied, [B] elements.
        return "lengths", q, key_lengths.contiguous(), 0, 0
    return "none", q, q, 0, 0


def _check_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                  key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float, precision: str) -> None:
    # The custom ops are public through torch.ops: check what the kernels would otherwise get silently wrong.
    if causal_mode not in _CAUSAL_ARGUMENT:
        raise ValueError(f"causal_mode must be 0, 1 or 2, got {causal_mode}")
    call = _validate(q, k, v, _CAUSAL_ARGUMENT[causal_mode], scale, key_padding_mask, key_lengths, "triton",
                     precision if q.dtype == torch.float32 else None)
    if precision != call.precision:
        raise ValueError(f"precision {precision!r} does not fit {q.dtype} inputs (expected {call.precision!r})")
    reason = _kernel_unsupported(q, k, v, key_padding_mask)
    if reason is not None:
        raise ValueError(f"the Triton kernel cannot run this call: {reason}")


@dataclass(frozen=True)
class _Grid:
    """Grid: sequence blocks on axis 0 (no practical limit), groups of BH_PER_PROGRAM (batch, head) pairs (one
    pair unless the config says more) on axis 1, flattened into axis 0 if batch * heads passes axis 1's limit.
    A frozen dataclass rather than a closure so that it can key a launch cache: equal grids, equal fields."""

    seq: int
    block_key: str
    batch_heads: int

    def __call__(self, meta: dict) -> tuple[int, ...]:
        pair_groups = cdiv(self.batch_heads, meta.get("BH_PER_PROGRAM", 1))
        if self.batch_heads > _GRID_AXIS1_LIMIT:
            return (cdiv(self.seq, meta[self.block_key]) * pair_groups,)
        return (cdiv(self.seq, meta[self.block_key]), pair_groups)


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _config_kwargs(config: "triton.Config") -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


# Configs the autotuner chose, per (autotuned kernel, tuning key). Once a key is tuned, launches go straight to the
# kernel with that config: the autotuner's per-call bookkeeping costs tens of microseconds of host time, as much
# as a whole small kernel.
_TUNED_CONFIGS: dict[tuple, dict] = {}


# Every launch of a known config goes through a cache of recorded launches (flashlite._direct_launch.LaunchCache),
# the backward kernels and autograd calls included: Triton's per-call argument binding costs more host time than a
# small kernel runs. FLASHLITE_LAUNCH_CACHE=0 turns it off (ordinary launches); replayed inference plans record
# their forward launch either way.
_USE_LAUNCH_CACHE = os.environ.get("FLASHLITE_LAUNCH_CACHE", "1") not in ("", "0")
_LAUNCHES = _direct_launch.LaunchCache()


def _launch(autotuned, fixed, config: Optional[BlockConfig], gpu_blocks, prune, q: torch.Tensor, block_d: int,
            grid, tuning_key: tuple, args: tuple, meta: dict, n_tensors: int,
            record: bool = False) -> Optional[_direct_launch.RecordedLaunch]:
    """Launch with a given ``config``; else the config tuned for ``tuning_key`` (tuning it on first use); else,
    with FLASHLITE_AUTOTUNE=0, the first of ``gpu_blocks`` that fits (one compile per shape class, no
    benchmarking). ``n_tensors``: the kernel's leading tensor arguments. With ``record``, a launch of a known config
    is recorded for replay with new tensors (``flashlite._direct_launch``); returns the recording or None."""
    if config is not None:
        if (not isinstance(config, tuple) or len(config) not in (4, 5)
                or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in config)):
            raise ValueError(f"config must be (BLOCK_M, BLOCK_N, num_warps, num_stages[, BH_PER_PROGRAM]) of positive "
                             f"integers, got {config!r}")
        block_m, block_n, num_warps, num_stages, *pairs = config
        if pairs and "BH_PER_PROGRAM" not in getattr(fixed, "arg_names", ("BH_PER_PROGRAM",)):
            raise ValueError(f"config {config!r}: only the forward kernel takes a fifth entry (BH_PER_PROGRAM)")
        forced = {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
                  **({"BH_PER_PROGRAM": pairs[0]} if pairs else {})}
    elif _runtime.interpreting() or os.environ.get("FLASHLITE_AUTOTUNE", "1") not in ("0", ""):
        cache_key = (id(autotuned), *tuning_key)
        forced = _TUNED_CONFIGS.get(cache_key)
        if forced is None:
            autotuned[grid](*args, **meta)
            _TUNED_CONFIGS[cache_key] = _config_kwargs(autotuned.best_config)
            return None
    else:
        forced = _config_kwargs(prune(_tuning.make_configs(gpu_blocks), {"Q": q}, BLOCK_D=block_d)[0])
    if record and not _runtime.interpreting():
        return _direct_launch.record(fixed, grid, args, {**meta, **forced}, n_tensors)
    if _USE_LAUNCH_CACHE and q.is_cuda:
        _LAUNCHES.launch(fixed, grid, args, {**meta, **forced}, n_tensors)
    else:
        fixed[grid](*args, **meta, **forced)
    return None


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                      causal_mode: int, scale: float, precision: str,
                      config: Optional[BlockConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; returns (out [B, H, S_q, D] in q's dtype, base-2 lse [B, H, S_q] float32).

    Inputs are assumed validated as ``attention()`` does. ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages)
    skips autotuning.

    Example:
        >>> q = torch.randn(1, 2, 20, 16)
        >>> out, lse = attention_forward(q, q, q, None, None, 1, 0.25, "ieee")  # doctest: +SKIP
    """
    _check_launch(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision)
    return _launch_forward(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, config)


def _launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                    causal_mode: int, scale: float, precision: str,
                    config: Optional[BlockConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse, _ = _launch_forward_recorded(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                                           config)
    return out, lse


def _launch_inference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                      key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float,
                      precision: str) -> torch.Tensor:
    """The forward output alone: no log-sum-exp is allocated or stored, since no backward pass will read it."""
    return _launch_forward_recorded(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                                    need_lse=False)[0]


# The forward kernel's leading tensor parameters, in order: Q, K, V, Out, Lse, KeyMask, KeyLen.
_FWD_TENSOR_ARGS = 7


def _launch_forward_recorded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                             causal_mode: int, scale: float, precision: str,
                             config: Optional[BlockConfig] = None, record: bool = False, need_lse: bool = True
                             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[_direct_launch.RecordedLaunch]]:
    """(out, lse or None without ``need_lse``, the recorded launch with ``record``). Without ``need_lse`` the
    kernel skips its log-sum-exp store and ``out`` fills the unused pointer slot, so a replay passes
    (q, k, v, out, out, q, q); the mask slots hold q when there are no masks."""
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    # Contiguous [B, H, S_q, D], allocated as replayed plans allocate it (empty_like parses fewer arguments).
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device) if need_lse else None
    key_mask, mask_arg, lengths_arg, stride_mask_b, stride_mask_n = _key_mask_args(q, key_padding_mask,
                                                                                    key_lengths)
    block_d = _block_d(head_dim)
    buckets = _tuning.tuning_buckets(seq_q, seq_k, batch * heads)
    dot = _dot_mode(precision)
    recorded = _launch(_fwd.attn_fwd, _fwd.attn_fwd_fixed, config, _fwd.FWD_GPU_BLOCKS, _fwd.prune_fwd_configs, q,
                       block_d, _Grid(seq_q, "BLOCK_M", batch * heads),
                       (*buckets, head_dim, causal_mode, key_mask, dot, q.dtype, mask_arg.dtype, lengths_arg.dtype),
                       (q, k, v, out, out if lse is None else lse, mask_arg, lengths_arg,
                        *q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_mask_b, stride_mask_n,
                        heads, heads // kv_heads, seq_q, seq_k, scale * math.log2(math.e), batch * heads,
                        *buckets),
                       dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal_mode, KEY_MASK=key_mask, DOT=dot,
                            FLAT_GRID=batch * heads > _GRID_AXIS1_LIMIT, STORE_LSE=need_lse),
                       n_tensors=_FWD_TENSOR_ARGS, record=record)
    return out, lse, recorded


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor,
                       key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                       causal_mode: int, scale: float, precision: str,
                       dkdv_config: Optional[BlockConfig] = None,
                       dq_config: Optional[BlockConfig] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels; returns (dq, dk, dv) shaped and typed like q, k, v.

    Example:
        >>> dq, dk, dv = attention_backward(do, q, k, v, out, lse, None, None, 1, 0.25, "ieee")  # doctest: +SKIP
    """
    _check_launch(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision)
    return _launch_backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                            precision, dkdv_config, dq_config)


def _launch_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor, lse: torch.Tensor,
                     key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                     causal_mode: int, scale: float, precision: str,
                     dkdv_config: Optional[BlockConfig] = None,
                     dq_config: Optional[BlockConfig] = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, heads, seq_q, head_dim = q.shape
    kv_heads, seq_k = k.shape[1], k.shape[2]
    block_d = _block_d(head_dim)
    dot = _dot_mode(precision)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)
    delta_grid = _Grid(seq_q, "BLOCK_M", batch * heads)({"BLOCK_M": _bwd.DELTA_BLOCK_M})
    delta_args = (out, grad_out, delta, *out.stride(), *grad_out.stride(), heads, seq_q)
    delta_meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, FLAT_GRID=batch * heads > _GRID_AXIS1_LIMIT,
                      BLOCK_M=_bwd.DELTA_BLOCK_M)
    if _USE_LAUNCH_CACHE and q.is_cuda:
        _LAUNCHES.launch(_bwd.attn_bwd_delta, delta_grid, delta_args, delta_meta, n_tensors=3)
    else:
        _bwd.attn_bwd_delta[delta_grid](*delta_args, **delta_meta)

    dq = torch.empty((batch, heads, seq_q, head_dim), dtype=q.dtype, device=q.device)
    dk = torch.empty((batch, kv_heads, seq_k, head_dim), dtype=k.dtype, device=k.device)
    dv = torch.empty((batch, kv_heads, seq_k, head_dim), dtype=v.dtype, device=v.device)
    key_mask, mask_arg, lengths_arg, stride_mask_b, stride_mask_n = _key_mask_args(q, key_padding_mask,
                                                                                    key_lengths)
    qk_scale = scale * math.log2(math.e)
    buckets = _tuning.tuning_buckets(seq_q, seq_k, batch * heads)
    meta = dict(HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal_mode, KEY_MASK=key_mask, DOT=dot)

    tuning_key = (*buckets, head_dim, causal_mode, key_mask, dot, q.dtype, mask_arg.dtype, lengths_arg.dtype,
                  grad_out.dtype)
    _launch(_bwd.attn_bwd_dkdv, _bwd.attn_bwd_dkdv_fixed, dkdv_config, _bwd.DKDV_GPU_BLOCKS,
            _bwd.prune_dkdv_configs, q, block_d, _Grid(seq_k, "BLOCK_N", batch * kv_heads), tuning_key,
            (q, k, v, grad_out, lse, delta, dk, dv, mask_arg, lengths_arg,
             *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dk.stride(), *dv.stride(),
             stride_mask_b, stride_mask_n,
             heads, kv_heads, heads // kv_heads, seq_q, seq_k, qk_scale, scale, *buckets),
            dict(FLAT_GRID=batch * kv_heads > _GRID_AXIS1_LIMIT, **meta), n_tensors=10)
    _launch(_bwd.attn_bwd_dq, _bwd.attn_bwd_dq_fixed, dq_config, _bwd.DQ_GPU_BLOCKS, _bwd.prune_dq_configs, q,
            block_d, _Grid(seq_q, "BLOCK_M", batch * heads), tuning_key,
            (q, k, v, grad_out, lse, delta, dq, mask_arg, lengths_arg,
             *q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *dq.stride(),
             stride_mask_b, stride_mask_n,
             heads, heads // kv_heads, seq_q, seq_k, qk_scale, scale, *buckets),
            dict(FLAT_GRID=batch * heads > _GRID_AXIS1_LIMIT, **meta), n_tensors=9)
    return dq, dk, dv
