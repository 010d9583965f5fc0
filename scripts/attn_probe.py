"""Quick GPU probe of flashlite's attention against SDPA: median times per case, forward and backward.

A tuning aid, not the A/B suite (that is ``pytest tests/perf --kernel-ab``): one do_bench median per point.
``--kernels`` lists, per case and side, each GPU kernel's time per call and its share (torch.profiler, 10 calls):
which of flashlite's kernels (forward, dQ, dK/dV) hold the time against which of SDPA's.
Usage: python scripts/attn_probe.py [--cases 1,3,9] [--dtype bfloat16] [--D 64] [--backward] [--kernels]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flashlite.attention import attention
from flashlite.cases import CASES
from layer_profile import kernel_times  # scripts/ is on sys.path when this runs as a script


def print_kernels(label: str, fn) -> None:
    """Each GPU kernel's time per call and share of the total (``layer_profile.kernel_times``, 10 calls)."""
    total, rows = kernel_times(fn)
    print(f"     {label}: {total:9.1f} us of GPU time per call")
    for name, us, launches in rows[:6]:
        print(f"       {us:9.1f} us {us / total:6.1%} x{launches:<2d} {name[:100]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="1,2,3,5,6,7,8,9,10,11")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--kernels", action="store_true", help="each side's GPU kernels per call (torch.profiler)")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    wanted = {int(c) for c in args.cases.split(",")}
    print(f"{'case':>4} {'B':>4} {'S':>6} {'triton ms':>10} {'sdpa ms':>10} {'speedup':>8} {'TFLOP/s':>8}")
    for c in CASES:
        if c.number not in wanted:
            continue
        q, k, v = (torch.randn(c.B, c.H, c.S, args.D, device="cuda", dtype=dtype, requires_grad=args.backward)
                   for _ in range(3))
        flops = 2.0 * c.B * c.H * c.S * c.S * args.D * (3.5 if args.backward else 1.0)
        if args.backward:
            g = torch.randn_like(q)
            tri = lambda: torch.autograd.grad(attention(q, k, v, causal=True, backend="triton"), (q, k, v), g)  # noqa
            ref = lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)  # noqa
        else:
            tri = lambda: attention(q, k, v, causal=True, backend="triton")  # noqa: E731
            ref = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
        t = do_bench(tri, warmup=25, rep=100, return_mode="median")
        s = do_bench(ref, warmup=25, rep=100, return_mode="median")
        print(f"{c.number:>4} {c.B:>4} {c.S:>6} {t:10.4f} {s:10.4f} {s / t:8.2f} {flops / t / 1e9:8.1f}", flush=True)
        if args.kernels:
            print_kernels("flashlite", tri)
            print_kernels("sdpa", ref)
        del q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
