"""Host time of the launchers' plan key (``flashlite._attention.launch._launcher_key``) on the development CPU: the
C++ key behind its prefix against the tuple key (the extension hidden from the launcher), for the call a compiled
graph's attention op makes (B=1 H=16 S=128 D=64 fp16, causal top-left, no variant). Best of five timeit means.

Usage (repository root): python benchmarks/results/cpu-host-2026-12-04/launcher_key_cost/probe.py
"""
import sys
import timeit
import types

sys.path.insert(0, ".")
import torch  # noqa: E402

from flashlite._attention import launch  # noqa: E402

q, k, v = (torch.randn(1, 16, 128, 64, dtype=torch.float16) for _ in range(3))
call = (q, k, v, None, None, 1, 0.125, "fp16", -1, -1, 0.0, None)
env = {"key": launch._launcher_key, "call": call}
native = launch._native


def best_us(number: int = 20000) -> float:
    return min(timeit.repeat("key(*call)", number=number, repeat=5, globals=env)) / number * 1e6


cpp = best_us()
assert isinstance(launch._launcher_key(*call), bytes)
launch._native = types.SimpleNamespace(plan_key=None)
try:
    assert isinstance(launch._launcher_key(*call), tuple)
    python = best_us()
finally:
    launch._native = native
print(f"launcher key, C++ behind its prefix: {cpp:.2f} us; the tuple key: {python:.2f} us")
