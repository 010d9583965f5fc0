"""Instruction mix of the Gluon forward's inner loops for sm_90 (machine code compiled on a machine without a
GPU), set against what the tensor cores and the exponential unit need for the same scores: an issue model.

For each listed config of the dispatched variants (D=128: "pingpong", step 3; D=64: "pipelined", step 1), bf16,
causal top-left: registers, and per innermost loop holding wgmma (HGMMA) the static counts of HGMMA, MUFU.EX2,
FFMA, FMUL, FADD, FMNMX, F2FP (packs to 16 bits), the warpgroup waits, barriers (BAR, SYNCS: mbarrier operations)
and all instructions. Then, per 1,024 scores of one SM, in SM clock cycles:
- issue: warp instructions / 4 (an SM issues at most one warp instruction per cycle in each of its 4 schedulers);
- tensor: the two products of the tile, 2 x 1,024 x D multiply-adds at 2,048 bf16 multiply-adds per SM per cycle
  (989 dense bf16 TFLOP/s over 132 SMs at 1.83 GHz on an H100 SXM; the H200 has the same SMs);
- exp2: the exponentials at 16 per SM per cycle (the MUFU unit: 4 per scheduler).
A loop body runs once per iteration (the masked loop holds the diagonal blocks; the unmasked one every block left
of them). The model counts instructions, not their latencies or dependencies, so it gives lower bounds.

Run from the repository root: python <this file>.
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import GLUON_COMPILER  # noqa: E402

exec(GLUON_COMPILER)  # compile_gluon
import torch  # noqa: E402
import triton  # noqa: E402
from flashlite._attention import launch_gluon  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KINDS = {"HGMMA": r"\bHGMMA\.", "EX2": r"MUFU\.EX2", "FFMA": r"\bFFMA\b", "FMUL": r"\bFMUL\b",
         "FADD": r"\bFADD\b", "FMNMX": r"\bFMNMX\b", "F2FP": r"\bF2FP\b", "WG.DEPBAR": r"WARPGROUP\.DEPBAR",
         "BAR": r"\bBAR\.", "SYNCS": r"\bSYNCS\.", "SHFL": r"\bSHFL\b", "LDL/STL": r"\b(LDL|STL)\b"}
MULADDS_PER_CYCLE = 2048  # bf16 dense, per SM
EX2_PER_CYCLE = 16  # per SM


def _tool(name, cubin_bytes, *args):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(cubin_bytes)
        cubin.flush()
        return subprocess.run([os.path.join(BIN, name), *args, cubin.name], capture_output=True, text=True).stdout


def innermost_wgmma_loops(sass):
    lines = sass.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [re.match(r"^\.(L_x_\d+):", line.strip())] if m}
    spans = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA (?:`\()?\.(L_x_\d+)", line)
        if target and labels.get(target.group(1), len(lines)) < i:
            if any("HGMMA" in x for x in lines[labels[target.group(1)]:i + 1]):
                spans.append((labels[target.group(1)], i))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    for start, end in inner:
        body = [x for x in lines[start:end + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
        counts = {kind: sum(bool(re.search(pattern, x)) for x in body) for kind, pattern in KINDS.items()}
        counts["all"] = len(body)
        yield start, end, counts


def report(config, head_dim):
    q = torch.empty(2, 4, 300, head_dim, dtype=torch.bfloat16)
    lse = torch.empty(2, 4, 300)
    args, meta = launch_gluon.kernel_arguments(q, q, q, torch.empty_like(q), lse, 1, 0.125, config)
    options = {"num_warps": config.num_warps}
    if "maxnreg" in meta:
        options["maxnreg"] = meta["maxnreg"]
    kernel, registers, spills, serialized = compile_gluon(launch_gluon.kernel_for(config), args, meta, options)  # noqa: F821
    print(f"D={head_dim} {config.variant} {config.block_m}x{config.block_n} s{config.stages} w{config.num_warps}"
          f"{' overlap' if config.overlap else ''}: registers {registers}, spill bytes {spills}, "
          f"serialized {serialized}")
    # The warps that run one tile's loop: one consumer warpgroup in ping-pong, else the program's warps.
    loop_warps = config.num_warps
    tile = config.block_m * config.block_n
    tensor = 2 * 1024 * head_dim / MULADDS_PER_CYCLE
    for start, end, counts in innermost_wgmma_loops(_tool("nvdisasm", kernel.asm["cubin"], "-c")):
        if counts["HGMMA"] == 0:  # a span between two functions' labels, not a loop of this kernel's code
            continue
        per = {k: v * loop_warps * 1024 / tile for k, v in counts.items()}
        issue = per["all"] / 4
        exp2 = per["EX2"] * 32 / EX2_PER_CYCLE
        print(f"  loop {start}-{end}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
        print(f"    per 1,024 scores, SM cycles: issue {issue:.0f}, tensor {tensor:.0f}, exp2 {exp2:.0f}; warp "
              f"instructions {per['all']:.0f} (FP32 arithmetic {sum(per[k] for k in ('FFMA', 'FMUL', 'FADD', 'FMNMX')):.0f}, "
              f"EX2 {per['EX2']:.0f}, F2FP {per['F2FP']:.0f})")


for head_dim, variant in ((128, "pingpong"), (64, "pipelined")):
    for config in launch_gluon.configs_for(head_dim, variant):
        report(config, head_dim)


# The bounds against run T1's kernel times at case 6 (B=8, H=16, S=4096, causal; torch.profiler, GPU time per call;
# benchmarks/results/h200-2026-12-05-b/t1_replay_kernels_guards_host/bwd_kernels_d{64,128}.txt). Work is counted as
# the scores a causal row sees, S (S + 1) / 2 per head, for both kernels alike; cycles at 1.98 GHz, the H200's top
# clock (at a lower clock the bound takes longer, and each fraction below is higher).
CLOCK_HZ, SMS = 1.98e9, 132
T1_FORWARD_US = {64: {"flashlite _attn_fwd (step 1)": 628.5, "cuDNN fprop 64x128x64": 664.2},
                 128: {"flashlite _attn_fwd_pingpong (step 3)": 1064.7, "cuDNN fprop 64x128x128": 937.3}}
# The static bound per 1,024 scores of the dispatched config's unmasked loop (the first loop printed above for
# D=128 pingpong 64x128 s3 and D=64 pipelined 64x128 s2): max(issue, tensor, exp2) in SM cycles.
BOUND_CYCLES = {64: ("exp2", 66), 128: ("tensor", 128)}
scores = 8 * 16 * 4096 * 4097 // 2
print("\nCase 6 (B=8, H=16, S=4096, causal), run T1's forward kernel times against the static bound:")
for head_dim, kernels in T1_FORWARD_US.items():
    unit, cycles = BOUND_CYCLES[head_dim]
    bound_us = scores / 1024 * cycles / SMS / CLOCK_HZ * 1e6
    for name, us in kernels.items():
        print(f"  D={head_dim} {name}: {us:.1f} us; bound ({unit}, {cycles} cycles per 1,024 scores) {bound_us:.1f} us"
              f" = {bound_us / us:.0%} of the measured time")
