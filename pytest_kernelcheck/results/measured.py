"""Typed records of what the speed side measures beside the times: the GPU a process is pinned to, the SM
clock during a run, the device's ceilings and a callable's throughput; each with its JSON form.

>>> ThroughputRecord.from_json(ThroughputRecord(flops=2e12, bytes=1e9).to_json()).intensity
2000.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .fields import interval_from_json


@dataclass(frozen=True)
class GpuIdentity:
    """The GPU a record's test process was pinned to (``--kernel-gpus``): physical index (NVML's and
    nvidia-smi's numbering), name and UUID, each None where unknown. ``key`` tells GPUs apart; ``model`` is what
    speeds are comparable across.

    >>> gpu = GpuIdentity.from_json({"index": 2, "name": "NVIDIA H200", "uuid": "GPU-1f"})
    >>> gpu.key, gpu.label, GpuIdentity.from_json(gpu.to_json()) == gpu
    ('GPU-1f', 'GPU 2 (NVIDIA H200, GPU-1f)', True)
    """

    index: int | None = None
    name: str | None = None
    uuid: str | None = None

    @property
    def key(self) -> str:
        return self.uuid or f"index-{self.index}"

    @property
    def model(self) -> str | None:
        return self.name

    @property
    def label(self) -> str:
        details = ", ".join(part for part in (self.name, self.uuid) if part)
        return f"GPU {self.index if self.index is not None else '?'}" + (f" ({details})" if details else "")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "uuid": self.uuid}

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "GpuIdentity | None":
        if not data:
            return None
        index = data.get("index")
        return cls(index=None if index is None else int(index), name=data.get("name"), uuid=data.get("uuid"))


@dataclass(frozen=True)
class ClockRecord:
    """The SM clock and temperature during a run (:class:`pytest_kernelcheck.speed.clocks.ClockMonitor`), or why
    they were not read (``available`` False: a CPU run, no nvidia-ml-py, NVML refused).

    ``throttled``: some reading was more than 10% below ``session_highest_mhz``, the highest clock this process
    saw on the device. ``at_looks_mhz``: the clock at each look. ``policy`` is ``--kernel-ab-throttle``;
    ``rounds_below`` counts the rounds taken below the threshold and ``dropped_rounds`` those the verdict left
    out (``discard``).

    >>> row = ClockRecord(available=True, throttled=True, samples=3, sm_start_mhz=1980, sm_min_mhz=1500,
    ...                   session_highest_mhz=1980, at_looks_mhz=(1980, 1500), policy="discard", dropped_rounds=20)
    >>> row.to_json()["throttle"], ClockRecord.from_json(row.to_json()) == row
    ({'policy': 'discard', 'rounds_below': 0, 'dropped_rounds': 20}, True)
    >>> ClockRecord.from_json({"available": False, "reason": "not a CUDA comparison", "throttled": False}).to_json()
    {'available': False, 'reason': 'not a CUDA comparison', 'throttled': False}
    """

    available: bool = False
    reason: str | None = None  # why the clock was not read
    throttled: bool = False
    samples: int = 0  # readings: one after each chunk of rounds
    sm_start_mhz: int | None = None
    sm_min_mhz: int | None = None
    sm_end_mhz: int | None = None
    sm_max_supported_mhz: int | None = None  # NVML's maximum SM clock of the device
    session_highest_mhz: int | None = None
    at_looks_mhz: tuple[int, ...] = ()
    temperature_start_c: int | None = None
    temperature_max_c: int | None = None
    temperature_end_c: int | None = None
    policy: str | None = None  # "flag", "discard" or "fail"; None in reports written before the option
    rounds_below: int = 0
    dropped_rounds: int = 0

    def to_json(self) -> dict[str, Any]:
        if not self.available:
            return {"available": False, "reason": self.reason, "throttled": self.throttled}
        data: dict[str, Any] = {
            "available": True,
            "sm_clock_mhz": {"start": self.sm_start_mhz, "min": self.sm_min_mhz, "end": self.sm_end_mhz,
                             "max_supported": self.sm_max_supported_mhz,
                             "session_highest": self.session_highest_mhz, "at_looks": list(self.at_looks_mhz)},
            "temperature_c": {"start": self.temperature_start_c, "max": self.temperature_max_c,
                              "end": self.temperature_end_c},
            "samples": self.samples, "throttled": self.throttled,
        }
        if self.policy is not None:
            data["throttle"] = {"policy": self.policy, "rounds_below": self.rounds_below,
                                "dropped_rounds": self.dropped_rounds}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> "ClockRecord":
        data = data or {}
        sm = data.get("sm_clock_mhz") or {}
        temperature = data.get("temperature_c") or {}
        throttle = data.get("throttle") or {}
        return cls(
            available=bool(data.get("available", False)), reason=data.get("reason"),
            throttled=bool(data.get("throttled", False)), samples=int(data.get("samples") or 0),
            sm_start_mhz=sm.get("start"), sm_min_mhz=sm.get("min"), sm_end_mhz=sm.get("end"),
            sm_max_supported_mhz=sm.get("max_supported"), session_highest_mhz=sm.get("session_highest"),
            at_looks_mhz=tuple(sm.get("at_looks") or ()), temperature_start_c=temperature.get("start"),
            temperature_max_c=temperature.get("max"), temperature_end_c=temperature.get("end"),
            policy=throttle.get("policy"), rounds_below=int(throttle.get("rounds_below") or 0),
            dropped_rounds=int(throttle.get("dropped_rounds") or 0),
        )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


@dataclass(frozen=True)
class CeilingRecord:
    """What one device reached in this session: a large dense matmul of ``dtype`` (TFLOP/s) and a
    device-to-device copy (GB/s, bytes read plus bytes written); ``reason`` says why a number is missing.

    >>> CeilingRecord("cuda:0 (NVIDIA H200)", "bfloat16", tflops=700.0, gbps=4000.0).key
    ('cuda:0 (NVIDIA H200)', 'bfloat16')
    >>> CeilingRecord.from_json({"device": "cpu-clock", "reason": "not measured"}).tflops is None
    True
    """

    device: str
    dtype: str | None = None
    tflops: float | None = None
    gbps: float | None = None
    flops_method: str | None = None  # how the TFLOP/s were measured: "matmul 8192^3 bfloat16, median of 10 (events)"
    bandwidth_method: str | None = None
    reason: str | None = None  # why tflops or gbps is None

    @property
    def key(self) -> tuple[str, str | None]:
        return (self.device, self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "tflops": self.tflops, "gbps": self.gbps,
                "flops_method": self.flops_method, "bandwidth_method": self.bandwidth_method, "reason": self.reason}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "CeilingRecord":
        return cls(device=str(data.get("device", "")), dtype=data.get("dtype"),
                   tflops=_optional_float(data.get("tflops")), gbps=_optional_float(data.get("gbps")),
                   flops_method=data.get("flops_method"), bandwidth_method=data.get("bandwidth_method"),
                   reason=data.get("reason"))


@dataclass(frozen=True)
class ThroughputRecord:
    """One callable's work per call (``flops``, ``bytes``, as the test gave them) and the rates its median time
    gives, with the percentage of this device's measured ceiling where there is one.

    >>> t = ThroughputRecord(flops=2e12, bytes=1e9, tflops=400.0, gbps=200.0, tflops_pct=50.0)
    >>> t.intensity, ThroughputRecord.from_json(t.to_json()) == t
    (2000.0, True)
    """

    flops: float | None = None
    bytes: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    tflops_pct: float | None = None  # of the ceiling's TFLOP/s
    gbps_pct: float | None = None  # of the ceiling's GB/s

    @property
    def intensity(self) -> float | None:
        """Arithmetic intensity, FLOPs per byte; None unless both counts are given and bytes is positive."""
        if self.flops is None or not self.bytes:
            return None
        return self.flops / self.bytes

    def to_json(self) -> dict[str, Any]:
        return {"flops": self.flops, "bytes": self.bytes, "tflops": self.tflops, "gbps": self.gbps,
                "tflops_pct": self.tflops_pct, "gbps_pct": self.gbps_pct}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ThroughputRecord":
        return cls(**{name: _optional_float(data.get(name))
                      for name in ("flops", "bytes", "tflops", "gbps", "tflops_pct", "gbps_pct")})


def _throughput_from_json(data: Any) -> ThroughputRecord | None:
    return ThroughputRecord.from_json(data) if data else None


def _ceiling_from_json(data: Any) -> CeilingRecord | None:
    return CeilingRecord.from_json(data) if data else None


@dataclass(frozen=True)
class ModeRecord:
    """One measurement mode of a comparison (``throughput``, ``latency``, ``graph``): its own verdict, speedup,
    interval and times, or why it could not run (``unavailable``). Latency rows on CUDA carry each side's device
    time (CUDA events around the same call) and so the host overhead per call: latency minus device time.

    >>> row = ModeRecord("latency", "loss", 0.9, (0.85, 0.95), candidate_ms=0.16, baseline_ms=0.14,
    ...                  candidate_device_ms=0.1, baseline_device_ms=0.11)
    >>> round(row.candidate_host_ms, 3), ModeRecord.from_json(row.to_json()) == row
    (0.06, True)
    >>> ModeRecord.from_json({"mode": "graph", "unavailable": "not capturable"}).available
    False
    """

    mode: str
    verdict: str | None = None
    speedup: float | None = None
    ci: tuple[float | None, float | None] = (None, None)
    p_value: float | None = None
    p_value_raw: float | None = None
    n_pairs: int = 0
    candidate_ms: float | None = None  # median per call in this mode
    baseline_ms: float | None = None
    method: str | None = None
    candidate_device_ms: float | None = None  # latency on CUDA: median device time of the same calls
    baseline_device_ms: float | None = None
    unavailable: str | None = None  # why the mode could not run; None when it ran
    candidate_samples_ms: tuple[float, ...] = ()
    baseline_samples_ms: tuple[float, ...] = ()

    @property
    def available(self) -> bool:
        return self.unavailable is None

    @property
    def candidate_host_ms(self) -> float | None:
        return _difference(self.candidate_ms, self.candidate_device_ms)

    @property
    def baseline_host_ms(self) -> float | None:
        return _difference(self.baseline_ms, self.baseline_device_ms)

    def to_json(self) -> dict[str, Any]:
        return {
            "mode": self.mode, "verdict": self.verdict, "speedup": self.speedup, "ci": list(self.ci),
            "p_value": self.p_value, "p_value_raw": self.p_value_raw, "n_pairs": self.n_pairs,
            "candidate_ms": self.candidate_ms, "baseline_ms": self.baseline_ms, "method": self.method,
            "candidate_device_ms": self.candidate_device_ms, "baseline_device_ms": self.baseline_device_ms,
            "candidate_host_ms": self.candidate_host_ms, "baseline_host_ms": self.baseline_host_ms,
            "unavailable": self.unavailable,
            "samples": {"candidate_ms": list(self.candidate_samples_ms),
                        "baseline_ms": list(self.baseline_samples_ms)},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "ModeRecord":
        samples = data.get("samples") or {}
        return cls(
            mode=str(data.get("mode", "")), verdict=data.get("verdict"), speedup=data.get("speedup"),
            ci=interval_from_json(data.get("ci")), p_value=data.get("p_value"), p_value_raw=data.get("p_value_raw"),
            n_pairs=int(data.get("n_pairs") or 0), candidate_ms=data.get("candidate_ms"),
            baseline_ms=data.get("baseline_ms"), method=data.get("method"),
            candidate_device_ms=data.get("candidate_device_ms"), baseline_device_ms=data.get("baseline_device_ms"),
            unavailable=data.get("unavailable"),
            candidate_samples_ms=tuple(samples.get("candidate_ms") or ()),
            baseline_samples_ms=tuple(samples.get("baseline_ms") or ()),
        )


def modes_disagree(verdicts: Mapping[str, str | None]) -> bool:
    """Whether two modes reached different decided verdicts (win, loss, tie); "inconclusive" and unavailable
    modes (None) decide nothing, so they disagree with no one.

    >>> modes_disagree({"throughput": "tie", "latency": "inconclusive"}), modes_disagree({"a": "win", "b": "tie"})
    (False, True)
    """
    return len({v for v in verdicts.values() if v in ("win", "loss", "tie")}) > 1


def _difference(total: float | None, part: float | None) -> float | None:
    return total - part if total is not None and part is not None else None
