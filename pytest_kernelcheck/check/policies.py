"""Tolerance policies per precision, the ``tolerance`` marker's override of them, and the policy an
``assert_close`` call without ``policy=`` gets."""
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
        >>> from pytest_kernelcheck import assert_close
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
