"""Descriptor reductions for Triton's interpreter, which has none (Triton 3.6): ``with_descriptor_adds()``.

A tensor descriptor's ``atomic_add`` lowers on sm_90 to a TMA bulk reduction: the tile is added into the global
tensor, clipped to the descriptor's shape. Under the interpreter the builder has no ``create_descriptor_reduce``,
so such a kernel cannot run on a CPU. This adds it for the tests, with the same meaning: the rows and columns the
descriptor's bounds hold are read, added to and written back; the rest of the tile is dropped. The interpreter runs
a grid's programs one after another, so a read-add-write is exact where the hardware's reduction is atomic.
"""
from __future__ import annotations

import contextlib

import numpy as np


@contextlib.contextmanager
def with_descriptor_adds():
    """Give the interpreter's builder descriptor "add" reductions while the block runs (other kinds raise)."""
    from triton._C.libtriton import ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def create_descriptor_reduce(self, kind, desc, value, indices):
        if kind != ir.DESCRIPTOR_REDUCE_KIND.ADD:
            raise NotImplementedError(f"descriptor reduction {kind} (the test shim adds only)")
        ptrs, mask = desc.materialize_pointers(indices)
        zeros = TensorHandle(np.zeros_like(value.data), value.dtype.scalar)
        current = self.create_masked_load(ptrs, mask, zeros, None, None, False)
        total = TensorHandle(current.data + value.data, value.dtype.scalar)
        return self.create_masked_store(ptrs, total, mask, None, None)

    assert not hasattr(InterpreterBuilder, "create_descriptor_reduce"), "the interpreter has its own now"
    InterpreterBuilder.create_descriptor_reduce = create_descriptor_reduce
    try:
        yield
    finally:
        del InterpreterBuilder.create_descriptor_reduce
