"""A made-up dispatch table in place of the shipped ones, for tests of what ``backend="auto"`` decides."""
from __future__ import annotations

from flashlite import dispatch


def use_table(monkeypatch, entries: dict, slug: str = "test-gpu-y", origin: dict | None = None) -> dict:
    """Make every call look like it runs on GPU model ``slug``, whose table holds ``entries``, measured on this
    checkout's kernels (``origin`` may name other ones: its ``kernel_hash``); returns the table."""
    origin = {"date": "2026-01-02", "commit": "abc123", **(origin or {})}
    origin.setdefault("kernel_hash", dispatch.kernel_source_hash())
    table = {"origin": origin, "entries": entries}
    monkeypatch.setattr(dispatch, "_slug_of", lambda q: slug)
    monkeypatch.setattr(dispatch, "_table_loaded", lambda name: True)
    monkeypatch.setitem(dispatch._TABLES, slug, table)
    return table
