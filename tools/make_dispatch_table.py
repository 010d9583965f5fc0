"""Turn an A/B report of the attention suite into flashlite's dispatch table for one GPU model.

Reads the JSON that ``pytest tests/perf --kernel-ab --kernel-ab-report PATH`` writes and, for every forward
comparison of the kernel against what ``backend="sdpa"`` runs ("triton vs sdpa" for dense calls; for a variant,
named in the shape's "variant", "vs sdpa+mask" or "vs materialized": SDPA with the mask or bias built, or the
scores materialized for softcapping; "vs sdpa padded" for packed sequences; for decoding "vs sdpa path", the
kernel against ``attention_with_kvcache(backend="sdpa")`` itself),
records which backend ``flashlite.attention(backend="auto")`` should use for
that (dtype, head dim, causal, batch, sequence bucket, variant): the Triton kernel only where its win survives the
report's Benjamini-Hochberg correction; SDPA on a loss, a tie or an inconclusive result, since SDPA is the safe
default. Forward+backward comparisons against the same baselines ("fwd+bwd triton vs sdpa" for dense calls; a
variant's "fwd+bwd ... vs sdpa+mask" or "vs materialized") give the entries keyed ``.../fwd+bwd``, which decide
the calls whose gradient is computed (``flashlite.dispatch``); packed sequences and decoding decide by their
forward only, so their forward+backward comparisons are not read. Comparisons against FlexAttention (which
``auto`` never runs) are not read. ``auto``'s own rows against SDPA ("fwd auto vs sdpa", "fwd+bwd auto vs sdpa")
are read last: a loss there makes the entry SDPA (small, host-bound calls can win a kernel-against-SDPA
comparison and still lose through ``auto``, as forward+backward did at B=128, S=128 on the H200).

Several reports (of the same GPU model) may be given: a later report's entry (by the report's date; reports of one
day in the order given) replaces an earlier one for the same key, and every entry records the report, commit and
date it came from. A report that cannot support a table (a damaged row, rows of another GPU, two rows that give
one key different backends, no comparison against SDPA) stops the script with a message naming it and the row.

Every table (and every merged entry) records the source hash of the kernels measured
(``flashlite.dispatch.kernel_source_hash``); ``flashlite.dispatch`` uses an entry only while the kernels have that
hash. The hash is of the kernel files at the report's commit (``--commit``, or the commit the report records) where
this clone has that commit and the report does not say its tree was dirty; else of this checkout's kernel files,
which is right when the table is made in the checkout that ran the measurement (the script says which it used).
``--kernel-hash`` gives it outright.

On a GPU machine, in the checkout to measure, one command measures and writes the table of that GPU:

    python -m pytest tests/perf/test_attention_ab.py tests/perf/test_variants_ab.py tests/perf/test_varlen_ab.py \
        tests/perf/test_kvcache_ab.py --kernel-ab --kernel-ab-report ab.json \
        && python tools/make_dispatch_table.py ab.json

Usage: python tools/make_dispatch_table.py REPORT.json [REPORT.json ...] [--commit SHA [SHA ...]]
       [--kernel-hash HASH [HASH ...]] [--out flashlite/dispatch_tables]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flashlite.dispatch import (MEASURED_KERNEL_FILES, gpu_slug, kernel_source_hash, source_hash,  # noqa: E402
                                table_key)
from pytest_kernelcheck.results.records import OUTCOMES, ComparisonRecord, DamagedReport  # noqa: E402

FORWARD_PREFIXES = ("fwd triton vs sdpa", "fwd fp32 triton vs sdpa", "fwd D128 triton vs sdpa")
# A variant's forward against the SDPA path: the kernel (or auto, which the rule sends to it) on the left.
# Decoding is read only against attention_with_kvcache's own SDPA path ("vs sdpa path"), not against a bare SDPA
# call with a length mask ("vs sdpa+lengths"): that path must also keep the cache's unwritten positions out of the
# output (it zeroes them in a copy) and gathers a paged cache first, so a loss against the bare call says nothing
# about which of the two auto should pick.
VARIANT_BASELINES = ("vs sdpa+mask", "vs materialized", "vs sdpa padded", "vs sdpa path")
# attention_with_kvcache aligns its queries bottom-right, so its dispatch keys on causal "lower_right"; its A/B
# shapes do not name a causal mode, and a key with the default (top-left) would never be looked up.
DECODING_VARIANTS = ("kvcache", "kvcache_paged")


FORWARD_BACKWARD_PREFIX = "fwd+bwd"
FORWARD_BACKWARD_DENSE = "fwd+bwd triton vs sdpa"
# Variants whose calls are not decided with the forward+backward entries (``attention_varlen`` and
# ``attention_with_kvcache`` look up forward entries only).
FORWARD_ONLY_VARIANTS = ("varlen", *DECODING_VARIANTS)


# auto's own comparisons against SDPA (the dispatch's never-slower rows): a loss there overrides a kernel entry of
# the same or an older report (auto then ran the kernel and lost, or lost even on SDPA; either way SDPA is the
# choice); a win or a tie leaves the entry as it is.
AUTO_ROWS = {"fwd auto vs sdpa": False, "fwd+bwd auto vs sdpa": True}


def _forward_against_sdpa(rec: dict) -> bool:
    name = str(rec.get("name", ""))
    if name.startswith(FORWARD_PREFIXES):
        return True
    variant = (rec.get("shape") or {}).get("variant", "dense")
    return variant != "dense" and name.endswith(VARIANT_BASELINES) and not name.startswith(FORWARD_BACKWARD_PREFIX)


def _forward_backward_against_sdpa(rec: dict) -> bool:
    name = str(rec.get("name", ""))
    variant = (rec.get("shape") or {}).get("variant", "dense")
    if variant == "dense":
        return name == FORWARD_BACKWARD_DENSE
    return (name.startswith(FORWARD_BACKWARD_PREFIX) and name.endswith(VARIANT_BASELINES)
            and variant not in FORWARD_ONLY_VARIANTS)


def _dtype(value: str) -> torch.dtype:
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {value!r} in report shape")
    return dtype


def _key(shape: dict, backward: bool) -> str:
    """The table key of a comparison's shape; a variant (key padding, window, softcap, ALiBi) names itself in the
    shape's "variant"."""
    variant = str(shape.get("variant", "dense"))
    causal = shape.get("causal", "lower_right" if variant in DECODING_VARIANTS else True)
    return table_key(_dtype(shape["dtype"]), int(shape["D"]), causal, int(shape["B"]), int(shape["S"]), variant,
                     backward)


