"""Validate an attention call into a ``Problem``, and say why the Triton kernel cannot run one.

Holds the constants every other module of the package reads: the integer causal modes, the head-dim range, the
precisions and the backends. Imports nothing from the package.
"""
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import torch

from flashlite import _env, _runtime

try:  # Triton has wheels for Linux x86_64 only; elsewhere every call goes to SDPA.
    import triton  # noqa: F401

    from flashlite.kernels import attention_bwd, attention_fwd, tuning  # noqa: F401
    _TRITON_ERROR: Optional[str] = None
except ImportError as error:  # pragma: no cover - exercised only on platforms without Triton
    _TRITON_ERROR = f"Triton is not available ({error})"

# Integer causal modes of the custom ops (a fixed op signature cannot take bool-or-str).
CAUSAL_NONE, CAUSAL_TOP_LEFT, CAUSAL_BOTTOM_RIGHT = 0, 1, 2
# Internal: bottom-right of each batch entry's key length (attention_with_kvcache, forward only).
CAUSAL_KEY_LENGTH = 3
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


KeyMasking = Literal["none", "bool", "lengths"]
AlibiSlopes = Literal["none", "heads", "batch_heads"]


@dataclass(frozen=True)
class Problem:
    """A validated attention call: what every internal function of the package takes instead of loose arguments.

    It describes a call signature, not one call's data: no tensors, so the plan of a signature can keep it while
    every call brings its own q, k, v and key mask (``key_padding_mask`` or ``key_lengths``, whichever
    ``key_masking`` names).

    Example:
        >>> q = torch.randn(2, 4, 10, 16)
        >>> problem = validate(q, q, q, True, None, None, None, "auto", None)
        >>> problem.causal_mode, problem.scale, problem.group_size, problem.key_masking
        (1, 0.25, 1, 'none')
    """

    batch: int
    heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: torch.dtype
    causal_mode: int
    scale: float
    precision: str
    key_masking: KeyMasking
    window_left: int = -1  # keys j >= i' - window_left are visible; -1: no bound on that side
    window_right: int = -1  # keys j <= i' + window_right are visible; -1: no bound
    softcap: float = 0.0  # scores become softcap * tanh(scores / softcap); 0.0: off
    alibi: AlibiSlopes = "none"  # slopes per query head ("heads", [H]) or per batch and head ("batch_heads")
    # Packed sequences (attention_varlen): batch counts the sequences, seq_q and seq_k are the longest ones
    varlen: bool = False
    # A paged KV cache (attention_with_kvcache): positions per cache block; 0 for contiguous keys
    page_size: int = 0
    # Split-KV (attention_with_kvcache's num_splits): programs per query block, each over a share of the keys
    key_splits: int = 1

    # Derived from the fields above in __post_init__; plain attributes rather than properties, so that
    # torch.compile reads them from a problem decided outside its trace (decide.traced_call_plan) without tracing
    # a method.
    # Query heads per key/value head (grouped-query attention).
    group_size: int = field(init=False)
    # What the call adds to dense attention, as the dispatch keys it: "dense", or the parts joined by "+"
    # ("varlen", "key_padding", "window", "softcap", "alibi").
    variant: str = field(init=False)

    def __post_init__(self) -> None:
        parts = [name for name, present in (("varlen", self.varlen), ("key_padding", self.key_masking != "none"),
                                             ("window", self.window_left >= 0 or self.window_right >= 0),
                                             ("softcap", self.softcap > 0), ("alibi", self.alibi != "none"))
                 if present]
        object.__setattr__(self, "group_size", self.heads // self.kv_heads)
        object.__setattr__(self, "variant", "+".join(parts) or "dense")


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


def check_dtypes_and_devices(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """One supported dtype and one device for q, k and v, and k shaped like v (every layout's rule)."""
    if q.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"q has dtype {q.dtype}; supported: float16, bfloat16, float32")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")


def validate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Union[bool, str], scale: Optional[float],
             key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
             backend: str, precision: Optional[str], window: Optional[tuple[int, int]] = None,
             softcap: Optional[float] = None, alibi_slopes: Optional[torch.Tensor] = None) -> Problem:
    """The ``Problem`` of an ``attention()`` call, or the error that names what is wrong with it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    check_dtypes_and_devices(q, k, v)
    batch, heads, seq_q, head_dim = q.shape
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
    scale = check_scale(scale, head_dim)
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
    key_masking = "bool" if key_padding_mask is not None else "lengths" if key_lengths is not None else "none"
    window_left, window_right = _check_window(window)
    return Problem(batch, heads, kv_heads, seq_q, seq_k, head_dim, q.dtype, causal_mode, float(scale),
                   _resolve_precision(q.dtype, precision), key_masking, window_left, window_right,
                   _check_softcap(softcap), _check_alibi(alibi_slopes, q, batch, heads))


def value_checks_asked(check_values: Optional[bool], like: torch.Tensor) -> bool:
    """Whether a call's index tensors (sequence offsets, cache lengths, block tables) are to be read back and their
    values checked: ``check_values`` when given; else always for CPU tensors, and on a GPU only with
    FLASHLITE_CHECK_VALUES=1, since reading them synchronises the device and breaks CUDA-graph capture."""
    if check_values is not None:
        return bool(check_values)
    return like.device.type == "cpu" or _env.flag("FLASHLITE_CHECK_VALUES", False)


def value_checks_wanted(check_values: Optional[bool], like: torch.Tensor) -> bool:
    """``value_checks_asked``, and never while torch.compile traces: traced tensors have no values to read. (A
    compiled graph checks them when it runs, in an op: ``varlen.checked_offsets_op``, the KV-cache op.)"""
    if torch.compiler.is_compiling():
        return False
    return value_checks_asked(check_values, like)


# The kernels and SDPA scale and cap scores in float32: a scale or softcap beyond its range is an infinity there.
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def eager_options(q: Any, dims: int, scale: float, precision: str, window_left: int, window_right: int,
                  softcap: float) -> tuple[Optional[float], Optional[str], Optional[tuple[int, int]], Optional[float]]:
    """(scale, precision, window, softcap) of the eager call that a custom op's flat arguments stand for: each
    flat form of an eager default (the default scale of a ``dims``-d q, the dtype's precision, window sides -1,
    softcap 0.0) read back as None, so that an op's call and the eager call share a plan key.

    Example:
        >>> eager_options(torch.empty(1, 2, 3, 16), 4, 0.25, "tf32", -1, -1, 0.0)
        (None, None, None, None)
        >>> eager_options(torch.empty(1, 2, 3, 16), 4, 0.5, "ieee", 8, 0, 30.0)
        (0.5, 'ieee', (8, 0), 30.0)
    """
    is_tensor = isinstance(q, torch.Tensor)
    default_scale = is_tensor and q.dim() == dims and scale == 1.0 / math.sqrt(q.shape[dims - 1])
    default_precision = (_NATIVE_PRECISION.get(q.dtype) if is_tensor else None) or DEFAULT_FP32_PRECISION
    return (None if default_scale else scale, None if precision == default_precision else precision,
            None if (window_left, window_right) == (-1, -1) else (window_left, window_right),
            None if softcap == 0.0 else softcap)


def check_scale(scale: object, head_dim: int) -> Any:
    """The softmax scale of a call: ``scale``, or 1 / sqrt(head_dim) for None; TypeError for anything but a real
    number within float32's range.

    Example:
        >>> check_scale(None, 64), check_scale(2, 64)
        (0.125, 2)
    """
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    # numbers.Real takes numpy's float and integer scalars too; bools (Python's and numpy's) are refused. The
    # comparisons (NaN fails both) instead of math.isfinite: under torch.compile with dynamic=True a float argument
    # is symbolic, which math.isfinite cannot take.
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) or not -_FLOAT32_MAX <= scale <= _FLOAT32_MAX:
        raise TypeError(f"scale must be a finite real number within float32's range (|scale| <= 3.4e38) or None, "
                        f"got {scale!r}")
    return scale


def _check_window(window: object) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(side, numbers.Integral) and not isinstance(side, bool) for side in window)):
        raise TypeError(f"window must be None or (left, right), two integers (-1: unbounded on that side), got "
                        f"{window!r}")
    left, right = (int(side) for side in window)
    if left < -1 or right < -1:
        raise ValueError(f"window sides must be >= 0, or -1 for unbounded, got window={window!r}")
    if left >= _INT32_LIMIT or right >= _INT32_LIMIT:
        raise ValueError(f"window sides must be below 2**31, got window={window!r}")
    return left, right


def _check_softcap(softcap: object) -> float:
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a real number > 0 or None, got {softcap!r}")
    if not 0 < softcap <= _FLOAT32_MAX:  # NaN fails; comparisons take a symbolic float too (see check_scale)
        raise ValueError(f"softcap must be finite and > 0, within float32's range (<= 3.4e38) (scores become "
                         f"softcap * tanh(scores / softcap)), got {softcap!r}")
    return float(softcap)


def _check_alibi(alibi_slopes: object, q: torch.Tensor, batch: int, heads: int) -> str:
    if alibi_slopes is None:
        return "none"
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes must be a float32 tensor [H] or [B, H], got {type(alibi_slopes).__name__}")
    if alibi_slopes.dtype != torch.float32:
        raise TypeError(f"alibi_slopes must be float32 (one slope per head, [H] or [B, H]), got "
                        f"{alibi_slopes.dtype}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes must have shape [H] = [{heads}] or [B, H] = [{batch}, {heads}], got "
                         f"{list(alibi_slopes.shape)}")
    if alibi_slopes.device != q.device:
        raise ValueError(f"alibi_slopes is on {alibi_slopes.device}, q on {q.device}")
    return "heads" if alibi_slopes.dim() == 1 else "batch_heads"


def check_constant_slopes(alibi_slopes: Optional[torch.Tensor]) -> None:
    """ValueError for ALiBi slopes that autograd would differentiate (they require grad, and grad mode is on).

    The slopes are constants of a call: the Triton kernels compute no gradient for them, so every backend refuses
    such slopes alike, rather than one leaving them without a gradient and another (SDPA, which adds them as a
    bias) giving them one. Checked on every call, not once per plan: ``requires_grad`` is not part of a call's
    signature.
    """
    if alibi_slopes is not None and alibi_slopes.requires_grad and torch.is_grad_enabled():
        raise ValueError("alibi_slopes requires grad, but attention() takes the slopes as constants and computes "
                         "no gradient for them on any backend; pass alibi_slopes.detach() (or call under "
                         "torch.no_grad())")


def _slice_span(t: torch.Tensor) -> int:
    """Elements spanned by one [S, D] slice (the kernels index inside a slice with 32-bit offsets)."""
    return (t.shape[-2] - 1) * t.stride(-2) + (t.shape[-1] - 1) * t.stride(-1) + 1


def kernel_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
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
    return kernel_size_limit(q, k, v, key_padding_mask)


def kernel_size_limit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_padding_mask: Optional[torch.Tensor]) -> Optional[str]:
    """Why the Triton kernel cannot index this call's tensors (too long for 32-bit offsets), or None: the reasons
    of ``kernel_unsupported`` that depend on the sequence lengths."""
    if max(_slice_span(q), _slice_span(k), _slice_span(v)) >= _INT32_LIMIT:
        return "one (batch, head) slice spans 2**31 elements or more (the kernel indexes slices with 32 bits)"
    if key_padding_mask is not None and (key_padding_mask.shape[1] - 1) * key_padding_mask.stride(1) >= _INT32_LIMIT:
        return "key_padding_mask rows span 2**31 elements or more"
    return None


# ----------------------------------------------------------------------------------------------------------------
# Packed sequences (attention_varlen) and KV caches (attention_with_kvcache): the same Problem, from their layouts.

def check_offsets(name: str, cu: torch.Tensor, total: int, max_len: int, max_name: str) -> None:
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(f"{name} must start at 0 and end at the token count {total}; got {values[0]} ... "
                         f"{values[-1]}")
    lengths = [b - a for a, b in zip(values, values[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must never decrease; got {values}")
    if max(lengths) > max_len:
        raise ValueError(f"{max_name}={max_len} is below the longest sequence of {name} ({max(lengths)} tokens)")


def validate_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                    cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: Union[bool, str],
                    scale: Optional[float], window: Optional[tuple[int, int]], softcap: Optional[float],
                    alibi_slopes: Optional[torch.Tensor], precision: Optional[str],
                    check_values: Optional[bool]) -> Problem:
    """The ``Problem`` of a packed call (``varlen``; batch = the sequence count, seq_q / seq_k = the maxima), or
    the error that names what is wrong with it."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions [total tokens, heads, head dim], got shape "
                             f"{tuple(t.shape)}")
    check_dtypes_and_devices(q, k, v)
    total_q, heads, head_dim = q.shape
    total_k, kv_heads, head_dim_k = k.shape
    if head_dim_k != head_dim:
        raise ValueError(f"head dim differs: q has {head_dim}, k and v have {head_dim_k}")
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q has {heads} heads and k, v have {kv_heads}: the number of q heads must be a multiple "
                         f"of the k/v heads (grouped-query attention)")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
            raise TypeError(f"{name} must be an int32 tensor [batch + 1] of sequence starts, got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D with batch + 1 >= 2 entries, got shape {tuple(cu.shape)}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device}, q on {q.device}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got "
                         f"{cu_seqlens_q.shape[0] - 1} and {cu_seqlens_k.shape[0] - 1}")
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer (the longest sequence's length), got {value!r}")
    if min(total_q, total_k, heads, head_dim) == 0:
        raise ValueError(f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if value_checks_wanted(check_values, cu_seqlens_q):
        check_offsets("cu_seqlens_q", cu_seqlens_q, total_q, int(max_seqlen_q), "max_seqlen_q")
        check_offsets("cu_seqlens_k", cu_seqlens_k, total_k, int(max_seqlen_k), "max_seqlen_k")
    batch = cu_seqlens_q.shape[0] - 1
    scale = check_scale(scale, head_dim)
    window_left, window_right = _check_window(window)
    return Problem(batch, heads, kv_heads, int(max_seqlen_q), int(max_seqlen_k), head_dim, q.dtype,
                   _causal_mode(causal), float(scale), _resolve_precision(q.dtype, precision), "none", window_left,
                   window_right, _check_softcap(softcap), _check_alibi(alibi_slopes, q, batch, heads), varlen=True)


def check_block_table(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor) -> int:
    """The positions a paged cache holds per entry (max blocks * block size), or the error naming the argument."""
    if not isinstance(block_table, torch.Tensor) or block_table.dtype != torch.int32:
        raise TypeError(f"block_table must be an int32 tensor [B, max blocks], got "
                        f"{getattr(block_table, 'dtype', type(block_table).__name__)}")
    if block_table.dim() != 2 or block_table.shape[0] != q.shape[0] or block_table.shape[1] == 0:
        raise ValueError(f"block_table must have shape [B, max blocks] with B = {q.shape[0]}, got "
                         f"{list(block_table.shape)}")
    if block_table.device != q.device:
        raise ValueError(f"block_table is on {block_table.device}, q on {q.device}")
    if k_cache.shape != v_cache.shape or k_cache.shape[0] == 0:
        raise ValueError(f"a paged k_cache and v_cache must both be [blocks, H_kv, block size, D], got "
                         f"{list(k_cache.shape)} and {list(v_cache.shape)}")
    if k_cache.shape[2] % 16:
        raise ValueError(f"the block size (k_cache.shape[2]) must be a multiple of 16, got {k_cache.shape[2]}")
    return block_table.shape[1] * k_cache.shape[2]


def check_cache_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_seqlens: torch.Tensor,
                      k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor]) -> None:
    if not isinstance(cache_seqlens, torch.Tensor) or cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be an int32 tensor [B], got "
                        f"{getattr(cache_seqlens, 'dtype', type(cache_seqlens).__name__)}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{name} must be a 4-D tensor [B, heads, S, D], got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    if tuple(cache_seqlens.shape) != (q.shape[0],):
        raise ValueError(f"cache_seqlens must have shape [B] = [{q.shape[0]}], got {list(cache_seqlens.shape)}")
    if cache_seqlens.device != q.device:
        raise ValueError(f"cache_seqlens is on {cache_seqlens.device}, q on {q.device}")
    if (k_new is None) != (v_new is None):
        raise ValueError("pass k_new and v_new together, or neither")
    if k_new is not None:
        expected = (q.shape[0], k_cache.shape[1], q.shape[2], k_cache.shape[3])
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != expected:
                raise ValueError(f"{name} must have shape [B, H_kv, S_q, D] = {list(expected)}, got "
                                 f"{list(getattr(t, 'shape', [])) or type(t).__name__}")
            # An fp8 cache receives new tokens in q's dtype, quantized with the scales as they are written.
            dtype = q.dtype if k_cache.dtype == torch.float8_e4m3fn else k_cache.dtype
            if t.dtype != dtype or t.device != k_cache.device:
                what = "q's dtype (the cache is fp8) and the cache's device" if dtype != k_cache.dtype else \
                    "the cache's dtype and device"
                raise TypeError(f"{name} must match {what} ({dtype} on {k_cache.device}), got {t.dtype} on "
                                f"{t.device}")


def check_lengths(cache_seqlens: torch.Tensor, appended: int, capacity: int) -> None:
    lengths = cache_seqlens.tolist()
    if min(lengths) < 0:
        raise ValueError(f"cache_seqlens must be >= 0, got {lengths}")
    if max(lengths) + appended > capacity:
        what = f"cache_seqlens + S_q (the new tokens) = {max(lengths) + appended}" if appended else \
            f"cache_seqlens = {max(lengths)}"
        raise ValueError(f"{what} overflows the cache of S_max = {capacity} positions")
