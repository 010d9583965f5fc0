"""flashlite's attention: the public ``attention()``, its dispatch, launchers and torch.library ops.

Layers, bottom up:

* kernels (``flashlite.kernels.attention_fwd`` / ``attention_bwd``): raw Triton code;
* launchers ``attention_forward`` / ``attention_backward``: check what the kernels assume, allocate, compute
  the grid, launch (autotuned, or with a forced config for tests);
* custom ops ``flashlite::attention_forward`` -> (out, lse) and ``flashlite::attention_backward`` ->
  (dq, dk, dv), with fake implementations, and autograd registered on the forward op, so ``torch.compile``
  treats the kernel as one opaque node instead of tracing into it;
* ``attention()``: validates the call, picks Triton or SDPA (``backend="auto"`` asks ``flashlite.dispatch``)
  and makes both paths agree, including zeros for rows that see no key.

Precision: float16/bfloat16 inputs multiply in their own precision. Float32 inputs take ``precision``:
"tf32" (the default: tensor cores, relative error near 3e-4), "ieee" (true float32, several times slower)
or "bf16" (operands rounded to bfloat16). Accumulation and softmax are always float32. ``precision`` shapes the
Triton kernel only; the SDPA path computes float32 in SDPA's own way.

The log-sum-exp saved for the backward pass is in base 2 of the scaled scores (natural lse * log2(e)), float32,
shape [B, H, S_q]; -inf for rows that see no key.
"""
import functools
import logging
import math
import numbers
import os
from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from flashlite import _direct_launch, _ops, _runtime
from flashlite._intmath import cdiv, next_power_of_2
from flashlite.dispatch import Decision, choose_backend

try:  # Triton has wheels for Linux x86_64 only; elsewhere every call goes to SDPA.
    import triton

    from flashlite.kernels import attention_bwd as _bwd
    from flashlite.kernels import attention_fwd as _fwd
    from flashlite.kernels import tuning as _tuning
    _TRITON_ERROR: Optional[str] = None
except ImportError as error:  # pragma: no cover - exercised only on platforms without Triton
    _TRITON_ERROR = f"Triton is not available ({error})"

__all__ = ["attention", "explain_dispatch", "attention_forward", "attention_backward", "CAUSAL_MODES"]

_log = logging.getLogger(__name__)

# Integer causal modes of the custom ops (a fixed op signature cannot take bool-or-str).
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2
CAUSAL_MODES = {False: CAUSAL_NONE, True: CAUSAL_TOP_LEFT, "top_left": CAUSAL_TOP_LEFT,
                "lower_right": CAUSAL_BOTTOM_RIGHT}

# The canonical user-facing value of each mode, as flashlite.dispatch keys its table.
_CAUSAL_ARGUMENT = {CAUSAL_NONE: False, CAUSAL_TOP_LEFT: True, CAUSAL_BOTTOM_RIGHT: "lower_right"}

MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
DEFAULT_FP32_PRECISION = "tf32"
_FP32_PRECISIONS = ("ieee", "tf32", "bf16")
_NATIVE_PRECISION = {torch.float16: "fp16", torch.bfloat16: "bf16"}
_PRECISION_ALIASES = {"fp16": "fp16", "float16": "fp16", "half": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BACKENDS = ("auto", "triton", "sdpa")
_INT32_LIMIT = 2 ** 31
# Grid axis 1 holds batch * heads; past CUDA's cap the kernels use a flattened 1-D grid (a module name, so that tests
# can lower it).
_GRID_AXIS1_LIMIT = _runtime.GRID_AXIS1_LIMIT

# (BLOCK_M, BLOCK_N, num_warps, num_stages), and for the forward kernel optionally BH_PER_PROGRAM fifth
BlockConfig = tuple[int, ...]


# ----------------------------------------------------------------------------------------------------------------
# Validation


@dataclass(frozen=True)
class _Call:
    """A validated attention call, in the form the custom ops take."""

    causal_mode: int
    scale: float
    precision: str
    key_padding_mask: Optional[torch.Tensor]
    key_lengths: Optional[torch.Tensor]


def _causal_mode(causal: Union[bool, str]) -> int:
    if isinstance(causal, bool) or (isinstance(causal, str) and causal in CAUSAL_MODES):
        return CAUSAL_MODES[causal]
    raise ValueError(f"causal must be False, True (top-left, like SDPA's is_causal) or 'lower_right', "
                     f"got {causal!r}")


def _resolve_precision(dtype: torch.dtype, precision: Optional[str]) -> str:
    """The dot-product operand precision for inputs of ``dtype``: fp16, bf16, ieee or tf32."""
    if precision is not None and not isinstance(precision, str):
        raise TypeError(f"precision must be a string or None, got {type(precision).__name__}")
    if dtype == torch.float32:
        if precision is None:
            return DEFAULT_FP32_PRECISION
        if precision not in _FP32_PRECISIONS:
            raise ValueError(f"precision for float32 inputs must be one of {_FP32_PRECISIONS} (or None for "
                             f"{DEFAULT_FP32_PRECISION!r}), got {precision!r}")
        return precision
    native = _NATIVE_PRECISION[dtype]
    if precision is not None and _PRECISION_ALIASES.get(precision) != native:
        raise ValueError(f"precision applies to float32 inputs only; {dtype} inputs always multiply in "
                         f"{native} with float32 accumulation, so pass precision=None (got {precision!r})")
    return native


def _check_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 4:
        raise ValueError(f"{name} must have 4 dimensions [B, H, S, D], got shape {tuple(t.shape)}")
    return t


def _validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Union[bool, str], scale: Optional[float],
              key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
              backend: str, precision: Optional[str]) -> _Call:
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    batch, heads, seq_q, head_dim = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch_k, kv_heads, seq_k, head_dim_k = k.shape
    if batch_k != batch:
        raise ValueError(f"batch size differs: q has {batch}, k and v have {batch_k}")
    if head_dim_k != head_dim:
        raise ValueError(f"head dim differs: q has {head_dim}, k and v have {head_dim_k}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q has {heads} heads and k, v have {kv_heads}: the number of q heads must be a multiple "
                         f"of the k/v heads (grouped-query attention)")
    if min(batch, heads, seq_q, seq_k, head_dim) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    causal_mode = _causal_mode(causal)
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        # numbers.Real takes numpy's float and integer scalars too; bools (Python's and numpy's) are refused.
        raise TypeError(f"scale must be a finite real number or None, got {scale!r}")
    if key_padding_mask is not None and key_lengths is not None:
        raise ValueError("pass key_padding_mask or key_lengths, not both")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, torch.Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be a bool tensor [B, S_k] (True = attend), got "
                            f"{getattr(key_padding_mask, 'dtype', type(key_padding_mask).__name__)}")
        if tuple(key_padding_mask.shape) != (batch, seq_k):
            raise ValueError(f"key_padding_mask must have shape [B, S_k] = {[batch, seq_k]}, got "
                             f"{list(key_padding_mask.shape)}")
        if key_padding_mask.device != q.device:
            raise ValueError(f"key_padding_mask is on {key_padding_mask.device}, q on {q.device}")
    if key_lengths is not None:
        if not isinstance(key_lengths, torch.Tensor) or key_lengths.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"key_lengths must be an int32 or int64 tensor [B], got "
                            f"{getattr(key_lengths, 'dtype', type(key_lengths).__name__)}")
        if tuple(key_lengths.shape) != (batch,):
            raise ValueError(f"key_lengths must have shape [B] = [{batch}], got {list(key_lengths.shape)}")
        if key_lengths.device != q.device:
            raise ValueError(f"key_lengths is on {key_lengths.device}, q on {q.device}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
    return _Call(causal_mode, float(scale), _resolve_precision(q.dtype, precision), key_padding_mask, key_lengths)


def _slice_span(t: torch.Tensor) -> int:
    """Elements spanned by one [S, D] slice (the kernels index inside a slice with 32-bit offsets)."""
    return (t.shape[-2] - 1) * t.stride(-2) + (t.shape[-1] - 1) * t.stride(-1) + 1


def _kernel_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        key_padding_mask: Optional[torch.Tensor]) -> Optional[str]:
    """Why the Triton kernel cannot run this (validated) call, or None when it can."""
    if _TRITON_ERROR is not None:
        return _TRITON_ERROR
    if not _runtime.kernel_device_ok(q):
        return (f"tensors on {q.device}; the Triton kernel runs on CUDA devices, or on the CPU only through the "
                f"Triton interpreter (TRITON_INTERPRET=1)")
    head_dim = q.shape[-1]
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"head dim {head_dim} is outside the kernel's range {MIN_HEAD_DIM}..{MAX_HEAD_DIM}"
    if max(_slice_span(q), _slice_span(k), _slice_span(v)) >= _INT32_LIMIT:
        return "one (batch, head) slice spans 2**31 elements or more (the kernel indexes slices with 32 bits)"
    if key_padding_mask is not None and (key_padding_mask.shape[1] - 1) * key_padding_mask.stride(1) >= _INT32_LIMIT:
        return "key_padding_mask rows span 2**31 elements or more"
    return None