def _refuse(source: str, rec: dict, why: str) -> SystemExit:
    return SystemExit(f"{source}: comparison {rec.get('name')!r} ({rec.get('nodeid') or 'no nodeid'}): {why}")


def _checked_row(rec: dict, gpu: str, source: str) -> None:
    """Exit naming the report and the row when a row the table reads holds what no run writes, or what would make
    its entry wrong: a damaged field (pytest_kernelcheck's own check of a report row), a missing or unknown
    Benjamini-Hochberg verdict, sizes that are not whole numbers >= 1, a causal mode ``table_key`` does not know,
    or a row measured on another GPU model than the table's."""
    try:
        ComparisonRecord.from_json(rec)
    except DamagedReport as exc:
        raise _refuse(source, rec, str(exc)) from None
    if rec.get("verdict") != "error" and rec.get("verdict_bh") not in OUTCOMES:
        raise _refuse(source, rec, f"verdict_bh {rec.get('verdict_bh')!r} is not one of {', '.join(OUTCOMES)}: a "
                                   f"table is made from a report with its Benjamini-Hochberg verdicts")
    shape = rec["shape"]
    for size in ("B", "S", "D"):
        value = shape.get(size)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _refuse(source, rec, f"shape {size}={value!r} is not a whole number >= 1")
    if shape.get("causal", True) not in (True, False, "lower_right"):
        raise _refuse(source, rec, f"shape causal={shape.get('causal')!r} is not true, false or 'lower_right'")
    row_gpu = (rec.get("gpu") or {}).get("name")
    if row_gpu is not None and row_gpu != gpu:
        raise _refuse(source, rec, f"measured on {row_gpu!r}, not on the table's {gpu!r}")


def _lost_mode(rec: dict) -> str:
    """The first measurement mode of a decoding row, other than the one its verdict is of, that did not win
    (e.g. "latency: tie 0.99x"), else "". A decoding step runs once per token from an idle GPU in a generation
    loop and inside a CUDA graph in a server, so its entry takes the kernel only where every mode measured (by the
    row's ``kernel_ab_modes``) won; other rows decide by their verdict alone."""
    if rec["shape"].get("variant") not in DECODING_VARIANTS:
        return ""
    for mode in rec.get("modes") or ():
        if mode.get("unavailable") is None and mode.get("mode") != rec.get("mode") and mode.get("verdict") != "win":
            return f"{mode.get('mode')}: {mode.get('verdict')} {mode.get('speedup')}x"
    return ""


