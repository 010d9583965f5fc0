"""Per-call host cost and pure GPU time of attention paths on small shapes (CUDA only; a tuning aid).

Host cost: wall time per call over many back-to-back calls (the GPU queue never drains when the host is the
bottleneck, so this is what an eager caller pays). GPU time: CUDA-graph replay of 20 calls, timed with events.
Usage: python scripts/overhead_probe.py
"""
from __future__ import annotations

import importlib
import time

import torch
import torch.nn.functional as F

attn_mod = importlib.import_module("flashlite._attention.api")
attn_launch = importlib.import_module("flashlite._attention.launch")
attn_ops = importlib.import_module("flashlite._attention.ops")
attn_plans = importlib.import_module("flashlite._attention.plans")


def host_us(fn, n: int = 400) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def graph_us(fn, n: int = 20) -> float:
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(10):
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / n)
    return best


def main() -> None:
    print(f"plan key in {'C++' if attn_plans.fast_signature is not attn_plans.signature else 'Python'}", flush=True)
    for B, S in ((1, 128), (64, 256), (128, 128), (256, 64)):
        q, k, v = (torch.randn(B, 16, S, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        attn_mod.attention(q, k, v, causal=True, backend="triton")
        attn_mod.attention(q, k, v, causal=True, backend="triton")  # records the plan's launch
        # The key attention() uses: C++ where flashlite._native built, the Python one otherwise (same arguments).
        key = attn_plans.fast_signature(q, k, v, None, None, True, None, "triton", None, None, None, None)
        plan = attn_plans._PLANS[key]
        problem = plan.problem
        args = (q, k, v, None, None, 1, problem.scale, problem.precision)
        auto_key = attn_plans.fast_signature(q, k, v, None, None, True, None, "auto", None, None, None, None)
        paths = {
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
            "attention(triton)": lambda: attn_mod.attention(q, k, v, causal=True, backend="triton"),
            "attention(auto)": lambda: attn_mod.attention(q, k, v, causal=True, backend="auto"),
            "custom op": lambda: attn_ops.attention_forward_op(*args),
            "launcher only": lambda: attn_launch.launch_forward(q, k, v, None, None, plan,
                                                                     need_lse=False),
            "plan key + lookup": lambda: attn_plans._PLANS.get(attn_plans.fast_signature(
                q, k, v, None, None, True, None, "auto", None, None, None, None)),
            "replay (key+lookup+run)": lambda: attn_plans.replay(
                attn_plans._PLANS, attn_plans.replay_by_python_key, q, k, v, None, None, True, None, "auto", None,
                None, None, None),
            "Python key only": lambda: attn_plans.signature(q, k, v, None, None, True, None, "auto", None),
            "dict lookup only": lambda: attn_plans._PLANS.get(auto_key),
            "two torch.empty": lambda: (torch.empty((B, 16, S, 64), dtype=q.dtype, device=q.device),
                                        torch.empty((B, 16, S), dtype=torch.float32, device=q.device)),
        }
        recorded = plan.recorded.get("inference")
        out = torch.empty_like(q)
        if recorded is not None:
            # The kernel's Q, K, V, Out, Lse, KeyMask, KeyLen, Alibi, CuSeqQ, CuSeqK, BlockTable, as the
            # launcher passes them for an inference call without masks or variants (unused slots take q).
            paths["recorded launch only"] = lambda: recorded.launch(q, k, v, out, out, q, q, q, q, q, q)
        for name, fn in paths.items():
            host = host_us(fn)
            try:
                gpu = f"{graph_us(fn):8.1f}"
            except Exception:  # host-only steps (no kernel) cannot be captured in a graph, and some paths refuse it
                gpu = "       -"
            print(f"B={B:<4} S={S:<4} {name:>20}: host {host:8.2f} us/call, GPU {gpu} us/call", flush=True)


if __name__ == "__main__":
    main()
