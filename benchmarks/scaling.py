"""How attention cost grows: sweep S at a fixed token count B*S, and B at a fixed S (CUDA only).

For flashlite's kernel, SDPA's default backend and, where it fits, a materialized reference, records the median
time (triton.testing.do_bench, L2 flushed, CUDA events), TFLOP/s, the percentage of the bf16 matmul ceiling measured
in the same run, and peak memory above the inputs. Writes JSON and a PNG plot.

Usage: python benchmarks/scaling.py OUTDIR [--tokens 65536] [--quick] [--plot-only]
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
from pathlib import Path

import torch
import torch.nn.functional as F


def matmul_ceiling_tflops(n: int = 8192) -> float:
    """bf16 n^3 matmul rate on this GPU right now: the ceiling attention's percentages refer to."""
    from triton.testing import do_bench

    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=25, rep=200, return_mode="median")
    return 2 * n**3 / (ms * 1e-3) / 1e12


def materialized(q, k, v):
    scores = (q @ k.transpose(-2, -1)).float() / math.sqrt(q.shape[-1])
    mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return (torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).to(q.dtype)) @ v


def measure(fn, inputs_bytes: int) -> dict:
    from triton.testing import do_bench

    fn()  # compile and autotune first: the autotuner's own L2-flush buffer (256 MiB) is not the call's memory
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    ms = do_bench(fn, warmup=25, rep=100, return_mode="median")
    return {"ms": ms, "peak_extra_bytes": int(peak), "inputs_bytes": inputs_bytes}


def sweep(sweep_name: str, points, H: int, D: int, dtype, ceiling: float, rows: list[dict], save) -> None:
    """Measure each (B, S) point of sweep ``sweep_name``; append one row per implementation to ``rows`` and call
    ``save`` after each."""
    from flashlite.attention import attention

    for B, S in points:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=dtype) for _ in range(3))
        flops = 2.0 * B * H * S * S * D  # causal: half of 4*B*H*S*S*D
        inputs = 3 * q.numel() * q.element_size()
        impls = {
            "flashlite": lambda: attention(q, k, v, causal=True, backend="triton"),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        }
        # fp32 scores plus softmax output: keep the materialized reference to what fits comfortably.
        if B * H * S * S * 4 * 3 < 40e9:
            impls["materialized"] = lambda: materialized(q, k, v)
        for impl, fn in impls.items():
            r = measure(fn, inputs)
            r.update(sweep=sweep_name, impl=impl, B=B, S=S, H=H, D=D, dtype=str(dtype).removeprefix("torch."),
                     tflops=flops / (r["ms"] * 1e-3) / 1e12)
            r["pct_of_matmul_ceiling"] = 100 * r["tflops"] / ceiling
            rows.append(r)
            save()
            print(f"{impl:>12} B={B:<4} S={S:<6} {r['ms']:9.4f} ms {r['tflops']:7.1f} TFLOP/s "
                  f"{r['pct_of_matmul_ceiling']:5.1f}% peak+{r['peak_extra_bytes'] / 2**20:9.1f} MiB", flush=True)
        del q, k, v
        torch.cuda.empty_cache()


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    for col, (sweep_name, x_key) in enumerate((("fixed_tokens", "S"), ("fixed_S", "B"))):
        sub = [r for r in rows if r["sweep"] == sweep_name]
        for impl in sorted({r["impl"] for r in sub}):
            pts = sorted((r[x_key], r["ms"], r["peak_extra_bytes"] / 2**20) for r in sub if r["impl"] == impl)
            axes[0][col].loglog([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl, base=2)
            axes[1][col].loglog([p[0] for p in pts], [max(p[2], 1e-3) for p in pts], "o-", label=impl, base=2)
        title = "fixed B*S tokens" if sweep_name == "fixed_tokens" else f"fixed S={sub[0]['S'] if sub else '?'}"
        axes[0][col].set(title=f"time, {title}", xlabel=x_key, ylabel="ms (median)")
        axes[1][col].set(title=f"peak memory above inputs, {title}", xlabel=x_key, ylabel="MiB")
        for ax in axes[:, col]:
            ax.legend()
            ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--quick", action="store_true", help="fewer points")
    parser.add_argument("--plot-only", action="store_true", help="redraw OUTDIR/scaling.png from OUTDIR/scaling.json")
    args = parser.parse_args()
    if args.plot_only:
        plot(json.loads((args.outdir / "scaling.json").read_text())["rows"], args.outdir / "scaling.png")
        return
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/scaling.py measures GPU speed and needs a CUDA GPU")
    args.outdir.mkdir(parents=True, exist_ok=True)
    H, D, dtype = 16, 64, torch.bfloat16
    ceiling = matmul_ceiling_tflops()
    print(f"bf16 matmul ceiling measured now: {ceiling:.0f} TFLOP/s")
    seqs = [256, 1024, 4096, 16384, 65536] if args.quick else [128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                                                   32768, 65536]
    fixed_tokens = [(max(1, args.tokens // S), S) for S in seqs]
    batches = [1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128]
    import triton

    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "python": platform.python_version(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
           "bf16_matmul_ceiling_tflops": ceiling, "tokens": args.tokens, "quick": args.quick}
    rows: list[dict] = []

    def save() -> None:
        (args.outdir / "scaling.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))

    sweep("fixed_tokens", fixed_tokens, H, D, dtype, ceiling, rows, save)
    sweep("fixed_S", [(B, 2048) for B in batches], H, D, dtype, ceiling, rows, save)
    plot(rows, args.outdir / "scaling.png")
    print(f"wrote {args.outdir / 'scaling.json'} and scaling.png")


if __name__ == "__main__":
    main()
