"""Launch the Gluon attention backward (``flashlite.kernels.attention_bwd_gluon``: dK/dV and dQ) on Hopper.

``gluon_attention_dkdv`` and ``gluon_attention_dq`` take what the pointer kernels' backward takes (the forward's out
and base-2 lse, from either forward) and return dK and dV, and dQ. They accept the calls ``gluon_supported``
accepts (sm_90, bf16/fp16, head dim 64 or 128, every causal mode, GQA, layouts TMA can describe); an incoming
gradient whose layout TMA cannot describe is copied to a contiguous one first. dK/dV runs on a single-partition
kernel, dQ on a warp-specialized one (a TMA producer warp and two consumer warpgroups): each the faster of its
kind at D=128 in an 8ca4529 run.

``flashlite.attention``'s backward (``triton_bwd.launch_backward``) runs these kernels instead of the pointer dK/dV and
dQ kernels (after the pointer delta kernel) only where ``backward_on_gluon`` says so: FLASHLITE_GLUON on (the
switch of the Gluon forward too), a dense call without key masks or variants that the kernels can run, with q, k
and v on 16-byte boundaries, and only where the A/B (``tests/perf/test_gluon_ab.py``) measured it faster than the
pointer backward (``measured_faster``: bf16, head dim 128, causal, as many queries as keys and at least 4,096).
(The single-partition dQ kernel, and the FLASHLITE_GLUON_BWD values that ran it or the pointer dK/dV kernel beside
the Gluon dQ kernel on every call, were deleted: no default dispatch selected them, and each measured slower than
this pair; BENCHMARKS.md at commit 8ca4529 keeps their numbers, git their code.)
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import torch

from flashlite.attn import gluon as launch_gluon
from flashlite.attn.gluon import _CAUSAL, _layout_problem, gluon_supported, tile_descriptor
from flashlite.attn.problem import _CAUSAL_ARGUMENT, CAUSAL_NONE, Problem

try:
    from flashlite.kernels import attention_bwd_gluon as _kernels
except ImportError:  # pragma: no cover - Triton without Gluon; gluon_supported then says so
    _kernels = None

# A FLASHLITE_GLUON_BWD left in an environment from before the switch went would otherwise be ignored without a
# word: FLASHLITE_GLUON_BWD=0 no longer keeps the backward off the Gluon kernels, FLASHLITE_GLUON=0 does.
if "FLASHLITE_GLUON_BWD" in os.environ:
    warnings.warn("FLASHLITE_GLUON_BWD is no longer read: FLASHLITE_GLUON turns the Gluon forward and backward on "
                  "or off together (docs/flashlite.md lists the switches)", stacklevel=2)

# measured_faster's rule. An H100 run (7de8265; benchmarks/results/h100-2026-12-05-c/ at commit 8ca4529), forward+
# backward of flashlite.attention, bf16, causal, H=16, these kernels against the pointer backward: at D=128 1.101x,
# 1.162x, 1.119x (cases 3, 6, 12: B=1 S=8192, B=8 S=4096, B=16 S=8192; wins); at D=64 0.874x, 0.865x, 0.905x
# (losses). Shorter sequences, S_q != S_k, non-causal and fp16 calls were not measured, so they keep the pointer
# backward.
GLUON_BWD_HEAD_DIMS = (128,)
GLUON_BWD_MIN_SEQ = 4096
KERNELS = ("dkdv", "dq")


@dataclass(frozen=True)
class GluonBwdConfig:
    """One compiled shape of a backward kernel (``kernel``: "dkdv" or "dq"): the rows a warpgroup owns (BLOCK_N
    keys for dK/dV, BLOCK_M query rows for dQ, whose kernel has two consumer warpgroups, each owning that many),
    the rows of each tile streamed past them, ring depth and warps (of the default partition for dQ).

    Example:
        >>> GluonBwdConfig("dkdv", 128, 64, 2, 8).shared_bytes(128)
        131072
        >>> GluonBwdConfig("dq", 64, 64, 2, 4).program_rows
        128
    """

    kernel: str
    own_rows: int
    streamed_rows: int
    stages: int
    num_warps: int

    @property
    def program_rows(self) -> int:
        """Keys (dK/dV) or query rows (dQ: two consumer warpgroups) one program covers."""
        return 2 * self.own_rows if self.kernel == "dq" else self.own_rows

    def shared_bytes(self, head_dim: int) -> int:
        return _kernels.shared_memory_bytes(self.program_rows, self.streamed_rows, self.stages, head_dim)


def bwd_configs_for(head_dim: int, kernel: str = "dkdv") -> list[GluonBwdConfig]:
    """Every config the kernel file lists for ``kernel`` ("dkdv" or "dq") at ``head_dim``, the launcher's first.

    Example:
        >>> config = bwd_configs_for(128)[0]
        >>> config.own_rows, config.streamed_rows, config.stages, config.num_warps
        (64, 64, 2, 4)
        >>> bwd_configs_for(64, "dq")[0].program_rows
        128
    """
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    listed = {"dkdv": _kernels.GLUON_BWD_CONFIGS, "dq": _kernels.GLUON_DQ_WS_CONFIGS}[kernel]
    return [GluonBwdConfig(kernel, *blocks) for blocks in listed[head_dim]]


def kernel_for(config: GluonBwdConfig):
    """The Gluon kernel that runs ``config``: ``_attn_bwd_dkdv`` or the warp-specialized ``_attn_bwd_dq_ws``."""
    return _kernels._attn_bwd_dq_ws if config.kernel == "dq" else _kernels._attn_bwd_dkdv


def dq_kernel_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                        dq: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor, causal_mode: int, scale: float,
                        config: GluonBwdConfig) -> tuple[tuple, dict]:
    """(positional arguments, constexprs and launch options) of one dQ launch, in the kernel's parameter order."""
    heads, kv_heads = q.shape[1], k.shape[1]
    block_m, block_n = config.own_rows, config.streamed_rows
    tiles = [tile_descriptor(t, rows) for t, rows in ((q, block_m), (k, block_n), (v, block_n), (grad_out, block_m),
                                                      (dq, block_m))]
    args = (*tiles, lse, delta, heads, heads // kv_heads, q.shape[2], k.shape[2], scale * math.log2(math.e), scale)
    # maxnreg: the register cap the partitions' split needs (see BWD_WS_MAXNREG).
    meta = dict(HEAD_DIM=q.shape[-1], BLOCK_M=block_m, BLOCK_N=block_n, STAGES=config.stages,
                CAUSAL=causal_mode, num_warps=config.num_warps, maxnreg=_kernels.BWD_WS_MAXNREG)
    return args, meta


def dkdv_kernel_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor,
                          dk: torch.Tensor, dv: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
                          causal_mode: int, scale: float, config: GluonBwdConfig) -> tuple[tuple, dict]:
    """(positional arguments, constexprs and launch options) of one dK/dV launch, in the kernel's parameter
    order."""
    head_dim = q.shape[-1]
    heads, kv_heads = q.shape[1], k.shape[1]
    block_n, block_m = config.own_rows, config.streamed_rows
    tiles = [tile_descriptor(t, rows) for t, rows in ((q, block_m), (k, block_n), (v, block_n), (grad_out, block_m),
                                                      (dk, block_n), (dv, block_n))]
    args = (*tiles, lse, delta, heads, heads // kv_heads, q.shape[2], k.shape[2], scale * math.log2(math.e), scale)
    meta = dict(HEAD_DIM=head_dim, BLOCK_N=block_n, BLOCK_M=block_m, STAGES=config.stages,
                CAUSAL=causal_mode, num_warps=config.num_warps)
    return args, meta


def tma_gradient(grad_out: torch.Tensor) -> torch.Tensor:
    """``grad_out`` itself, or a contiguous copy where TMA cannot describe its layout (autograd may hand over an
    expanded or transposed gradient): made once per backward, for both kernels."""
    return grad_out if _layout_problem("grad_out", grad_out) is None else grad_out.contiguous()


def _checked(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
             lse: torch.Tensor, causal: Union[bool, str],
             scale: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(grad_out as ``tma_gradient`` returns it, delta, scale) of a direct call, after checking it (ValueError
    naming the argument)."""
    reason = gluon_supported(q, k, v, causal, scale)
    if reason is not None:
        raise ValueError(f"the Gluon attention backward cannot run this call: {reason}")
    for name, t in (("grad_out", grad_out), ("out", out)):
        if t.shape != q.shape or t.dtype != q.dtype or t.device != q.device:
            raise ValueError(f"{name} must match q ({tuple(q.shape)}, {q.dtype}, {q.device}); got "
                             f"{tuple(t.shape)}, {t.dtype}, {t.device}")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or lse.device != q.device:
        raise ValueError(f"lse must be float32 {tuple(q.shape[:3])} on {q.device}; got {lse.dtype} "
                         f"{tuple(lse.shape)} on {lse.device}")
    # rowsum(dO * O) in float32, one per query row: what dS = P * (dP - delta) subtracts.
    delta = (grad_out.float() * out.float()).sum(-1)
    return tma_gradient(grad_out), delta, 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def gluon_attention_dkdv(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         out: torch.Tensor, lse: torch.Tensor, causal: Union[bool, str] = False,
                         scale: Optional[float] = None,
                         config: Optional[GluonBwdConfig] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dk, dv) of attention(q, k, v) for the output gradient ``grad_out``, through the Gluon kernel.

    ``out`` and ``lse`` are the forward's ([B, H, S_q, D] and float32 [B, H, S_q], base-2 log-sum-exp of the scaled
    scores, as ``flashlite.attn.triton.attention_forward`` and the Gluon forward return them). dk and dv
    are contiguous, in k's and v's dtype. Raises ValueError with ``gluon_supported``'s reason when the kernel cannot
    run the call, or naming the argument whose shape or dtype does not match q's.

    Example:
        >>> from flashlite.attn.gluon import gluon_attention_forward
        >>> q = torch.randn(2, 16, 1000, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> out, lse = gluon_attention_forward(q, q, q, causal=True)  # doctest: +SKIP
        >>> dk, dv = gluon_attention_dkdv(torch.randn_like(q), q, q, q, out, lse, causal=True)  # doctest: +SKIP
    """
    grad_out, delta, scale = _checked(grad_out, q, k, v, out, lse, causal, scale)
    head_dim = q.shape[-1]
    config = config or bwd_configs_for(head_dim)[0]
    if config not in bwd_configs_for(head_dim, "dkdv"):
        raise ValueError(f"config {config} is not listed for the dK/dV kernel at head dim {head_dim}: "
                         f"{bwd_configs_for(head_dim, 'dkdv')}")
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    launch_dkdv(q, k, v, grad_out, lse.contiguous(), delta, dk, dv, _CAUSAL[causal], scale, config)
    return dk, dv


def launch_dkdv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
                delta: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, causal_mode: int, scale: float,
                config: Optional[GluonBwdConfig] = None) -> None:
    """Write dK and dV of a checked call into ``dk`` and ``dv`` (contiguous, k's and v's shapes): ``grad_out`` as
    ``tma_gradient`` returns it, ``lse`` and ``delta`` contiguous float32 [B, H, S_q]. What
    ``gluon_attention_dkdv`` and ``triton_bwd.launch_backward`` launch; without ``config``, the kernel's first listed
    config."""
    config = config or bwd_configs_for(q.shape[-1], "dkdv")[0]
    args, meta = dkdv_kernel_arguments(q, k, v, grad_out, dk, dv, lse, delta, causal_mode, scale, config)
    grid = (math.ceil(k.shape[2] / config.program_rows), k.shape[0] * k.shape[1])
    kernel_for(config)[grid](*args, **meta)


def launch_dq(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad_out: torch.Tensor, lse: torch.Tensor,
              delta: torch.Tensor, dq: torch.Tensor, causal_mode: int, scale: float,
              config: Optional[GluonBwdConfig] = None) -> None:
    """Write dQ of a checked call into ``dq`` (contiguous, q's shape), as ``launch_dkdv`` does dK and dV."""
    config = config or bwd_configs_for(q.shape[-1], "dq")[0]
    args, meta = dq_kernel_arguments(q, k, v, grad_out, dq, lse, delta, causal_mode, scale, config)
    grid = (math.ceil(q.shape[2] / config.program_rows), q.shape[0] * q.shape[1])
    kernel_for(config)[grid](*args, **meta)


def gluon_attention_dq(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, lse: torch.Tensor, causal: Union[bool, str] = False,
                       scale: Optional[float] = None, config: Optional[GluonBwdConfig] = None) -> torch.Tensor:
    """dq of attention(q, k, v) for the output gradient ``grad_out``, through the Gluon kernel; the arguments and
    errors as in ``gluon_attention_dkdv``. dq is contiguous, in q's dtype.

    Example:
        >>> dq = gluon_attention_dq(torch.randn_like(q), q, q, q, out, lse, causal=True)  # doctest: +SKIP
    """
    grad_out, delta, scale = _checked(grad_out, q, k, v, out, lse, causal, scale)
    config = config or bwd_configs_for(q.shape[-1], "dq")[0]
    if config not in bwd_configs_for(q.shape[-1], "dq"):
        raise ValueError(f"config {config} is not listed for the dQ kernel at head dim {q.shape[-1]}: "
                         f"{bwd_configs_for(q.shape[-1], 'dq')}")
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    launch_dq(q, k, v, grad_out, lse.contiguous(), delta, dq, _CAUSAL[causal], scale, config)
    return dq


def measured_faster(problem: Problem) -> bool:
    """Whether the Gluon backward measured faster than the pointer backward for calls like ``problem``: bf16, head
    dim 128 (``GLUON_BWD_HEAD_DIMS``), causal with as many queries as keys, at least ``GLUON_BWD_MIN_SEQ`` of them
    (see there for the runs).

    Example:
        >>> from flashlite.attn.problem import validate
        >>> q = torch.randn(1, 2, 4096, 128, dtype=torch.bfloat16)
        >>> measured_faster(validate(q, q, q, True, None, None, None, "triton", None))
        True
        >>> measured_faster(validate(q, q, q, False, None, None, None, "triton", None))
        False
    """
    return (problem.dtype == torch.bfloat16 and problem.head_dim in GLUON_BWD_HEAD_DIMS
            and problem.causal_mode != CAUSAL_NONE and problem.seq_q == problem.seq_k
            and problem.seq_q >= GLUON_BWD_MIN_SEQ)


def backward_kernel_for(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why a Triton plan's backward runs on the Gluon kernels (a reason for ``explain_dispatch``), or None for the
    pointer kernels: ``backward_on_gluon``'s rule, said in words.

    Example:
        >>> from flashlite.attn.problem import validate
        >>> q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
        >>> backward_kernel_for(validate(q, q, q, True, None, None, None, "triton", None), q, q, q) is None
        True
    """
    if not backward_on_gluon(problem, q, k, v):
        return None
    head_dims = " or ".join(str(d) for d in GLUON_BWD_HEAD_DIMS)
    return (f"backward: dK/dV on the Gluon kernel, dQ on the warp-specialized Gluon kernel, for calls with 16-byte "
            f"aligned q, k, v (measured faster than the pointer backward for bf16, D={head_dims}, causal, "
            f"S_q == S_k >= {GLUON_BWD_MIN_SEQ}; FLASHLITE_GLUON=0 turns it off)")


def backward_on_gluon(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether ``launch_backward`` runs a call's dK/dV and dQ on the Gluon kernels: FLASHLITE_GLUON on
    (``gluon.GLUON_ENABLED``), a dense call without key masks, variants or packed sequences, one where they
    ``measured_faster``, and one the kernels can run (``gluon_supported``).

    Example:
        >>> from flashlite.attn.problem import validate
        >>> q = torch.randn(1, 2, 16, 64, dtype=torch.bfloat16)
        >>> backward_on_gluon(validate(q, q, q, True, None, None, None, "triton", None), q, q, q)
        False
    """
    if not (launch_gluon.GLUON_ENABLED and problem.variant == "dense" and problem.key_masking == "none"
            and not problem.varlen and problem.page_size == 0 and measured_faster(problem)):
        return False
    causal = _CAUSAL_ARGUMENT.get(problem.causal_mode)
    # Kept per plan, so no address check here: launch_backward checks each call's (bases_aligned).
    return causal is not None and gluon_supported(q, k, v, causal, problem.scale, addresses=False) is None
