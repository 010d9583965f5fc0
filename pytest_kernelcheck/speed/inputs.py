"""Inputs the plugin owns: input sets built from ``make_inputs()``, rotated between timed calls, and the check of
the candidate's output against the baseline's on fresh inputs.

A kernel timed again and again on one input finds its data in the L2 cache, and one that caches its result (or
skips work on inputs it has seen) looks fast and stays correct on that input. Given ``inputs=make_inputs``,
:func:`build_input_sets` makes enough sets that together they exceed the L2 (on CUDA; on the CPU a few), each
timed call takes the next set (:meth:`InputSets.bind`), so the set it runs on was last touched several calls
ago, and after timing :func:`check_fresh_outputs` calls both sides on inputs neither has seen.
"""
from __future__ import annotations

import inspect
import math
import sys
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import outputs, timing

__all__ = ["FreshOutputMismatch", "InputSets", "OutputMismatch", "build_input_sets", "check_first_outputs",
           "check_fresh_outputs", "validate_check"]

# On the CPU the caches are small and per core; three sets already keep a call from reusing the previous one's.
CPU_INPUT_SETS = 3
# At least two sets, so consecutive calls never share one, however large a set is.
MIN_INPUT_SETS = 2
# Device memory the rotated sets may take together; past it fewer sets are built and the notes say so.
INPUT_MEMORY_BUDGET_BYTES = 2 * 2**30
# Tiny inputs would need tens of thousands of sets to fill the L2; past this count the rest is Python overhead.
MAX_INPUT_SETS = 512

Arguments = tuple[tuple[Any, ...], dict[str, Any]]
brief = outputs.brief_value  # how a message names a value: type and shape, never a tensor's elements


class OutputMismatch(AssertionError):
    """The candidate's output is not the baseline's (compared before timing, by default, or on fresh inputs)."""


class FreshOutputMismatch(OutputMismatch):
    """The candidate's output on fresh inputs is not the baseline's, or does not change with the inputs."""


@dataclass
class InputSets:
    """The rotated input sets of one comparison and what was decided about them.

    >>> sets = InputSets([((1,), {}), ((2,), {})], set_bytes=0, device="cpu", note="")
    >>> double = sets.bind(lambda x: 2 * x, "candidate")
    >>> double(), double(), double()
    (2, 4, 2)
    """

    sets: list[Arguments]
    set_bytes: int
    device: str
    note: str
    _next: int = 0

    def __len__(self) -> int:
        return len(self.sets)

    def bind(self, fn: Callable[..., Any], side: str) -> Callable[[], Any]:
        """A zero-argument callable that runs ``fn`` on the next input set.

        One counter serves every side: in a round the baseline runs on the set after the candidate's, so no call
        finds its inputs left in cache by the call just before it.
        """
        require_accepts(fn, self.sets[0], side)

        def call_next() -> Any:
            args, kwargs = self.sets[self._next]
            self._next = (self._next + 1) % len(self.sets)
            return fn(*args, **kwargs)

        return call_next

    def pinned(self, fn: Callable[..., Any], index: int = 0) -> Callable[[], Any]:
        """``fn`` on one fixed set: the first call and the same-output check after timing use it."""
        args, kwargs = self.sets[index]
        return lambda: fn(*args, **kwargs)


def call_inputs(make_inputs: Any) -> Arguments:
    """One input set from ``make_inputs()``: a tuple is positional arguments, a dict keyword arguments.

    >>> call_inputs(lambda: (1, 2)), call_inputs(lambda: {"x": 1})
    (((1, 2), {}), ((), {'x': 1}))
    >>> call_inputs(lambda: [1, 2])
    Traceback (most recent call last):
    ...
    TypeError: inputs() must return a tuple of arguments or a dict of keyword arguments, got list [1, 2]
    """
    if not callable(make_inputs):
        raise TypeError(
            "inputs must be a zero-argument callable returning a tuple of arguments or a dict of keyword "
            f"arguments (e.g. inputs=lambda: (x,)), got {brief(make_inputs)}"
        )
    try:
        made = make_inputs()
    except Exception as exc:
        raise timing.CallableFailed("inputs", exc, "a call of inputs()") from exc
    if isinstance(made, tuple):
        return made, {}
    if isinstance(made, dict):
        if not all(isinstance(key, str) for key in made):
            raise TypeError(f"inputs() returned a dict whose keys are not all argument names: {list(made)!r}")
        return (), dict(made)
    raise TypeError(
        f"inputs() must return a tuple of arguments or a dict of keyword arguments, got {brief(made)}"
    )


