"""Render the report's plots of docs/kernelcheck.md from synthetic runs of 3 and 60 comparisons (the shapes and
speedups are drawn at random, not measured), so the pictures in the guide follow the plot code.

    PYTHONPATH=$PWD python docs/images/render.py docs/images/after
"""
import math
import random
import sys

from pytest_kernelcheck.results import plots, report
from pytest_kernelcheck.results.build import assemble_report
from pytest_kernelcheck.results.measured import ModeRecord

TESTS = ["test_dense_forward", "test_variants_forward", "test_decoding", "test_layer_training"]


def rows(count, seed=0):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        test = TESTS[i * len(TESTS) // count]
        B, S, D = rng.choice([1, 4, 16, 32]), rng.choice([128, 1024, 2048, 8192, 32768]), rng.choice([64, 128])
        dtype = rng.choice(["torch.bfloat16", "torch.float16"])
        causal = rng.choice([True, False])
        shape = {"B": B, "S": S, "H": 16, "D": D, "dtype": dtype, "causal": causal}
        ident = f"B{B}-S{S}-H16-D{D}-{dtype.split('.')[1]}-{'causal' if causal else 'nocausal'}"
        speedup = math.exp(rng.gauss(0.0, 0.15))
        width = rng.choice([0.005, 0.01, 0.03, 0.2])
        ci = [speedup * math.exp(-width), speedup * math.exp(width)]
        low, high = ci
        verdict = ("tie" if low >= 1 / 1.02 and high <= 1.02 else "win" if low > 1 else "loss" if high < 1
                   else "inconclusive")
        flops = 4 * B * 16 * S * S * D / (2 if causal else 1)
        nbytes = 4 * B * 16 * S * D * 2
        cand_ms, base_ms = 1.0 / speedup, 1.0
        if i % 17 == 5:  # a row whose medians disagree with its paired speedup
            cand_ms, base_ms = 1.9, 0.8
        modes = []
        if i % 13 == 2:  # a row that wins back to back and loses from an idle GPU: its modes disagree
            speedup, ci, verdict = 1.04, [1.02, 1.06], "win"
            cand_ms = 1.0 / speedup
            modes = [ModeRecord("throughput", "win", 1.04, (1.02, 1.06)).to_json(),
                     ModeRecord("latency", "loss", 0.88, (0.85, 0.91)).to_json()]
        out.append({
            "kind": "comparison", "nodeid": f"tests/perf/test_attention_ab.py::{test}[{ident}]",
            "name": f"flashlite vs sdpa {test.removeprefix('test_').replace('_', ' ')}", "shape": shape,
            "verdict": verdict, "speedup": speedup, "ci": ci, "p_value": 0.001, "p_value_raw": 0.0001,
            "ceiling": {"device": "NVIDIA H200", "dtype": "bfloat16", "tflops": 700.0, "gbps": 4000.0},
            "modes": modes, "candidate_ms": cand_ms, "baseline_ms": base_ms, "method": "events", "margin": 0.02,
            "throughput": {
                "candidate": {"flops": flops, "bytes": nbytes, "tflops": flops / (cand_ms * 1e-3) / 1e12,
                              "gbps": nbytes / (cand_ms * 1e-3) / 1e9, "intensity": flops / nbytes},
                "baseline": {"flops": flops, "bytes": nbytes, "tflops": flops / (base_ms * 1e-3) / 1e12,
                             "gbps": nbytes / (base_ms * 1e-3) / 1e9, "intensity": flops / nbytes},
            },
        })
    return out


prefix = sys.argv[1]
for count in (3, 60):
    built = assemble_report(rows(count), settings={"margin": 0.02})
    print(count, report.write_plot(built, f"{prefix}_{count}.png"),
          plots.write_roofline(built, f"{prefix}_roofline_{count}.png"))