def _decide(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call, backend: str) -> Decision:
    if backend == "sdpa":
        return Decision("sdpa", "forced by backend='sdpa'")
    unsupported = _kernel_unsupported(q, k, v, call.key_padding_mask)
    if backend == "triton":
        if unsupported is not None:
            raise ValueError(f"backend='triton' cannot run this call: {unsupported}")
        return Decision("triton", "forced by backend='triton'")
    return choose_backend(q, causal=_CAUSAL_ARGUMENT[call.causal_mode], seq_k=k.shape[2], unsupported=unsupported)


def _log_decision(decision: Decision, q: torch.Tensor, k: torch.Tensor) -> None:
    if os.environ.get("FLASHLITE_DEBUG_DISPATCH", "0") not in ("", "0"):
        _log.debug("flashlite.attention q %s k %s %s -> %s: %s", tuple(q.shape), tuple(k.shape), q.dtype,
                   decision.backend, decision.reason)


# ----------------------------------------------------------------------------------------------------------------
# Launchers


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


# ----------------------------------------------------------------------------------------------------------------
# Custom ops and autograd


@torch.library.custom_op("flashlite::attention_forward", mutates_args=())
def attention_forward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                         causal_mode: int, scale: float, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton attention forward as an opaque op: (out [B, H, S_q, D], base-2 lse [B, H, S_q] float32)."""
    return attention_forward(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision):
    batch, heads, seq_q, head_dim = q.shape
    return (q.new_empty((batch, heads, seq_q, head_dim)),
            q.new_empty((batch, heads, seq_q), dtype=torch.float32))


@torch.library.custom_op("flashlite::attention_backward", mutates_args=())
def attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor,
                          key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                          causal_mode: int, scale: float, precision: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton attention backward as an opaque op: (dq, dk, dv), contiguous, in the dtypes of q, k, v."""
    return attention_backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                              precision)


@attention_backward_op.register_fake
def _attention_backward_fake(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, causal_mode, scale,
                             precision):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_padding_mask, key_lengths)
    ctx.mark_non_differentiable(lse)
    ctx.causal_mode, ctx.scale, ctx.precision = causal_mode, scale, precision


def _gradient(backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]):
    """The forward's gradient through ``backward``: the backward op under torch.compile, its launcher in eager
    calls (the op's dispatcher round trips would cost as much as a small kernel)."""

    def grad(ctx, grad_out, _grad_lse):
        q, k, v, out, lse, key_padding_mask, key_lengths = ctx.saved_tensors
        dq, dk, dv = backward(grad_out, q, k, v, out, lse, key_padding_mask, key_lengths, ctx.causal_mode,
                              ctx.scale, ctx.precision)
        return dq, dk, dv, None, None, None, None, None

    return grad


attention_forward_op.register_autograd(_gradient(attention_backward_op), setup_context=_setup_context)
# Eager calls with gradients: the same forward launcher, context and gradient, without the op's dispatcher.
_EagerTritonAttention = _ops.eager_function("_EagerTritonAttention", _launch_forward, _setup_context,
                                            _gradient(_launch_backward), non_differentiable=())


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call) -> torch.Tensor:
    args = (q, k, v, call.key_padding_mask, call.key_lengths, call.causal_mode, call.scale, call.precision)
    if torch.compiler.is_compiling():
        return attention_forward_op(*args)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _EagerTritonAttention.apply(*args)[0]
    return _launch_inference(*args)


