"""The attention calls that Nsight Compute (ncu) profiles: each side warmed up, then one call of each inside the
profiler's range, so that ``ncu --profile-from-start off`` collects exactly their kernels (no autotuning or compile
launches, no warm-up calls).

Sides: "flashlite" (``attention(backend="triton")``: the Gluon forward and backward where their rules dispatch
them, ``FLASHLITE_GLUON=0`` none) and "sdpa" (``F.scaled_dot_product_attention``'s default, cuDNN on an H200).
bf16, causal, H=16, one case of ``flashlite.cases``; ``--backward``: forward and backward in one call.

Usage, on a GPU (``tools/ncu_summary.py`` reads the report):
    ncu --profile-from-start off --clock-control none --section SpeedOfLight --section WarpStateStats \
        -o REPORT python3 tools/ncu_attention.py --D 128 --case 6 [--backward] [--sides flashlite,sdpa]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from flashlite.attention import attention
from flashlite.cases import CASES

SIDES = ("flashlite", "sdpa")


def call_for(side: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor | None):
    """One call of ``side``: the forward, or with ``grad`` the forward and its backward."""
    def forward():
        if side == "flashlite":
            return attention(q, k, v, causal=True, backend="triton")
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    if grad is None:
        return forward
    return lambda: torch.autograd.grad(forward(), (q, k, v), grad)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--case", type=int, default=6)
    p.add_argument("--backward", action="store_true")
    p.add_argument("--sides", default=",".join(SIDES))
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    sides = args.sides.split(",")
    unknown = sorted(set(sides) - set(SIDES))
    if unknown:
        p.error(f"--sides: unknown {unknown}; choose from {SIDES}")
    case = next((c for c in CASES if c.number == args.case), None)
    if case is None:
        p.error(f"--case: no case {args.case}; the cases are {[c.number for c in CASES]}")
    torch.manual_seed(0)
    q, k, v = (torch.randn(case.B, case.H, case.S, args.D, device="cuda", dtype=torch.bfloat16,
                           requires_grad=args.backward) for _ in range(3))
    grad = torch.randn_like(q) if args.backward else None
    calls = {side: call_for(side, q, k, v, grad) for side in sides}
    for call in calls.values():
        for _ in range(args.warmup):
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled: case {case.number} (B={case.B}, H={case.H}, S={case.S}), D={args.D}, "
          f"{'forward+backward' if args.backward else 'forward'}, sides {sides}")


if __name__ == "__main__":
    main()
