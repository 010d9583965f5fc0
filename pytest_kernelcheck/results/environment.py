"""Where a run's numbers came from: host, package versions, GPU, date and git commit."""
from __future__ import annotations

import datetime as _datetime
import os
import platform
import sys
from typing import Any

from .report_record import GpuInfo, RunEnvironment


def environment_info() -> dict[str, Any]:
    """Where the numbers came from: host, versions, GPU, date and git commit.

    Commit details reuse pytest-benchmark's helper (the same fields its saved runs carry). Its machine-info
    helper is not used: it starts py-cpuinfo in a subprocess, which took long enough on a GPU virtual machine
    that a time-limited run was killed while writing its report; the fields that matter are read directly.
    """
    from importlib import metadata

    packages: dict[str, str | None] = {}
    for package in ("torch", "triton", "numpy", "scipy", "pytest", "pytest-kernelcheck"):
        try:
            packages[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            packages[package] = None
    machine_info = commit_info = machine_info_error = None
    try:
        from pytest_benchmark.utils import get_commit_info

        machine_info = {
            "node": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
            "system": platform.system(), "release": platform.release(), "cpu_count": os.cpu_count(),
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
        }
        commit_info = get_commit_info()
    except Exception as exc:  # environment details must never cost the report itself
        machine_info_error = f"{type(exc).__name__}: {exc}"
    environment = RunEnvironment(
        date=utc_now(),
        hostname=platform.node(),
        python=platform.python_version(),
        packages=packages,
        machine_info=machine_info,
        commit_info=commit_info,
        machine_info_error=machine_info_error,
        gpu=_gpu_info(),
        cpu_model=_cpu_model(),
    )
    return environment.to_json()


def _cpu_model() -> str | None:
    """The CPU's marketing name: /proc/cpuinfo on Linux (platform.processor() there is only the architecture)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                    return value.strip()
    except OSError:  # not Linux: fall through to what platform knows
        pass
    return platform.processor() or None


def _gpu_info() -> GpuInfo:
    torch = sys.modules.get("torch")  # only describe a GPU the tests actually used torch for
    if torch is None or not torch.cuda.is_available():
        return GpuInfo(available=False)
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception as exc:
        driver = f"unavailable ({type(exc).__name__})"
    try:
        cudnn_version = torch.backends.cudnn.version()
        cudnn = None if cudnn_version is None else str(cudnn_version)
    except Exception as exc:  # a broken cuDNN install must not cost the report
        cudnn = f"unavailable ({type(exc).__name__})"
    return GpuInfo(
        available=True,
        devices=tuple(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())),
        cuda=torch.version.cuda,
        driver=driver,
        cudnn=cudnn,
    )


def utc_now() -> str:
    return _datetime.datetime.now(_datetime.timezone.utc).isoformat(timespec="seconds")
