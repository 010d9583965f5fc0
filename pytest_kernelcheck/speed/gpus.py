"""One pytest-xdist worker per GPU (``--kernel-gpus``): the spec, the visible GPUs, and which worker gets which.

The controller resolves the spec against the GPUs it can see (:func:`visible_gpus`) and hands the list to its
workers through the environment (:func:`pin_instruction`); each worker picks its GPU round-robin by worker index
(gw0, gw1, ...: :func:`assign`) and narrows ``CUDA_VISIBLE_DEVICES`` to that one GPU (:func:`pin_worker`) before
torch initialises CUDA, so ``cuda`` and ``cuda:0`` in that worker are its own GPU, and so are memory markers, the
device-memory cap, clocks and locks. :func:`describe_gpu` names a worker's GPU for its A/B records.

>>> spec = parse_spec("all")
>>> gpus = spec.resolve(("0", "1", "2"))
>>> [assign(worker, gpus) for worker in ("gw0", "gw1", "gw2", "gw3")]
['0', '1', '2', '0']
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, MutableMapping, Sequence

from ..results.measured import GpuIdentity

OPTION = "--kernel-gpus"
INI = "kernel_gpus"
ACCEPTED = "'all', a count of GPUs (2), or a comma list of CUDA device indices (0,2,3; one device: 3,)"
# The controller's instruction to its workers. Workers are started by execnet as direct children of the controller
# and inherit its environment; a worker reads the instruction in its earliest hook, before any conftest is imported
# (a conftest may touch CUDA). The controller's pid guards against processes further down (a pytester subprocess
# run by a test inside a worker) taking the instruction as theirs.
INSTRUCTION_VARIABLE = "PYTEST_KERNELCHECK_WORKER_GPUS"
_WORKER = re.compile(r"gw(\d+)")


class GpuSpecError(ValueError):
    """A ``--kernel-gpus`` value that is not one of the accepted forms, or asks for GPUs that are not visible."""


@dataclass(frozen=True)
class GpuSpec:
    """A parsed ``--kernel-gpus``: every visible GPU (``count`` and ``indices`` None), the first ``count``
    of them, or the listed CUDA device indices (as this process numbers them).

    >>> parse_spec("2").resolve(("0", "1", "2", "3"))
    ('0', '1')
    >>> parse_spec("3,1").resolve(("4", "5", "6", "7"))  # indices into CUDA_VISIBLE_DEVICES=4,5,6,7
    ('7', '5')
    """

    count: int | None = None
    indices: tuple[int, ...] | None = None

    def resolve(self, visible: Sequence[str]) -> tuple[str, ...]:
        """The GPUs to spread the workers over, as ``CUDA_VISIBLE_DEVICES`` entries; raises GpuSpecError when
        the spec asks for more than ``visible`` holds."""
        if self.indices is not None:
            missing = [index for index in self.indices if index >= len(visible)]
            if missing:
                raise GpuSpecError(f"{OPTION}: CUDA device {missing[0]} is not visible ({_seen(visible)})")
            return tuple(visible[index] for index in self.indices)
        if self.count is not None:
            if self.count > len(visible):
                raise GpuSpecError(f"{OPTION}: {self.count} GPUs asked for, {_seen(visible)}")
            return tuple(visible[: self.count])
        return tuple(visible)


def _seen(visible: Sequence[str]) -> str:
    return f"{len(visible)} visible" if visible else "no CUDA device is visible"


def parse_spec(text: str) -> GpuSpec:
    """Read a ``--kernel-gpus`` value; raises GpuSpecError naming the option and the accepted forms.

    >>> parse_spec("all"), parse_spec(" 4 "), parse_spec("0,2"), parse_spec("3,").indices
    (GpuSpec(count=None, indices=None), GpuSpec(count=4, indices=None), GpuSpec(count=None, indices=(0, 2)), (3,))
    >>> parse_spec("gpu0")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.speed.gpus.GpuSpecError: --kernel-gpus / kernel_gpus: 'gpu0' is not 'all', a count of GPUs (2), \
