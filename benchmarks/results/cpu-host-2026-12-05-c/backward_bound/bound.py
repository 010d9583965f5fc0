"""The backward kernels of run T1 against their tensor-core bound: how much of each kernel's time its matrix
products need at full rate, for flashlite's two kernels (dK/dV: four products per tile pair; dQ: three) and cuDNN's
one (five, dQ accumulated in float32 and converted after).

Work per kernel: each product of a 1,024-score tile at head dim D is 1,024 x D multiply-adds,
and an H100/H200 SM does 2,048 bf16 multiply-adds per cycle (989 dense TFLOP/s over 132 SMs at 1.83 GHz). Scores:
S (S + 1) / 2 per head, causal, for every kernel alike. Cycles at 1.98 GHz, the H200's top clock, so each fraction
is a lower bound. Kernel times: torch.profiler, GPU time per forward+backward call, from
benchmarks/results/h200-2026-12-05-b/t1_replay_kernels_guards_host/bwd_kernels_d{64,128}.txt.

Run from anywhere: python bound.py
"""
CLOCK_HZ, SMS, MULADDS_PER_CYCLE = 1.98e9, 132, 2048
# case: (B, H, S); kernel times in microseconds per (D, case): name -> (products per tile pair, time)
CASES = {3: (1, 16, 8192), 6: (8, 16, 4096)}
T1 = {
    (64, 3): {"flashlite dK/dV": (4, 596.5), "flashlite dQ (with delta)": (3, 379.6),
              "cuDNN bprop": (5, 845.2)},
    (64, 6): {"flashlite dK/dV": (4, 1216.4), "flashlite dQ (with delta)": (3, 750.4),
              "cuDNN bprop": (5, 1726.1)},
    (128, 3): {"flashlite dK/dV": (4, 1150.0), "flashlite dQ (with delta)": (3, 766.9),
               "cuDNN bprop": (5, 1374.3)},
    (128, 6): {"flashlite dK/dV": (4, 2263.8), "flashlite dQ (with delta)": (3, 1562.2),
               "cuDNN bprop": (5, 2644.9)},
}
for (head_dim, case), kernels in T1.items():
    batch, heads, seq = CASES[case]
    scores = batch * heads * seq * (seq + 1) // 2
    print(f"D={head_dim}, case {case} (B={batch}, H={heads}, S={seq}):")
    totals = {}
    for name, (products, us) in kernels.items():
        bound_us = scores * head_dim * products / MULADDS_PER_CYCLE / SMS / CLOCK_HZ * 1e6
        side = name.split()[0]
        totals.setdefault(side, [0, 0.0, 0.0])
        totals[side][0] += products
        totals[side][1] += bound_us
        totals[side][2] += us
        print(f"  {name}: {products} products, {us:,.1f} us; bound {bound_us:,.1f} us = {bound_us / us:.0%}")
    for side, (products, bound_us, us) in totals.items():
        print(f"  {side} backward: {products} products, {us:,.1f} us; bound {bound_us:,.1f} us = {bound_us / us:.0%}")
    ours, theirs = totals["flashlite"][2], totals["cuDNN"][2]
    print(f"  cuDNN / flashlite backward time: {theirs / ours:.3f} (5/7 = {5 / 7:.3f}: equal rates per product)")
