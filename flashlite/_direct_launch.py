"""Relaunch a compiled Triton kernel without Triton's per-call argument binding.

``kernel[grid](...)`` binds and specializes every argument, formats the compile options into a cache key and looks
the kernel up on every call: tens of microseconds of host time, longer than a small attention kernel runs on the
GPU. A caller that launches one kernel again and again with the same non-tensor arguments (a replayed plan of
``flashlite.attention``: fixed shapes, strides, dtypes and scalars) can keep the compiled kernel and its argument
list from one ordinary launch and pass only new tensors after that.

What a replay must match: Triton specializes pointer arguments on 16-byte alignment, so the recorded launch must
have had every tensor aligned and a replay refuses tensors that are not (the caller then launches normally); the
compiled function belongs to the device it was loaded on, so a replay on another current device is refused too.
Recording relies on ``CompiledKernel.run`` (Triton 3.x); where recording fails the caller keeps launching normally.

A replaced argument may also be a TMA descriptor (a host-side ``TensorDescriptor`` over a new tensor, as the Gluon
kernels take): it goes to the launcher as the object itself, which encodes it as Triton's ordinary launch does,
after the same alignment and device checks on the tensor it describes. The descriptor's block shape, dtype and
layout (what Triton specializes a descriptor argument on) must be the recorded ones: the caller replays only
launches of one plan, whose shapes, strides and dtypes are fixed.

Where flashlite's C++ helpers were built (``flashlite._native``), a replay without descriptors reads and checks the
tensors' addresses and calls the launcher in one C call (``launch_recorded``); the Python loop here does the same for
descriptors, tensor subclasses and machines without the extension.
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

import torch

from flashlite import _native

_ALIGNMENT = 16


def _jit_function(kernel: Any) -> Any:
    """The JITFunction under ``triton.heuristics`` / ``triton.autotune`` wrappers."""
    while hasattr(getattr(kernel, "fn", None), "arg_names"):
        kernel = kernel.fn
    return kernel


def _bound_values(kernel: Any, args: Sequence[Any], kwargs: dict) -> list[Any]:
    """Every parameter's value in signature order, as Triton's launcher receives them: positional arguments,
    keywords, values from ``triton.heuristics`` wrappers (applied as their ``run`` applies them), defaults."""
    kwargs = dict(kwargs)
    wrapper = kernel
    while hasattr(wrapper, "values") and hasattr(wrapper, "fn"):
        for name, heuristic in wrapper.values.items():
            kwargs[name] = heuristic({**dict(zip(wrapper.arg_names, args)), **kwargs})
        wrapper = wrapper.fn
    jit = _jit_function(kernel)
    named = dict(zip(jit.arg_names, args))
    named.update((name, value) for name, value in kwargs.items() if name in jit.arg_names)
    parameters = inspect.signature(jit.fn).parameters
    values = []
    for name in jit.arg_names:
        if name in named:
            values.append(named[name])
        elif parameters[name].default is not inspect.Parameter.empty:
            values.append(parameters[name].default)
        else:
            raise TypeError(f"no value for kernel parameter {name}")
    return values


def _described_tensor(arg: Any) -> Any:
    """The tensor a TMA descriptor argument describes, or None for any other argument."""
    base = getattr(arg, "base", None)
    return base if hasattr(base, "data_ptr") else None


def _hook_installed(hook: Any) -> bool:
    """Whether a launch hook would do anything: Triton 3.6 keeps a chain of hooks (empty by default) where older
    versions keep None or one callable."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


