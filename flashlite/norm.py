"""LayerNorm, residual-add + LayerNorm and bias + exact GELU on flashlite's Triton kernels.

Three layers, as for every flashlite kernel: the raw kernels in ``flashlite.kernels.layer_norm``; launchers here
that check inputs, flatten to rows and compute the grid; and ``torch.library`` custom ops with fake (meta)
implementations and registered autograd, so that ``torch.compile`` treats each kernel as one opaque call and
fuses what is around it.

Public entry points: :func:`layer_norm`, :func:`add_layer_norm`, :func:`bias_gelu`.
"""
from __future__ import annotations

import functools
import math
import numbers
from typing import Optional

import torch

from flashlite._double_backward import bias_gelu_gradients, layer_norm_gradients
from flashlite._intmath import cdiv, next_power_of_2
from flashlite._ops import eager_function, run
from flashlite._runtime import interpreting, kernel_device_ok
from flashlite.kernels.layer_norm import (
    _bias_gelu_bwd_kernel,
    _bias_gelu_fwd_kernel,
    _layer_norm_bwd_kernel,
    _layer_norm_fwd_kernel,
)

# A row lives in registers of one program; past this length the registers spill and a split-row kernel would be
# needed. 32768 covers every hidden size in use today.
MAX_ROW_LENGTH = 32768
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Elements per program of the GELU kernels on a GPU.
_ELEMENTWISE_BLOCK = 1024
# Elements per program under the Triton interpreter, where every program costs Python overhead.
_INTERPRETER_TILE = 1 << 16


# ----------------------------------------------------------------------------------------------------------------
# Input checks and launch geometry
# ----------------------------------------------------------------------------------------------------------------


