"""The report's files on disk: paths beside the JSON, the writability check, atomic writes, and reading an
earlier report back with every field checked."""
from __future__ import annotations

import json
import math
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping

from .records import (
    DamagedReport,
    NotAReport,
)
from .report_record import ABReport
from .report_schema import checked_report


class ReportError(Exception):
    """An earlier report cannot be read, or a report cannot be written; the message names the path."""


def companion_paths(json_path: str | Path) -> tuple[Path, Path]:
    """Markdown and PNG paths beside the JSON report (same stem).

    >>> [p.name for p in companion_paths("out/ab.json")]
    ['ab.md', 'ab.png']
    """
    path = Path(json_path)
    return path.with_suffix(".md"), path.with_suffix(".png")


def plot_paths(json_path: str | Path) -> dict[str, Path]:
    """The other plots beside the JSON report: the roofline, and the speedup trend over saved runs.

    >>> {kind: path.name for kind, path in plot_paths("out/ab.json").items()}
    {'roofline': 'ab_roofline.png', 'trend': 'ab_trend.png'}
    """
    path = Path(json_path)
    return {kind: path.with_name(f"{path.stem}_{kind}.png") for kind in ("roofline", "trend")}


def check_writable(json_path: str | Path) -> None:
    """Raise ``ReportError`` unless the report (and its companions) can be written there.

    Missing directories are fine (they are created when the report is written) as long as the nearest existing
    one is a writable directory.
    """
    import os

    path = Path(json_path)
    if path.is_dir():
        raise ReportError(f"report path {str(path)!r} is a directory; give a file name such as ab.json")
    ancestor = path.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise ReportError(f"cannot write report {str(path)!r}: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise ReportError(f"cannot write report {str(path)!r}: permission denied")


def load_report(path: str | Path) -> dict[str, Any]:
    """The JSON form of :func:`read_report` (the earlier report, every field checked), for callers that want the
    document as written.

    >>> load_report("/nonexistent/ab.json")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.report_files.ReportError: earlier report '/nonexistent/ab.json' does not exist
    """
    data, _ = _read(path)
    return data


def read_report(path: str | Path) -> ABReport:
    """Read an earlier JSON report as the typed report, with a clear error when it is missing or not an A/B report.

    >>> read_report("/nonexistent/ab.json")
    Traceback (most recent call last):
    ...
    pytest_kernelcheck.results.report_files.ReportError: earlier report '/nonexistent/ab.json' does not exist

    A report holding a field no run writes is refused, naming the file, the row and the field (such a row would be
    shown but never judged, or crash the run at its end): ``earlier report 'ab.json': comparisons[0]
    ('fused'): field 'verdict': 'WIN' is refused; accepted: 'win', 'loss', 'tie', 'inconclusive', 'error'``.
    """
    _, typed = _read(path)
    return typed


def _read(path: str | Path) -> tuple[dict[str, Any], ABReport]:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ReportError(f"earlier report {str(path)!r} does not exist") from None
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise ReportError(f"earlier report {str(path)!r} cannot be read as JSON: {exc}") from None
    try:
        typed = checked_report(data)  # every reader of a report checks each field's JSON type, then its value
    except NotAReport as exc:
        raise ReportError(f"{str(path)!r} is not a kernel A/B report ({exc})") from None
    except DamagedReport as exc:
        raise ReportError(f"earlier report {str(path)!r}: {exc}") from None
    return data, typed


def write_json(report: ABReport | Mapping[str, Any], path: str | Path) -> None:
    """Write the report (typed, or already in its JSON form) as standard JSON (non-finite numbers become null).

    Like every report file it goes to a temporary file beside ``path`` that then replaces ``path`` in one step,
    so a failed or killed write leaves the previous file as it was, never half a file.
    """
    document = report.to_json() if isinstance(report, ABReport) else dict(report)
    write_text(path, json.dumps(_finite(document), indent=1, default=str, allow_nan=False) + "\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_text(path: str | Path, text: str) -> None:
    # Encoded up front: an unencodable name fails here, before any file is touched, instead of halfway.
    data = text.encode("utf-8", errors="backslashreplace")
    write_atomically(path, lambda handle: handle.write(data), "report")


def write_atomically(path: str | Path, write: Callable[[BinaryIO], Any], what: str) -> None:
    """Have ``write`` fill a temporary file in ``path``'s folder, then move it over ``path`` with ``os.replace``.

    The move is atomic within one file system, so readers and later runs see the old file or the new one,
    whatever happens mid-write (full disk, a killed run). The temporary file is removed when anything fails; an
    ``OSError`` becomes ``ReportError`` naming ``path`` and the error.
    """
    target = Path(path)
    temporary: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        # os.open with 0o666 leaves the mode to the umask, as for any new file (mkstemp would make it 0600).
        with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())  # the data is on disk before the name points at it
        os.replace(temporary, target)
        temporary = None
    except OSError as exc:
        raise ReportError(f"cannot write {what} {str(path)!r}: {exc}") from None
    finally:
        if temporary is not None:
            try:
                temporary.unlink()
            except OSError:  # never created, or already gone: nothing to clean up
                pass
