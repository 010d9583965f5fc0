"""Tolerance policies per precision, the baseline-relative rule, and ``assert_close`` with its failure message.

Two rules decide whether a kernel's output is close to a float64 reference:

- per element (torch.isclose's form): ``|actual - expected| <= atol + rtol * |expected|``;
- baseline-relative, when ``baseline`` (the same computation done by PyTorch in the input precision) is given,
  in the manner of FlashAttention's tests: ``max|actual - expected| <= baseline_factor * max|baseline -
  expected| + baseline_floor``. The kernel may be no worse than ``baseline_factor`` times what PyTorch itself
  achieves in that precision. When a baseline is given, this rule replaces the per-element one.

In both rules NaN never passes (in ``actual`` or in ``expected``: a reference that produces NaN is broken), and
an infinity passes only where the other tensor holds the same infinity. Integer and bool tensors compared with
each other are compared in exact integer arithmetic, not through float64 (which rounds integers beyond 2**53).

A ``tolerance`` marker on a test overrides the default policy of floating-point results for every
``assert_close`` call made inside that test without an explicit ``policy=``; integer and bool results keep the
exact comparison (only a call's own ``policy=`` gives them a tolerance). :func:`use_override` is the context
manager the plugin wraps the call in.

A comparison that cannot fail is refused with a ValueError: tensors with no elements, and an ``expected`` (or
``baseline``) that is ``actual`` itself.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from .exact_diff import (
    Mismatch,
    Number,
    exact_abs_diff,
    first_best,
    float_block,
    integer_block,
    is_integral,
    unravel,
)
from .policies import (
    PolicyLike,
    TolerancePolicy,
    active_policy,
    policy_for,
)

# Re-exported: the plugin and assert_close's callers know the marker's override from here.
from .policies import ToleranceOverride as ToleranceOverride
from .policies import override_sets_policy as override_sets_policy
from .policies import parse_tolerance_marker as parse_tolerance_marker
from .policies import use_override as use_override

# --------------------------------------------------------------------------------------------------------------
# The comparison

# What ``actual``, ``expected`` and ``baseline`` may be, as the error messages say it.
_ACCEPTED = "a dense torch.Tensor, a numpy array or scalar, or a Python bool, int or float"



@dataclasses.dataclass
class CloseReport:
    """What ``assert_close`` found; ``message`` is the text of the failure (or of the pass).

    ``worst`` is the element furthest over its bound (largest error / bound; NaN and an unmatched Inf count as
    infinitely far; ties go to the larger error, then to the first index), ``first_mismatches`` the first few
    failing elements in index order. ``max_abs_*`` and ``max_rel_*`` describe the largest errors whether or not
    they fail (``max_abs_failed``, ``max_rel_failed`` say which). ``exact`` is true when both tensors are integer
    or bool and were compared in exact integer arithmetic; the values in the report are then exact Python ints.
    """

    passed: bool
    policy: TolerancePolicy
    numel: int
    mismatched: int
    max_abs_error: float
    max_abs_index: tuple[int, ...] | None
    max_abs_values: tuple[Number, Number] | None
    max_rel_error: float
    max_rel_index: tuple[int, ...] | None
    max_rel_values: tuple[Number, Number] | None
    nan_actual: int
    nan_expected: int
    inf_actual: int
    inf_expected: int
    inf_mismatched: int
    first_bad_index: tuple[int, ...] | None
    baseline_error: float | None = None
    allowed_error: float | None = None
    message: str = ""
    notes: tuple[str, ...] = ()
    exact: bool = False
    worst: Mismatch | None = None
    first_mismatches: tuple[Mismatch, ...] = ()
    max_abs_failed: bool = False
    max_rel_failed: bool = False

    @property
    def baseline_ratio(self) -> float | None:
        """max|actual - expected| / max|baseline - expected|, or None without a baseline."""
        if self.baseline_error is None:
            return None
        if self.baseline_error == 0:
            return 0.0 if self.max_abs_error == 0 else math.inf
        return self.max_abs_error / self.baseline_error

    def __repr__(self) -> str:
        return (
            f"CloseReport(passed={self.passed}, policy={self.policy.name!r}, max_abs_error={self.max_abs_error:.3g}, "
            f"mismatched={self.mismatched}/{self.numel})"
        )


# Elements per streamed block: bounds the float64 temporaries to a few of this size whatever the tensor size.
_BLOCK_ELEMENTS = 1 << 24
# Failing elements listed in the message after the worst one.
_SHOWN_MISMATCHES = 5


def assert_close(
    actual: torch.Tensor | Number,
    expected: torch.Tensor | Number,
    *,
    policy: PolicyLike | None = None,
    baseline: torch.Tensor | Number | None = None,
    notes: tuple[str, ...] = (),
) -> CloseReport:
    """Assert that ``actual`` is close to the (usually float64) reference ``expected``.

    The policy is ``policy`` when given (a TolerancePolicy, a dtype or a name such as "tf32"), else the
    ``tolerance`` marker's override for ``actual.dtype``, else the default for ``actual.dtype``. With
    ``baseline`` the baseline-relative rule replaces the per-element rule. ``notes`` are extra lines for the
    message. No argument is modified.

    When both ``actual`` and ``expected`` are integer or bool tensors they are compared in exact integer
    arithmetic (any widths, signed or not; True is 1): ``2**53 + 1`` differs from ``2**53``. The default policy
    for an integer result is "exact"; a policy with a tolerance applies its bound ``atol + rtol * |expected|``
    (computed in float64) to the exact difference. When either side is floating point, both are compared in
    float64 under the policy, as floats: an integer beyond 2**53 is rounded to float64 first.

    Tensors are compared on their device, streamed in blocks. numpy arrays and scalars and Python numbers are
    accepted wherever a tensor is and behave as numbers of their own dtype (a Python float is float64, a Python
    int int64, or uint64 above int64's range), placed on the tensor arguments' device. Sparse tensors are
    refused rather than densified: a dense copy may not fit in memory, and the caller knows whether it does.

    A failure names the worst violation (index, both values, the bound there and how far over it the error is),
    the first few failing elements, the largest absolute and relative errors, and NaN/Inf counts; under the
    baseline rule, the kernel's and the baseline's max errors with the factor and floor that decided.

    Example::

        >>> ref = torch.randn(64, 64, dtype=torch.float64)
        >>> assert_close(ref.to(torch.bfloat16), ref).passed
        True
        >>> try:  # doctest: +ELLIPSIS
        ...     assert_close(torch.tensor([2**53 + 1]), torch.tensor([2**53]))
        ... except AssertionError as failure:
        ...     print(str(failure).splitlines()[2])  # the worst violation
          worst violation at index (0,): actual 9007199254740993, expected 9007199254740992, differ by 1 ...

    Raises:
        TypeError: an input is not one of the accepted kinds, or is complex, sparse, nested or quantized.
        ValueError: shapes or devices differ, the tensors are on the meta device or hold no elements, expected
            or baseline is actual itself (the same memory read the same way), a Python int does not fit in 64
            bits, or the baseline holds NaN or Inf.
        AssertionError: the tensors are not close; the message gives the error figures.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's body
    given = (actual, expected, baseline)  # as passed: a numpy array's memory is known only before it is copied
    actual, expected, baseline = _checked_inputs(actual, expected, baseline)
    _refuse_vacuous(actual, expected, baseline, given)
    resolved = policy_for(policy) if policy is not None else active_policy(actual.dtype)

    baseline_error = None
    allowed = None
    if baseline is not None:
        baseline_error = _baseline_error(baseline, expected)
        allowed = resolved.baseline_factor * baseline_error + resolved.baseline_floor

    report = _compare(actual, expected, resolved, allowed)
    report.baseline_error = baseline_error
    report.allowed_error = allowed
    report.notes = tuple(notes)
    report.message = _message(report)
    if not report.passed:
        raise AssertionError(report.message)
    return report


def _as_tensor(label: str, value: Any) -> torch.Tensor:
    """``value`` as a tensor of its own dtype; tensors are returned as they are."""
    __tracebackhide__ = True
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)):
        array = np.asarray(value)
        try:
            return torch.tensor(array)  # a copy: torch cannot wrap a read-only array, and nothing is shared
        except TypeError:
            raise TypeError(
                f"assert_close: {label} is a numpy array of dtype {array.dtype}, which torch cannot hold; {label} "
                f"must be {_ACCEPTED}"
            ) from None
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        if -(1 << 63) <= value < 1 << 63:
            return torch.tensor(value, dtype=torch.int64)
        if 0 <= value < 1 << 64:
            return torch.tensor(value, dtype=torch.uint64)
        raise ValueError(f"assert_close: {label} is the Python int {value}, outside the int64 and uint64 ranges")
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)  # a Python float is a double; torch's default is float32
    if isinstance(value, complex):
        return torch.tensor(value, dtype=torch.complex128)  # refused below, with the message for complex tensors
    raise TypeError(f"assert_close: {label} must be {_ACCEPTED}; got {type(value).__name__}")