or a comma list of CUDA device indices (0,2,3; one device: 3,)
    """
    value = str(text).strip()
    problem = f"{OPTION} / {INI}: {text!r} is not {ACCEPTED}"
    if value.lower() == "all":
        return GpuSpec()
    # ASCII digits only: str.isdigit() is also true of "²", which int() refuses, and of "٣", which int() reads as 3;
    # and no more than a device index or count can have (int() refuses thousands of digits with its own error).
    if not value.isascii() or any(len(part.strip()) > 9 for part in value.split(",")):
        raise GpuSpecError(problem)
    if "," in value:
        parts = [part.strip() for part in value.removesuffix(",").split(",")]  # "3," is the list of device 3
        if not all(part.isdigit() for part in parts):
            raise GpuSpecError(problem)
        indices = tuple(int(part) for part in parts)
        if len(set(indices)) != len(indices):
            raise GpuSpecError(f"{OPTION} / {INI}: {text!r} lists a device twice")
        return GpuSpec(indices=indices)
    if not value.isdigit():
        raise GpuSpecError(problem)
    if int(value) < 1:
        raise GpuSpecError(f"{OPTION} / {INI}: a count must be at least 1, got {text!r}")
    return GpuSpec(count=int(value))


def worker_index(worker_id: str) -> int:
    """The index of an xdist worker id.

    >>> worker_index("gw12")
    12
    """
    match = _WORKER.fullmatch(worker_id)
    if match is None:
        raise ValueError(f"not a pytest-xdist worker id: {worker_id!r}")
    return int(match.group(1))


def assign(worker_id: str, gpus: Sequence[str]) -> str:
    """The GPU of a worker: round-robin by worker index, so gw0..gw(N-1) get one GPU each and more workers share.

    >>> assign("gw5", ("0", "1"))
    '1'
    """
    if not gpus:
        raise ValueError("no GPUs to assign")
    return gpus[worker_index(worker_id) % len(gpus)]


def visible_gpus(environ: Mapping[str, str] | None = None, nvml: Any = None) -> tuple[str, ...]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` entries, without initialising CUDA.

    With ``CUDA_VISIBLE_DEVICES`` set, its entries up to the first empty one (as CUDA reads it: the variable
    narrows, so it is respected rather than re-counted); else every device NVML counts, as physical indices. NVML
    is asked rather than CUDA because it creates no CUDA context and needs no torch import on the controller,
    which runs no tests. Without NVML (``nvml`` None and nvidia-ml-py missing or refusing): no devices, and the
    run stays as it would be without ``--kernel-gpus``.

    >>> visible_gpus({"CUDA_VISIBLE_DEVICES": "2,3"})
    ('2', '3')
    >>> class FakeNvml:
    ...     def nvmlInit(self): pass
    ...     def nvmlDeviceGetCount(self): return 4
    >>> visible_gpus({}, nvml=FakeNvml())
    ('0', '1', '2', '3')
    """
    environ = os.environ if environ is None else environ
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        entries = []
        for entry in listed.split(","):
            if not entry.strip():
                break
            entries.append(entry.strip())
        return tuple(entries)
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
        return tuple(str(index) for index in range(int(nvml.nvmlDeviceGetCount())))
    except Exception:  # no nvidia-ml-py, no driver, NVML refused: no GPUs seen, nothing is pinned
        return ()


def pin_instruction(gpus: Sequence[str], controller_pid: int | None = None) -> str:
    """The value of INSTRUCTION_VARIABLE the controller sets for its workers.

    >>> pin_instruction(("0", "1"), controller_pid=42)
    '42:0,1'
    """
    return f"{os.getpid() if controller_pid is None else controller_pid}:{','.join(gpus)}"


