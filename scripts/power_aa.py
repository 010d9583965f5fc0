"""GPU check of the A/B engine's honesty and power: A/A false-verdict rates (idle and under a duty-cycled load) and
how often a real 1% difference is found as a win, all at the default time budget.

A/A: two callables doing identical work (a 4095^3 bf16 matmul, about 0.2 ms; and a small SDPA call, about 20 us,
which the engine batches) must give a tie or an inconclusive verdict, never a win or a loss; the false rate must stay
within alpha (0.05) over all comparisons. Half of them run while a second process loads the same GPU half the time
(matmuls for 0.5 s, idle for 0.5 s), with ``throttle="discard"`` and the default ``"flag"``.

Power: SDPA, bf16, non-causal, B=1 H=16 S_q=1024 D=64, over 12,800 keys against 12,928 (100 and 101 key blocks of
128: 1% more work in the same kernel, about 0.13 ms), with ``margin=0.005`` (at the default 2% margin a 1%
difference is a tie by design). The shorter call must be found a win in at least 90% of runs.

Usage: python scripts/power_aa.py [--aa 100] [--power 30]   (needs CUDA; nvidia-ml-py for the clock record)
Prints one line per comparison and a summary last.
"""
from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import time

import torch
import torch.nn.functional as F

from pytest_kernelcheck.ab import Budget, run_comparison


def duty_cycled_load(stop: "mp.synchronize.Event", n: int, on_s: float, off_s: float) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        end = time.perf_counter() + on_s
        while time.perf_counter() < end:
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()
        time.sleep(off_s)


def aa_pairs():
    x = torch.randn(4095, 4095, device="cuda", dtype=torch.bfloat16)
    q, k, v = (torch.randn(4, 16, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    return {
        "matmul 4095^3": ((lambda: x @ x), (lambda: x @ x)),
        "sdpa 4x16x512x64": ((lambda: F.scaled_dot_product_attention(q, k, v)),
                             (lambda: F.scaled_dot_product_attention(q, k, v))),
    }


def run_aa(count: int, condition: str, policy: str, tally: collections.Counter) -> None:
    pairs = aa_pairs()
    for index in range(count):
        label = list(pairs)[index % len(pairs)]
        one, two = pairs[label]
        try:
            r = run_comparison(one, two, Budget(throttle=policy), name=f"A/A {label}")
            verdict = r.verdict
            detail = (f"{r.speedup:.4f}x [{r.ci[0]:.4f}, {r.ci[1]:.4f}] n={r.n_pairs} "
                      f"throttled={r.throttled} {r.elapsed_s:.2f}s")
        except Exception as exc:  # a policy that refuses throttled rounds raises: that is not a false verdict
            verdict, detail = "error", f"{type(exc).__name__}: {str(exc)[:100]}"
        tally[(condition, policy, verdict)] += 1
        print(f"A/A {condition:6} {policy:7} {index:3} {label:18} {verdict:12} {detail}", flush=True)


def run_power(count: int, tally: collections.Counter) -> None:
    q = torch.randn(1, 16, 1024, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, 16, 12928, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k_short, v_short = k[:, :, :12800], v[:, :, :12800]
    shorter = lambda: F.scaled_dot_product_attention(q, k_short, v_short)  # noqa: E731
    longer = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
    for index in range(count):
        r = run_comparison(shorter, longer, Budget(margin=0.005), name="1% less work")
        tally[r.verdict] += 1
        tally["elapsed"] += r.elapsed_s
        print(f"power {index:3} {r.verdict:12} {r.speedup:.4f}x [{r.ci[0]:.4f}, {r.ci[1]:.4f}] n={r.n_pairs} "
              f"median candidate {r.candidate_ms * 1e3:.1f} us {r.elapsed_s:.2f}s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--aa", type=int, default=100, help="A/A comparisons per condition (idle, loaded)")
    p.add_argument("--power", type=int, default=30, help="runs of the 1%% difference")
    args = p.parse_args()
    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | default budget {Budget()}", flush=True)
    aa, power = collections.Counter(), collections.Counter()
    run_power(args.power, power)
    run_aa(args.aa, "idle", "flag", aa)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    worker = ctx.Process(target=duty_cycled_load, args=(stop, 8192, 0.5, 0.5), daemon=True)
    worker.start()
    time.sleep(3.0)
    try:
        run_aa(args.aa // 2, "loaded", "flag", aa)
        run_aa(args.aa - args.aa // 2, "loaded", "discard", aa)
    finally:
        stop.set()
        worker.join(timeout=30)
    print("\nsummary")
    total = sum(n for (_, _, verdict), n in aa.items())
    false = sum(n for (_, _, verdict), n in aa.items() if verdict in ("win", "loss"))
    for key in sorted(aa):
        print(f"  A/A {key[0]:6} {key[1]:7} {key[2]:12} {aa[key]}")
    print(f"  A/A false verdicts: {false} of {total} ({false / max(total, 1):.1%}; alpha 5%)")
    runs = args.power
    print(f"  1% difference: {power['win']} wins of {runs} ({power['win'] / max(runs, 1):.0%}; target 90%), "
          f"{dict((k, v) for k, v in power.items() if k != 'elapsed')}, mean {power['elapsed'] / max(runs, 1):.2f} s "
          f"per comparison")


if __name__ == "__main__":
    main()
