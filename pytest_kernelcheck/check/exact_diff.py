"""Differences without rounding: integer tensors compared in exact 64-bit arithmetic (float64 rounds integers
beyond 2**53), floating-point ones per block, each block's worst element and the count past the bound."""
from __future__ import annotations

import dataclasses
import math
from typing import Union

import torch

from .policies import TolerancePolicy

Number = Union[float, int, bool]


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """One element that broke the rule: where it is, both values, ``|actual - expected|`` and the bound it exceeded.

    In an exact (integer) comparison the values and the error are Python ints or bools, exactly; otherwise floats.
    ``error`` is NaN where either value is NaN and inf where an Inf is not matched. ``bound`` is
    ``atol + rtol * |expected|`` under the per-element rule and the allowed maximum error under the baseline rule.

    Example::

        >>> m = Mismatch(index=(0, 2), actual=1.5, expected=1.0, error=0.5, bound=0.125)
        >>> m.excess, m.ratio
        (0.375, 4.0)
    """

    index: tuple[int, ...]
    actual: Number
    expected: Number
    error: float | int
    bound: float

    @property
    def excess(self) -> float | int:
        """How far the error is over the bound (an exact int for integers against a bound of 0)."""
        return self.error - self.bound if self.bound else self.error

    @property
    def ratio(self) -> float:
        """error / bound; inf against a bound of 0."""
        return self.error / self.bound if self.bound else math.inf


# A difference of two 64-bit integers needs 65 bits, and float64 holds integers exactly only up to 2**53, so
# integers are split into 32-bit words held in int64, where no step can overflow.
_TWO_32 = float(1 << 32)


def is_integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


_LOW_MASK = 0xFFFFFFFF


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any integer or bool dtype) as int64 words with ``x == high * 2**32 + low`` and ``0 <= low < 2**32``."""
    if x.dtype == torch.uint64:
        # Above 2**63 the bits read as a negative int64; the high word taken unsigned restores the value.
        bits = x.view(torch.int64)
        return (bits >> 32) & _LOW_MASK, bits & _LOW_MASK
    wide = x.to(torch.int64)
    return wide >> 32, wide & _LOW_MASK


def exact_abs_diff(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|a - e|`` exactly, as int64 words ``(high, low)`` with value ``high * 2**32 + low`` and ``0 <= low < 2**32``.

    Example::

        >>> high, low = exact_abs_diff(torch.tensor([-2**63]), torch.tensor([2**63 - 1]))
        >>> int(high) * 2**32 + int(low) == 2**64 - 1
        True
    """
    a_high, a_low = _words(a)
    e_high, e_low = _words(e)
    high, low = a_high - e_high, a_low - e_low  # a - e == high * 2**32 + low; |high| < 2**33, |low| < 2**32
    negative = (high < 0) | ((high == 0) & (low < 0))
    high, low = torch.where(negative, -high, high), torch.where(negative, -low, low)
    borrow = (low < 0).to(torch.int64)  # only where high >= 1, since the value is now >= 0
    return high - borrow, low + borrow * (1 << 32)


def _exceeds(high: torch.Tensor, low: torch.Tensor, bound: torch.Tensor | float) -> torch.Tensor:
    """Whether ``high * 2**32 + low > bound``, decided exactly.

    An integer exceeds a bound exactly when it exceeds the bound's floor. That floor, split at 2**32, gives two
    float64 words with no rounding (scaling by a power of two, floor, and a difference smaller than 2**32 that
    is a multiple of the floor's last bit are all exact), and the integer's words are below 2**33: so the two
    pairs compare exactly in float64.
    """
    limit = torch.as_tensor(bound, dtype=torch.float64, device=high.device).floor()
    limit_high = (limit / _TWO_32).floor()
    limit_low = limit - limit_high * _TWO_32
    high, low = high.to(torch.float64), low.to(torch.float64)
    return (high > limit_high) | ((high == limit_high) & (low > limit_low))


