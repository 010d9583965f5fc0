"""Before and after a change, from two A/B reports of one machine session: each comparison's speedup and candidate
and baseline times in both, and whether the after speedup lies inside the before interval ("inside"), their
intervals overlap ("overlap") or neither ("APART"). Used for issue 13's constraint (flashlite of c0bcbe8 against
later commits: `benchmarks/results/h200-2026-12-01-gate-and-variants/before_after.txt`,
`benchmarks/results/h200-2026-12-04-b/run4_before_after_same_session/before_after.txt`) and for the layer's rows
(`benchmarks/results/h200-2026-12-04-d/*/before_after.txt`; shapes without D show "-").

Usage: python scripts/ab_before_after.py BEFORE.json AFTER.json   (prints the table)
"""
import json
import math
import sys


def load(path):
    out = {}
    for record in json.load(open(path))["comparisons"]:
        shape = record["shape"]
        key = (record["name"], shape.get("case", "-"), shape["B"], shape["S"], shape.get("D", "-"))
        out[key] = record
    return out


before, after = (load(p) for p in sys.argv[1:3])
rows, inside, ratios, cand_ratios, base_ratios = [], 0, [], [], []
for key in sorted(set(before) & set(after), key=lambda k: (k[0], str(k[4]), k[2] * k[3] ** 2, str(k[1]))):
    b, a = before[key], after[key]
    lo, hi = b["ci"]
    ok = lo <= a["speedup"] <= hi
    overlap = a["ci"][0] <= hi and lo <= a["ci"][1]
    inside += ok
    ratios.append(a["speedup"] / b["speedup"])
    cand_ratios.append(a["candidate_ms"] / b["candidate_ms"])
    base_ratios.append(a["baseline_ms"] / b["baseline_ms"])
    rows.append(f"{key[0]:58s} case {key[1]!s:>2} B={key[2]:<4} S={key[3]:<6} D={key[4]!s:<4} "
                f"before {b['speedup']:.3f}x [{lo:.3f}, {hi:.3f}]  after {a['speedup']:.3f}x "
                f"[{a['ci'][0]:.3f}, {a['ci'][1]:.3f}]  {'inside' if ok else ('overlap' if overlap else 'APART'):7s} "
                f"candidate ms {b['candidate_ms']:.4g} -> {a['candidate_ms']:.4g} ({cand_ratios[-1]:.3f}x)  "
                f"baseline ms {b['baseline_ms']:.4g} -> {a['baseline_ms']:.4g}")


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


print("\n".join(rows))
print(f"{len(rows)} comparisons in both runs; after speedup inside the before interval: {inside}; "
      f"geometric mean of after/before: speedup {geomean(ratios):.3f}, candidate time {geomean(cand_ratios):.3f}, "
      f"baseline time {geomean(base_ratios):.3f}")
print("only in before:", sorted(set(before) - set(after)) or "none", "| only in after:",
      sorted(set(after) - set(before)) or "none")
