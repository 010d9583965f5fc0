"""A short per-kernel summary of an Nsight Compute report's raw metrics: time, throughput against the peaks, the
busiest pipes, issue activity and the warp stall reasons that hold each kernel back.

Reads what ``ncu --import REPORT.ncu-rep --csv --page raw`` prints (one header row of metric names, one row of
units, one row per profiled kernel; the standard library's csv module reads it). What each line means, in ncu's
terms:
- time: ``gpu__time_duration.sum``;
- SM, memory, DRAM: ``sm__throughput``, ``gpu__compute_memory_throughput``, ``dram__throughput``, % of peak;
- issue active: ``smsp__issue_active``, the share of cycles a scheduler issued an instruction (% of peak);
- warp cycles per issued instruction: ``smsp__average_warp_latency_per_inst_issued``;
- pipes: every ``sm__inst_executed_pipe_*`` and ``sm__pipe_*_cycles_active`` share (% of peak, active cycles), the
  largest first, tensor pipes always shown;
- stalls: ``smsp__average_warps_issue_stalled_<reason>_per_issue_active``, warps stalled for that reason per issued
  instruction, the largest first (their sum is about the warp cycles per issued instruction).
A metric the report lacks is left out of the summary.

Usage: python tools/ncu_summary.py RAW.csv [--top 6]
"""
from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Optional

_TIME_UNITS = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3,
               "second": 1e6, "s": 1e6}
_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_PIPE = re.compile(r"^sm__(?:inst_executed_pipe_(\w+?)|pipe_(\w+?)_cycles_active)\.avg\.pct_of_peak_sustained_active$")
_SCALARS = {
    "SM %": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "memory %": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
    "DRAM %": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "issue active %": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "warp cycles per issued instruction": "smsp__average_warp_latency_per_inst_issued.ratio",
    "achieved occupancy %": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "registers per thread": "launch__registers_per_thread",
}


@dataclass
class KernelMetrics:
    """One profiled kernel launch: its name, its time in microseconds (None if the report lacks it) and every
    numeric metric of the row by ncu's name."""

    name: str
    time_us: Optional[float]
    values: dict[str, float] = field(default_factory=dict)


def _number(text: str) -> Optional[float]:
    """ncu's printed number (thousands separators allowed), or None for an empty or non-numeric field."""
    cleaned = text.replace(",", "").strip()
    try:
        value = float(cleaned)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_raw_csv(text: str) -> list[KernelMetrics]:
    """The kernels of ``ncu --csv --page raw`` output. Lines before the header (ncu's own ``==PROF==`` messages) are
    skipped; the row after the header is the units row when its "ID" field is empty.

    Example:
        >>> rows = read_raw_csv('"ID","Kernel Name","gpu__time_duration.sum"\\n"","","usecond"\\n"0","k","1,064.7"\\n')
        >>> rows[0].name, rows[0].time_us
        ('k', 1064.7)
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith('"ID"') and "Kernel Name" in line), None)
    if start is None:
        raise ValueError("no ncu raw-page header (a row starting with \"ID\" that names \"Kernel Name\") found")
    rows = list(csv.reader(io.StringIO("\n".join(lines[start:]))))
    header, body = rows[0], rows[1:]
    units = [""] * len(header)
    if body and body[0] and body[0][0] == "":
        units, body = body[0], body[1:]
    name_at = header.index("Kernel Name")
    kernels = []
    for row in body:
        if len(row) != len(header):
            continue  # a trailing message line, not a kernel
        values = {}
        for column, unit, cell in zip(header, units, row):
            value = _number(cell)
            if value is not None:
                values[column] = value * _TIME_UNITS.get(unit, 1.0) if column == "gpu__time_duration.sum" else value
        kernels.append(KernelMetrics(row[name_at], values.get("gpu__time_duration.sum"), values))
    return kernels


def stall_reasons(kernel: KernelMetrics) -> list[tuple[str, float]]:
    """(reason, warps stalled per issued instruction), the largest first.

    Example:
        >>> k = KernelMetrics("k", 1.0, {"smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio": 2.0,
        ...                              "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio": 3.0})
        >>> stall_reasons(k)
        [('wait', 3.0), ('barrier', 2.0)]
    """
    found = [(m.group(1), value) for column, value in kernel.values.items() for m in [_STALL.match(column)] if m]
    return sorted(found, key=lambda item: -item[1])


def pipe_shares(kernel: KernelMetrics) -> list[tuple[str, float]]:
    """(pipe, % of peak over active cycles) for each pipe metric, the largest first; a pipe reported both as
    instructions executed and as cycles active appears twice, labelled "inst" and "cycles"."""
    found = []
    for column, value in kernel.values.items():
        m = _PIPE.match(column)
        if m:
            found.append((f"{m.group(1)} (inst)" if m.group(1) else f"{m.group(2)} (cycles)", value))
    return sorted(found, key=lambda item: -item[1])


def summary(kernels: list[KernelMetrics], top: int = 6) -> str:
    """The text this script prints: one block per kernel."""
    out = []
    for kernel in kernels:
        time = f"{kernel.time_us:,.1f} us" if kernel.time_us is not None else "time not in the report"
        out.append(f"{kernel.name[:110]}: {time}")
        scalars = [f"{label} {kernel.values[metric]:,.1f}" for label, metric in _SCALARS.items()
                   if metric in kernel.values]
        if scalars:
            out.append("  " + "; ".join(scalars))
        pipes = pipe_shares(kernel)
        shown = pipes[:top] + [p for p in pipes[top:] if re.search(r"tensor|gmma|hmma", p[0])]
        if shown:
            out.append("  pipes: " + ", ".join(f"{name} {value:.1f}%" for name, value in shown))
        stalls = stall_reasons(kernel)
        if stalls:
            out.append("  stalls per issued instruction: "
                       + ", ".join(f"{name} {value:.2f}" for name, value in stalls[:top]))
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("raw_csv")
    p.add_argument("--top", type=int, default=6)
    args = p.parse_args(argv)
    with open(args.raw_csv, encoding="utf-8", errors="replace") as f:
        kernels = read_raw_csv(f.read())
    if not kernels:
        print(f"{args.raw_csv}: no kernel rows", file=sys.stderr)
        return 1
    print(summary(kernels, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