def _entry(rec: dict, backend: str, who: str, source: str, note: str = "") -> dict:
    """A table entry for ``backend`` from a finished comparison of ``who`` (the kernel or auto) against SDPA; a
    kernel entry only from a row whose verdicts both say win with a speedup above 1."""
    if backend == "triton" and not (rec.get("verdict") == "win" and rec["speedup"] > 1):
        raise _refuse(source, rec, f"Benjamini-Hochberg says win but the verdict is {rec.get('verdict')!r} at "
                                   f"{rec['speedup']}x: the row contradicts itself")
    lo, hi = rec["ci"]
    hi_text = "inf" if hi is None else f"{hi:.2f}"
    return {"backend": backend,
            "why": f"{who} {rec['speedup']:.2f}x SDPA [{lo:.2f}, {hi_text}], {rec['verdict']} "
                   f"(after Benjamini-Hochberg: {rec.get('verdict_bh')}), {rec['n_pairs']} pairs{note}",
            "speedup": rec["speedup"]}


ROOT = Path(__file__).resolve().parents[1]


def measured_kernel_hash(report: dict, commit: str | None) -> tuple[str, str]:
    """(kernel source hash, where it came from) of the code ``report`` measured: the kernel files at ``commit`` (or
    the report's own commit) where this clone has it and the report's tree was not dirty, else this checkout's."""
    info = report.get("environment", {}).get("commit_info") or {}
    commit = commit or info.get("id")
    if commit and not info.get("dirty"):
        try:
            files = {path: subprocess.run(["git", "-C", str(ROOT), "show", f"{commit}:flashlite/{path}"],
                                          capture_output=True, check=True).stdout for path in MEASURED_KERNEL_FILES}
            return source_hash(files), f"the kernels at commit {commit}"
        except (OSError, subprocess.CalledProcessError):
            pass
    why = "its tree was dirty" if info.get("dirty") else f"commit {commit} is not in this clone" if commit else \
        "it records no commit"
    return kernel_source_hash(), f"this checkout's kernels ({why})"


def build_table(report: dict, commit: str | None = None, source: str | None = None,
                kernel_hash: str | None = None) -> dict:
    """The dispatch table (origin + entries) for the GPU a report was measured on.

    ``commit`` names the code that was measured when the report could not read it (no git on the GPU machine);
    ``kernel_hash`` the source hash of its kernels (``measured_kernel_hash`` where None).
    Exits naming the report (and the row) when it cannot support a table: no GPU or several GPU models, a damaged
    row, two rows that give one key different backends, or no comparison against SDPA at all.
    """
    source = source or "pytest tests/perf --kernel-ab"
    env = report.get("environment", {})
    devices = (env.get("gpu") or {}).get("devices") or []
    if not devices:
        raise SystemExit("the report records no GPU: dispatch tables come from GPU runs only")
    models = sorted({device["name"] if isinstance(device, dict) else str(device) for device in devices})
    if len(models) != 1:
        raise SystemExit(f"{source}: the report ran on several GPU models {models}; a table is for one model")
    gpu = models[0]
    created = report.get("created")
    if not isinstance(created, str) or len(created) < 10:
        raise SystemExit(f"{source}: 'created' is {created!r}, not the report's ISO date and time")
    commit = commit or (env.get("commit_info") or {}).get("id") or "unknown"
    entries: dict[str, dict] = {}
    decided_by: dict[str, dict] = {}  # key -> the kernel row its entry came from
    # auto's rows after the kernel's (a stable sort), so that within one report a loss of auto overrides the
    # kernel's win.
    for rec in sorted(report.get("comparisons", []), key=lambda r: r.get("name") in AUTO_ROWS):
        if not rec.get("shape"):
            continue
        if rec.get("name") in AUTO_ROWS:
            _checked_row(rec, gpu, source)
            if rec.get("verdict_bh") == "loss":
                entries[_key(rec["shape"], AUTO_ROWS[rec["name"]])] = _entry(rec, "sdpa", "auto", source,
                                                                             ": auto's own row")
            continue
        backward = _forward_backward_against_sdpa(rec)
        if not backward and not _forward_against_sdpa(rec):
            continue
        _checked_row(rec, gpu, source)
        key = _key(rec["shape"], backward)
        if rec.get("verdict") == "error":
            entry = {"backend": "sdpa", "why": f"comparison failed: {rec.get('error')}"}
        elif rec.get("verdict_bh") == "win" and _lost_mode(rec):
            entry = _entry(rec, "sdpa", "Triton", source, f"; not a win from {_lost_mode(rec)}")
        else:
            entry = _entry(rec, "triton" if rec.get("verdict_bh") == "win" else "sdpa", "Triton", source)
        earlier = decided_by.get(key)
        if earlier is not None and entries[key]["backend"] != entry["backend"]:
            # Two measurements of one key (sizes that share a sequence bucket, or other head counts) that disagree:
            # their order in the report would decide.
            raise _refuse(source, rec, f"gives key {key!r} {entry['backend']}, where comparison "
                                       f"{earlier.get('name')!r} ({earlier.get('nodeid')}) gives it "
                                       f"{entries[key]['backend']}")
        entries[key], decided_by[key] = entry, rec
    if not entries:
        raise SystemExit(f"{source}: no comparison of the kernel against SDPA to make a table from")
    if kernel_hash is None:
        kernel_hash, _ = measured_kernel_hash(report, None if commit == "unknown" else commit)
    origin = {"gpu": gpu, "date": created[:10], "commit": str(commit)[:12], "kernel_hash": kernel_hash,
              "torch": (env.get("packages") or {}).get("torch"),
              "triton": (env.get("packages") or {}).get("triton"),
              "source": source}
    return {"origin": origin, "entries": dict(sorted(entries.items()))}


