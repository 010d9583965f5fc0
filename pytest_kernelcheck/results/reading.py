"""How one comparison row is read: what its verdict rests on, why its medians may seem to say otherwise, which
p-value decided it, and what to do about noise; the terminal, the markdown report and ``describe()`` all say it so.

A verdict rests on the *paired* speedup: the median, over pairs of back-to-back calls, of baseline time / candidate
time. Each side's median time per call is shown beside it, and the ratio of those medians usually agrees with it;
when the times are spread or bimodal (on a CPU, torch's thread pool contending for the cores) the two can fall on
opposite sides of 1, and a row reading ``1.681 ms, 0.7972 ms, 1.086x`` looks like a contradiction. Such a row
carries a note saying why, and the advice that steadies the times.

>>> from .records import ComparisonRecord, RunDetails
>>> row = ComparisonRecord("softmax", "inconclusive", speedup=1.086, ci=(0.135, 3.561), candidate_ms=1.681,
...                        baseline_ms=0.7972, p_value=1.0, p_value_raw=0.36,
...                        run=RunDetails(method="cpu-clock", margin=0.02, looks_planned=11))
>>> p_cell(row)
'1 [0.36]'
>>> print(medians_note(row))  # doctest: +NORMALIZE_WHITESPACE
the medians (candidate 1.681 ms, baseline 0.7972 ms) give 0.474x but the paired speedup, which the verdict uses,
is 1.086x: the times are spread or bimodal, so which side ran slow changed from pair to pair; pass
--kernel-ab-cpu-threads 1 (or torch.set_num_threads(1)) for stable times
"""
from __future__ import annotations

import math
from typing import Any

from .records import ComparisonRecord

# The engine's spread note (speed.stats.spread_note) ends with the same advice, worded alike.
CPU_ADVICE = "pass --kernel-ab-cpu-threads 1 (or torch.set_num_threads(1)) for stable times"
# Where the run already had one thread, the advice would name a command that changes nothing.
BUSY_ADVICE = ("the run already used one torch thread (--kernel-ab-cpu-threads 1), so other processes share the "
               "cores: rerun on a quieter machine, or give it more --kernel-ab-max-time")
GPU_ADVICE = "give it more --kernel-ab-max-time, or run it on a quiet GPU"
P_HEADER = "p adj [raw]"
P_LEGEND = ("p adj: the signed-rank p-value times the looks planned (Bonferroni, capped at 1), the one the verdict "
            "compares with alpha; [raw]: the same test at the last look alone")
DEFAULT_MARGIN = 0.02


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def tie_margin(margin: Any) -> float:
    """``margin`` where it is one a run can have (a finite number from 0 to below 1), else the default: a saved
    run's field is the user's file and may hold anything.

    >>> tie_margin(0.05), tie_margin(-3), tie_margin("x"), tie_margin(None)
    (0.05, 0.02, 0.02, 0.02)
    """
    value = _finite(margin)
    return value if value is not None and 0 <= value < 1 else DEFAULT_MARGIN


def medians_speedup(record: ComparisonRecord) -> float | None:
    """Baseline median / candidate median (None when either is missing or not above 0).

    >>> medians_speedup(ComparisonRecord("a", "tie", candidate_ms=2.0, baseline_ms=1.0))
    0.5
    """
    candidate, baseline = _finite(record.candidate_ms), _finite(record.baseline_ms)
    if not candidate or not baseline or candidate <= 0 or baseline <= 0:
        return None
    return baseline / candidate


