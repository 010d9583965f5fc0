"""A lock per timing device, shared by every process on the machine (pytest-xdist workers included).

Two workers timing on the same GPU at once would each measure the other's load, so sampling holds an exclusive
``fcntl.flock`` on a file in the temp directory named after the device. The key names the physical GPU
(:func:`cuda_lock_key`), so workers pinned to different GPUs (``--kernel-gpus``) time in parallel and workers
sharing one take turns. Where ``fcntl`` does not exist (Windows) the lock is a no-op and the comparison records
that it ran unlocked.
"""
from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping


def cuda_lock_key(uuid: str | None, visible_index: int | None, environ: Mapping[str, str] | None = None) -> str:
    """The lock key of a CUDA device: its UUID, else its physical index.

    ``visible_index`` is the process's own CUDA index, which ``CUDA_VISIBLE_DEVICES`` renumbers: every worker
    pinned to one GPU calls it 0, so keyed by it, all workers would serialise on one lock whatever GPU they
    time on (and a worker with ``CUDA_VISIBLE_DEVICES=3`` would not exclude an unpinned process timing GPU 3).
    The variable's entry at that index is the physical device.

    >>> cuda_lock_key("GPU-1f", 0, {"CUDA_VISIBLE_DEVICES": "3"})
    'cuda-GPU-1f'
    >>> cuda_lock_key(None, 0, {"CUDA_VISIBLE_DEVICES": "3"}), cuda_lock_key(None, 1, {})
    ('cuda-3', 'cuda-1')
    """
    if uuid:
        return f"cuda-{uuid}"
    environ = os.environ if environ is None else environ
    entries = [entry.strip() for entry in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()]
    index = 0 if visible_index is None else visible_index
    return f"cuda-{entries[index]}" if index < len(entries) else f"cuda-{index}"


def lock_path(key: str) -> Path:
    """The lock file for a device key (e.g. ``"cuda-GPU-1234"``, ``"cpu"``).

    >>> lock_path("cuda-0").name
    'pytest-kernelcheck-cuda-0.lock'
    """
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key)
    return Path(tempfile.gettempdir()) / f"pytest-kernelcheck-{safe}.lock"


@contextmanager
def device_lock(key: str) -> Iterator[bool]:
    """Hold the machine-wide lock for ``key`` for the duration of the block; yields whether it is really locked.

    >>> with device_lock("doctest") as locked:
    ...     locked
    True
    """
    try:
        import fcntl
    except ImportError:  # not POSIX: nothing to lock with
        yield False
        return
    path = lock_path(key)
    try:
        handle = open(path, "a+")
    except PermissionError:  # another user's lock file: fall back to one of ours (still serialises our workers)
        path = path.with_name(f"{path.stem}-{os.getuid()}.lock")
        handle = open(path, "a+")
    with handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield True
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
