"""A lock per timing device, shared by every process on the machine (pytest-xdist workers included).

Two workers timing on the same GPU at once would each measure the other's load, so sampling holds an exclusive
``fcntl.flock`` on a file in the temp directory named after the device. Where ``fcntl`` does not exist (Windows)
the lock is a no-op and the comparison records that it ran unlocked.
"""
from __future__ import annotations

import os
import re
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
