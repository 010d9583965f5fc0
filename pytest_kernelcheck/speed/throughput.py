"""Throughput: the work a call does (FLOPs, bytes), the rates its time gives, and this device's measured ceilings.

Counts are per call of the timed callable and describe the problem, not an implementation: a comparison rates
candidate and baseline by the same ``flops`` and ``bytes``, so the ratio of their rates is the speedup, and the
faster one is the one closer to the ceiling. TFLOP/s is ``flops / seconds / 1e12``; GB/s is
``bytes / seconds / 1e9`` (decimal giga, as GPU data sheets quote it).

Ceilings are measured, not looked up: once per process and per (device, dtype), at the first comparison that
gives ``flops`` or ``bytes``, inside that comparison's device lock:

- FLOP/s: a dense ``n x n @ n x n`` matmul (``MATMUL_N``) of the comparison's dtype on random data, 2 n^3 FLOPs per
  call, the median of ``CEILING_SAMPLES`` event-timed calls after ``CEILING_WARMUP`` untimed ones. float32
  matmuls run as the process's ``torch.get_float32_matmul_precision()`` says (recorded in the method text).
- GB/s: a device-to-device copy of ``COPY_BYTES`` (far beyond any L2), counted as bytes read plus bytes written.

The dtype is the comparison's ``dtype=`` keyword, else the test's ``shape.dtype``; without either only the copy
is measured. Ceilings are a GPU notion here: a comparison timed on the CPU clock gets its rates but no ceiling,
and its record says so. Everything that measures takes its timer as an argument, so tests run it on the CPU with
timers of known durations.

>>> work = Work.of(flops=2e12, bytes=1e9)
>>> rates = achieved(work, seconds_per_call=0.004, ceiling=CeilingRecord("gpu", "bfloat16", tflops=1000.0))
>>> rates.tflops, rates.gbps, rates.tflops_pct
(500.0, 250.0, 50.0)
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from ..results.measured import CeilingRecord, ThroughputRecord
from . import timing

MATMUL_N = 8192  # 1.1e12 FLOPs a call: about 1.5 ms in bf16 on an H200, long enough for events to time well
COPY_BYTES = 1 << 30  # 1 GiB each way, some 20x an H200's L2, so the copy streams from memory
CEILING_WARMUP = 3  # untimed calls: cuBLAS heuristics and clocks settle
CEILING_SAMPLES = 10
CPU_REASON = "not measured: ceilings are measured on CUDA devices only, and this ran on the CPU clock"


def _count(value: Any, argument: str) -> float:
    """A per-call count as a float: a finite number >= 0 (Python, numpy or a 0-d tensor), never a bool."""
    item = value
    if hasattr(item, "item") and getattr(item, "shape", None) == ():  # numpy scalars, 0-d arrays and tensors
        item = item.item()
    if isinstance(item, bool) or not isinstance(item, (int, float)):
        raise TypeError(f"{argument} must be a number per call (int or float), got {type(value).__name__}: {value!r}")
    if not math.isfinite(item) or item < 0:
        raise ValueError(f"{argument} must be a finite number >= 0 per call, got {value!r}")
    return float(item)


def per_call(value: Any, argument: str, shape: Any = None) -> float | None:
    """Resolve ``flops=`` or ``bytes=``: None, a number, or a callable of the test's ``shape`` returning one.

    >>> per_call(lambda s: 4 * s["n"], "flops", {"n": 8})
    32.0
    >>> per_call(-1, "bytes")
    Traceback (most recent call last):
    ...
    ValueError: bytes= must be a finite number >= 0 per call, got -1
    >>> per_call(lambda s: "many", "flops", {"n": 8})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: flops= (returned by its callable for shape {'n': 8}) must be a number per call ..., got str: 'many'
    """
    if value is None:
        return None
    if callable(value):
        if shape is None:
            raise TypeError(f"{argument}= is a callable of the test's shape, but this test has no shape "
                            "(use @pytest.mark.shape, or pass a number)")
        try:
            result = value(shape)
        except Exception as exc:
            raise ValueError(f"{argument}= callable raised {type(exc).__name__} for shape {shape}: {exc}") from exc
        return _count(result, f"{argument}= (returned by its callable for shape {shape})")
    return _count(value, f"{argument}=")


@dataclass(frozen=True)
class Work:
    """FLOPs and bytes of one call (None: not given).

    >>> Work.of(flops=lambda s: 2 * s["n"] ** 3, shape={"n": 4}), Work().given
    (Work(flops=128.0, bytes=None), False)
    """

    flops: float | None = None
    bytes: float | None = None

    @classmethod
    def of(cls, flops: Any = None, bytes: Any = None, shape: Any = None, *, what: str = "") -> "Work":
        """Checked counts; ``what`` prefixes the argument in error messages (a tournament variant's name)."""
        return cls(per_call(flops, f"{what}flops", shape), per_call(bytes, f"{what}bytes", shape))

    @property
    def given(self) -> bool:
        return self.flops is not None or self.bytes is not None


def per_variant(value: Any, names: list[str], argument: str) -> dict[str, Any]:
    """A tournament's ``flops=``/``bytes=``: one value for every variant, or a mapping of some variants to theirs.

    >>> per_variant({"a": 1.0}, ["a", "b"], "flops")
    {'a': 1.0, 'b': None}
    >>> per_variant({"c": 1.0}, ["a", "b"], "flops")
    Traceback (most recent call last):
    ...
    ValueError: flops= names variants the tournament does not have: 'c' (variants: a, b)
    """
    if not isinstance(value, Mapping):
        return {name: value for name in names}
    unknown = [str(key) for key in value if str(key) not in names]
    if unknown:
        raise ValueError(f"{argument}= names variants the tournament does not have: "
                         f"{', '.join(repr(u) for u in unknown)} (variants: {', '.join(names)})")
    by_name = {str(key): item for key, item in value.items()}
    return {name: by_name.get(name) for name in names}


def dtype_name(dtype: Any, shape: Any = None) -> str | None:
    """The dtype whose FLOP ceiling applies, as a name: ``dtype=`` (a torch dtype or its name), else the shape's.

    >>> dtype_name("torch.bfloat16"), dtype_name(None, {"dtype": "float16"}), dtype_name(None, {"n": 1})
    ('bfloat16', 'float16', None)
    """
    argument = "dtype="
    if dtype is None:
        dtype = shape.get("dtype") if isinstance(shape, Mapping) else getattr(shape, "dtype", None)
        argument = "the shape's dtype"
        if dtype is None:
            return None
    name = str(dtype).removeprefix("torch.")
    if not name.replace("_", "").isalnum():
        raise ValueError(f"{argument} must be a torch dtype or its name (e.g. torch.bfloat16), got {dtype!r}")
    return name


def achieved(work: Work, seconds_per_call: float | None, ceiling: CeilingRecord | None) -> ThroughputRecord | None:
    """The rates of ``work`` done in ``seconds_per_call``, and their share of ``ceiling`` (percent); None without
    work.

    >>> achieved(Work(bytes=4e9), 0.002, None).gbps
    2000.0
    """
    if not work.given:
        return None
    if not seconds_per_call or seconds_per_call <= 0:
        return ThroughputRecord(flops=work.flops, bytes=work.bytes)
    tflops = None if work.flops is None else work.flops / seconds_per_call / 1e12
    gbps = None if work.bytes is None else work.bytes / seconds_per_call / 1e9

    def share(rate: float | None, peak: float | None) -> float | None:
        return None if rate is None or not peak else 100.0 * rate / peak

    return ThroughputRecord(
        flops=work.flops, bytes=work.bytes, tflops=tflops, gbps=gbps,
        tflops_pct=share(tflops, ceiling and ceiling.tflops), gbps_pct=share(gbps, ceiling and ceiling.gbps),
    )


def _median_seconds(timer: Any, fn: Callable[[], Any], samples: int, warmup: int) -> float:
    """Median seconds of one call of ``fn``, each sample timed alone by ``timer`` after ``warmup`` calls."""
    if warmup:
        timer.time_calls([fn] * warmup, 1)
    return statistics.median(timing.checked_durations(timer, timer.time_calls([fn] * samples, 1),
                                                      ["a ceiling measurement"] * samples))


def matmul_tflops(timer: Any, device: Any, dtype: str, *, n: int = MATMUL_N, samples: int = CEILING_SAMPLES,
                  warmup: int = CEILING_WARMUP) -> tuple[float, str]:
    """TFLOP/s of a dense ``n x n`` matmul of ``dtype`` on ``device`` on random data, and how it was measured.

    >>> class Fixed:  # a timer of known durations: 1 ms a call
    ...     name = "fixed"
    ...     def time_calls(self, fns, repeat): return [1e-3 * repeat] * len(fns)
    >>> matmul_tflops(Fixed(), "cpu", "float32", n=100)
    (0.002, 'matmul 100^3 float32, float32 matmul precision highest, median of 10 (fixed)')
    """
    import torch

    torch_dtype = getattr(torch, dtype, None)
    if not isinstance(torch_dtype, torch.dtype):
        raise ValueError(f"{dtype!r} is not a torch dtype")
    generator = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=generator).to(torch_dtype) for _ in range(2))
    out = torch.empty(n, n, device=device, dtype=torch_dtype)
    seconds = _median_seconds(timer, lambda: torch.matmul(a, b, out=out), samples, warmup)
    method = f"matmul {n}^3 {dtype}"
    if torch_dtype == torch.float32:  # TF32 or not decides a float32 ceiling by a factor of ~8
        method += f", float32 matmul precision {torch.get_float32_matmul_precision()}"
    return 2.0 * n**3 / seconds / 1e12, f"{method}, median of {samples} ({timer.name})"


