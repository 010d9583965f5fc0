"""Wall time of one attention training call (forward and backward) through flashlite against SDPA called directly.

At small sizes a forward+backward call is bound by host time (Python, autograd's engine, launches), so this
measures what flashlite's front end adds to a call whose gradient is computed: ``attention(backend="auto")`` (its
plan replayed; where the forward and forward+backward decisions differ, the plan picks per call),
``attention(backend="sdpa")`` (the plan of SDPA alone) and SDPA itself, on the same inputs. Each sample is the mean
of ``CALLS`` back-to-back calls and one synchronisation; the three are sampled in turn, ``ROUNDS`` times, and the
median per call and the median difference to SDPA are printed (microseconds). Forward-only calls (no gradient) are
timed the same way. Without CUDA it times float32 CPU tensors (default 1 2 8 16: host time dominates there too),
with one more row, the plan's ``run`` called directly, which separates the plan's own call from the replay around it.

Usage: python scripts/gradient_call_host_probe.py [B S H D ...]   (default on a GPU: 1 128 16 64 and 1 1024 16 64,
bf16; on the CPU: 1 2 8 16, float32)

Example:
    python scripts/gradient_call_host_probe.py 1 128 16 64
"""
from __future__ import annotations

import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashlite
from flashlite._attention import plans

CALLS = 50
ROUNDS = 40


CUDA = torch.cuda.is_available()
DEVICE, DTYPE = ("cuda", torch.bfloat16) if CUDA else ("cpu", torch.float32)


def _sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def _sample(fn) -> float:
    _sync()
    start = time.perf_counter()
    for _ in range(CALLS):
        fn()
    _sync()
    return (time.perf_counter() - start) / CALLS * 1e6


def _probe(B: int, S: int, H: int, D: int) -> None:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, device=DEVICE, dtype=DTYPE, generator=gen).requires_grad_()
               for _ in range(3))
    grad_out = torch.randn_like(q)

    def training(call):
        def step():
            q.grad = k.grad = v.grad = None
            call().backward(grad_out)
        return step

    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "flashlite sdpa": lambda: flashlite.attention(q, k, v, causal=True, backend="sdpa"),
        "flashlite auto": lambda: flashlite.attention(q, k, v, causal=True),
    }
    if not CUDA:  # the SDPA plan's run itself, without the replay (attention() has made the plan above)
        flashlite.attention(q, k, v, causal=True, backend="sdpa")
        plan = plans._PLANS[plans.key_of(q, k, v, None, None, True, None, "sdpa", None)]
        calls["plan.run (sdpa)"] = lambda: plan.run(q, k, v, None)
    print(f"B={B} S={S} H={H} D={D} {DTYPE}: auto decides {flashlite.explain_dispatch(q, k, v, causal=True)}")
    for mode in ("forward+backward", "forward"):
        fns = {name: (training(call) if mode == "forward+backward" else call) for name, call in calls.items()}
        samples: dict[str, list[float]] = {name: [] for name in fns}
        with torch.set_grad_enabled(mode == "forward+backward"):
            for fn in fns.values():  # warm-up: plans made, kernels compiled
                for _ in range(20):
                    fn()
            for _ in range(ROUNDS):
                for name, fn in fns.items():
                    samples[name].append(_sample(fn))
        base = samples["sdpa"]
        for name, values in samples.items():
            diff = statistics.median(a - b for a, b in zip(values, base))
            print(f"  {mode:17s} {name:16s} median {statistics.median(values):8.2f} us per call, "
                  f"{diff:+7.2f} us against SDPA (median of {ROUNDS} paired samples of {CALLS} calls)")


def main() -> None:
    args = [int(a) for a in sys.argv[1:]] or ([1, 128, 16, 64, 1, 1024, 16, 64] if CUDA else [1, 2, 8, 16])
    if len(args) % 4:
        raise SystemExit("shapes are given as B S H D, four integers each")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if CUDA else platform.processor() or 'CPU'}")
    for i in range(0, len(args), 4):
        _probe(*args[i:i + 4])


if __name__ == "__main__":
    main()
