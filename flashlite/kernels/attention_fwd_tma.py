"""Experimental forward attention kernel whose Q, K, V loads and O stores go through Triton tensor descriptors.

On Hopper and newer GPUs a tensor descriptor becomes a TMA (Tensor Memory Accelerator) copy: one thread issues a
bulk copy of a whole tile between global and shared memory, and the hardware computes addresses, clips at the
tensor's bounds and zero-fills what lies outside. The pointer-based kernel (``attention_fwd``) spends registers and
instructions on per-element addresses and masks instead. The math here is that kernel's, step for step (online
softmax in base 2 with ``qk_scale = scale * log2(e)`` folded into the scores, unmasked full key blocks first and
masked diagonal/tail blocks after, later query blocks launched first when causal), so that a benchmark of the two
measures the loads and stores and nothing else.

Descriptors are built on the host over 3-D views ``[B*H, S, D]`` of the contiguous inputs, with block shape
``[1, BLOCK, D]``. A tile that runs past the end of one (batch, head) slice is therefore cut at ``S`` by the
descriptor itself: its missing rows load as zeros and are dropped on store, and the next slice is never touched.
Keys past ``S_k`` still have their scores masked to -inf, since a zero key would otherwise score 0, not -inf.

Scope (the fast path only): contiguous q [B, H, S_q, D], k and v [B, H_kv, S_k, D] with H a multiple of H_kv,
float16 / bfloat16 / float32 (tf32 dots), D a power of two in 16..256, causal modes 0/1/2 as in ``attention_fwd``,
no key padding masks. Outputs match ``attention_fwd``'s: out in q's dtype and the base-2 log-sum-exp lse
[B, H, S_q] float32 (-inf, with out = 0, for rows that see no key), so ``attention_bwd`` can consume them.

Under the Triton interpreter (CPU) host-side descriptors are emulated with masked loads and stores, so the
kernel's logic can be tested without a GPU; bfloat16 dots there use ``attention_fwd``'s "bf16_emulated" mode,
because the interpreter's ``tl.dot`` on bfloat16 operands is broken.
"""
from __future__ import annotations

import math
import os
from typing import Callable, Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from flashlite import _runtime
from flashlite._intmath import cdiv
from flashlite.kernels.attention_fwd import (_cast_out, _key_range, _mma, _program_ids, prune_by_resources,
                                             tuning_buckets)

__all__ = ["attention_forward_tma", "tma_supported", "TMA_GPU_BLOCKS", "TMA_INTERPRETER_BLOCKS"]

_SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256
# TMA needs the base address and every stride but the last to be multiples of 16 bytes.
_TMA_ALIGNMENT = 16
# A tensor map's strides must stay below 2**40 bytes; descriptor coordinates are 32-bit.
_TMA_STRIDE_LIMIT = 2 ** 40
_INT32_LIMIT = 2 ** 31