@dataclasses.dataclass
class _Block:
    """One streamed block compared; positions are the block's own flat positions."""

    bad: torch.Tensor  # bool: the element breaks the rule
    ratio: torch.Tensor  # float64 error / bound, meaningful where bad; inf for NaN, an unmatched Inf, a bound of 0
    error_keys: tuple[torch.Tensor, ...]  # rank errors exactly: (error,) for floats, (high, low) for integers
    abs_keys: tuple[torch.Tensor, ...]  # the same for finite errors only, for the max abs error
    abs_error: torch.Tensor  # float64 |actual - expected|, 0 where not finite (integers rounded only beyond 2**53)
    max_rel: float  # the largest abs_error / |expected| (inf against an exact 0) and its position
    max_rel_at: int
    bound: torch.Tensor | float
    actual: torch.Tensor  # the values the report shows (float64 for floats, the integers themselves otherwise)
    expected: torch.Tensor
    exact: bool
    nan_actual: int = 0
    nan_expected: int = 0
    inf_actual: int = 0
    inf_expected: int = 0
    inf_mismatched: int = 0

    def mismatch(self, position: int, index: tuple[int, ...]) -> Mismatch:
        a, e = self.actual[position].item(), self.expected[position].item()
        error = abs(int(a) - int(e)) if self.exact else abs(a - e)  # Python ints: exact at any size
        bound = float(self.bound[position]) if isinstance(self.bound, torch.Tensor) else float(self.bound)
        return Mismatch(index=index, actual=a, expected=e, error=error, bound=bound)


def float_block(a_raw: torch.Tensor, e_raw: torch.Tensor, policy: TolerancePolicy, allowed: float | None) -> _Block:
    # ``to`` returns the argument itself when it is float64 already: these are read, never written in place.
    a, e = a_raw.to(torch.float64), e_raw.to(torch.float64)
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    # An infinity is acceptable only opposite the same infinity.
    inf_bad = (inf_a | inf_e) & (a != e)
    never = nan_a | nan_e | inf_bad
    finite = ~(nan_a | nan_e | inf_a | inf_e)
    diff = torch.where(finite, a - e, 0.0).abs_()
    bound = allowed if allowed is not None else e.abs().mul_(policy.rtol).add_(policy.atol)
    bad = (diff > bound) | never
    error_key = diff.masked_fill(never, math.inf)
    max_rel, max_rel_at = _max_rel(diff, e.abs())
    return _Block(
        bad=bad, ratio=error_key / bound, error_keys=(error_key,), abs_keys=(diff,), abs_error=diff,
        max_rel=max_rel, max_rel_at=max_rel_at, bound=bound, actual=a, expected=e, exact=False,
        nan_actual=int(nan_a.sum()), nan_expected=int(nan_e.sum()), inf_actual=int(inf_a.sum()),
        inf_expected=int(inf_e.sum()), inf_mismatched=int(inf_bad.sum()),
    )


def integer_block(a_raw: torch.Tensor, e_raw: torch.Tensor, policy: TolerancePolicy, allowed: float | None) -> _Block:
    high, low = exact_abs_diff(a_raw, e_raw)
    abs_error = high.to(torch.float64).mul_(_TWO_32).add_(low)
    e_abs = e_raw.to(torch.float64).abs_()  # a new tensor: e_raw is an integer tensor
    if allowed is not None:
        bound: torch.Tensor | float = allowed
    elif policy.rtol == 0:
        bound = float(policy.atol)  # the usual case ('exact'): one number, not a tensor of them
    else:
        bound = e_abs.mul(policy.rtol).add_(policy.atol)
    max_rel, max_rel_at = _max_rel(abs_error, e_abs)
    return _Block(
        bad=_exceeds(high, low, bound), ratio=abs_error / bound, error_keys=(high, low), abs_keys=(high, low),
        abs_error=abs_error, max_rel=max_rel, max_rel_at=max_rel_at, bound=bound, actual=a_raw, expected=e_raw,
        exact=True,
    )


def _max_rel(abs_error: torch.Tensor, e_abs: torch.Tensor) -> tuple[float, int]:
    # x / 0 is inf: a non-zero error against an exact zero is infinitely large (and is printed as inf); 0 / 0 is
    # no error at all.
    rel = abs_error / e_abs
    rel.masked_fill_(rel.isnan(), 0.0)
    j = int(rel.argmax())
    return float(rel[j]), j


def first_best(candidates: torch.Tensor, keys: tuple[torch.Tensor, ...]) -> int:
    """The first position among ``candidates`` whose ``keys`` are lexicographically largest (keys are >= 0)."""
    for key in keys:
        candidates = candidates & (key == torch.where(candidates, key, -1).max())
    return int(candidates.to(torch.uint8).argmax())  # argmax returns the first of equal maxima


def unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))
