"""Tolerance policies per precision, the baseline-relative rule, and ``assert_close`` with its failure message.

Two rules decide whether a kernel's output is close to a float64 reference:

- per element (torch.isclose's form): ``|actual - expected| <= atol + rtol * |expected|``;
- baseline-relative, when ``baseline`` (the same computation done by PyTorch in the input precision) is given,
  in the manner of FlashAttention's tests: ``max|actual - expected| <= baseline_factor * max|baseline -
  expected| + baseline_floor``. The kernel may be no worse than ``baseline_factor`` times what PyTorch itself
  achieves in that precision. When a baseline is given, this rule replaces the per-element one.

In both rules NaN never passes (in ``actual`` or in ``expected``: a reference that produces NaN is broken), and
an infinity passes only where the other tensor holds the same infinity.

A ``tolerance`` marker on a test overrides the default policy for every ``assert_close`` call made inside that
test without an explicit ``policy=``; :func:`use_override` is the context manager the plugin wraps the call in.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, Union

import torch

PolicyLike = Union["TolerancePolicy", torch.dtype, str]


@dataclasses.dataclass(frozen=True)
class TolerancePolicy:
    """How close a result of one precision must be to a float64 reference.

    Example::

        >>> loose = TolerancePolicy(atol=1e-2, rtol=1e-2, name="loose")
        >>> assert_close(torch.ones(3, dtype=torch.float16), torch.ones(3, dtype=torch.float64), policy=loose).passed
        True
    """

    atol: float
    rtol: float
    baseline_factor: float = 2.0
    baseline_floor: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        for field in ("atol", "rtol", "baseline_factor", "baseline_floor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"TolerancePolicy.{field} must be a finite number >= 0; got {value!r}")

    def replace(self, **changes: float) -> "TolerancePolicy":
        """A copy with some fields changed; the name records what changed, e.g. ``bf16 (atol=0.01)``."""
        unknown = set(changes) - {"atol", "rtol", "baseline_factor", "baseline_floor", "name"}
        if unknown:
            raise TypeError(
                f"unknown tolerance field(s) {sorted(unknown)}; known: atol, rtol, baseline_factor, baseline_floor"
            )
        if "name" not in changes and changes:
            described = ", ".join(f"{k}={v:g}" for k, v in changes.items())
            changes = {**changes, "name": f"{self.name} ({described})"}
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return f"policy {self.name!r} (atol={self.atol:g}, rtol={self.rtol:g})"


# Per-element numbers: rtol from torch.testing.assert_close's defaults where it has one; atol raised where its
# default is too tight for a low-precision kernel against a float64 reference on attention-like data. Measured on
# CPU with N(0, 1) inputs, B=2, H=4, S in {128, 2048}, D=64, causal and not, with a flash-style emulation (fp32
# scores, probabilities rounded to the input dtype before P @ V, output rounded to the input dtype): the atol
# each dtype needed next to its rtol is noted; the defaults leave about 5x headroom.
# Baseline floors follow FlashAttention's fwd_atol: about twice the rounding error of a value near 0.3 in the
# output precision, so a baseline that happens to be exact does not demand exactness.
_DEFAULTS: dict[str, TolerancePolicy] = {
    # torch.testing defaults (1e-7, 1e-7); floor: a few float64 ulps of summation-order noise at values near 1.
    "fp64": TolerancePolicy(atol=1e-7, rtol=1e-7, baseline_floor=1e-14, name="fp64"),
    # torch.testing defaults (atol 1e-5, rtol 1.3e-6); measured need 4.4e-7 with that rtol; ulp(0.3) = 3e-8.
    "fp32": TolerancePolicy(atol=1e-5, rtol=1.3e-6, baseline_floor=3e-8, name="fp32"),
    # No torch.testing entry. tf32 keeps 10 mantissa bits, so dots on tf32-rounded inputs carry relative error
    # near 3e-4; rtol 1e-3 is about 3x that. Measured atol need 7.2e-4 -> 3e-3. Floor as for fp16 (same mantissa).
    "tf32": TolerancePolicy(atol=3e-3, rtol=1e-3, baseline_floor=2.5e-4, name="tf32"),
    # torch.testing rtol 1e-3; its atol 1e-5 fails correct kernels (measured need 2.0e-4) -> 1e-3.
    # Floor: ulp(0.3) in fp16 is 2.4e-4.
    "fp16": TolerancePolicy(atol=1e-3, rtol=1e-3, baseline_floor=2.5e-4, name="fp16"),
    # torch.testing rtol 1.6e-2; its atol 1e-5 fails correct kernels (measured need 1.7e-3) -> 1e-2.
    # Floor: ulp(0.3) in bf16 is 1.95e-3.
    "bf16": TolerancePolicy(atol=1e-2, rtol=1.6e-2, baseline_floor=2e-3, name="bf16"),
    # No torch.testing entry. e4m3 has 3 mantissa bits: rtol is one ulp at 1.0 (2^-3); measured atol need with
    # fp8 inputs and probabilities and a bf16 output was 3.6e-2 at rtol 0.1 -> 6e-2. Floor: ulp(0.3) = 2^-5.
    "fp8_e4m3": TolerancePolicy(atol=6e-2, rtol=0.125, baseline_floor=3.1e-2, name="fp8_e4m3"),
    # e5m2 has 2 mantissa bits: rtol 2^-2; measured atol need 6.9e-2 at rtol 0.1 -> 1.2e-1. Floor: ulp(0.3) = 2^-4.
    "fp8_e5m2": TolerancePolicy(atol=0.12, rtol=0.25, baseline_floor=6.25e-2, name="fp8_e5m2"),
    # Integer and bool results are compared exactly.
    "exact": TolerancePolicy(atol=0.0, rtol=0.0, baseline_floor=0.0, name="exact"),
}

_ALIASES: dict[str, str] = {
    "float64": "fp64", "double": "fp64",
    "float32": "fp32", "float": "fp32",
    "tensorfloat32": "tf32",
    "float16": "fp16", "half": "fp16",
    "bfloat16": "bf16",
    "float8_e4m3fn": "fp8_e4m3", "float8_e4m3fnuz": "fp8_e4m3", "e4m3": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2", "float8_e5m2fnuz": "fp8_e5m2", "e5m2": "fp8_e5m2",
}


def _dtype_policy_name(dtype: torch.dtype) -> str:
    if dtype.is_complex:
        raise TypeError(f"complex tensors ({dtype}) are not supported; compare real and imaginary parts")
    if not dtype.is_floating_point:
        return "exact"
    name = str(dtype).removeprefix("torch.")
    if name not in _ALIASES:
        raise ValueError(f"no default tolerance policy for {dtype}; pass policy=TolerancePolicy(...)")
    return _ALIASES[name]


def policy_for(what: PolicyLike) -> TolerancePolicy:
    """The policy for a dtype, a policy name, or a policy object (returned as is).

    Names: fp64, fp32, tf32, fp16, bf16, fp8_e4m3, fp8_e5m2, exact, and aliases such as "float16", "half",
    "bfloat16", "e4m3".

    Example::

        >>> policy_for(torch.bfloat16).rtol, policy_for("tf32").name
        (0.016, 'tf32')
    """
    if isinstance(what, TolerancePolicy):
        return what
    if isinstance(what, torch.dtype):
        return _DEFAULTS[_dtype_policy_name(what)]
    if isinstance(what, str):
        key = what.strip().lower().removeprefix("torch.")
        key = _ALIASES.get(key, key)
        if key in _DEFAULTS:
            return _DEFAULTS[key]
        known = ", ".join(sorted(set(_DEFAULTS) | set(_ALIASES)))
        raise ValueError(f"unknown tolerance policy name {what!r}; known names: {known}")
    raise TypeError(
        f"a tolerance policy must be a TolerancePolicy, a torch.dtype or a name such as 'tf32'; got "
        f"{type(what).__name__}"
    )


# --------------------------------------------------------------------------------------------------------------
# Per-test overrides (the ``tolerance`` marker)


@dataclasses.dataclass(frozen=True)
class ToleranceOverride:
    """A test's replacement for the default policies, built from a ``tolerance`` marker.

    ``base`` replaces the per-dtype default for every dtype; ``per_dtype`` maps a dtype to a policy or to field
    changes; ``fields`` (atol=..., rtol=...) are applied last, to whatever policy results.

    Example::

        >>> ov = parse_tolerance_marker((), {"atol": 1e-2})
        >>> ov.resolve(torch.float16).atol
        0.01
    """

    base: TolerancePolicy | None = None
    per_dtype: tuple[tuple[torch.dtype, Any], ...] = ()
    fields: tuple[tuple[str, float], ...] = ()

    def resolve(self, dtype: torch.dtype) -> TolerancePolicy:
        policy = self.base if self.base is not None else policy_for(dtype)
        for key, entry in self.per_dtype:
            if key == dtype:
                policy = entry if isinstance(entry, TolerancePolicy) else policy.replace(**entry)
        return policy.replace(**dict(self.fields)) if self.fields else policy


_FIELDS = ("atol", "rtol", "baseline_factor", "baseline_floor")


def parse_tolerance_marker(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> ToleranceOverride:
    """Turn the arguments of ``@pytest.mark.tolerance(...)`` into a :class:`ToleranceOverride`.

    Accepted forms: ``tolerance("tf32")``, ``tolerance(torch.float32)``, ``tolerance(TolerancePolicy(...))``,
    ``tolerance(atol=1e-2, rtol=1e-2)``, ``tolerance(baseline_factor=3)``,
    ``tolerance({torch.float16: dict(atol=2e-3), torch.bfloat16: "tf32"})``, and a positional one with keywords.

    Example::

        >>> parse_tolerance_marker(("tf32",), {"baseline_factor": 3}).resolve(torch.float32).baseline_factor
        3
    """
    if not args and not kwargs:
        raise ValueError(
            "the tolerance marker is empty; give a policy (tolerance('tf32')), fields (tolerance(atol=1e-2)) or a "
            "per-dtype mapping"
        )
    if len(args) > 1:
        raise ValueError(f"the tolerance marker takes at most one positional argument; got {len(args)}")
    unknown = set(kwargs) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown tolerance field(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}")
    fields = tuple((name, _check_field(name, value)) for name, value in kwargs.items())
    base = None
    per_dtype: list[tuple[torch.dtype, Any]] = []
    if args:
        (first,) = args
        if isinstance(first, Mapping):
            for key, entry in first.items():
                per_dtype.append((_dtype_key(key), _per_dtype_entry(key, entry)))
        else:
            base = policy_for(first)
    override = ToleranceOverride(base=base, per_dtype=tuple(per_dtype), fields=fields)
    override.resolve(torch.float32)  # surfaces impossible combinations now rather than inside the test
    return override


def _check_field(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"tolerance field {name} must be a finite number >= 0; got {value!r}")
    return value


def _dtype_key(key: Any) -> torch.dtype:
    if isinstance(key, torch.dtype):
        return key
    if isinstance(key, str):
        dtype = getattr(torch, key.strip().removeprefix("torch."), None)
        if isinstance(dtype, torch.dtype):
            return dtype
        by_policy = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        if key in by_policy:
            return by_policy[key]
    raise ValueError(f"per-dtype tolerance keys must name a torch dtype (torch.float16, 'bfloat16'); got {key!r}")


def _per_dtype_entry(key: Any, entry: Any) -> Any:
    if isinstance(entry, Mapping):
        unknown = set(entry) - set(_FIELDS)
        if unknown:
            raise ValueError(f"tolerance for {key}: unknown field(s) {sorted(unknown)}; known: {', '.join(_FIELDS)}")
        return {name: _check_field(name, value) for name, value in entry.items()}
    return policy_for(entry)


_active_override: contextvars.ContextVar[ToleranceOverride | None] = contextvars.ContextVar(
    "kernelcheck_tolerance_override", default=None
)


@contextlib.contextmanager
def use_override(override: ToleranceOverride | None) -> Iterator[None]:
    """Make ``override`` the policy source for ``assert_close`` calls without ``policy=`` inside the block.

    Example::

        >>> with use_override(parse_tolerance_marker((), {"atol": 0.5})):
        ...     active_policy(torch.float16).atol
        0.5
    """
    token = _active_override.set(override)
    try:
        yield
    finally:
        _active_override.reset(token)


def override_sets_policy(dtype: torch.dtype) -> bool:
    """Whether the active ``tolerance`` marker names a whole policy for ``dtype`` (not just changed fields)."""
    override = _active_override.get()
    if override is None:
        return False
    if override.base is not None:
        return True
    return any(key == dtype and isinstance(entry, TolerancePolicy) for key, entry in override.per_dtype)


def active_policy(dtype: torch.dtype) -> TolerancePolicy:
    """The policy ``assert_close`` uses for ``dtype`` when no ``policy=`` is given (override first)."""
    override = _active_override.get()
    return override.resolve(dtype) if override is not None else policy_for(dtype)


# --------------------------------------------------------------------------------------------------------------
# The comparison


@dataclasses.dataclass
class CloseReport:
    """What ``assert_close`` found; ``message`` is the text of the failure (or of the pass)."""

    passed: bool
    policy: TolerancePolicy
    numel: int
    mismatched: int
    max_abs_error: float
    max_abs_index: tuple[int, ...] | None
    max_abs_values: tuple[float, float] | None
    max_rel_error: float
    max_rel_index: tuple[int, ...] | None
    max_rel_values: tuple[float, float] | None
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


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    *,
    policy: PolicyLike | None = None,
    baseline: torch.Tensor | None = None,
    notes: tuple[str, ...] = (),
) -> CloseReport:
    """Assert that ``actual`` is close to the (usually float64) reference ``expected``.

    The policy is ``policy`` when given (a TolerancePolicy, a dtype or a name such as "tf32"), else the
    ``tolerance`` marker's override for ``actual.dtype``, else the default for ``actual.dtype``. With
    ``baseline`` the baseline-relative rule replaces the per-element rule. Comparison is done in float64 on the
    tensors' device, streamed in blocks. ``notes`` are extra lines for the message.

    Example::

        >>> ref = torch.randn(64, 64, dtype=torch.float64)
        >>> assert_close(ref.to(torch.bfloat16), ref).passed
        True

    Raises:
        TypeError: an input is not a tensor, or is complex.
        ValueError: shapes or devices differ, or the baseline holds NaN or Inf.
        AssertionError: the tensors are not close; the message gives the error figures.
    """
    __tracebackhide__ = True  # pytest shows the caller's line, not this function's body
    for label, tensor in (("actual", actual), ("expected", expected), ("baseline", baseline)):
        if tensor is None and label == "baseline":
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"assert_close: {label} must be a torch.Tensor; got {type(tensor).__name__}")
        if tensor.is_complex():
            raise TypeError(f"assert_close: {label} is complex ({tensor.dtype}); compare real and imaginary parts")
        if tensor.shape != actual.shape:
            raise ValueError(
                f"assert_close: shapes differ: actual {tuple(actual.shape)}, {label} {tuple(tensor.shape)}"
            )
        if tensor.device != actual.device:
            raise ValueError(
                f"assert_close: devices differ: actual on {actual.device}, {label} on {tensor.device}; move one "
                "explicitly"
            )
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


def _baseline_error(baseline: torch.Tensor, expected: torch.Tensor) -> float:
    worst = 0.0
    flat_b, flat_e = baseline.reshape(-1), expected.reshape(-1)
    for start in range(0, flat_b.numel(), _BLOCK_ELEMENTS):
        b = flat_b[start : start + _BLOCK_ELEMENTS].to(torch.float64)
        e = flat_e[start : start + _BLOCK_ELEMENTS].to(torch.float64)
        if not torch.isfinite(b).all():
            raise ValueError("assert_close: the baseline holds NaN or Inf, so it cannot bound the error")
        worst = max(worst, float(torch.nan_to_num(b.sub_(e).abs_(), nan=0.0, posinf=0.0).max()))
    return worst


def _compare(
    actual: torch.Tensor, expected: torch.Tensor, policy: TolerancePolicy, allowed: float | None
) -> CloseReport:
    shape = tuple(actual.shape)
    numel = actual.numel()
    flat_a, flat_e = actual.reshape(-1), expected.reshape(-1)
    stats = dict(
        mismatched=0, nan_actual=0, nan_expected=0, inf_actual=0, inf_expected=0, inf_mismatched=0,
        max_abs=0.0, max_abs_at=None, max_abs_values=None, max_rel=0.0, max_rel_at=None, max_rel_values=None,
        first_bad=None,
    )
    for start in range(0, numel, _BLOCK_ELEMENTS):
        a = flat_a[start : start + _BLOCK_ELEMENTS].to(torch.float64)
        e = flat_e[start : start + _BLOCK_ELEMENTS].to(torch.float64)
        nan_a, nan_e = torch.isnan(a), torch.isnan(e)
        inf_a, inf_e = torch.isinf(a), torch.isinf(e)
        stats["nan_actual"] += int(nan_a.sum())
        stats["nan_expected"] += int(nan_e.sum())
        stats["inf_actual"] += int(inf_a.sum())
        stats["inf_expected"] += int(inf_e.sum())
        # An infinity is acceptable only opposite the same infinity.
        inf_bad = (inf_a | inf_e) & (a != e)
        stats["inf_mismatched"] += int(inf_bad.sum())
        finite = ~(nan_a | nan_e | inf_a | inf_e)

        diff = torch.where(finite, a - e, 0.0).abs_()
        if allowed is None:
            bound = e.abs().mul_(policy.rtol).add_(policy.atol)
            bad = diff > bound
            del bound
        else:
            bad = diff > allowed
        bad |= nan_a | nan_e | inf_bad
        block_bad = int(bad.sum())
        stats["mismatched"] += block_bad
        if block_bad and stats["first_bad"] is None:
            stats["first_bad"] = start + int(bad.nonzero()[0, 0])

        if diff.numel():
            i = int(diff.argmax())
            if float(diff[i]) > stats["max_abs"] or stats["max_abs_at"] is None:
                stats["max_abs"], stats["max_abs_at"] = float(diff[i]), start + i
                stats["max_abs_values"] = (float(a[i]), float(e[i]))
            # Relative error where expected is non-zero; a non-zero difference against an exact zero counts as inf.
            rel = diff.div_(e.abs())
            rel = torch.nan_to_num(rel, nan=0.0)
            j = int(rel.argmax())
            if float(rel[j]) > stats["max_rel"] or stats["max_rel_at"] is None:
                stats["max_rel"], stats["max_rel_at"] = float(rel[j]), start + j
                stats["max_rel_values"] = (float(a[j]), float(e[j]))
        del a, e, diff

    def unravel(flat: int | None) -> tuple[int, ...] | None:
        if flat is None:
            return None
        index = []
        for size in reversed(shape):
            index.append(flat % size)
            flat //= size
        return tuple(reversed(index))

    passed = stats["mismatched"] == 0
    if allowed is not None and not stats["max_abs"] <= allowed:
        passed = False
    return CloseReport(
        passed=passed,
        policy=policy,
        numel=numel,
        mismatched=stats["mismatched"],
        max_abs_error=stats["max_abs"],
        max_abs_index=unravel(stats["max_abs_at"]),
        max_abs_values=stats["max_abs_values"],
        max_rel_error=stats["max_rel"],
        max_rel_index=unravel(stats["max_rel_at"]),
        max_rel_values=stats["max_rel_values"],
        nan_actual=stats["nan_actual"],
        nan_expected=stats["nan_expected"],
        inf_actual=stats["inf_actual"],
        inf_expected=stats["inf_expected"],
        inf_mismatched=stats["inf_mismatched"],
        first_bad_index=unravel(stats["first_bad"]),
    )


def _message(r: CloseReport) -> str:
    head = "Tensors are close" if r.passed else "Tensors are not close"
    if r.allowed_error is None:
        rule = f"{r.policy.describe()}: |actual - expected| <= atol + rtol * |expected|"
    else:
        rule = (
            f"{r.policy.describe()}, baseline rule: max|actual - expected| <= {r.policy.baseline_factor:g} * "
            f"max|baseline - expected| + {r.policy.baseline_floor:g} = {r.allowed_error:.3g}"
        )
    share = 100.0 * r.mismatched / r.numel if r.numel else 0.0
    lines = [f"{head} under {rule}", f"  mismatched elements: {r.mismatched} / {r.numel} ({share:.4g}%)"]
    if r.max_abs_index is not None:
        a, e = r.max_abs_values
        lines.append(
            f"  max abs error: {r.max_abs_error:.6g} at index {r.max_abs_index} (actual {a:.8g}, expected {e:.8g})"
        )
        a, e = r.max_rel_values
        lines.append(
            f"  max rel error: {r.max_rel_error:.6g} at index {r.max_rel_index} (actual {a:.8g}, expected {e:.8g})"
        )
    lines.append(
        f"  NaN: {r.nan_actual} in actual, {r.nan_expected} in expected; Inf: {r.inf_actual} in actual, "
        f"{r.inf_expected} in expected, {r.inf_mismatched} without the same Inf opposite"
    )
    if r.nan_actual:
        lines.append("  actual holds NaN: NaN never passes")
    if r.nan_expected:
        lines.append("  expected holds NaN: a reference must not produce NaN, so this never passes")
    if r.mismatched:
        lines.append(f"  first mismatched element at index {r.first_bad_index}")
    if r.baseline_error is not None:
        ratio = r.baseline_ratio
        lines.append(
            f"  baseline: max|baseline - expected| = {r.baseline_error:.6g}; error ratio actual/baseline = "
            f"{ratio:.3g} (allowed {r.policy.baseline_factor:g} + floor {r.policy.baseline_floor:g})"
        )
    lines.extend(f"  {note}" for note in r.notes)
    return "\n".join(lines)