@triton.jit
def _attn_fwd_tma_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, offs_m, start, end, seq_k, diag_shift,
                        qk_scale,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                        CAUSAL: tl.constexpr, DOT: tl.constexpr, BOUNDARY: tl.constexpr,
                        WARP_SPECIALIZE: tl.constexpr):
    """Fold key blocks [start, end) of slice ``kv_row`` into the running softmax. BOUNDARY: the blocks may cross
    the causal diagonal or the end of the keys, so mask; blocks before ``full_end`` need no mask at all.
    WARP_SPECIALIZE asks the compiler to split the loop into producer (TMA loads) and consumer (MMA, softmax)
    warp groups."""
    offs_n0 = tl.arange(0, BLOCK_N)
    for start_n in tl.range(start, end, BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = desc_k.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        qk = _mma(q, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), DOT) * qk_scale
        if BOUNDARY:
            # Keys past seq_k were zero-filled by the descriptor: they would score 0, so mask them explicitly.
            offs_n = start_n + offs_n0
            visible = offs_n[None, :] < seq_k
            if CAUSAL != 0:
                visible = visible & (offs_n[None, :] <= offs_m[:, None] + diag_shift)
            qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        if BOUNDARY:
            # Only masked blocks can leave a row at m = -inf; subtracting 0 there avoids inf - inf = NaN.
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_ref = m_new
        p = tl.math.exp2(qk - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = desc_v.load([kv_row, start_n, 0]).reshape(BLOCK_N, HEAD_DIM)
        acc = _mma(p, v, acc * alpha[:, None], DOT)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attn_fwd_tma(desc_q,  # [B*H, S_q, D] descriptor, block [1, BLOCK_M, D]
                  desc_k,  # [B*H_kv, S_k, D] descriptor, block [1, BLOCK_N, D]
                  desc_v,  # [B*H_kv, S_k, D] descriptor, block [1, BLOCK_N, D]
                  desc_o,  # [B*H, S_q, D] descriptor, block [1, BLOCK_M, D], dtype of q
                  Lse,  # [B, H, S_q] float32, contiguous; base-2 log-sum-exp of the scaled scores
                  group_size, seq_q, seq_k, qk_scale,
                  SEQ_Q_BUCKET, SEQ_K_BUCKET, BATCH_HEADS_BUCKET,  # autotuning keys only
                  HEAD_DIM: tl.constexpr, CAUSAL: tl.constexpr, DOT: tl.constexpr, FLAT_GRID: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr = False):
    num_m_blocks = tl.cdiv(seq_q, BLOCK_M)
    pid_m, pid_bh = _program_ids(num_m_blocks, FLAT_GRID)
    if CAUSAL != 0:
        # Later query blocks see more keys; launching them first lets the short ones fill the tail of the grid.
        pid_m = num_m_blocks - 1 - pid_m
    start_m = pid_m * BLOCK_M
    # Slices are (batch, head)-major and H = H_kv * group_size, so b * H_kv + h // group_size reduces to this.
    kv_row = pid_bh // group_size

    q = desc_q.load([pid_bh, start_m, 0]).reshape(BLOCK_M, HEAD_DIM)
    offs_m = start_m + tl.arange(0, BLOCK_M)
    # No key padding here: the lengths pointer is never read, so any pointer fills the slot.
    n_len, diag_shift, full_end, hi = _key_range(Lse, 0, start_m, seq_q, seq_k, BLOCK_M, BLOCK_N, CAUSAL, "none")

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    acc, l_i, m_i = _attn_fwd_tma_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, offs_m, 0, full_end, n_len,
                                        diag_shift, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DOT, False,
                                        WARP_SPECIALIZE)
    acc, l_i, m_i = _attn_fwd_tma_inner(acc, l_i, m_i, q, desc_k, desc_v, kv_row, offs_m, full_end, hi, n_len,
                                        diag_shift, qk_scale, BLOCK_M, BLOCK_N, HEAD_DIM, CAUSAL, DOT, True, False)

    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc * (1.0 / l_safe)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))

    # A 1-D row of S_q floats is rarely 16-byte aligned per slice (S_q % 4 != 0), so lse keeps a masked store.
    tl.store(Lse + pid_bh.to(tl.int64) * seq_q + offs_m, lse, mask=offs_m < seq_q)
    out = _cast_out(out, desc_o.dtype, DOT)
    desc_o.store([pid_bh, start_m, 0], out.reshape(1, BLOCK_M, HEAD_DIM))


# ----------------------------------------------------------------------------------------------------------------
# Autotuning

# (BLOCK_M, BLOCK_N, num_warps, num_stages) tried on a GPU; with FLASHLITE_AUTOTUNE=0 the first one that fits is
# used. The last entry is small enough for D=256 in float32, where shared-memory pruning drops the rest.
TMA_GPU_BLOCKS: list[tuple[int, int, int, int]] = [
    (128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 4), (64, 64, 4, 3), (64, 32, 4, 2),
]
# One config under the interpreter, where tuning would only cost time; BLOCK_M != BLOCK_N on purpose so that CPU
# tests exercise diagonal blocks that straddle several key blocks.
TMA_INTERPRETER_BLOCKS: list[tuple[int, int, int, int]] = [(32, 16, 4, 1)]

TMA_AUTOTUNE_KEY = ["SEQ_Q_BUCKET", "SEQ_K_BUCKET", "BATCH_HEADS_BUCKET", "HEAD_DIM", "CAUSAL", "DOT"]


def _set_block_shapes(nargs: dict) -> None:
    """Give the descriptors the tile shape of the config about to run. The host descriptors are built before the
    config is known, and the kernel is compiled for the block shape they carry, so this runs before every
    launch, benchmarking runs included."""
    head_dim = nargs["HEAD_DIM"]
    nargs["desc_q"].block_shape = [1, nargs["BLOCK_M"], head_dim]
    nargs["desc_o"].block_shape = [1, nargs["BLOCK_M"], head_dim]
    nargs["desc_k"].block_shape = [1, nargs["BLOCK_N"], head_dim]
    nargs["desc_v"].block_shape = [1, nargs["BLOCK_N"], head_dim]