class _TritonPlan:
    """A replayed Triton-backend call (no masks; fixed shapes, strides, dtypes, devices and arguments).

    Inference calls replay the forward launch recorded on the plan's first inference replay straight into the
    compiled kernel (``flashlite._direct_launch``), skipping Triton's per-call argument binding; calls that need
    gradients, compiled code, and calls the recording cannot take (unaligned tensors) launch the ordinary way. The
    plan keeps its own recording rather than going through the launch cache: its signature is already fixed, so a
    replay needs no bucket arithmetic, argument tuple or cache key, each of which would add host time to every
    call at launch-bound sizes."""

    __slots__ = ("call", "recorded", "tried")

    def __init__(self, call: _Call) -> None:
        self.call = call
        self.recorded: Optional[_direct_launch.RecordedLaunch] = None
        self.tried = False

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        call = self.call
        if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            return _triton_attention(q, k, v, call)
        recorded = self.recorded
        if recorded is not None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            # As recorded: out in the (unused) lse slot, q in the mask slots.
            if recorded.launch(q, k, v, out, out, q, q):
                return out
        if self.tried or not q.is_cuda:
            return _launch_inference(q, k, v, None, None, call.causal_mode, call.scale, call.precision)
        self.tried = True
        out, _, self.recorded = _launch_forward_recorded(q, k, v, None, None, call.causal_mode, call.scale,
                                                         call.precision, record=True, need_lse=False)
        return out


# ----------------------------------------------------------------------------------------------------------------
# SDPA path


def _visibility_mask(q: torch.Tensor, k: torch.Tensor, call: _Call) -> torch.Tensor:
    """Bool [B or 1, 1, S_q, S_k]: True where query i may attend key j, from causal mode and key padding."""
    seq_q, seq_k = q.shape[2], k.shape[2]
    mask = torch.ones((1, 1, seq_q, seq_k), dtype=torch.bool, device=q.device)
    if call.causal_mode != CAUSAL_NONE:
        shift = 0 if call.causal_mode == CAUSAL_TOP_LEFT else seq_k - seq_q
        mask = mask.tril(diagonal=shift)
    if call.key_padding_mask is not None:
        mask = mask & call.key_padding_mask[:, None, None, :]
    elif call.key_lengths is not None:
        keys = torch.arange(seq_k, device=q.device)
        mask = mask & (keys[None, :] < call.key_lengths[:, None])[:, None, None, :]
    return mask


def _check_attn_mask(q: torch.Tensor, k: torch.Tensor, attn_mask: object) -> torch.Tensor:
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(f"attn_mask must be bool (True = attend) or floating (an additive bias), got "
                        f"{attn_mask.dtype}")
    if attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device}, q on {q.device}")
    target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    try:
        if attn_mask.dim() > 4 or torch.broadcast_shapes(attn_mask.shape, target) != torch.Size(target):
            raise RuntimeError
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} does not broadcast to [B, H, S_q, S_k] = "
                         f"{list(target)}") from None
    return attn_mask


def _decide_with_mask(q: torch.Tensor, k: torch.Tensor, call: _Call, backend: str,
                      attn_mask: object) -> Decision:
    _check_attn_mask(q, k, attn_mask)
    reason = "an explicit attn_mask (arbitrary mask or bias) is not an input of the Triton kernel"
    if backend == "triton":
        raise ValueError(f"backend='triton' cannot run this call: {reason}; use key_padding_mask / key_lengths "
                         f"and causal, or backend='sdpa'")
    return Decision("sdpa", "forced by backend='sdpa'" if backend == "sdpa" else f"kernel cannot run this call: "
                                                                                f"{reason}")


def _padded_keys(k: torch.Tensor, call: _Call) -> Optional[torch.Tensor]:
    """Bool [B, S_k], True for keys that key_padding_mask or key_lengths hide from every query; None without."""
    if call.key_padding_mask is not None:
        return ~call.key_padding_mask
    if call.key_lengths is not None:
        return torch.arange(k.shape[2], device=k.device)[None, :] >= call.key_lengths[:, None]
    return None