def _checked_inputs(
    actual: Any, expected: Any, baseline: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The three arguments as comparable tensors, or the error that names the one that is not."""
    __tracebackhide__ = True
    given = {"actual": actual, "expected": expected, "baseline": baseline}
    # Numbers and numpy values have no device: they go where the tensor arguments are.
    device = next((value.device for value in given.values() if isinstance(value, torch.Tensor)), None)
    tensors: dict[str, torch.Tensor] = {}
    for label, value in given.items():
        if value is None and label == "baseline":
            continue
        tensor = _as_tensor(label, value)
        if not isinstance(value, torch.Tensor) and device is not None:
            tensor = tensor.to(device)
        if tensor.is_complex():
            raise TypeError(f"assert_close: {label} is complex ({tensor.dtype}); compare real and imaginary parts")
        if tensor.is_nested:
            raise TypeError(
                f"assert_close: {label} is a nested tensor; assert_close accepts dense (strided) tensors: compare "
                f"its components ({label}.unbind()) one by one"
            )
        if tensor.layout != torch.strided:
            raise TypeError(
                f"assert_close: {label} is a sparse tensor ({tensor.layout}); assert_close accepts dense (strided) "
                f"tensors: pass {label}.to_dense() if it fits in memory"
            )
        if tensor.is_quantized:
            raise TypeError(
                f"assert_close: {label} is quantized ({tensor.dtype}); assert_close accepts integer, bool and "
                f"floating-point tensors: pass {label}.dequantize()"
            )
        # Values are compared, not gradients: without this, every reduction would join the caller's autograd
        # graph and reading a result out (float(...)) would warn about a tensor that requires grad.
        tensors[label] = tensor.detach()
    first = tensors["actual"]
    for label, tensor in tensors.items():
        if tensor.shape != first.shape:
            raise ValueError(
                f"assert_close: shapes differ: actual {tuple(first.shape)}, {label} {tuple(tensor.shape)}"
            )
        if tensor.device != first.device:
            raise ValueError(
                f"assert_close: devices differ: actual on {first.device}, {label} on {tensor.device}; move one "
                "explicitly"
            )
    if first.device.type == "meta":
        raise ValueError("assert_close: actual and expected are on the meta device, which holds no values to compare")
    return first, tensors["expected"], tensors.get("baseline")


def _refuse_vacuous(actual: torch.Tensor, expected: torch.Tensor, baseline: torch.Tensor | None,
                    given: tuple[Any, Any, Any]) -> None:
    """Refuse a comparison that cannot fail: no elements, or a result checked against itself: ``given`` (the
    arguments as passed) read the same memory as the same values, whether tensors, numpy arrays or a mix
    (:func:`.aliasing.same_elements`)."""
    __tracebackhide__ = True
    from .aliasing import same_elements

    given_actual, given_expected, given_baseline = given
    # A pass over no elements, or of a tensor against itself, would report "close" whatever the kernel did.
    if actual.numel() == 0:
        raise ValueError(
            f"assert_close: actual and expected hold no elements (shape {tuple(actual.shape)}), so the comparison "
            "would assert nothing; compare outputs that have at least one element"
        )
    if same_elements(given_actual, given_expected):
        raise ValueError(
            "assert_close: expected is actual itself (the same memory, dtype, shape and strides), so the comparison "
            "cannot fail; compare with a reference computed separately (in float64, say)"
        )
    if baseline is not None and same_elements(given_actual, given_baseline):
        raise ValueError(
            "assert_close: baseline is actual itself (the same memory, dtype, shape and strides); the baseline rule "
            "would then allow at least actual's own error, so the comparison cannot fail; pass the result PyTorch "
            "computes in the input precision"
        )


def _baseline_error(baseline: torch.Tensor, expected: torch.Tensor) -> float:
    worst = 0.0
    exact = is_integral(baseline.dtype) and is_integral(expected.dtype)
    flat_b, flat_e = baseline.reshape(-1), expected.reshape(-1)
    for start in range(0, flat_b.numel(), _BLOCK_ELEMENTS):
        b_raw = flat_b[start : start + _BLOCK_ELEMENTS]
        e_raw = flat_e[start : start + _BLOCK_ELEMENTS]
        if exact:
            high, low = exact_abs_diff(b_raw, e_raw)
            i = first_best(torch.ones_like(high, dtype=torch.bool), (high, low))
            worst = max(worst, float(int(high[i]) * (1 << 32) + int(low[i])))
            continue
        # ``to`` may return the argument itself: the difference is taken out of place.
        b, e = b_raw.to(torch.float64), e_raw.to(torch.float64)
        if not torch.isfinite(b).all():
            raise ValueError("assert_close: the baseline holds NaN or Inf, so it cannot bound the error")
        worst = max(worst, float(torch.nan_to_num((b - e).abs_(), nan=0.0, posinf=0.0).max()))
    return worst


def _compare(
    actual: torch.Tensor, expected: torch.Tensor, policy: TolerancePolicy, allowed: float | None
) -> CloseReport:
    shape = tuple(actual.shape)
    numel = actual.numel()
    exact = is_integral(actual.dtype) and is_integral(expected.dtype)
    compare_block = integer_block if exact else float_block
    flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
    counts = dict(mismatched=0, nan_actual=0, nan_expected=0, inf_actual=0, inf_expected=0, inf_mismatched=0)
    # Across blocks the ranks are Python tuples (exact for integers); a later block wins only when strictly larger.
    worst_rank: tuple[Any, ...] | None = None
    worst: Mismatch | None = None
    first: list[Mismatch] = []
    abs_rank: tuple[Any, ...] | None = None
    abs_at = rel_at = None
    abs_values = rel_values = None
    abs_failed = rel_failed = False
    max_abs = max_rel = 0.0
    for start in range(0, numel, _BLOCK_ELEMENTS):
        block = compare_block(
            flat_a[start : start + _BLOCK_ELEMENTS], flat_e[start : start + _BLOCK_ELEMENTS], policy, allowed
        )
        for name in counts:
            if name != "mismatched":
                counts[name] += getattr(block, name)
        block_bad = int(block.bad.sum())
        counts["mismatched"] += block_bad

        if block_bad:
            i = first_best(block.bad, (block.ratio,) + block.error_keys)
            rank = (float(block.ratio[i]),) + tuple(key[i].item() for key in block.error_keys)
            if worst_rank is None or rank > worst_rank:
                worst_rank, worst = rank, block.mismatch(i, unravel(start + i, shape))
            if len(first) < _SHOWN_MISMATCHES:
                for p in block.bad.nonzero()[: _SHOWN_MISMATCHES - len(first), 0].tolist():
                    first.append(block.mismatch(p, unravel(start + p, shape)))

        i = first_best(torch.ones_like(block.bad), block.abs_keys)
        rank = tuple(key[i].item() for key in block.abs_keys)
        if abs_rank is None or rank > abs_rank:
            abs_rank, abs_at, abs_failed = rank, start + i, bool(block.bad[i])
            element = block.mismatch(i, ())
            abs_values, max_abs = (element.actual, element.expected), float(block.abs_error[i])
        j = block.max_rel_at
        if rel_at is None or block.max_rel > max_rel:
            max_rel, rel_at, rel_failed = block.max_rel, start + j, bool(block.bad[j])
            element = block.mismatch(j, ())
            rel_values = (element.actual, element.expected)
        del block

    passed = counts["mismatched"] == 0
    if allowed is not None and not exact and not max_abs <= allowed:
        passed = False
    return CloseReport(
        passed=passed,
        policy=policy,
        numel=numel,
        mismatched=counts["mismatched"],
        max_abs_error=max_abs,
        max_abs_index=None if abs_at is None else unravel(abs_at, shape),
        max_abs_values=abs_values,
        max_rel_error=max_rel,
        max_rel_index=None if rel_at is None else unravel(rel_at, shape),
        max_rel_values=rel_values,
        nan_actual=counts["nan_actual"],
        nan_expected=counts["nan_expected"],
        inf_actual=counts["inf_actual"],
        inf_expected=counts["inf_expected"],
        inf_mismatched=counts["inf_mismatched"],
        first_bad_index=first[0].index if first else None,
        exact=exact,
        worst=worst,
        first_mismatches=tuple(first),
        max_abs_failed=abs_failed,
        max_rel_failed=rel_failed,
    )


# --------------------------------------------------------------------------------------------------------------
# The message


def _value(v: Number) -> str:
    """A value as the message shows it: integers and bools exactly, floats to 8 significant digits."""
    return str(v) if isinstance(v, (bool, int)) else f"{v:.8g}"


def _error(v: float | int) -> str:
    return str(v) if isinstance(v, int) else f"{v:.6g}"


def _violation(m: Mismatch, r: CloseReport) -> str:
    at = f"worst violation at index {m.index}: actual {_value(m.actual)}, expected {_value(m.expected)}"
    if math.isnan(m.error):
        return f"{at}: NaN never passes"
    if math.isinf(m.error):
        return f"{at}: an Inf passes only opposite the same Inf"
    if r.exact and m.bound == 0:
        return f"{at}, differ by {m.error} (exact comparison)"
    if r.allowed_error is None:
        bound, what = f"bound {m.bound:.6g} (atol + rtol * |expected|)", "the bound"
    else:
        bound, what = f"allowed {m.bound:.6g}", "the allowed error"
    scale = f" ({m.ratio:.3g}x {what})" if m.bound else f"; {what} is 0"
    excess = str(m.excess) if isinstance(m.excess, int) else f"{m.excess:.3g}"
    return f"{at}, |actual - expected| {_error(m.error)} > {bound} by {excess}{scale}"


def _message(r: CloseReport) -> str:
    head = "Tensors are close" if r.passed else "Tensors are not close"
    how = ", compared exactly as integers" if r.exact else ""
    factor, floor = r.policy.baseline_factor, r.policy.baseline_floor
    if r.allowed_error is None:
        lines = [f"{head} under {r.policy.describe()}{how}: |actual - expected| <= atol + rtol * |expected|"]
    else:
        verdict = ">" if not r.max_abs_error <= r.allowed_error else "<="
        lines = [
            f"{head} under the baseline rule of policy {r.policy.name!r}{how}: max|actual - expected| <= {factor:g} "
            f"* max|baseline - expected| + {floor:g}",
            f"  the baseline rule decided: max|actual - expected| = {r.max_abs_error:.6g} {verdict} allowed "
            f"{factor:g} * {r.baseline_error:.6g} (max|baseline - expected|) + {floor:g} (floor) = "
            f"{r.allowed_error:.6g}",
        ]
    share = 100.0 * r.mismatched / r.numel if r.numel else 0.0
    over = "" if r.allowed_error is None else f", over the allowed error {r.allowed_error:.6g} or NaN/Inf"
    lines.append(f"  mismatched elements: {r.mismatched} / {r.numel} ({share:.4g}%){over}")
    if r.worst is not None:
        lines.append(f"  {_violation(r.worst, r)}")
    if r.first_mismatches:
        lines.append(f"  first {len(r.first_mismatches)} of {r.mismatched} mismatched elements:")
        lines.extend(
            f"    {m.index}: actual {_value(m.actual)}, expected {_value(m.expected)}, |actual - expected| "
            f"{_error(m.error)}"
            for m in r.first_mismatches
        )
    if r.allowed_error is None and r.max_abs_index is not None:
        a, e = r.max_abs_values
        size = _error(abs(int(a) - int(e))) if r.exact else f"{r.max_abs_error:.6g}"
        status = "over its bound" if r.max_abs_failed else "within its bound"
        lines.append(
            f"  max abs error: {size} at index {r.max_abs_index} (actual {_value(a)}, expected {_value(e)}), {status}"
        )
        if not r.exact:
            a, e = r.max_rel_values
            status = "over its bound" if r.max_rel_failed else "within its bound"
            lines.append(
                f"  max rel error: {r.max_rel_error:.6g} at index {r.max_rel_index} (actual {_value(a)}, expected "
                f"{_value(e)}), {status}"
            )
    lines.append(
        f"  NaN: {r.nan_actual} in actual, {r.nan_expected} in expected; Inf: {r.inf_actual} in actual, "
        f"{r.inf_expected} in expected, {r.inf_mismatched} without the same Inf opposite"
    )
    if r.nan_actual:
        lines.append("  actual holds NaN: NaN never passes")
    if r.nan_expected:
        lines.append("  expected holds NaN: a reference must not produce NaN, so this never passes")
    if r.baseline_error is not None:
        lines.append(
            f"  error ratio actual/baseline = {r.baseline_ratio:.3g} (allowed {factor:g}, plus the floor {floor:g})"
        )
    lines.extend(f"  {note}" for note in r.notes)
    return "\n".join(lines)
