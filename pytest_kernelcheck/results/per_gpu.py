"""Per-GPU views of a report of a run spread over several GPUs (``--kernel-gpus``): each GPU's totals, and the
comparisons whose verdict differs between two GPUs of the same model.

Rows name their GPU (:class:`pytest_kernelcheck.results.records.GpuIdentity`, on ``run.gpu``) only when their worker was
pinned to one; a report without such rows has no per-GPU lines, so runs on one GPU read as before.

>>> from pytest_kernelcheck.results.records import ComparisonRecord, GpuIdentity, RunDetails
>>> h200 = lambda index: RunDetails(elapsed_s=2.0, gpu=GpuIdentity(index, "NVIDIA H200", f"GPU-{index}"))
>>> rows = [ComparisonRecord("fused", "win", nodeid="t.py::a", run=h200(0)),
...         ComparisonRecord("fused", "tie", nodeid="t.py::a", run=h200(1))]
>>> summary_lines(rows)[1]
'GPU 0 (NVIDIA H200, GPU-0): 1 comparison(s) (1 win), 2.0 s timing'
>>> disagreement_lines(rows)
['WARNING: t.py::a fused: verdicts differ across NVIDIA H200 GPUs: win on GPU 0, tie on GPU 1']
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Sequence

from ..visible_text import visible
from .records import ComparisonRecord, GpuIdentity

VERDICT_ORDER = ("win", "loss", "tie", "inconclusive", "error")


@dataclass(frozen=True)
class GpuTotals:
    """One GPU's share of a run: its comparisons per verdict, tournaments and measurements, seconds spent timing
    (the rows' ``elapsed_s`` summed) and the range of SM clocks its rows read (None when none was read)."""

    gpu: GpuIdentity
    verdicts: collections.Counter
    other_rows: int  # tournaments and measurements
    timing_s: float
    clock_low_mhz: int | None
    clock_high_mhz: int | None

    @property
    def comparisons(self) -> int:
        return sum(self.verdicts.values())

    def line(self) -> str:
        counts = ", ".join(f"{self.verdicts[v]} {v}" for v in VERDICT_ORDER if self.verdicts[v])
        text = f"{self.gpu.label}: {self.comparisons} comparison(s)" + (f" ({counts})" if counts else "")
        if self.other_rows:
            text += f", {self.other_rows} tournament(s)/measurement(s)"
        text += f", {self.timing_s:.1f} s timing"
        if self.clock_low_mhz is not None:
            text += f", SM clock {self.clock_low_mhz}-{self.clock_high_mhz} MHz"
        return text


def totals(rows: Sequence[Any]) -> list[GpuTotals]:
    """Each GPU's totals, in physical index order, from typed records (comparisons, tournaments, measurements).

    >>> totals([ComparisonRecord("a", "tie")])  # not pinned: no GPU named
    []
    """
    by_gpu: dict[str, list[Any]] = {}
    for row in rows:
        if row.run.gpu is not None:
            by_gpu.setdefault(row.run.gpu.key, []).append(row)
    found = []
    for group in by_gpu.values():
        clocks = [row.run.clock for row in group if row.run.clock.available]
        lows = [c.sm_min_mhz for c in clocks if c.sm_min_mhz is not None]
        highs = [mhz for c in clocks for mhz in (c.sm_start_mhz, c.sm_end_mhz, c.session_highest_mhz)
                 if mhz is not None]
        found.append(GpuTotals(
            gpu=group[0].run.gpu,
            verdicts=collections.Counter(row.verdict for row in group if isinstance(row, ComparisonRecord)),
            other_rows=sum(not isinstance(row, ComparisonRecord) for row in group),
            timing_s=sum(row.run.elapsed_s or 0.0 for row in group),
            clock_low_mhz=min(lows + highs) if lows or highs else None,
            clock_high_mhz=max(lows + highs) if lows or highs else None,
        ))
    return sorted(found, key=lambda t: (t.gpu.index is None, t.gpu.index or 0, t.gpu.key))


def summary_lines(rows: Sequence[Any]) -> list[str]:
    """A title and one line per GPU; none when no row names a GPU."""
    found = totals(rows)
    return [f"Per GPU ({len(found)}):"] + [t.line() for t in found] if found else []


def disagreement_lines(comparisons: Sequence[ComparisonRecord]) -> list[str]:
    """A warning per comparison (test and name) whose verdicts differ between GPUs of one model (``--dist each``
    runs every comparison on every GPU). GPUs of different models may rightly disagree, so they are not compared;
    neither are GPUs whose model is unknown."""
    verdicts: dict[tuple[str, str, str], dict[str, tuple[GpuIdentity, str]]] = {}
    for row in comparisons:
        gpu = row.run.gpu
        if gpu is None or gpu.model is None:
            continue
        verdicts.setdefault((row.nodeid, row.name, gpu.model), {}).setdefault(gpu.key, (gpu, str(row.verdict)))
    lines = []
    for (nodeid, name, model), seen in verdicts.items():
        if len({verdict for _, verdict in seen.values()}) > 1:
            listed = ", ".join(f"{verdict} on GPU {gpu.index if gpu.index is not None else gpu.key}"
                               for gpu, verdict in sorted(seen.values(), key=lambda s: (s[0].index or 0, s[0].key)))
            lines.append(f"WARNING: {visible(nodeid)} {visible(name)}: verdicts differ across {model} GPUs: {listed}")
    return lines