def copy_gbps(timer: Any, device: Any, *, nbytes: int = COPY_BYTES, samples: int = CEILING_SAMPLES,
              warmup: int = CEILING_WARMUP) -> tuple[float, str]:
    """GB/s of a device-to-device copy of ``nbytes`` (read plus write), and how it was measured.

    >>> class Fixed:
    ...     name = "fixed"
    ...     def time_calls(self, fns, repeat): return [1e-3 * repeat] * len(fns)
    >>> copy_gbps(Fixed(), "cpu", nbytes=4096)
    (0.008192, 'copy of 4 KiB (read + write), median of 10 (fixed)')
    """
    import torch

    from ..check.memory import human_bytes

    source = torch.rand(nbytes // 4, device=device)
    target = torch.empty_like(source)
    seconds = _median_seconds(timer, lambda: target.copy_(source), samples, warmup)
    return 2.0 * source.numel() * 4 / seconds / 1e9, (
        f"copy of {human_bytes(source.numel() * 4)} (read + write), median of {samples} ({timer.name})")


def measure_on(timer: Any, device: Any, label: str, dtype: str | None, *, n: int = MATMUL_N,
               nbytes: int = COPY_BYTES, samples: int = CEILING_SAMPLES) -> CeilingRecord:
    """Both ceilings of ``device`` timed by ``timer``; a part that fails (no matmul for an integer dtype, out of
    memory) leaves its number None and says why in ``reason``, never raising."""
    reasons = []
    tflops = flops_method = gbps = bandwidth_method = None
    if dtype is None:
        reasons.append("no FLOP/s ceiling: give dtype= (or a shape with a dtype)")
    else:
        try:
            tflops, flops_method = matmul_tflops(timer, device, dtype, n=n, samples=samples)
        except Exception as exc:  # a missing ceiling must not cost the comparison
            reasons.append(f"no FLOP/s ceiling for {dtype}: {type(exc).__name__}: {exc}")
    try:
        gbps, bandwidth_method = copy_gbps(timer, device, nbytes=nbytes, samples=samples)
    except Exception as exc:
        reasons.append(f"no GB/s ceiling: {type(exc).__name__}: {exc}")
    return CeilingRecord(device=label, dtype=dtype, tflops=tflops, gbps=gbps, flops_method=flops_method,
                         bandwidth_method=bandwidth_method, reason="; ".join(reasons) or None)


def measure_ceiling(timer: Any, dtype: str | None) -> CeilingRecord:
    """The default measurement of :class:`CeilingMeter`: on the CUDA device a comparison was timed on, with a
    fresh event timer (no L2 flush, no hold); for any other timer, nothing, saying so.

    >>> measure_ceiling(timing.CpuTimer(), "float32").reason == CPU_REASON
    True
    """
    if not isinstance(timer, timing.CudaEventTimer):
        return CeilingRecord(device=timer.name, dtype=dtype, reason=CPU_REASON)
    import torch

    label = f"{timer.device} ({timer.device_name})"
    try:
        return measure_on(timing.CudaEventTimer(timer.device), timer.device, label, dtype)
    finally:
        torch.cuda.empty_cache()  # the 2 GiB of buffers must not count against later tests' memory markers


class CeilingMeter:
    """Ceilings measured once per (device, dtype) and kept for the rest of the process.

    ``measure(timer, dtype) -> CeilingRecord`` does the measuring (default :func:`measure_ceiling`); tests pass
    their own, and the ``kernel_ab_ceilings`` fixture can be overridden with one. ``enabled=False``
    (``--kernel-ab-ceilings off``) measures nothing and gives None.

    >>> meter = CeilingMeter(measure=lambda timer, dtype: CeilingRecord(timer.name, dtype, tflops=1.0, gbps=2.0))
    >>> meter.ceiling_for(timing.CpuTimer(), "float32").tflops, len(meter.measured)
    (1.0, 1)
    >>> CeilingMeter(enabled=False).ceiling_for(timing.CpuTimer(), "float32") is None
    True
    """

    def __init__(self, *, enabled: bool = True,
                 measure: Callable[[Any, str | None], CeilingRecord] = measure_ceiling) -> None:
        self.enabled = enabled
        self._measure = measure
        self._cache: dict[tuple[str, str | None], CeilingRecord] = {}

    def ceiling_for(self, timer: Any, dtype: str | None) -> CeilingRecord | None:
        if not self.enabled:
            return None
        key = (str(getattr(timer, "device", None) or timer.name), dtype)
        if key not in self._cache:
            self._cache[key] = self._measure(timer, dtype)
        return self._cache[key]

    @property
    def measured(self) -> list[CeilingRecord]:
        return list(self._cache.values())