def pinned_gpu(environ: Mapping[str, str], parent_pid: int | None = None) -> str | None:
    """The GPU this process is to be pinned to: an xdist worker (PYTEST_XDIST_WORKER, which xdist sets before the
    worker reads its options) started by the controller that left the instruction; else None.

    >>> pinned_gpu({"PYTEST_XDIST_WORKER": "gw3", INSTRUCTION_VARIABLE: "42:0,1"}, parent_pid=42)
    '1'
    >>> pinned_gpu({"PYTEST_XDIST_WORKER": "gw3", INSTRUCTION_VARIABLE: "42:0,1"}, parent_pid=7) is None
    True
    """
    instruction = environ.get(INSTRUCTION_VARIABLE)
    worker = environ.get("PYTEST_XDIST_WORKER")
    if not instruction or not worker:
        return None
    pid, _, listed = instruction.partition(":")
    if str(os.getppid() if parent_pid is None else parent_pid) != pid or not listed:
        return None
    return assign(worker, listed.split(","))


def pin_worker(environ: MutableMapping[str, str], parent_pid: int | None = None) -> str | None:
    """Narrow this worker's CUDA to its GPU; returns the GPU (a ``CUDA_VISIBLE_DEVICES`` entry) or None when
    this process is not a pinned worker. Calling it again changes nothing.

    CUDA reads ``CUDA_VISIBLE_DEVICES`` once, when it initialises in the process (torch does that lazily, at the
    first CUDA call), and never again: set later, the variable would be ignored and every worker would see every
    GPU as cuda:0..N-1, all starting on GPU 0. ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (unless set) makes an index mean
    the same GPU to CUDA as to NVML and nvidia-smi, whose order is the PCI bus order.

    >>> env = {"PYTEST_XDIST_WORKER": "gw1", INSTRUCTION_VARIABLE: "42:4,5"}
    >>> pin_worker(env, parent_pid=42), env["CUDA_VISIBLE_DEVICES"], env["CUDA_DEVICE_ORDER"]
    ('5', '5', 'PCI_BUS_ID')
    """
    gpu = pinned_gpu(environ, parent_pid)
    if gpu is None:
        return None
    environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    environ["CUDA_VISIBLE_DEVICES"] = gpu
    return gpu


def cuda_initialised() -> bool:
    """Whether torch has already initialised CUDA in this process (too late to pin it); False without torch.

    >>> cuda_initialised() in (True, False)
    True
    """
    import sys

    torch = sys.modules.get("torch")  # never imported here: the plugin must not load torch to ask
    return bool(torch is not None and torch.cuda.is_initialized())


def describe_gpu(gpu: str, nvml: Any = None) -> GpuIdentity:
    """The identity of a pinned worker's GPU (a ``CUDA_VISIBLE_DEVICES`` entry: a physical index or a UUID):
    physical index, name and UUID from NVML (which numbers GPUs physically), as much as is known.

    >>> class FakeNvml:
    ...     def nvmlInit(self): pass
    ...     def nvmlDeviceGetHandleByIndex(self, index): return index
    ...     def nvmlDeviceGetName(self, handle): return b"NVIDIA H200"
    ...     def nvmlDeviceGetUUID(self, handle): return f"GPU-{handle}"
    ...     def nvmlDeviceGetIndex(self, handle): return handle
    >>> describe_gpu("3", nvml=FakeNvml())
    GpuIdentity(index=3, name='NVIDIA H200', uuid='GPU-3')
    >>> describe_gpu("1", nvml=object())  # NVML unusable: the index alone
    GpuIdentity(index=1, name=None, uuid=None)
    """
    index = int(gpu) if gpu.isdigit() else None
    try:
        if nvml is None:
            import pynvml as nvml  # nvidia-ml-py
        nvml.nvmlInit()
        if index is not None:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        else:
            handle = nvml.nvmlDeviceGetHandleByUUID(gpu)
            index = int(nvml.nvmlDeviceGetIndex(handle))
        return GpuIdentity(index=index, name=_text(nvml.nvmlDeviceGetName(handle)),
                           uuid=_text(nvml.nvmlDeviceGetUUID(handle)))
    except Exception:  # no nvidia-ml-py, no driver, MIG: the record keeps what is known, never fails a test
        return GpuIdentity(index=index, uuid=gpu if index is None else None)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