def _make_configs(blocks: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages,
                          pre_hook=_set_block_shapes)
            for bm, bn, warps, stages in blocks]


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    # The same shared-memory / register budget as the pointer kernel: TMA stages the same tiles in shared memory.
    return prune_by_resources(configs, {"Q": named_args["desc_q"].base, "BLOCK_D": kwargs["HEAD_DIM"]},
                              streamed=("BLOCK_N", "BLOCK_M"), resident="BLOCK_M")


def _configs() -> list[triton.Config]:
    return _make_configs(TMA_INTERPRETER_BLOCKS if _runtime.interpreting() else TMA_GPU_BLOCKS)


# Tensor descriptors carry no dtype attribute the autotuner would add to its key, so DOT (one value per input
# dtype) keeps float16, bfloat16 and float32 tunings apart.
attn_fwd_tma = triton.autotune(configs=_configs(), key=TMA_AUTOTUNE_KEY,
                               prune_configs_by={"early_config_prune": _prune_configs})(_attn_fwd_tma)


# ----------------------------------------------------------------------------------------------------------------
# Launcher

Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)

# The config tuned per tuning key. Later calls launch the plain kernel with it: the autotuner's own per-call
# bookkeeping costs tens of microseconds of host time, as much as a small kernel.
_TUNED: dict[tuple, Config] = {}


def _input_problem(q: object, k: object, v: object) -> Optional[tuple[type[Exception], str]]:
    """The first reason the kernel cannot take these inputs, with the exception type the launcher raises."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            return TypeError, f"{name} must be a torch.Tensor, got {type(t).__name__}"
        if t.dim() != 4:
            return ValueError, f"{name} must have 4 dimensions [B, H, S, D], got shape {tuple(t.shape)}"
    if q.dtype not in _SUPPORTED_DTYPES:
        return TypeError, f"q has dtype {q.dtype}; the TMA kernel supports float16, bfloat16 and float32"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return TypeError, f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}"
    if k.device != q.device or v.device != q.device:
        return ValueError, f"q, k and v must be on one device, got q {q.device}, k {k.device}, v {v.device}"
    if not _runtime.kernel_device_ok(q):
        return ValueError, (f"tensors are on {q.device}; the kernel runs on CUDA devices, or on the CPU only "
                            f"through the Triton interpreter (TRITON_INTERPRET=1)")
    batch, heads, seq_q, head_dim = q.shape
    if k.shape != v.shape:
        return ValueError, f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}"
    batch_k, kv_heads, seq_k, head_dim_k = k.shape
    if batch_k != batch:
        return ValueError, f"batch size differs: q has {batch}, k and v have {batch_k}"
    if head_dim_k != head_dim:
        return ValueError, f"head dim differs: q has {head_dim}, k and v have {head_dim_k}"
    if kv_heads == 0 or heads % kv_heads != 0:
        return ValueError, (f"q has {heads} heads and k, v have {kv_heads}: the number of q heads must be a "
                            f"multiple of the k/v heads (grouped-query attention)")
    if min(batch, heads, seq_q, seq_k) == 0:
        return ValueError, f"empty input: q {tuple(q.shape)}, k {tuple(k.shape)}"
    if not (MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM and head_dim & (head_dim - 1) == 0):
        return ValueError, (f"head dim {head_dim} is not supported: the TMA kernel needs a power of two in "
                            f"{MIN_HEAD_DIM}..{MAX_HEAD_DIM} (descriptor tiles span the whole head dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not t.is_contiguous():
            return ValueError, (f"{name} is not contiguous (strides {t.stride()}); the TMA kernel views it as "
                                f"[B*H, S, D], so pass {name}.contiguous()")
    return None


def _tma_problem(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why validated inputs still cannot go through tensor descriptors on this device, or None."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.data_ptr() % _TMA_ALIGNMENT != 0:
            return (f"{name}'s data pointer {t.data_ptr():#x} is not {_TMA_ALIGNMENT}-byte aligned (a view with a "
                    f"storage offset?); tensor descriptors need aligned base addresses")
        row_bytes = t.shape[-1] * t.element_size()
        slice_bytes = t.shape[-2] * row_bytes
        if row_bytes % _TMA_ALIGNMENT or slice_bytes % _TMA_ALIGNMENT:
            return f"{name}'s strides are not multiples of {_TMA_ALIGNMENT} bytes, which tensor descriptors need"
        if slice_bytes >= _TMA_STRIDE_LIMIT or t.shape[0] * t.shape[1] >= _INT32_LIMIT:
            return f"{name} {tuple(t.shape)} is too large for a tensor descriptor (strides < 2**40 bytes)"
    if q.is_cuda:
        major, minor = torch.cuda.get_device_capability(q.device)
        if major < 9:
            return (f"the GPU (compute capability {major}.{minor}) has no TMA unit; tensor descriptors need "
                    f"9.0 (Hopper) or newer")
    return None


def tma_supported(q: object, k: object, v: object) -> Optional[str]:
    """Why ``attention_forward_tma`` cannot run on these inputs, or None when it can.

    Covers everything the launcher would reject about the tensors: types, dtypes, shapes, head dim, contiguity,
    device, 16-byte alignment of base pointers and strides, and a GPU without TMA (compute capability < 9.0).

    Example:
        >>> tma_supported(torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8, 64), "v")
        'v must be a torch.Tensor, got str'
    """
    problem = _input_problem(q, k, v)
    if problem is not None:
        return problem[1]
    return _tma_problem(q, k, v)


def _check_config(config: object) -> Config:
    if (not isinstance(config, tuple) or len(config) != 4
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in config)):
        raise ValueError(f"config must be (BLOCK_M, BLOCK_N, num_warps, num_stages) of positive integers, "
                         f"got {config!r}")
    block_m, block_n = config[0], config[1]
    for name, block in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if block < 16 or block > 256 or block & (block - 1):
            raise ValueError(f"config {config!r}: {name} must be a power of two in 16..256 (a descriptor "
                             f"block dimension), got {block}")
    return config


def _dot_mode(dtype: torch.dtype) -> str:
    if dtype == torch.float16:
        return "fp16"
    if dtype == torch.bfloat16:
        # The interpreter's bf16 tl.dot is broken: round operands to bf16 and multiply in fp32 instead.
        return "bf16_emulated" if _runtime.interpreting() else "bf16"
    return "tf32"


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A descriptor over the [B*H, S, D] view of a contiguous [B, H, S, D] tensor with [1, rows, D] tiles."""
    batch, heads, seq, head_dim = t.shape
    return TensorDescriptor.from_tensor(t.view(batch * heads, seq, head_dim), [1, rows, head_dim])


