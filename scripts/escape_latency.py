"""GPU check of the escape check's thresholds (pytest_kernelcheck.escape): events against synchronised time.

Prints, per callable, the medians the check compares and whether it would fail the comparison: a tiny kernel and a
host-bound loop (launch and synchronisation latency alone: the gap must stay under ESCAPE_FLOOR_S), a 1 ms matmul,
work joined back from a side stream (seen), and work left on a side stream or launched from a thread (escaped).
Usage: python scripts/escape_latency.py [--n 2047]   (needs CUDA)
"""
from __future__ import annotations

import argparse
import threading

import torch

from pytest_kernelcheck import escape


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=2047)
    args = p.parse_args()
    x = torch.randn(args.n, args.n, device="cuda")
    small = torch.randn(1023, device="cuda")
    side = torch.cuda.Stream()

    def unjoined() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            x @ x

    def joined() -> None:
        unjoined()
        torch.cuda.current_stream().wait_stream(side)

    thread_stream = torch.cuda.Stream()

    def on_thread() -> None:
        with torch.cuda.stream(thread_stream):
            x @ x

    def threaded() -> None:  # launches from a thread on its own stream and returns without waiting for it
        threading.Thread(target=on_thread).start()

    cases = {
        "tiny kernel": lambda: small.add_(1), "host-bound loop": lambda: [small.add_(1) for _ in range(41)],
        "1 ms matmul": lambda: x @ x, "side stream, joined": joined, "side stream, unjoined": unjoined,
        "thread, own stream": threaded,
    }
    probe = escape.CudaEscapeProbe(x.device)
    for name, fn in cases.items():
        for _ in range(3):
            fn()  # warm-up: cuBLAS handles, streams
        for repeat in (1, 25):
            events = sorted(probe.event_time(fn, repeat) for _ in range(escape.ESCAPE_ROUNDS))
            synced = sorted(probe.synced_time(fn, repeat) for _ in range(escape.ESCAPE_ROUNDS))
            times = escape.EscapeTimes(name, events[len(events) // 2], synced[len(synced) // 2])
            # The control: a spin kernel as long as the events saw, on the timed stream (what the check runs
            # before it fails a comparison).
            gaps = sorted(max(b - a, 0.0) for a, b in (probe.control_times(times.event_s)
                                                        for _ in range(escape.ESCAPE_ROUNDS)))
            checked = escape.EscapeTimes(name, times.event_s, times.synced_s, gaps[len(gaps) // 2])
            print(f"{name:22} x{repeat:<3} events {times.event_s * 1e6:9.1f} us  synced {times.synced_s * 1e6:9.1f} us  "
                  f"gap {(times.synced_s - times.event_s) * 1e6:8.1f} us  control gap {checked.control_gap_s * 1e6:7.1f}"
                  f" us  {'ESCAPED' if checked.escaped else 'ok'}")


if __name__ == "__main__":
    main()