def merge_tables(tables: list[dict]) -> dict:
    """One table from several of the same GPU model; each entry keeps the origin it came from, and a later report's
    entry replaces an earlier one's. Later means a later date: the tables are put in date order (a stable sort, so
    reports of one day keep the order given), whatever order they came in.

    The merged origin names the newest report and lists all of them under "sources".
    """
    gpus = {t["origin"]["gpu"] for t in tables}
    if len(gpus) != 1:
        raise SystemExit(f"reports from different GPU models cannot share a table: {sorted(gpus)}")
    tables = sorted(tables, key=lambda t: t["origin"]["date"])
    entries: dict[str, dict] = {}
    for table in tables:
        origin = table["origin"]
        for key, entry in table["entries"].items():
            entries[key] = {**entry, "date": origin["date"], "commit": origin["commit"], "source": origin["source"],
                            "kernel_hash": origin.get("kernel_hash")}
    origin = {**tables[-1]["origin"], "sources": [
        {k: t["origin"].get(k) for k in ("source", "commit", "date", "kernel_hash")} for t in tables]}
    return {"origin": origin, "entries": dict(sorted(entries.items()))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reports", type=Path, nargs="+", metavar="report")
    parser.add_argument("--commit", nargs="+", default=[],
                        help="commit of the measured code per report, in the same order, when reports do not record it")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "flashlite" /
                        "dispatch_tables")
    parser.add_argument("--kernel-hash", nargs="+", default=[],
                        help="source hash of the measured kernels per report (flashlite.dispatch.source_hash), in the "
                             "same order; default: worked out from the report's commit (see above)")
    args = parser.parse_args()
    for option, given in (("--commit", args.commit), ("--kernel-hash", args.kernel_hash)):
        if given and len(given) != len(args.reports):
            parser.error(f"{option} needs one value per report: {len(args.reports)} reports, {len(given)} values")
    commits = args.commit or [None] * len(args.reports)
    hashes = args.kernel_hash or [None] * len(args.reports)
    tables = []
    for path, commit, kernel_hash in zip(args.reports, commits, hashes):
        report = json.loads(path.read_text())
        if kernel_hash is None:
            kernel_hash, where = measured_kernel_hash(report, commit)
            print(f"{path}: kernel source hash {kernel_hash}, of {where}")
        tables.append(build_table(report, commit=commit, source=str(path), kernel_hash=kernel_hash))
    table = tables[0] if len(tables) == 1 else merge_tables(tables)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{gpu_slug(table['origin']['gpu'])}.json"
    path.write_text(json.dumps(table, indent=1) + "\n")
    n_triton = sum(e["backend"] == "triton" for e in table["entries"].values())
    print(f"wrote {path}: {len(table['entries'])} entries, {n_triton} use the Triton kernel")


if __name__ == "__main__":
    main()