def attention_forward_tma(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal_mode: int, scale: float,
                          config: Optional[Config] = None,
                          warp_specialize: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention forward through tensor descriptors (TMA on Hopper): returns (out, lse).

    Args:
        q: [B, H, S_q, D], contiguous, float16 / bfloat16 / float32 (float32 multiplies in tf32).
        k, v: [B, H_kv, S_k, D], contiguous, q's dtype; H must be a multiple of H_kv.
        causal_mode: 0 none; 1 top-left (query i sees keys j <= i, SDPA's ``is_causal``); 2 bottom-right
            (j <= i + S_k - S_q).
        scale: multiplies q . k before the softmax (usually 1 / sqrt(D)).
        config: (BLOCK_M, BLOCK_N, num_warps, num_stages) to skip autotuning.
        warp_specialize: compile the unmasked key loop with Triton's automatic warp specialization (separate
            load and compute warp groups). Needs an explicit ``config``: tuned configs are kept without it.

    Returns:
        out [B, H, S_q, D] in q's dtype, and lse [B, H, S_q] float32, the base-2 log-sum-exp of the scaled scores
        (natural lse * log2(e)) as ``attention_bwd`` expects. Rows that see no key get out = 0 and lse = -inf.

    Raises:
        TypeError: a non-tensor input, an unsupported or mismatched dtype, a non-integer causal_mode or a
            non-number scale.
        ValueError: mismatched shapes, H not a multiple of H_kv, an unsupported head dim, a non-contiguous input,
            a wrong device, misaligned data, a GPU without TMA, or a bad causal_mode or config.

    Example:
        >>> q = torch.randn(1, 2, 40, 16, dtype=torch.float16)
        >>> out, lse = attention_forward_tma(q, q, q, causal_mode=1, scale=0.25)  # doctest: +SKIP
        >>> out.shape, lse.shape  # doctest: +SKIP
        (torch.Size([1, 2, 40, 16]), torch.Size([1, 2, 40]))
    """
    problem = _input_problem(q, k, v)
    if problem is not None:
        raise problem[0](problem[1])
    reason = _tma_problem(q, k, v)
    if reason is not None:
        raise ValueError(f"the TMA kernel cannot run this call: {reason}")
    if isinstance(causal_mode, bool) or not isinstance(causal_mode, int):
        raise TypeError(f"causal_mode must be the int 0, 1 or 2, got {causal_mode!r}")
    if causal_mode not in (0, 1, 2):
        raise ValueError(f"causal_mode must be 0 (none), 1 (top-left) or 2 (bottom-right), got {causal_mode}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if config is not None:
        config = _check_config(config)
    if not isinstance(warp_specialize, bool):
        raise TypeError(f"warp_specialize must be a bool, got {warp_specialize!r}")
    if warp_specialize and config is None:
        raise ValueError("warp_specialize=True needs an explicit config (BLOCK_M, BLOCK_N, num_warps, num_stages)")

    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    batch_heads = batch * heads
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    dot = _dot_mode(q.dtype)
    buckets = tuning_buckets(seq_q, seq_k, batch_heads)
    flat_grid = batch_heads > _runtime.GRID_AXIS1_LIMIT

    # Block shapes are placeholders until a config is chosen (see _set_block_shapes).
    desc_q, desc_o = _descriptor(q, 16), _descriptor(out, 16)
    desc_k, desc_v = _descriptor(k, 16), _descriptor(v, 16)
    args = (desc_q, desc_k, desc_v, desc_o, lse, heads // k.shape[1], seq_q, seq_k, scale * math.log2(math.e),
            *buckets)
    meta = dict(HEAD_DIM=head_dim, CAUSAL=causal_mode, DOT=dot, FLAT_GRID=flat_grid)
    grid = _grid(seq_q, batch_heads, flat_grid)

    if config is None:
        tuning_key = (*buckets, head_dim, causal_mode, dot)
        config = _TUNED.get(tuning_key)
        if config is None:
            if _runtime.interpreting() or os.environ.get("FLASHLITE_AUTOTUNE", "1") not in ("0", ""):
                attn_fwd_tma[grid](*args, **meta)
                best = attn_fwd_tma.best_config
                _TUNED[tuning_key] = (best.kwargs["BLOCK_M"], best.kwargs["BLOCK_N"], best.num_warps,
                                      best.num_stages)
                return out, lse
            first = _prune_configs(_make_configs(TMA_GPU_BLOCKS), {"desc_q": desc_q}, HEAD_DIM=head_dim)[0]
            config = (first.kwargs["BLOCK_M"], first.kwargs["BLOCK_N"], first.num_warps, first.num_stages)
    block_m, block_n, num_warps, num_stages = config
    forced = dict(BLOCK_M=block_m, BLOCK_N=block_n)
    _set_block_shapes({"desc_q": desc_q, "desc_k": desc_k, "desc_v": desc_v, "desc_o": desc_o,
                       "HEAD_DIM": head_dim, **forced})
    try:
        _attn_fwd_tma[grid](*args, **meta, **forced, WARP_SPECIALIZE=warp_specialize, num_warps=num_warps,
                            num_stages=num_stages)
    except RuntimeError as error:
        if not warp_specialize or "PassManager" not in str(error):
            raise
        # Triton 3.6's Hopper warp-specialization pass rejects some configs (on an H200: every 4-warp one).
        raise RuntimeError(f"Triton could not warp-specialize the key loop with config {config} "
                           f"(BLOCK_M, BLOCK_N, num_warps, num_stages); use 8 warps or warp_specialize=False. "
                           f"Compiler error: {str(error).splitlines()[0] if str(error) else error!r}") from error
    return out, lse


def _grid(seq_q: int, batch_heads: int, flat: bool) -> Callable[[dict], tuple[int, ...]]:
    if flat:
        return lambda meta: (cdiv(seq_q, meta["BLOCK_M"]) * batch_heads,)
    return lambda meta: (cdiv(seq_q, meta["BLOCK_M"]), batch_heads)
