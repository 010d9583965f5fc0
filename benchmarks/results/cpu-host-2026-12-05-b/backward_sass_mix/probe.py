"""Instruction mix and occupancy of the backward kernels at D=128, from their machine code for sm_90 (compiled on a
machine without a GPU): the pointer dK/dV and dQ kernels in the configs the autotuner chose on the H200 (run Q1:
dK/dV (32, 64, 4, 3) and (64, 128, 8, 2); dQ (128, 64, 8, 2) and (64, 64, 4, 3), as (BLOCK_M, BLOCK_N, warps,
stages)), and every listed config of the Gluon dK/dV and dQ kernels.

Per kernel: registers per thread and shared memory (cuobjdump's resource usage), and how many programs fit one SM
by each (65,536 registers, allocated per warp in units of 256; 228 KB of shared memory with 1 KB reserved per
program; 64 warps). Per innermost loop that holds wgmma instructions (HGMMA; a loop is a backward branch, and a loop
holding another such loop is left out): the static count of HGMMA, warpgroup waits and arrives, thread-issued
shared-memory loads and stores (LDS/STS, layout conversions and staging; the copy engine's traffic is no
instruction), exponentials (MUFU.EX2), CTA barriers (BAR), local-memory spills (LDL/STL), global loads and stores,
and all instructions; then all instructions per 1,024 scores of one iteration's tile, over every warp that runs
the loop, so that kernels of different tiles compare. A loop body runs once per iteration (its masked branches are
counted too). For a warp-specialized kernel the rows are one consumer warpgroup's (4 warps).

Run from the repository root: python <this file>. bf16, causal top-left, no key mask or GQA.
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips the compile
sys.path.insert(0, os.getcwd())
from tests.flashlite.sm90 import GLUON_COMPILER, SM90_COMPILER  # noqa: E402

exec(SM90_COMPILER)  # compile_for_sm90, attention_bwd
exec(GLUON_COMPILER)  # compile_gluon
import torch  # noqa: E402
import triton  # noqa: E402
from flashlite._attention import launch_gluon_bwd  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
KINDS = {"HGMMA": r"\bHGMMA\.", "WG.DEPBAR": r"WARPGROUP\.DEPBAR", "WG.ARRIVE": r"WARPGROUP\.ARRIVE",
         "LDS": r"\bLDS(M)?\b", "STS": r"\bSTS(M)?\b", "EX2": r"MUFU\.EX2", "BAR": r"\bBAR\.",
         "LDL/STL": r"\b(LDL|STL)\b", "LDG/STG": r"\b(LDG|STG|LDGSTS|RED|ATOM)"}


def _tool(name, cubin_bytes, *args):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(cubin_bytes)
        cubin.flush()
        return subprocess.run([os.path.join(BIN, name), *args, cubin.name], capture_output=True, text=True).stdout


def programs_per_sm(registers, shared, warps):
    per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (per_warp * warps)
    by_shared = (228 * 1024) // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps), by_registers, by_shared


def innermost_wgmma_loops(sass):
    lines = sass.split("\n")
    labels = {m.group(1): i for i, line in enumerate(lines) for m in [re.match(r"^\.(L_x_\d+):", line.strip())] if m}
    spans = []
    for i, line in enumerate(lines):
        target = re.search(r"BRA (?:`\()?\.(L_x_\d+)", line)
        if target and labels.get(target.group(1), len(lines)) < i:
            body = lines[labels[target.group(1)]:i + 1]
            if any("HGMMA" in x for x in body):
                spans.append((labels[target.group(1)], i))
    inner = [s for s in spans if not any(o != s and s[0] <= o[0] and o[1] <= s[1] for o in spans)]
    for start, end in inner:
        body = [x for x in lines[start:end + 1] if re.search(r"/\*[0-9a-f]{4}\*/", x)]
        counts = {kind: sum(bool(re.search(pattern, x)) for x in body) for kind, pattern in KINDS.items()}
        counts["all"] = len(body)
        yield start, end, counts


def report(name, kernel, tile_scores, loop_warps, launch_warps):
    usage = _tool("cuobjdump", kernel.asm["cubin"], "--dump-resource-usage")
    registers = int(re.search(r"REG:(\d+)", usage).group(1))
    shared = kernel.metadata.shared
    fit, by_registers, by_shared = programs_per_sm(registers, shared, launch_warps)
    print(f"{name}: {registers} registers, {shared} B shared, {launch_warps} warps; programs per SM {fit} "
          f"(registers {by_registers}, shared memory {by_shared}); tile {tile_scores} scores")
    for start, end, counts in innermost_wgmma_loops(_tool("nvdisasm", kernel.asm["cubin"], "-c")):
        per = counts["all"] * loop_warps * 1024 / tile_scores
        print(f"  loop {start}-{end}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
              + f"; instructions per 1,024 scores {per:.0f}")


for block_m, block_n, warps, stages in [(32, 64, 4, 3), (64, 128, 8, 2)]:
    kernel = compile_for_sm90(attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=block_m, BLOCK_N=block_n),  # noqa: F821
                              head_dim=128, block_d=128, causal=1, key_mask="none", warps=warps, stages=stages)
    report(f"pointer dK/dV {(block_m, block_n, warps, stages)}", kernel, block_m * block_n, warps, warps)
for block_m, block_n, warps, stages in [(128, 64, 8, 2), (64, 64, 4, 3)]:
    kernel = compile_for_sm90(attention_bwd._attn_bwd_dq, dict(BLOCK_M=block_m, BLOCK_N=block_n),  # noqa: F821
                              head_dim=128, block_d=128, causal=1, key_mask="none", warps=warps, stages=stages)
    report(f"pointer dQ {(block_m, block_n, warps, stages)}", kernel, block_m * block_n, warps, warps)

q = torch.empty(2, 4, 300, 128, dtype=torch.bfloat16)
lse = torch.empty(2, 4, 300)
for kind in ("dkdv", "dq"):
    for variant in launch_gluon_bwd.BWD_VARIANTS[kind]:
        for config in launch_gluon_bwd.bwd_configs_for(128, kind, variant):
            if kind == "dq":
                args, meta = launch_gluon_bwd.dq_kernel_arguments(q, q, q, q, q, lse, lse, 1, 0.125, config)
                fn = launch_gluon_bwd.dq_kernel_for(config)
            else:
                args, meta = launch_gluon_bwd.dkdv_kernel_arguments(q, q, q, q, q, q, lse, lse, 1, 0.125, config)
                fn = launch_gluon_bwd.dkdv_kernel_for(config)
            options = {"num_warps": config.num_warps}
            if "maxnreg" in meta:
                options["maxnreg"] = meta["maxnreg"]
            kernel, _, spills, serialized = compile_gluon(fn, args, meta, options)  # noqa: F821
            ws = variant == "ws"
            # ws: the default partition's warps plus the one-warp producer, launched as 12 warps in all
            launch_warps = 12 if ws else config.num_warps
            report(f"Gluon {kind} {variant} {config.own_rows}x{config.streamed_rows} s{config.stages} "
                   f"w{config.num_warps}{' dP early' if config.early_dp else ''}{' overlap' if config.overlap else ''}"
                   f" (spill bytes {spills})", kernel, config.own_rows * config.streamed_rows,
                   4 if ws else config.num_warps, launch_warps)
