"""Probe: the TMA forward kernel with and without Triton's automatic warp specialization, against the pointer
kernel and SDPA (CUDA only; a tuning aid, not the A/B suite).

For each case and head dim: max |out - SDPA| as a sanity check, then one ``do_bench`` median per path.
Usage: python scripts/ws_probe.py [--cases 3,6,12] [--dims 64,128]
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from flashlite.attention import attention
from flashlite.cases import CASES
from flashlite.kernels.attention_fwd_tma import attention_forward_tma

CONFIGS = [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 8, 2)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="3,6,12")
    parser.add_argument("--dims", default="64,128")
    args = parser.parse_args()
    wanted = {int(c) for c in args.cases.split(",")}
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    for head_dim in (int(d) for d in args.dims.split(",")):
        for case in (c for c in CASES if c.number in wanted):
            q, k, v = (torch.randn(case.B, case.H, case.S, head_dim, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            flops = 2.0 * case.B * case.H * case.S * case.S * head_dim  # causal: half of 4*B*H*S^2*D
            ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            paths = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                     "pointer kernel": lambda: attention(q, k, v, causal=True, backend="triton")}
            for config in CONFIGS:
                for ws in (False, True):
                    paths[f"tma {config} ws={int(ws)}"] = (
                        lambda config=config, ws=ws: attention_forward_tma(
                            q, k, v, causal_mode=1, scale=1 / math.sqrt(head_dim), config=config,
                            warp_specialize=ws)[0])
            base = None
            for name, fn in paths.items():
                try:
                    err = (fn().float() - ref.float()).abs().max().item()
                    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
                except Exception as exc:  # a config that does not compile: report and go on
                    print(f"case {case.number} D={head_dim} {name:>32}: failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:120] if str(exc) else ''}", flush=True)
                    continue
                base = ms if name == "sdpa" else base
                print(f"case {case.number} D={head_dim} {name:>32}: {ms:9.4f} ms  {flops / ms / 1e9:6.1f} TFLOP/s  "
                      f"sdpa/this {base / ms:5.3f}  max|diff| {err:.2e}", flush=True)
            del q, k, v, ref
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