def _without_hidden_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call,
                           visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(k, v, rows that see a non-finite key or value) for a masked SDPA call, so that what the masks hide never
    reaches the output, as in the kernel: SDPA multiplies its zero weights by every value, and 0 * NaN is NaN.

    Padded keys become zeros (their gradients are zero either way). Keys the causal mask hides from some rows and
    shows to others become zeros when they are not finite, and the rows that see them are returned so that the
    caller sets them to NaN, as the exact sum would be. The copies cost O(S * D); the masked path already builds
    an [S_q, S_k] mask."""
    padded = _padded_keys(k, call)
    if padded is not None:
        k = k.masked_fill(padded[:, None, :, None], 0.0)
        v = v.masked_fill(padded[:, None, :, None], 0.0)
    if call.causal_mode == CAUSAL_NONE:
        return k, v, None
    bad = ~(torch.isfinite(k).all(dim=-1) & torch.isfinite(v).all(dim=-1))  # [B, H_kv, S_k]
    k = k.masked_fill(bad[..., None], 0.0)
    v = v.masked_fill(bad[..., None], 0.0)
    bad = bad.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return k, v, (visible & bad[:, :, None, :]).any(dim=-1, keepdim=True)


def _sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call,
                    attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    if (attn_mask is None and call.key_padding_mask is None and call.key_lengths is None
            and call.causal_mode != CAUSAL_BOTTOM_RIGHT):
        if call.causal_mode == CAUSAL_TOP_LEFT and k.shape[2] > q.shape[2]:
            # Keys past the last query row are hidden from every row: SDPA never sees them (a view, no copy).
            k, v = k[:, :, :q.shape[2]], v[:, :, :q.shape[2]]
        # SDPA's own causal kernels: a NaN in a key that later rows see may turn earlier rows NaN too (see
        # ``attention``).
        return F.scaled_dot_product_attention(q, k, v, is_causal=call.causal_mode == CAUSAL_TOP_LEFT,
                                              scale=call.scale, **gqa)
    visible = _visibility_mask(q, k, call)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        visible = visible & attn_mask
    k, v, sees_bad = _without_hidden_values(q, k, v, call, visible)
    out = _sdpa_masked(q, k, v, call, attn_mask, visible, gqa)
    return out if sees_bad is None else out.masked_fill(sees_bad, float("nan"))


def _sdpa_masked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: _Call,
                 attn_mask: Optional[torch.Tensor], visible: torch.Tensor, gqa: dict) -> torch.Tensor:
    """SDPA under ``visible`` (bool, attn_mask included when it is bool) or ``visible`` plus a float attn_mask."""
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        # A float bias: positions the causal or padding mask hides get -inf; rows are empty where nothing finite
        # is left.
        bias = torch.where(visible, attn_mask.to(q.dtype), float("-inf"))
        empty_rows = torch.isneginf(bias).all(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(empty_rows, 0.0),
                                             scale=call.scale, **gqa)
        return out.masked_fill(empty_rows, 0.0)
    # SDPA returns NaN for a row that sees no key; let such rows see every key (finite), then zero them, so the
    # output and its gradients match the kernel's zeros.
    empty_rows = ~visible.any(dim=-1, keepdim=True)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible | empty_rows, scale=call.scale, **gqa)
    return out.masked_fill(empty_rows, 0.0)


# ----------------------------------------------------------------------------------------------------------------
# Public API


def explain_dispatch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
                     scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
                     key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
                     backend: str = "auto", precision: Optional[str] = None) -> Decision:
    """Which implementation ``attention(q, k, v, **same arguments)`` would run, and why.

    Raises the same errors as ``attention`` for invalid calls. With FLASHLITE_DEBUG_DISPATCH=1 the decision is
    also logged (logger ``flashlite.attention``, level DEBUG).

    Example:
        >>> q = torch.randn(1, 2, 16, 8)
        >>> print(explain_dispatch(q, q, q).reason)
        kernel cannot run this call: head dim 8 is outside the kernel's range 16..256
    """
    call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
    decision = _decide_with_mask(q, k, call, backend, attn_mask) if attn_mask is not None else \
        _decide(q, k, v, call, backend)
    _log_decision(decision, q, k)
    return decision


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: Union[bool, str] = False,
              scale: Optional[float] = None, key_padding_mask: Optional[torch.Tensor] = None,
              key_lengths: Optional[torch.Tensor] = None, attn_mask: Optional[torch.Tensor] = None,
              backend: str = "auto", precision: Optional[str] = None) -> torch.Tensor:
    """Scaled dot-product attention, softmax(scale * q k^T) v, with flashlite's Triton kernel or SDPA.

    Args:
        q: [B, H, S_q, D]; k, v: [B, H_kv, S_k, D] with H a multiple of H_kv (grouped-query attention, k and v
            are not copied). float16, bfloat16 or float32; any strides.
        causal: False; True for SDPA's ``is_causal`` (top-left: query i sees keys j <= i); "lower_right" for
            bottom-right alignment (j <= i + S_k - S_q, as for decoding against a KV cache).
        scale: defaults to 1 / sqrt(D).
        key_padding_mask: bool [B, S_k], True = attend. Or key_lengths: int [B], keys j >= length masked
            (lengths are clamped to [0, S_k]). Rows that see no key return zeros, with zero gradients. What the
            masks hide from every query row (padding, key lengths, keys past the last row's causal frontier)
            may hold anything, NaN and inf included: it never reaches the output or the gradients. A
            non-finite key or value a row does see makes that row non-finite; the Triton kernel, which sums
            over tiles of up to 128 query rows, may then turn the other rows of that tile NaN too, and SDPA's
            own causal kernel (calls without key masks) every row. Pass ``key_lengths`` for a cache filled
            past its end.
        attn_mask: an arbitrary mask or additive bias broadcastable to [B, H, S_q, S_k]: bool (True = attend) or
            floating (added to the scaled scores), combined with ``causal`` and key padding. The Triton kernel
            has no such input, so these calls run on SDPA (``backend="triton"`` refuses them); rows that see no
            key still give zeros.
        backend: "auto" (per-shape choice from ``flashlite.dispatch``; see ``explain_dispatch``), "triton" or
            "sdpa". Calls without masks are validated and decided once per signature (shapes, strides, dtypes,
            devices, arguments) and replayed after that; with FLASHLITE_DEBUG_DISPATCH=1 each signature's
            decision is logged when it is made (logger ``flashlite.attention``, level DEBUG).
        precision: float32 inputs only: "tf32" (default), "ieee" or "bf16" dot products in the Triton kernel.

    Returns:
        [B, H, S_q, D] in q's dtype.

    Example:
        >>> q, k, v = (torch.randn(2, 4, 10, 16) for _ in range(3))
        >>> attention(q, k, v, causal=True, backend="sdpa").shape
        torch.Size([2, 4, 10, 16])
    """
    if attn_mask is not None:
        call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
        decision = _decide_with_mask(q, k, call, backend, attn_mask)
        _log_decision(decision, q, k)
        return _sdpa_attention(q, k, v, call, attn_mask)
    plan_key = None
    if key_padding_mask is None and key_lengths is None and not torch.compiler.is_compiling():
        try:
            # causal and scale join the key with their classes: 1 == True == 1.0 hash alike, but validation refuses
            # causal=1 and scale=True, so a plan made for one must never answer the other. (Flat, not nested
            # tuples: the key is built on every call, and a nested tuple costs a tenth of a microsecond.)
            plan_key = (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
                        q.device, k.device, v.device, causal, causal.__class__, scale, scale.__class__, backend,
                        precision)
            plan = _PLANS.get(plan_key)
        except (AttributeError, TypeError):  # not tensors, or unhashable arguments: _validate names the problem
            plan_key = plan = None
        if plan is not None:
            return plan(q, k, v)
    call = _validate(q, k, v, causal, scale, key_padding_mask, key_lengths, backend, precision)
    decision = _decide(q, k, v, call, backend)
    _log_decision(decision, q, k)
    if plan_key is not None and len(_PLANS) < _MAX_PLANS:
        if (decision.backend == "sdpa" and call.causal_mode != CAUSAL_BOTTOM_RIGHT
                and not (call.causal_mode == CAUSAL_TOP_LEFT and k.shape[2] > q.shape[2])):
            # Only the arguments the call needs (SDPA parses every keyword it is given, on every call), bound in a
            # partial so that a replay costs one C-level call.
            sdpa_kwargs = {"is_causal": call.causal_mode == CAUSAL_TOP_LEFT}
            if scale is not None:
                sdpa_kwargs["scale"] = call.scale
            if q.shape[1] != k.shape[1]:
                sdpa_kwargs["enable_gqa"] = True
            _PLANS[plan_key] = functools.partial(F.scaled_dot_product_attention, **sdpa_kwargs)
        elif decision.backend == "triton":
            _PLANS[plan_key] = _TritonPlan(call)
        else:
            _PLANS[plan_key] = functools.partial(_sdpa_attention, call=call)
    if decision.backend == "triton":
        return _triton_attention(q, k, v, call)
    return _sdpa_attention(q, k, v, call)


# A validated, decided call without masks, keyed by shapes, strides, dtypes, devices and arguments, and replayed
# for later calls with the same key: a repeated call costs a dictionary lookup, not a validation and a dispatch.
_PLANS: dict[tuple, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {}
_MAX_PLANS = 4096  # past this many distinct call signatures, new ones are validated every time

