"""Side-by-side speedups and candidate times of A/B reports, keyed by test function, case and head dim.

Usage: python compare.py REPORT.json [REPORT.json ...]   (wrote run3_vs_d4_and_run6.txt)
"""
import json
import sys


def load(path):
    out = {}
    for record in json.load(open(path))["comparisons"]:
        shape = record["shape"]
        test = record["nodeid"].split("::")[1].split("[")[0]
        out[(test, shape["case"], shape["D"])] = (record["speedup"], record["candidate_ms"])
    return out


runs = [load(p) for p in sys.argv[1:]]
keys = sorted(set().union(*runs), key=lambda k: (k[2], k[1]))
print("D case | " + " | ".join(sys.argv[1:]))
for key in keys:
    cells = [("%.3fx cand %.4f ms" % run[key]) if key in run else "-" for run in runs]
    print(key[2], key[1], "|", " | ".join(cells))