def require_accepts(fn: Any, arguments: Arguments, side: str) -> None:
    """Raise ``TypeError`` naming ``side`` unless ``fn`` accepts one input set."""
    if not callable(fn):
        raise TypeError(f"{side} must be a callable taking the inputs, got {brief(fn)}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: calling them will tell
        return
    args, kwargs = arguments
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        given = ", ".join([f"{len(args)} positional"] + ([f"keywords {sorted(kwargs)}"] if kwargs else []))
        raise TypeError(f"{side} must accept the inputs ({given}) since inputs= is given: {exc}") from None


def nbytes(value: Any) -> int:
    """Bytes of the tensors and arrays in ``value`` (nested in tuples, lists and dicts).

    >>> import numpy as np
    >>> nbytes(((np.zeros(4), [np.zeros(2)]), {"n": 3}))
    48
    """
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if hasattr(value, "nbytes") and hasattr(value, "dtype"):
        return int(value.nbytes)
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(nbytes(item) for item in items)


def cuda_device(value: Any) -> Any:
    """The device of the first CUDA tensor in ``value``, else None."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if isinstance(value, torch.Tensor):
        return value.device if value.is_cuda else None
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    for item in items:
        found = cuda_device(item)
        if found is not None:
            return found
    return None


def _l2_bytes(device: Any) -> int | None:
    import torch

    return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)


def plan_set_count(set_bytes: int, l2_bytes: int | None, memory_budget: int) -> tuple[int, str]:
    """How many CUDA input sets, and the note saying why: together past the L2 flush size, within the budget.

    The target is what the L2 flush writes (:func:`pytest_kernelcheck.speed.timing.l2_flush_bytes`): twice the L2, as
    writing only the L2's size can leave lines resident.

    >>> plan_set_count(10 * 2**20, 50 * 2**20, 2**30)[0]
    11
    >>> count, note = plan_set_count(600 * 2**20, 50 * 2**20, 2**30); count, "budget" in note
    (2, True)
    """
    target = timing.l2_flush_bytes(l2_bytes)
    wanted = max(MIN_INPUT_SETS, math.ceil(target / set_bytes) + 1) if set_bytes > 0 else MAX_INPUT_SETS
    count = min(wanted, MAX_INPUT_SETS)
    reason = ""
    if set_bytes > 0 and count * set_bytes > memory_budget:
        count = max(MIN_INPUT_SETS, memory_budget // set_bytes)
        reason = (f"; capped by the {memory_budget // 2**20} MiB input memory budget, so together they "
                  + ("still exceed" if count * set_bytes > target else "do not exceed")
                  + f" the {target // 2**20} MiB L2 flush size")
    elif count < wanted:
        reason = f"; capped at {MAX_INPUT_SETS} sets, so together they do not exceed the L2"
    total = count * set_bytes
    return count, (f"{count} input sets of {set_bytes / 2**20:.3g} MiB rotated ({total / 2**20:.3g} MiB in all, "
                   f"target {target // 2**20} MiB: twice the L2)" + reason)


def build_input_sets(
    make_inputs: Any, *, l2_bytes: int | None = None, memory_budget: int = INPUT_MEMORY_BUDGET_BYTES
) -> InputSets:
    """Call ``make_inputs()`` until there are enough sets for every timed call to start cold.

    On CUDA (a CUDA tensor among the inputs) the sets together exceed the L2 (``l2_bytes``: the device's, read
    from torch when None), within ``memory_budget``; on the CPU there are ``CPU_INPUT_SETS``.

    >>> import numpy as np
    >>> sets = build_input_sets(lambda: (np.ones(3),))
    >>> len(sets), sets.device, sets.note
    (3, 'cpu', '3 input sets of 2.29e-05 MiB rotated (CPU: a fixed count)')
    """
    first = call_inputs(make_inputs)
    device = cuda_device(first)
    set_bytes = nbytes(first)
    if device is None:
        count = CPU_INPUT_SETS
        note = f"{count} input sets of {set_bytes / 2**20:.3g} MiB rotated (CPU: a fixed count)"
    else:
        count, note = plan_set_count(set_bytes, _l2_bytes(device) if l2_bytes is None else l2_bytes, memory_budget)
    sets = [first] + [call_inputs(make_inputs) for _ in range(count - 1)]
    return InputSets(sets, set_bytes, str(device) if device is not None else "cpu", note)


# What check= may be: a policy for assert_close, a callable, or False.
CHECK_HELP = ("check must be a tolerance policy (a name such as 'fp16', a torch dtype or a TolerancePolicy), a "
              "callable (candidate_out, baseline_out) -> None that raises on a mismatch, True/None (the policy "
              "of the output's dtype) or False")


def validate_check(check: Any) -> None:
    """Refuse a ``check=`` of the wrong type before anything runs.

    >>> validate_check(3)
    Traceback (most recent call last):
    ...
    TypeError: check must be a tolerance policy (a name such as 'fp16', a torch dtype or a TolerancePolicy), a callable (candidate_out, baseline_out) -> None that raises on a mismatch, True/None (the policy of the output's dtype) or False; got int 3
    """
    if check is None or isinstance(check, (bool, str)) or callable(check):
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(check, torch.dtype):
        return
    if type(check).__name__ == "TolerancePolicy":
        return
    raise TypeError(f"{CHECK_HELP}; got {brief(check)}")


def _assert_close_nested(
    candidate: Any, baseline: Any, policy: Any, path: str = "output", empty: list[str] | None = None
) -> int:
    """assert_close on every tensor or number of two outputs of the same structure; returns how many elements
    were compared. Empty tensors and arrays of equal shape, and None beside None, are passed over
    (assert_close refuses them, having nothing to compare) and named in ``empty``."""
    from ..check.tolerance import assert_close

    if isinstance(baseline, (list, tuple)):
        if not isinstance(candidate, (list, tuple)) or len(candidate) != len(baseline):
            raise AssertionError(f"{path}: the candidate returned {outputs._brief(candidate)}, the baseline "
                                 f"{len(baseline)} items")
        return sum(_assert_close_nested(c, b, policy, f"{path}[{index}]", empty)
                   for index, (c, b) in enumerate(zip(candidate, baseline)))
    if isinstance(baseline, dict):
        if not isinstance(candidate, dict) or set(candidate) != set(baseline):
            raise AssertionError(f"{path}: keys differ from the baseline's")
        return sum(_assert_close_nested(candidate[key], baseline[key], policy, f"{path}[{key!r}]", empty)
                   for key in baseline)
    if baseline is None or isinstance(baseline, (str, bytes)):
        if candidate != baseline:
            raise AssertionError(f"{path}: {candidate!r} != {baseline!r}")
        if baseline is None:
            # None beside None compares nothing: a side that forgot to return its output would match.
            if empty is not None:
                empty.append(f"{path} (None)")
            return 0
        return 1  # equal text is a comparison that could have failed
    shape = getattr(baseline, "shape", None)
    if shape is not None and math.prod(shape) == 0 and tuple(getattr(candidate, "shape", ())) == tuple(shape):
        if empty is not None:
            empty.append(f"{path} of shape {tuple(shape)}")
        return 0
    try:
        return assert_close(candidate, baseline, policy=None if policy is True else policy).numel
    except AssertionError as exc:
        raise AssertionError(f"{path}: {exc}") from None


def check_fresh_outputs(
    candidate: Callable[..., Any],
    baseline: Callable[..., Any],
    make_inputs: Callable[[], Any],
    check: Any = None,
    *,
    candidate_side: str = "candidate",
    baseline_side: str = "baseline",
) -> None:
    """Run both sides on two fresh input sets and fail when the candidate's outputs are not the baseline's.

    First the reuse check: when the baseline's outputs on the two sets differ and the candidate's are
    identical, the candidate returns a cached result (or one it computed on other inputs). Then ``check`` on
    each set: ``assert_close`` under a policy (None/True: the policy of the output's dtype) or a callable that
    raises; ``False`` skips both checks. Under a policy, outputs that hold no elements (empty tensors, None) are
    refused with a ValueError: comparing them would check nothing.

    >>> import numpy as np
    >>> rng = np.random.default_rng(0)
    >>> make = lambda: (rng.random(4),)
    >>> check_fresh_outputs(lambda x: x * 2, lambda x: x + x, make)
    >>> cached = make()[0] * 2
    >>> check_fresh_outputs(lambda x: cached, lambda x: x + x, make)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.speed.inputs.FreshOutputMismatch: the candidate returns the same output for different inputs ...
    """
    if check is False:
        return
    validate_check(check)
    results = []
    for _ in range(2):
        args, kwargs = call_inputs(make_inputs)
        # Snapshots: a side that writes into one buffer and returns it would otherwise change the first result.
        ran = []
        for fn, side in ((candidate, candidate_side), (baseline, baseline_side)):
            try:
                ran.append(outputs.snapshot(fn(*args, **kwargs)))
            except Exception as exc:
                raise timing.CallableFailed(side, exc, "the check on fresh inputs") from exc
        results.append(ran)
    (candidate_1, baseline_1), (candidate_2, baseline_2) = results
    if _differs(baseline_1, baseline_2) and not _differs(candidate_1, candidate_2):
        raise FreshOutputMismatch(
            f"the {candidate_side} returns the same output for different inputs (the {baseline_side}'s outputs "
            "differ): it returns a cached result or skips work on inputs it has seen"
        )
    for index, (cand, base) in enumerate(results, 1):
        empty: list[str] = []
        compared = 0
        try:
            if callable(check) and not isinstance(check, bool):
                check(cand, base)
            else:
                compared = _assert_close_nested(cand, base, check, empty=empty)
        except AssertionError as exc:
            raise FreshOutputMismatch(
                f"{candidate_side} output on fresh inputs differs from the {baseline_side}'s "
                f"(fresh set {index} of 2): {exc}"
            ) from None
        if empty and not compared:
            raise ValueError(
                f"the check on fresh inputs compared no elements: the {baseline_side}'s {', '.join(empty)} holds "
                "none, so a wrong candidate would match it too; make inputs= give outputs with elements (a side "
                "that writes into a buffer should return it), pass a callable check=, or check=False to skip the "
                "check"
            )


def _differs(first: Any, again: Any) -> bool:
    """Whether two outputs are not identical (an output the exact check cannot compare counts as differing)."""
    try:
        return outputs.output_difference(first, again) is not None
    except outputs.OutputNotComparable:
        return True


def bind_all(sets: InputSets, fns: Sequence[Callable[..., Any]], sides: Sequence[str]) -> list[Callable[[], Any]]:
    """Each callable bound to the shared rotation (see :meth:`InputSets.bind`)."""
    return [sets.bind(fn, side) for fn, side in zip(fns, sides)]


def holds_arrays(value: Any) -> bool:
    """Whether an output is, or holds inside tuples, lists and dicts, a torch tensor or a numpy array.

    >>> import numpy as np
    >>> holds_arrays((1, {"out": np.ones(2)})), holds_arrays(None), holds_arrays([1.0])
    (True, False, False)
    """
    if isinstance(value, (list, tuple)):
        return any(holds_arrays(item) for item in value)
    if isinstance(value, dict):
        return any(holds_arrays(item) for item in value.values())
    torch, numpy = sys.modules.get("torch"), sys.modules.get("numpy")
    return (torch is not None and isinstance(value, torch.Tensor)) or (
        numpy is not None and isinstance(value, numpy.ndarray))


def incomparable(candidate: Any, baseline: Any, path: str = "output") -> str | None:
    """Why two outputs are not comparable tensors (a structure or a tensor's shape differs), or None.

    Two sides that return arrays of different shapes compute different things (a sort of ``n`` numbers against
    one of ``2n``): their speed may still be compared, their values cannot.

    >>> import numpy as np
    >>> incomparable((np.ones(2), 1), (np.ones(3), 1))
    'output[0] has shape (2,) against (3,)'
    """
    if isinstance(baseline, (list, tuple)):
        if not isinstance(candidate, (list, tuple)) or len(candidate) != len(baseline):
            return f"{path} is {outputs._brief(candidate)} against {outputs._brief(baseline)}"
        return next((why for why in (incomparable(c, b, f"{path}[{i}]")
                                     for i, (c, b) in enumerate(zip(candidate, baseline))) if why), None)
    if isinstance(baseline, dict):
        if not isinstance(candidate, dict) or set(candidate) != set(baseline):
            return f"{path} is {outputs._brief(candidate)} against {outputs._brief(baseline)}"
        return next((why for why in (incomparable(candidate[k], baseline[k], f"{path}[{k!r}]") for k in baseline)
                     if why), None)
    if holds_arrays(baseline) != holds_arrays(candidate):
        return f"{path} is {outputs._brief(candidate)} against {outputs._brief(baseline)}"
    if holds_arrays(baseline) and tuple(candidate.shape) != tuple(baseline.shape):
        return f"{path} has shape {tuple(candidate.shape)} against {tuple(baseline.shape)}"
    return None


def check_first_outputs(
    candidate_out: Any, baseline_out: Any, check: Any = None, *, candidate_side: str = "candidate",
    baseline_side: str = "baseline",
) -> str:
    """Compare two sides' first outputs before anything is timed: a speed verdict for a wrong kernel is worthless.

    Outputs are compared whenever both hold tensors or arrays of the same shapes in the same structure (``check``: None/True the policy of the output's
    dtype, a policy, or a callable that raises, which is always called); ``check=False`` skips it. Raises
    :class:`OutputMismatch` naming how to opt out; returns the note that says what was compared.

    >>> import numpy as np
    >>> x = np.linspace(0.0, 1.0, 7)
    >>> check_first_outputs(x * 2, x + x)
    "outputs compared before timing: the candidate's matched the baseline's (the policy of the output's dtype)"
    >>> check_first_outputs(x * 3, x + x)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.speed.inputs.OutputMismatch: candidate output differs from the baseline's before timing ...
    """
    if check is False:
        return "outputs not compared (check=False)"
    custom = callable(check) and not isinstance(check, bool)
    if not custom and not (holds_arrays(candidate_out) and holds_arrays(baseline_out)):
        return (f"outputs not compared: the {candidate_side} returns {outputs._brief(candidate_out)}, the "
                f"{baseline_side} {outputs._brief(baseline_out)} (compared by default when both return tensors "
                "or arrays; pass check=a callable to compare others)")
    why = None if custom else incomparable(candidate_out, baseline_out)
    if why:
        return (f"outputs not compared: {why}, so the two sides compute different things (compared by default "
                "when both return tensors of the same shapes; pass check=a callable to compare others)")
    try:
        if custom:
            check(candidate_out, baseline_out)
        else:
            _assert_close_nested(candidate_out, baseline_out, check)
    except AssertionError as exc:
        raise OutputMismatch(
            f"{candidate_side} output differs from the {baseline_side}'s before timing (outputs are compared by "
            f"default when both sides return tensors): {exc}. Pass check=False to time callables whose outputs "
            "differ by design, or check=<policy or callable> for another tolerance"
        ) from None
    how = "a callable" if custom else ("the policy of the output's dtype" if check in (None, True)
                                        else f"policy {check}")
    return f"outputs compared before timing: the {candidate_side}'s matched the {baseline_side}'s ({how})"