class RecordedLaunch:
    """One ordinary launch, kept for replay with new leading tensor arguments.

    Example (on a GPU; the first ``n_tensors`` parameters of the kernel are the tensors that change):
        >>> recorded = record(kernel, grid, args, kwargs, n_tensors=2)  # doctest: +SKIP
        >>> recorded.launch(x, out)  # False: not replayable here, launch normally  # doctest: +SKIP
        True
    """

    def __init__(self, compiled: Any, grid: tuple[int, int, int], values: list[Any], n_tensors: int,
                 device_index: int, driver: Any = None, hooks: Any = None,
                 descriptors: tuple[int, ...] = ()) -> None:
        self._compiled = compiled
        self._grid = tuple(grid)
        self._rest = tuple(values[n_tensors:])
        self._n_tensors = n_tensors
        self._device_index = device_index
        # Positions among the replaced arguments that are TMA descriptors (known at recording): the other
        # positions are tensors, and a launch without descriptors keeps the plain loop, the pointer kernel's.
        self._descriptors = frozenset(descriptors)
        if driver is None or hooks is None:
            from triton import knobs
            from triton.runtime.driver import driver as triton_driver

            driver, hooks = triton_driver.active, knobs.runtime
        self._driver = driver  # current device and stream, as Triton's own launch reads them
        self._hooks = hooks  # launch_enter_hook / launch_exit_hook, read at each launch

    def launch(self, *tensors: Any) -> bool:
        """Launch with these tensors (or TMA descriptors of tensors) in place of the recorded ones; False (nothing
        launched) when the tensors' alignment or device, the current device or an installed launch hook rules a
        replay out."""
        if len(tensors) != self._n_tensors:
            raise TypeError(f"expected {self._n_tensors} tensors, got {len(tensors)}")
        device_index = self._device_index
        if _native.launch_recorded is not None and not self._descriptors:
            # The same checks and launch in C++ (about 1 us less per replay); None: not plain tensors, checked below.
            if _hook_installed(self._hooks.launch_enter_hook) or _hook_installed(self._hooks.launch_exit_hook):
                return False
            driver = self._driver
            if driver.get_current_device() != device_index:
                return False
            compiled = self._compiled
            launched = _native.launch_recorded(compiled.run, self._grid, driver.get_current_stream(device_index),
                                               compiled.function, compiled.packed_metadata, tensors, device_index,
                                               self._rest)
            if launched is not None:
                return launched
        pointers = []
        if not self._descriptors:
            # Launchers pass their first tensor (q) for the slots a call leaves unused, and some slots twice in a
            # row (out as lse): a repeat takes the address already checked, which saves a third of a replay's loop.
            first = previous = None
            for tensor in tensors:
                if tensor is previous:
                    pointers.append(pointers[-1])
                    continue
                if tensor is first:
                    pointers.append(pointers[0])
                else:
                    pointer = tensor.data_ptr()
                    if pointer % _ALIGNMENT or tensor.get_device() != device_index:
                        return False
                    pointers.append(pointer)
                    if first is None:
                        first = tensor
                previous = tensor
        else:
            for position, argument in enumerate(tensors):
                described = argument.base if position in self._descriptors else argument
                pointer = described.data_ptr()
                if pointer % _ALIGNMENT or described.get_device() != device_index:
                    return False
                # A tensor goes in as its address; a descriptor as itself, for the launcher to encode.
                pointers.append(argument if position in self._descriptors else pointer)
        if _hook_installed(self._hooks.launch_enter_hook) or _hook_installed(self._hooks.launch_exit_hook):
            return False  # profilers hook launches; the ordinary path calls them
        driver = self._driver
        if driver.get_current_device() != device_index:
            return False
        compiled = self._compiled
        # Addresses go in as integers: Triton's launcher then skips, per tensor, the data_ptr() call and the driver
        # query that checks the address is device memory; the device check above stands in for that query.
        compiled.run(*self._grid, driver.get_current_stream(device_index), compiled.function,
                     compiled.packed_metadata, None, None, None, *pointers, *self._rest)
        return True


def record(kernel: Any, grid: Callable[[dict], tuple] | tuple, args: Sequence[Any], kwargs: dict,
           n_tensors: int) -> Optional[RecordedLaunch]:
    """Launch ``kernel[grid](*args, **kwargs)`` once; return a replay of it, or None where replay cannot apply.

    ``n_tensors``: the leading arguments that replays replace; each must be a CUDA tensor with a 16-byte aligned
    address in this launch (the compiled kernel assumes it), or a TMA descriptor of one. The launch itself always
    happens.
    """
    compiled = kernel[grid](*args, **kwargs)
    descriptors = tuple(i for i, arg in enumerate(args[:n_tensors]) if _described_tensor(arg) is not None)
    tensors = [arg.base if i in descriptors else arg for i, arg in enumerate(args[:n_tensors])]
    if (compiled is None or not hasattr(compiled, "run") or not hasattr(compiled, "function")
            or not all(isinstance(t, torch.Tensor) and t.is_cuda and t.data_ptr() % _ALIGNMENT == 0
                       for t in tensors)):
        return None
    try:
        values = _bound_values(kernel, args, kwargs)
        jit = _jit_function(kernel)
        if callable(grid):
            grid = grid(dict(zip(jit.arg_names, values)))
        grid = tuple(grid) + (1,) * (3 - len(grid))
        from triton.runtime.driver import driver

        return RecordedLaunch(compiled, grid, values, n_tensors, driver.active.get_current_device(),
                              descriptors=descriptors)
    except Exception:  # a Triton version whose internals differ: keep launching the ordinary way
        return None
