"""flashlite's compiled host helpers: attention()'s plan key and replay, and the replay of a recorded Triton launch,
in C++ (``plan_key.cpp``), built on first import.

The key of a call decides whether its plan can be replayed, so it is built on every call; in Python it costs more
than the 1 us budget a replayed SDPA call has over SDPA itself (``scripts/host_cost_probe.py at commit 8ca4529``). The
C++ version
reads sizes and strides straight off the tensors, and ``replay`` does the key, the plan lookup and the plan's call
in one C call. ``launch_recorded`` reads and checks a replayed launch's tensor addresses and calls the compiled
kernel's launcher with one argument array (``flashlite._direct_launch``).

The extension is compiled once per source, torch and Python version with the system's C++ compiler (``CXX``, else
``c++`` or ``g++``) into the cache folder ``FLASHLITE_CACHE_DIR`` (default ``~/.cache/flashlite``), then loaded
from there in milliseconds. ``torch.utils.cpp_extension.load`` would do the same but needs ninja, which the
project's GPU machine lacks; a direct compiler call with torch's include and library paths needs nothing more.
``FLASHLITE_NATIVE=0`` turns it off. Without a compiler, or when the build fails, ``plan_key``, ``any_length_key``,
``replay``, ``launch_recorded`` and ``fields_key`` are None, the reason is logged once (logger ``flashlite``, WARNING) and kept in
``build_error``, and flashlite does their work in Python (same decisions, about 1.5 us more per attention call, and about 1 us more
per replayed launch).
"""
from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional

import torch

from flashlite import _env

_SOURCE = Path(__file__).with_name("plan_key.cpp")
_MODULE_NAME = "flashlite_plan_key"
_log = logging.getLogger("flashlite")


def cache_dir() -> Path:
    """Where compiled helpers are kept: ``FLASHLITE_CACHE_DIR``, else ``~/.cache/flashlite``.

    Example:
        >>> isinstance(cache_dir(), Path)
        True
    """
    return Path(os.environ.get("FLASHLITE_CACHE_DIR") or Path.home() / ".cache" / "flashlite")


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


def _compile_command(compiler: str, output: Path) -> list[str]:
    from torch.utils import cpp_extension  # its paths only; imported here because it is slow to import

    torch_lib = Path(torch.__file__).parent / "lib"
    includes = [f"-I{path}" for path in cpp_extension.include_paths()] + [f"-I{sysconfig.get_paths()['include']}"]
    # The C++ ABI flag must match torch's build, or std::string-taking symbols of libtorch would not link.
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    return [compiler, "-O2", "-shared", "-fPIC", "-std=c++20", "-w", abi, *includes, str(_SOURCE), "-o", str(output),
            f"-L{torch_lib}", "-ltorch_python", "-ltorch", "-ltorch_cpu", "-lc10", f"-Wl,-rpath,{torch_lib}"]


def _build_path() -> Path:
    # One build per source text, torch and Python: a changed source or another torch gets its own file.
    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode() + sys.version.encode()).hexdigest()
    return cache_dir() / f"{_MODULE_NAME}-{digest[:16]}{sysconfig.get_config_var('EXT_SUFFIX')}"


def _load(path: Path) -> ModuleType:
    loader = importlib.machinery.ExtensionFileLoader(_MODULE_NAME, str(path))
    spec = importlib.util.spec_from_file_location(_MODULE_NAME, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def build() -> ModuleType:
    """Compile the plan-key extension if its build is not cached yet, and load it. Raises RuntimeError (naming the
    compiler's complaint) when there is no compiler or the build fails.

    Example:
        >>> build().plan_key is not None   # doctest: +SKIP
        True
    """
    path = _build_path()
    if not path.exists():
        from filelock import FileLock  # torch's own dependency: one build at a time across processes

        path.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(str(path) + ".lock"):
            if not path.exists():  # another process may have built it while this one waited
                compiler = _compiler()
                if compiler is None:
                    raise RuntimeError("no C++ compiler found (set CXX, or install g++ or clang++)")
                with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
                    partial = Path(scratch) / path.name
                    done = subprocess.run(_compile_command(compiler, partial), capture_output=True, text=True)
                    if done.returncode != 0:
                        raise RuntimeError(f"{compiler} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
                    os.replace(partial, path)  # whole or absent: a reader never loads a half-written file
    return _load(path)


def _build_or_none() -> tuple[Optional[ModuleType], Optional[str]]:
    if not _env.flag("FLASHLITE_NATIVE", True):
        return None, f"off: FLASHLITE_NATIVE={os.environ['FLASHLITE_NATIVE']!r}"
    try:
        return build(), None
    except Exception as error:  # any failure leaves the Python key, which is always right, only slower
        _log.warning("flashlite: the C++ plan key is not available, plans are keyed in Python (about 1.5 us more "
                     "per attention call): %s", error)
        return None, f"{type(error).__name__}: {error}"


_extension, build_error = _build_or_none()
# plan_key(q, k, v, key_padding_mask, key_lengths, causal, scale, backend, precision, window, softcap, alibi_slopes)
# -> bytes, or None for arguments it does not cover; None itself when the extension could not be built.
plan_key: Optional[Callable[..., Optional[bytes]]] = None if _extension is None else _extension.plan_key
# any_length_key(the same twelve) -> bytes of the call's key without its key length (flashlite.attn.plan's
# any_length_key), or None where the Python key is needed; None itself without the extension.
any_length_key: Optional[Callable[..., Optional[bytes]]] = None if _extension is None else _extension.any_length_key
# replay(plans, fallback, <the same twelve arguments>) -> the output of the plan that the dict plans keeps for the
# call's plan_key, else for its any_length_key, computed by plan.run(q, k, v[, key_mask[, alibi_slopes]]); None
# when plans has neither; fallback(plans, <the twelve>) answers for calls plan_key does not cover. None itself
# without the extension.
replay: Optional[Callable[..., Optional[torch.Tensor]]] = None if _extension is None else _extension.replay
# launch_recorded(run, grid, stream, function, metadata, tensors, device_index, rest) -> True (launched), False
# (refused: an unaligned tensor or one on another device) or None (not plain tensors: check them in Python), for
# flashlite._direct_launch; None itself without the extension.
launch_recorded: Optional[Callable[..., Optional[bool]]] = None if _extension is None else _extension.launch_recorded
# fields_key(entry, *fields) -> bytes of flashlite.attn.plan.key_of's key (the kvcache, varlen and launcher
# entries), or None for a field it does not cover (then the Python key); None itself without the extension.
fields_key: Optional[Callable[..., Optional[bytes]]] = None if _extension is None else _extension.fields_key
