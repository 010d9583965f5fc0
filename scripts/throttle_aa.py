"""GPU check of --kernel-ab-throttle: A/A comparisons while another process loads the same GPU.

Each run compares one matmul with itself (two callables, identical work) under each throttle policy, first on an
idle GPU, then while a background process keeps the GPU busy with large matmuls (power and heat lower the SM clock).
An A/A pair should never be a win or a loss; the table shows what each policy made of the throttled rounds.
Usage: python scripts/throttle_aa.py [--runs 5] [--n 4095] [--max-time 2.0]   (needs CUDA and nvidia-ml-py)
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import time

import torch

from pytest_kernelcheck.ab import Budget, run_comparison


def background_load(stop: "mp.synchronize.Event", n: int) -> None:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    while not stop.is_set():
        for _ in range(50):
            a @ a
        torch.cuda.synchronize()


def run(policy: str, n: int, max_time: float) -> str:
    x = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    one, two = (lambda: x @ x), (lambda: x @ x)
    try:
        r = run_comparison(one, two, Budget(max_time=max_time, throttle=policy))
    except Exception as exc:  # fail (and discard with nothing left) raise: that is their verdict
        return f"{type(exc).__name__}: {str(exc)[:90]}"
    clock = r.clock.get("sm_clock_mhz", {})
    dropped = (r.clock.get("throttle") or {}).get("dropped_rounds", 0)
    return (f"{r.verdict:12} {r.speedup:.3f}x n={r.n_pairs:5} throttled={r.throttled!s:5} dropped={dropped:5} "
            f"clock min/highest {clock.get('min')}/{clock.get('session_highest')} MHz")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--n", type=int, default=4095)  # odd: no shape the libraries special-case
    p.add_argument("--max-time", type=float, default=2.0)
    args = p.parse_args()
    for loaded in (False, True):
        stop, worker = mp.get_context("spawn").Event(), None
        if loaded:
            worker = mp.get_context("spawn").Process(target=background_load, args=(stop, 8192), daemon=True)
            worker.start()
            time.sleep(5.0)  # let the load heat the GPU and settle its clock
        for policy in ("flag", "discard", "fail"):
            for index in range(args.runs):
                print(f"{'loaded' if loaded else 'idle':6} {policy:7} run {index}: {run(policy, args.n, args.max_time)}",
                      flush=True)
        if worker is not None:
            stop.set()
            worker.join(timeout=30)


if __name__ == "__main__":
    main()
