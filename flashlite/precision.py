"""The precision policy of :class:`flashlite.TransformerLayer`: which dtype each part of the layer computes in.

One row per mode; the table below is the whole policy (``POLICIES``), and ``policy_table()`` prints it.

===================  =====  ========  ==============  =====  ========  =======  ==============  ====================
mode                 param  residual  matmul          accum  LN stats  softmax  GELU math/out   attention dots
===================  =====  ========  ==============  =====  ========  =======  ==============  ====================
mixed                fp32   fp32      bf16 (or fp16)  fp32   fp32      fp32     fp32 / operand  bf16 (or fp16)
mixed_bf16_residual  fp32   bf16      bf16            fp32   fp32      fp32     fp32 / bf16     bf16
bf16_fp32_residual   bf16   fp32      bf16            fp32   fp32      fp32     fp32 / bf16     bf16
fp32                 fp32   fp32      fp32            fp32   fp32      fp32     fp32 / fp32     ieee (or tf32, bf16)
bf16                 bf16   bf16      bf16            fp32   fp32      fp32     fp32 / bf16     bf16
fp16                 fp16   fp16      fp16            fp32   fp32      fp32     fp32 / fp16     fp16
===================  =====  ========  ==============  =====  ========  =======  ==============  ====================

Why: reductions (LayerNorm statistics, softmax, matmul accumulation) compound rounding error over their length,
so they run in fp32 in every mode; matmul operands and elementwise results round once, so they can be low
precision. "mixed" keeps fp32 master weights and an fp32 residual stream, so repeated layers do not accumulate
bf16 rounding in the stream; "mixed_bf16_residual" keeps the fp32 master weights but carries the stream in bf16
(half its memory traffic), which shows what the fp32 stream buys. "bf16_fp32_residual" is the converse: bf16
parameters (no cast of the weights per forward, which "mixed" pays) with the fp32 stream, for inference and for
training that keeps its master weights elsewhere; an optimizer stepping bf16 parameters loses updates smaller than
a bf16 step of the weight. Measured costs of each mode: ``docs/precision.md``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

MODES = ("mixed", "mixed_bf16_residual", "bf16_fp32_residual", "fp32", "bf16", "fp16")
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
ATTENTION_PRECISIONS = ("ieee", "tf32", "bf16")


@dataclass(frozen=True)
class PrecisionPolicy:
    """The dtypes one precision mode uses; see the module docstring for the table of all modes.

    ``attention_precision`` is the ``precision`` argument passed to ``flashlite.attention.attention`` (only
    meaningful for float32 operands; None for low-precision operands, whose dots are already tensor-core native).

    Example:
        >>> resolve_policy("mixed").matmul_dtype
        torch.bfloat16
    """

    mode: str
    param_dtype: torch.dtype
    residual_dtype: torch.dtype
    matmul_dtype: torch.dtype
    accumulate_dtype: torch.dtype
    ln_stats_dtype: torch.dtype
    softmax_dtype: torch.dtype
    gelu_math_dtype: torch.dtype
    gelu_out_dtype: torch.dtype
    attention_precision: Optional[str]


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16

POLICIES: dict[str, PrecisionPolicy] = {
    "mixed": PrecisionPolicy("mixed", _F32, _F32, _BF16, _F32, _F32, _F32, _F32, _BF16, None),
    "mixed_bf16_residual": PrecisionPolicy("mixed_bf16_residual", _F32, _BF16, _BF16, _F32, _F32, _F32, _F32, _BF16,
                                           None),
    "bf16_fp32_residual": PrecisionPolicy("bf16_fp32_residual", _BF16, _F32, _BF16, _F32, _F32, _F32, _F32, _BF16,
                                          None),
    "fp32": PrecisionPolicy("fp32", _F32, _F32, _F32, _F32, _F32, _F32, _F32, _F32, "ieee"),
    "bf16": PrecisionPolicy("bf16", _BF16, _BF16, _BF16, _F32, _F32, _F32, _F32, _BF16, None),
    "fp16": PrecisionPolicy("fp16", _F16, _F16, _F16, _F32, _F32, _F32, _F32, _F16, None),
}


def resolve_policy(
    precision: str,
    *,
    compute_dtype: Optional[torch.dtype] = None,
    attention_precision: Optional[str] = None,
) -> PrecisionPolicy:
    """The policy for ``precision``, with the two choices a mode leaves open.

    ``compute_dtype`` (only with "mixed"): the low-precision matmul operand dtype, bfloat16 (default) or float16.
    ``attention_precision`` (only with "fp32"): how the attention kernel computes its float32 dots: "ieee"
    (default, true fp32), "tf32" or "bf16" (tensor cores, fp32 accumulation).

    Example:
        >>> resolve_policy("mixed", compute_dtype=torch.float16).gelu_out_dtype
        torch.float16
        >>> resolve_policy("fp32", attention_precision="tf32").attention_precision
        'tf32'
    """
    if not isinstance(precision, str):  # and not a membership test, which fails on an unhashable value
        raise TypeError(f"precision must be one of {', '.join(map(repr, MODES))}, got {type(precision).__name__} "
                        f"{precision!r}")
    if precision not in POLICIES:
        raise ValueError(f"unknown precision mode {precision!r}; choose one of {', '.join(map(repr, MODES))}")
    policy = POLICIES[precision]
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype):
            raise TypeError(f"compute_dtype must be torch.bfloat16 or torch.float16, got "
                            f"{type(compute_dtype).__name__} {compute_dtype!r}")
        if precision != "mixed":
            raise ValueError(
                f"compute_dtype applies to precision='mixed' only; precision={precision!r} fixes the matmul dtype "
                f"to {policy.matmul_dtype}"
            )
        if compute_dtype not in LOW_PRECISION_DTYPES:
            raise ValueError(f"compute_dtype must be torch.bfloat16 or torch.float16, got {compute_dtype}")
        policy = replace(policy, matmul_dtype=compute_dtype, gelu_out_dtype=compute_dtype)
    if attention_precision is not None:
        if precision != "fp32":
            raise ValueError(
                f"attention_precision applies to precision='fp32' only (float32 attention operands); with "
                f"precision={precision!r} the operands are {policy.matmul_dtype}"
            )
        if attention_precision not in ATTENTION_PRECISIONS:
            raise ValueError(
                f"unknown attention_precision {attention_precision!r}; choose one of "
                f"{', '.join(map(repr, ATTENTION_PRECISIONS))}"
            )
        policy = replace(policy, attention_precision=attention_precision)
    return policy


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def policy_table(policies: Optional[dict[str, PrecisionPolicy]] = None) -> str:
    """The policies as a markdown table (one row per mode), for docs and reports.

    Example:
        >>> print(policy_table().splitlines()[2])
        | mixed | fp32 | fp32 | bf16 | fp32 | fp32 | fp32 | fp32 | bf16 | bf16 |
    """
    rows = [
        "| mode | param | residual | matmul operands | accumulation | LN stats | softmax | GELU math | GELU out "
        "| attention dots |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (policies or POLICIES).values():
        dots = p.attention_precision or _short(p.matmul_dtype)
        rows.append(
            f"| {p.mode} | {_short(p.param_dtype)} | {_short(p.residual_dtype)} | {_short(p.matmul_dtype)} | "
            f"{_short(p.accumulate_dtype)} | {_short(p.ln_stats_dtype)} | {_short(p.softmax_dtype)} | "
            f"{_short(p.gelu_math_dtype)} | {_short(p.gelu_out_dtype)} | {dots} |"
        )
    return "\n".join(rows)