def _check_kernel_tensor(name: str, t: torch.Tensor, op: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
    if not kernel_device_ok(t):
        raise ValueError(
            f"{op}: {name} is on {t.device}, where the Triton kernel cannot run (it needs a CUDA device, or the CPU "
            "with TRITON_INTERPRET=1); use torch.nn.functional for this device"
        )


def _check_row_params(op: str, x: torch.Tensor, row_limit: bool = True, **params: torch.Tensor) -> int:
    n = x.shape[-1] if x.dim() > 0 else 0
    if x.dim() == 0 or n == 0:
        raise ValueError(f"{op}: x must have a non-empty last dimension, got shape {tuple(x.shape)}")
    if row_limit and n > MAX_ROW_LENGTH:
        raise ValueError(f"{op}: rows of {n} elements exceed the kernel's limit of {MAX_ROW_LENGTH}")
    for name, p in params.items():
        _check_kernel_tensor(name, p, op)
        if p.shape != (n,):
            raise ValueError(f"{op}: {name} must have shape ({n},) to match x's last dimension, got {tuple(p.shape)}")
        if p.device != x.device:
            raise ValueError(f"{op}: {name} is on {p.device} but x is on {x.device}")
    return n


def _rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """View ``t`` as [M, n] rows with unit column stride (copying only when the layout needs it).

    The kernels take any row stride (0 for rows expanded from one) and the storage offset through the pointer;
    a transposed tensor, or leading dimensions that do not flatten into one row stride, get a copy.
    """
    rows = t.reshape(-1, n)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _row_launch(m: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the LayerNorm kernels, which hold BLOCK_M whole rows per program.

    On a GPU: tiles of at least ~1024 elements (one row when rows are that wide), about 8 elements per thread.
    Under the interpreter each program costs Python time, so a tile takes up to 64K elements.
    """
    block_n = next_power_of_2(n)
    tile = _INTERPRETER_TILE if interpreting() else 1024
    block_m = max(1, min(tile // block_n, next_power_of_2(max(m, 1))))
    return block_m, block_n, min(max(block_m * block_n // 256, 1), 16)


def _elementwise_block(numel: int) -> int:
    if interpreting():
        return min(_INTERPRETER_TILE, next_power_of_2(max(numel, 1)))
    return _ELEMENTWISE_BLOCK


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _backward_programs(m: int, device: torch.device) -> int:
    # Enough programs to fill the GPU a few times over; each writes one row of dW/dB partial sums, so more programs
    # mean a longer final reduction. The interpreter runs programs one after another, so few is best there.
    target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 4
    return max(1, min(m, target))


# ----------------------------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------------------------


def _launch_layer_norm_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor],
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    n = x.shape[-1]
    x2 = _rows(x, n)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
    summed = r2 = None
    if residual is not None:
        r2 = _rows(residual, n)
        summed = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m > 0:
        block_m, block_n, warps = _row_launch(m, n)
        _layer_norm_fwd_kernel[(cdiv(m, block_m),)](
            x2, r2 if r2 is not None else x2, summed if summed is not None else x2,
            weight, bias, y, rstd,
            x2.stride(0), r2.stride(0) if r2 is not None else 0, summed.stride(0) if summed is not None else 0,
            y.stride(0), weight.stride(0), bias.stride(0), m, n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_RTNE=interpreting(),
            num_warps=warps,
        )
    shape = x.shape
    return (
        y.view(shape),
        summed.view(shape) if summed is not None else None,
        rstd.view(shape[:-1]),
    )


def _launch_layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dsum: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    x2, dy2 = _rows(x, n), _rows(dy, n)
    ds2 = _rows(dsum, n) if dsum is not None else None
    m = x2.shape[0]
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_m, block_n, warps = _row_launch(m, n)
    programs = _backward_programs(m, x.device) if m > 0 else 1
    # Each program takes a run of whole row tiles.
    rows_per_program = cdiv(cdiv(max(m, 1), programs), block_m) * block_m
    programs = cdiv(max(m, 1), rows_per_program)
    dw_partial = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    db_partial = torch.zeros((programs, n), dtype=torch.float32, device=x.device)
    if m > 0:
        _layer_norm_bwd_kernel[(programs,)](
            x2, weight, dy2, ds2 if ds2 is not None else dy2, dx, dw_partial, db_partial,
            rstd.reshape(-1),  # contiguous [M] in x's row order (a copy only if a caller passed a strided one)
            x2.stride(0), dy2.stride(0), ds2.stride(0) if ds2 is not None else 0, dx.stride(0), weight.stride(0),
            m, n, rows_per_program,
            HAS_DSUM=ds2 is not None, BLOCK_M=block_m, BLOCK_N=block_n, EMULATE_RTNE=interpreting(),
            num_warps=warps,
        )
    # The partial sums are reduced in float32 and rounded once to the parameter dtype.
    dw = dw_partial.sum(0).to(weight.dtype)
    db = db_partial.sum(0).to(weight.dtype)
    return dx.view(x.shape), dw, db


def _launch_bias_gelu_fwd(x: torch.Tensor, bias: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    # The kernel walks x as one flat array (a copy unless x is contiguous); bias may have any stride.
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    numel = x.numel()
    if numel > 0:
        block = _elementwise_block(numel)
        _bias_gelu_fwd_kernel[(cdiv(numel, block),)](
            x, bias, y, bias.stride(0), numel, x.shape[-1], BLOCK=block, EMULATE_RTNE=interpreting(), num_warps=4
        )
    return y


def _launch_bias_gelu_bwd(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    x, dy = x.contiguous(), dy.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    numel = x.numel()
    if numel > 0:
        block = _elementwise_block(numel)
        _bias_gelu_bwd_kernel[(cdiv(numel, block),)](
            x, bias, dy, dx, bias.stride(0), numel, x.shape[-1], BLOCK=block, EMULATE_RTNE=interpreting(), num_warps=4
        )
    return dx


# ----------------------------------------------------------------------------------------------------------------
# Custom ops: opaque to torch.compile, with fake implementations for tracing and registered autograd
# ----------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("flashlite::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float, out_dtype: Optional[torch.dtype]
) -> tuple[torch.Tensor, torch.Tensor]:
    return _layer_norm_forward(x, weight, bias, eps, out_dtype)


@_layer_norm_op.register_fake
def _(x, weight, bias, eps, out_dtype):
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), rstd


@torch.library.custom_op("flashlite::add_layer_norm", mutates_args=())
def _add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    out_dtype: Optional[torch.dtype],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, summed, rstd = _launch_layer_norm_fwd(x, weight, bias, eps, residual, out_dtype)
    return y, summed, rstd


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps, out_dtype):
    # Contiguous outputs whatever x's layout (new_empty, not empty_like, which would keep a transposed x's strides),
    # as the launcher allocates them.
    rstd = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype), x.new_empty(x.shape), rstd


@torch.library.custom_op("flashlite::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    dsum: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launch_layer_norm_bwd(dy, x, weight, rstd, dsum)


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, rstd, dsum):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape)


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, weight, _bias, eps, _out_dtype = inputs
    _y, rstd = output
    ctx.save_for_backward(x, weight, rstd)
    ctx.eps = eps  # for a backward that autograd records, which recomputes the statistics from x


def _layer_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again (the kernel's
        return (*layer_norm_gradients(dy, x, weight, ctx.eps), None, None)  # are constants to it)
    dx, dw, db = _layer_norm_backward_op(dy, x, weight, rstd, None)
    return dx, dw, db, None, None


_layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


def _add_layer_norm_setup(ctx, inputs, output) -> None:
    _x, residual, weight, _bias, eps, _out_dtype = inputs
    _y, summed, rstd = output
    ctx.residual_dtype = residual.dtype
    ctx.save_for_backward(summed, weight, rstd)
    ctx.eps = eps


def _add_layer_norm_grad(ctx, dy, dsum, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    if torch.is_grad_enabled():
        # create_graph=True: gradients autograd can differentiate again, as functions of the sum, a saved output:
        # autograd differentiates it back through this function's own backward to x and residual, so neither
        # needs saving.
        dx, dw, db = layer_norm_gradients(dy, summed, weight, ctx.eps, dsum)
        return dx, dx.to(ctx.residual_dtype), dw, db, None, None
    # The sum feeds both the normalization and (typically) the next residual add: its gradient is the sum of both.
    dx, dw, db = _layer_norm_backward_op(dy, summed, weight, rstd, dsum)
    return dx, dx.to(ctx.residual_dtype), dw, db, None, None


_add_layer_norm_op.register_autograd(_add_layer_norm_grad, setup_context=_add_layer_norm_setup)


@torch.library.custom_op("flashlite::bias_gelu", mutates_args=())
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.Tensor:
    return _launch_bias_gelu_fwd(x, bias, out_dtype)


@_bias_gelu_op.register_fake
def _(x, bias, out_dtype):
    return x.new_empty(x.shape, dtype=out_dtype or x.dtype)


@torch.library.custom_op("flashlite::bias_gelu_backward", mutates_args=())
def _bias_gelu_backward_op(dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return _launch_bias_gelu_bwd(dy, x, bias)


@_bias_gelu_backward_op.register_fake
def _(dy, x, bias):
    return x.new_empty(x.shape)


def _bias_gelu_setup(ctx, inputs, output) -> None:
    x, bias, _out_dtype = inputs
    ctx.save_for_backward(x, bias)


def _bias_gelu_grad(ctx, dy):
    x, bias = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True: gradients autograd can differentiate again
        return (*bias_gelu_gradients(dy, x, bias), None)
    dx = _bias_gelu_backward_op(dy, x, bias)
    # Reduced in float32 over all rows, rounded once to the bias dtype.
    dbias = dx.reshape(-1, x.shape[-1]).sum(0, dtype=torch.float32).to(bias.dtype)
    return dx, dbias, None


_bias_gelu_op.register_autograd(_bias_gelu_grad, setup_context=_bias_gelu_setup)


def _layer_norm_forward(x, weight, bias, eps, out_dtype):
    y, _, rstd = _launch_layer_norm_fwd(x, weight, bias, eps, None, out_dtype)
    return y, rstd


def _add_layer_norm_forward(x, residual, weight, bias, eps, out_dtype):
    return _launch_layer_norm_fwd(x, weight, bias, eps, residual, out_dtype)


_EagerLayerNorm = eager_function("_EagerLayerNorm", _layer_norm_forward, _layer_norm_setup, _layer_norm_grad, (1,))
_EagerAddLayerNorm = eager_function("_EagerAddLayerNorm", _add_layer_norm_forward, _add_layer_norm_setup,
                                     _add_layer_norm_grad, (2,))
_EagerBiasGelu = eager_function("_EagerBiasGelu", _launch_bias_gelu_fwd, _bias_gelu_setup, _bias_gelu_grad, ())


# ----------------------------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------------------------


def _affine_or_default(
    op: str, x: torch.Tensor, weight: Optional[torch.Tensor], bias: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1] if x.dim() > 0 else 0
    if weight is None:
        weight = torch.ones(n, dtype=x.dtype, device=x.device)
    if bias is None:
        bias = torch.zeros(n, dtype=x.dtype, device=x.device)
    _check_row_params(op, x, weight=weight, bias=bias)
    return weight, bias


def _check_eps(op: Optional[str], eps: float) -> float:
    """``eps`` as a Python float, or a clear error; ``op`` (the function's name) prefixes the message when given.

    Any real number is accepted, NumPy scalars included (they register as ``numbers.Real``); bool is refused
    although it is an int, and so are tensors (pass ``float(eps)``: a tensor would force a device sync here).
    Non-finite values are refused too: an infinite eps makes every output equal to the bias.
    """
    prefix = f"{op}: " if op else ""
    accepted = "a positive finite number (a Python or NumPy int or float)"
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):  # NumPy's bool is not numbers.Real either
        raise TypeError(f"{prefix}eps must be {accepted}, got {type(eps).__name__} {eps!r}")
    value = float(eps)
    # Comparisons, not math.isfinite: under torch.compile(dynamic=True) a float module attribute (the layer's eps)
    # is traced as a symbolic float, which comparisons accept and math.isfinite does not. NaN fails both.
    if not 0 < value < math.inf:
        raise ValueError(f"{prefix}eps must be {accepted}, got {eps!r}")
    return value


def _check_out_dtype(op: str, out_dtype: Optional[torch.dtype]) -> None:
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        # A name ("float16") prints as the dtype it names: "not supported" below would name a supported dtype.
        raise TypeError(f"{op}: out_dtype must be None or a torch.dtype (torch.float32, torch.float16 or "
                        f"torch.bfloat16), got {type(out_dtype).__name__} {out_dtype!r}")
    if out_dtype is not None and out_dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{op}: out_dtype {out_dtype} is not supported; use float32, float16 or bfloat16")


def layer_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> torch.Tensor:
    """LayerNorm over the last dimension of ``x`` with a Triton kernel; differentiable in x, weight and bias (twice
    too: a backward with ``create_graph=True`` computes its gradients with PyTorch operations in float32).

    Statistics are computed in float32 whatever ``x``'s dtype, with a two-pass variance (stable when the mean is
    large against the spread). The output has ``x``'s dtype unless ``out_dtype`` asks for another (for example the
    bfloat16 operand of the next matmul, which saves a separate cast). ``weight``/``bias`` may be None (1 and 0)
    and may have a different floating dtype from ``x`` (for example float32 parameters with bfloat16 activations).
    Rows of up to ``MAX_ROW_LENGTH`` elements. Any argument may be a view of any layout (``weight`` a column of a
    matrix, or one value expanded with stride 0); gradients come back to it through autograd as for a torch op.

    Example:
        >>> x = torch.randn(2, 5, 37)
        >>> w, b = torch.rand(37), torch.randn(37)
        >>> y = layer_norm(x, w, b)
        >>> torch.allclose(y, torch.nn.functional.layer_norm(x, (37,), w, b), atol=1e-5)
        True
    """
    op = "flashlite.layer_norm"
    _check_kernel_tensor("x", x, op)
    weight, bias = _affine_or_default(op, x, weight, bias)
    _check_out_dtype(op, out_dtype)
    return run(_layer_norm_op, _EagerLayerNorm, _layer_norm_forward, x, weight, bias, _check_eps(op, eps),
                out_dtype)[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float = 1e-5,
    *,
    out_dtype: Optional[torch.dtype] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add fused with LayerNorm: returns ``(layer_norm(h), h)`` with ``h = x + residual``.

    ``h`` (the new residual stream) has ``x``'s dtype; ``residual`` may be in another dtype (for example a
    bfloat16 branch output added to a float32 stream); the add is done in float32. The normalized output has
    ``x``'s dtype unless ``out_dtype`` is given. One pass over memory instead of three (add, read for the norm,
    write the norm).

    Example:
        >>> x, r = torch.randn(3, 64), torch.randn(3, 64)
        >>> w, b = torch.ones(64), torch.zeros(64)
        >>> y, h = add_layer_norm(x, r, w, b)
        >>> torch.allclose(h, x + r), torch.allclose(y, torch.nn.functional.layer_norm(x + r, (64,)), atol=1e-5)
        (True, True)
    """
    op = "flashlite.add_layer_norm"
    _check_kernel_tensor("x", x, op)
    _check_kernel_tensor("residual", residual, op)
    if residual.shape != x.shape:
        raise ValueError(f"{op}: residual has shape {tuple(residual.shape)} but x has {tuple(x.shape)}")
    if residual.device != x.device:
        raise ValueError(f"{op}: residual is on {residual.device} but x is on {x.device}")
    weight, bias = _affine_or_default(op, x, weight, bias)
    _check_out_dtype(op, out_dtype)
    y, summed, _ = run(_add_layer_norm_op, _EagerAddLayerNorm, _add_layer_norm_forward, x, residual, weight, bias,
                        _check_eps(op, eps), out_dtype)
    return y, summed


def bias_gelu(x: torch.Tensor, bias: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``gelu(x + bias)`` with the exact (erf) GELU, computed in float32, in one pass; differentiable in both (twice
    too, as ``layer_norm``).

    Meant for the first MLP matmul's output: the bias add, the GELU and the cast to the second matmul's operand
    dtype (``out_dtype``, default ``x``'s dtype) happen in one read and one write.

    Example:
        >>> x, b = torch.randn(4, 100), torch.randn(100)
        >>> torch.allclose(bias_gelu(x, b), torch.nn.functional.gelu(x + b), atol=1e-6)
        True
    """
    op = "flashlite.bias_gelu"
    _check_kernel_tensor("x", x, op)
    _check_row_params(op, x, row_limit=False, bias=bias)
    _check_out_dtype(op, out_dtype)
    return run(_bias_gelu_op, _EagerBiasGelu, _launch_bias_gelu_fwd, x, bias, out_dtype)
