"""Quick GPU probe of the Gluon attention forward (sm_90) against SDPA and the pointer kernel: do_bench medians.

A first look before the A/B suite (``pytest tests/perf/test_gluon_ab.py --kernel-ab``, which tests the speedups):
causal, H=16, the cases of ``flashlite.cases`` asked for, every Gluon schedule (step 1 "pipelined", step 2 "ws",
step 3 "pingpong", each with and without the softmax/P V overlap; ``--all-configs``: every config listed, named by
its shape), each checked against SDPA before it is timed.
Usage: python scripts/gluon_probe.py [--cases 3,6,12] [--D 64,128] [--dtype bfloat16] [--variants pingpong]
       [--all-configs]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flashlite._attention.launch import attention_forward
from flashlite._attention.launch_gluon import configs_for, gluon_attention_forward
from flashlite.cases import CASES


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", default="3,6,12")
    p.add_argument("--D", default="64,128")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--variants", default="pipelined,ws,pingpong")
    p.add_argument("--all-configs", action="store_true")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    wanted = {int(c) for c in args.cases.split(",")}
    for head_dim in (int(d) for d in args.D.split(",")):
        schedules = {}  # the first config listed for each variant and overlap (or every config)
        for variant in args.variants.split(","):
            for config in configs_for(head_dim, variant):
                name = config.step + (" overlap" if config.overlap else "")
                name += " named" if config.named_barriers else ""
                if args.all_configs:
                    name = f"{config.step} {config.block_m}x{config.block_n}x{config.stages}w{config.num_warps}"
                    name += (" ov" if config.overlap else "") + (" nb" if config.named_barriers else "")
                schedules.setdefault(name, config)
        names = ["sdpa", "pointer"] + sorted(schedules)
        print(f"D={head_dim} {args.dtype} causal, ms (TFLOP/s)")
        print(f"{'case':>4} {'B':>3} {'S':>6} " + " ".join(f"{n:>22}" for n in names))
        for c in CASES:
            if c.number not in wanted:
                continue
            q, k, v = (torch.randn(c.B, c.H, c.S, head_dim, device="cuda", dtype=dtype) for _ in range(3))
            fns = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                   "pointer": lambda: attention_forward(q, k, v, None, None, 1, head_dim ** -0.5, precision)[0]}
            for name, config in schedules.items():
                fns[name] = (lambda config=config: gluon_attention_forward(q, k, v, causal=True,
                                                                           variant=config.variant, config=config)[0])
            expected = fns["sdpa"]().float()
            flops = 2.0 * c.B * c.H * c.S * c.S * head_dim  # causal: half of 4 B H S^2 D
            cells = []
            for name in names:
                err = (fns[name]().float() - expected).abs().max().item()
                if err > 0.1:
                    cells.append(f"{'wrong: ' + format(err, '.2g'):>22}")
                    continue
                ms = do_bench(fns[name], warmup=25, rep=100, return_mode="median")
                cells.append(f"{ms:12.3f} ({flops / ms / 1e9:6.1f})")
            print(f"{c.number:>4} {c.B:>3} {c.S:>6} " + " ".join(cells), flush=True)
            del q, k, v, fns, expected
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