def medians_disagree(record: ComparisonRecord) -> bool:
    """Whether the medians' ratio would read as another answer than the paired speedup: the two lie on opposite
    sides of the tie band (one a clear win, the other a clear loss), or the ratio lies outside the paired interval
    and more than the margin from the paired speedup.

    >>> medians_disagree(ComparisonRecord("a", "win", speedup=1.5, ci=(1.4, 1.6), candidate_ms=1.0,
    ...                                   baseline_ms=1.52))
    False
    """
    ratio, speedup = medians_speedup(record), _finite(record.speedup)
    if record.failed or ratio is None or speedup is None:
        return False
    band = math.log1p(tie_margin(record.run.margin))
    log_ratio, log_speedup = math.log(ratio), math.log(speedup)
    if log_ratio * log_speedup < 0 and min(abs(log_ratio), abs(log_speedup)) > band:
        return True
    low, high = record.ci
    outside = (low is not None and ratio < low) or (high is not None and ratio > high)
    return outside and abs(log_ratio - log_speedup) > band


def advice(record: ComparisonRecord) -> str:
    """What steadies this row's times: CUDA events' usual fix, or else (a host clock) the CPU's."""
    return GPU_ADVICE if str(record.run.method or "").startswith(("events", "cuda")) else CPU_ADVICE


def medians_note(record: ComparisonRecord) -> str | None:
    """Why this row's medians and its paired speedup disagree, with the advice; None when they agree."""
    if not medians_disagree(record):
        return None
    ratio = medians_speedup(record)
    return (f"the medians (candidate {record.candidate_ms:.4g} ms, baseline {record.baseline_ms:.4g} ms) give "
            f"{ratio:.3g}x but the paired speedup, which the verdict uses, is {record.speedup:.4g}x: the times are "
            f"spread or bimodal, so which side ran slow changed from pair to pair; {advice(record)}")


def row_notes(record: ComparisonRecord, cpu_threads: int | None = None) -> list[str]:
    """Everything a reader of this row should know beyond its cells: the medians' disagreement and the engine's
    notes (noise, ignored settings, timer resolution), each once. ``cpu_threads``: the run's
    ``--kernel-ab-cpu-threads``; at 1, advice to pass it gives way to advice that can still help.

    >>> from .records import RunDetails
    >>> row_notes(ComparisonRecord("a", "tie", run=RunDetails(notes=("flush_l2 ignored", "flush_l2 ignored"))))
    ['flush_l2 ignored']
    >>> row_notes(ComparisonRecord("a", "tie", run=RunDetails(notes=(f"spread; {CPU_ADVICE}",))), cpu_threads=1)
    ['spread; the run already used one torch thread (--kernel-ab-cpu-threads 1), so other processes share the \
cores: rerun on a quieter machine, or give it more --kernel-ab-max-time']
    """
    notes: list[str] = []
    for note in (medians_note(record), *record.run.notes):
        if note and cpu_threads == 1:
            note = note.replace(CPU_ADVICE, BUSY_ADVICE)
        if note and note not in notes:
            notes.append(note)
    return notes


def p_cell(record: ComparisonRecord) -> str:
    """The p-value the verdict used (corrected for the looks) and, in brackets, the raw one of the last look.

    >>> p_cell(ComparisonRecord("a", "win", p_value=0.002, p_value_raw=0.0002))
    '0.002 [0.0002]'
    >>> p_cell(ComparisonRecord("a", "error"))
    '-'
    """
    used, raw = _finite(record.p_value), _finite(record.p_value_raw)
    if used is None:
        return "-"
    return _p(used) + (f" [{_p(raw)}]" if raw is not None else "")


def p_text(record: ComparisonRecord) -> str:
    """The p-value for a sentence, labelled: ``p=1 (adjusted for 11 looks; raw 0.36)``.

    >>> from .records import RunDetails
    >>> p_text(ComparisonRecord("a", "tie", p_value=1.0, p_value_raw=0.36, run=RunDetails(looks_planned=11)))
    'p=1 (adjusted for 11 looks; raw 0.36)'
    """
    used, raw = _finite(record.p_value), _finite(record.p_value_raw)
    looks = record.run.looks_planned
    label = f"adjusted for {looks} looks" if looks else "adjusted for the looks"
    return f"p={_p(used)} ({label}; raw {_p(raw)})" if raw is not None else f"p={_p(used)}"
