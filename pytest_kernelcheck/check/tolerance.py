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

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any, Union

import numpy as np
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

    ``base`` replaces the per-dtype default for every floating-point dtype; ``per_dtype`` maps a floating-point
    dtype to a policy or to field changes; ``fields`` (atol=..., rtol=...) are applied last, to whatever policy
    results. Integer and bool dtypes resolve to "exact" whatever the override says.

    Example::

        >>> ov = parse_tolerance_marker((), {"atol": 1e-2})
        >>> ov.resolve(torch.float16).atol, ov.resolve(torch.int64).name
        (0.01, 'exact')
    """

    base: TolerancePolicy | None = None
    per_dtype: tuple[tuple[torch.dtype, Any], ...] = ()
    fields: tuple[tuple[str, float], ...] = ()

    def resolve(self, dtype: torch.dtype) -> TolerancePolicy:
        if not dtype.is_floating_point:
            # A marker loosens the rounding of floating-point results; integers have none, so a count or an
            # index that is off stays a failure (policy_for also refuses complex dtypes here).
            return policy_for(dtype)
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
    ``policy=`` is the keyword form of the positional argument: ``tolerance(policy="tf32")``. The override
    applies to floating-point results only; integer and bool results stay exact.

    Example::

        >>> parse_tolerance_marker(("tf32",), {"baseline_factor": 3}).resolve(torch.float32).baseline_factor
        3
        >>> parse_tolerance_marker((), {"policy": "tf32"}).resolve(torch.float32).name
        'tf32'
    """
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy", None)
    if policy is not None:
        if args:
            raise ValueError(
                f"the tolerance marker got a policy both positionally ({args[0]!r}) and as policy={policy!r}; give "
                "it once"
            )
        args = (policy,)
    if not args and not kwargs:
        raise ValueError(
            "the tolerance marker is empty; give a policy (tolerance('tf32') or tolerance(policy='tf32')), fields "
            "(tolerance(atol=1e-2)) or a per-dtype mapping"
        )
    if len(args) > 1:
        raise ValueError(f"the tolerance marker takes at most one positional argument; got {len(args)}")
    unknown = set(kwargs) - set(_FIELDS)
    if unknown:
        raise ValueError(f"unknown tolerance field(s) {sorted(unknown)}; known: policy, {', '.join(_FIELDS)}")
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
    dtype = None
    if isinstance(key, torch.dtype):
        dtype = key
    elif isinstance(key, str):
        dtype = getattr(torch, key.strip().removeprefix("torch."), None)
        by_policy = {"fp64": torch.float64, "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
        if not isinstance(dtype, torch.dtype):
            dtype = by_policy.get(key)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(
            f"per-dtype tolerance keys must name a torch dtype (torch.float16, 'bfloat16'); got {key!r}"
        )
    if not dtype.is_floating_point:
        # Such an entry would never be used (integer results stay exact under a marker): refuse it, not ignore it.
        raise ValueError(
            f"per-dtype tolerance keys must name a floating-point dtype; got {key!r}: integer and bool "
            "results are compared exactly under a tolerance marker (pass policy= to assert_close to loosen one)"
        )
    return dtype


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
    if override is None or not dtype.is_floating_point:
        return False
    if override.base is not None:
        return True
    return any(key == dtype and isinstance(entry, TolerancePolicy) for key, entry in override.per_dtype)


def active_policy(dtype: torch.dtype) -> TolerancePolicy:
    """The policy ``assert_close`` uses for ``dtype`` when no ``policy=`` is given (override first; integer and bool
    dtypes always get "exact")."""
    override = _active_override.get()
    return override.resolve(dtype) if override is not None else policy_for(dtype)


# --------------------------------------------------------------------------------------------------------------
# The comparison

# What ``actual``, ``expected`` and ``baseline`` may be, as the error messages say it.
_ACCEPTED = "a dense torch.Tensor, a numpy array or scalar, or a Python bool, int or float"

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


def _is_integral(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex


# --------------------------------------------------------------------------------------------------------------
# Exact integer arithmetic. A difference of two 64-bit integers needs 65 bits, and float64 holds integers exactly
# only up to 2**53, so integers are split into 32-bit words held in int64, where no step can overflow.

_LOW_MASK = 0xFFFFFFFF
_TWO_32 = float(1 << 32)


def _words(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` (any integer or bool dtype) as int64 words with ``x == high * 2**32 + low`` and ``0 <= low < 2**32``."""
    if x.dtype == torch.uint64:
        # Above 2**63 the bits read as a negative int64; the high word taken unsigned restores the value.
        bits = x.view(torch.int64)
        return (bits >> 32) & _LOW_MASK, bits & _LOW_MASK
    wide = x.to(torch.int64)
    return wide >> 32, wide & _LOW_MASK


def _exact_abs_diff(a: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``|a - e|`` exactly, as int64 words ``(high, low)`` with value ``high * 2**32 + low`` and ``0 <= low < 2**32``.

    Example::

        >>> high, low = _exact_abs_diff(torch.tensor([-2**63]), torch.tensor([2**63 - 1]))
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


# --------------------------------------------------------------------------------------------------------------
# Blocks


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


def _float_block(a_raw: torch.Tensor, e_raw: torch.Tensor, policy: TolerancePolicy, allowed: float | None) -> _Block:
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


def _integer_block(a_raw: torch.Tensor, e_raw: torch.Tensor, policy: TolerancePolicy, allowed: float | None) -> _Block:
    high, low = _exact_abs_diff(a_raw, e_raw)
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


def _first_best(candidates: torch.Tensor, keys: tuple[torch.Tensor, ...]) -> int:
    """The first position among ``candidates`` whose ``keys`` are lexicographically largest (keys are >= 0)."""
    for key in keys:
        candidates = candidates & (key == torch.where(candidates, key, -1).max())
    return int(candidates.to(torch.uint8).argmax())  # argmax returns the first of equal maxima


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    index = []
    for size in reversed(shape):
        index.append(flat % size)
        flat //= size
    return tuple(reversed(index))


def _baseline_error(baseline: torch.Tensor, expected: torch.Tensor) -> float:
    worst = 0.0
    exact = _is_integral(baseline.dtype) and _is_integral(expected.dtype)
    flat_b, flat_e = baseline.reshape(-1), expected.reshape(-1)
    for start in range(0, flat_b.numel(), _BLOCK_ELEMENTS):
        b_raw = flat_b[start : start + _BLOCK_ELEMENTS]
        e_raw = flat_e[start : start + _BLOCK_ELEMENTS]
        if exact:
            high, low = _exact_abs_diff(b_raw, e_raw)
            i = _first_best(torch.ones_like(high, dtype=torch.bool), (high, low))
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
    exact = _is_integral(actual.dtype) and _is_integral(expected.dtype)
    compare_block = _integer_block if exact else _float_block
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
            i = _first_best(block.bad, (block.ratio,) + block.error_keys)
            rank = (float(block.ratio[i]),) + tuple(key[i].item() for key in block.error_keys)
            if worst_rank is None or rank > worst_rank:
                worst_rank, worst = rank, block.mismatch(i, _unravel(start + i, shape))
            if len(first) < _SHOWN_MISMATCHES:
                for p in block.bad.nonzero()[: _SHOWN_MISMATCHES - len(first), 0].tolist():
                    first.append(block.mismatch(p, _unravel(start + p, shape)))

        i = _first_best(torch.ones_like(block.bad), block.abs_keys)
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
        max_abs_index=None if abs_at is None else _unravel(abs_at, shape),
        max_abs_values=abs_values,
        max_rel_error=max_rel,
        max_rel_index=None if rel_at is None else _unravel(rel_at, shape),
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
