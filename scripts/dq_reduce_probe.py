"""Probe: one backward kernel that adds dQ in by TMA reductions, against flashlite's two-kernel backward.

flashlite's pointer backward runs two kernels that each recompute the probabilities: dK/dV (four matmuls per tile
pair) and dQ (three). Run P2 tried one kernel that adds each key block's share of dQ (scale * dS K) into a float32
buffer with ``tl.atomic_add``, one element per thread and instruction; it lost 0.85-0.96x
(``benchmarks/results/h200-2026-12-04-f/``). On sm_90 a tensor descriptor's ``atomic_add`` lowers instead to
``cp.reduce.async.bulk.tensor ... add``: the whole [BLOCK_M, D] tile is staged in shared memory and the copy engine
adds it into global memory asynchronously, the way FlashAttention-3 accumulates dQ. flashlite's pointer dK/dV kernel
did that for a while (FLASHLITE_DQ_REDUCE=1, 3336421) and lost 0.69-0.92x to the two-kernel backward on an H100
(run U1, benchmarks/results/h100-2026-12-05/), so it was removed; this probe, a minimal kernel with the three modes
side by side, splits what the dQ share costs from what adding it in costs.

The kernel here is minimal on purpose: dense, causal top-left, S_q = S_k a multiple of the blocks, as many key/value
heads as query heads, contiguous [B, H, S, D]. Its dQ modes (``DQ_MODE``): "atomic" (P2's per-element adds),
"tma" (the descriptor reduction) and, for timing only, "none" (dK and dV alone, no dQ: what the dQ share costs is
the difference). Each call returns (dq, dk, dv); the forward's out and base-2 log-sum-exp come from flashlite's own
forward launcher.

Usage:
    python scripts/dq_reduce_probe.py check     # float64 check; on a CPU under TRITON_INTERPRET=1 ("none" and
                                                # "atomic": the interpreter has no descriptor reductions)
    python scripts/dq_reduce_probe.py compile   # CPU or GPU: compile every config and mode for sm_90; shared memory,
                                                # registers and spills (ptxas)
    python scripts/dq_reduce_probe.py time [--D 64,128] [--shapes 1x8192,8x4096]   # GPU: do_bench medians
"""
from __future__ import annotations

import argparse
import math
import os
import re
import sys

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, num_warps, num_stages): query rows streamed past BLOCK_N resident keys. BLOCK_N is a multiple
# of BLOCK_M, so the diagonal falls inside the first BLOCK_N / BLOCK_M query blocks of a key block.
CONFIGS = [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2), (32, 128, 4, 2), (32, 64, 4, 3), (64, 64, 4, 3),
           (16, 128, 8, 3)]
INTERPRETER_CONFIGS = [(16, 32, 4, 1)]
MODES = ("atomic", "tma")  # the modes that compute dQ
TIMED_MODES = ("none",) + MODES
LOG2E = 1.4426950408889634


@triton.jit
def _dkdv_dq_blocks(dk, dv, k, v, Q, dOut, Lse, Delta, DqAcc, DqDesc, head, bh, seq, offs_n, offs_d, start, end,
                    qk_scale, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    DIAGONAL: tl.constexpr, DQ_MODE: tl.constexpr):
    """dK, dV of one key block over query blocks [start, end), adding each block's dQ share (dS K, unscaled) in;
    DIAGONAL: the blocks cross the diagonal, so mask."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + offs_m0
        q = tl.load(Q + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        do = tl.load(dOut + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :])
        lse = tl.load(Lse + bh.to(tl.int64) * seq + offs_m)
        delta = tl.load(Delta + bh.to(tl.int64) * seq + offs_m)
        p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse[None, :])  # [BLOCK_N, BLOCK_M]
        if DIAGONAL:
            p_t = tl.where(offs_n[:, None] <= offs_m[None, :], p_t, 0.0)
        dv = tl.dot(p_t.to(do.dtype), do, dv)
        dp_t = tl.dot(v, tl.trans(do))
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk)
        if DQ_MODE != "none":
            dq_part = tl.dot(tl.trans(ds_t), k)  # [BLOCK_M, D] float32
            if DQ_MODE == "tma":
                DqDesc.atomic_add([bh, start_m, 0], dq_part.reshape(1, BLOCK_M, HEAD_DIM))
            else:
                tl.atomic_add(DqAcc + head + offs_m[:, None] * HEAD_DIM + offs_d[None, :], dq_part, sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_dq_kernel(Q,  # [B, H, S, D] contiguous
                    K,  # [B, H, S, D] contiguous
                    V,  # [B, H, S, D] contiguous
                    dOut,  # [B, H, S, D] contiguous
                    Lse,  # [B, H, S] float32, the forward's base-2 log-sum-exp
                    Delta,  # [B, H, S] float32, rowsum(dO * O)
                    dK,  # [B, H, S, D], K's dtype
                    dV,  # [B, H, S, D], V's dtype
                    DqAcc,  # [B * H, S, D] float32 zeros: dQ / scale is added into it ("atomic": its pointer)
                    DqDesc,  # "tma": a descriptor of DqAcc with blocks [1, BLOCK_M, D]; else DqAcc again
                    seq, qk_scale, sm_scale,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_MODE: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    head = bh.to(tl.int64) * seq * HEAD_DIM
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(K + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    v = tl.load(V + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :])
    dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
    # Rows before start_n see none of this key block; the BLOCK_N rows from start_n cross the diagonal; the rest
    # see all of it.
    dk, dv = _dkdv_dq_blocks(dk, dv, k, v, Q, dOut, Lse, Delta, DqAcc, DqDesc, head, bh, seq, offs_n, offs_d,
                             start_n, start_n + BLOCK_N, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, True, DQ_MODE)
    dk, dv = _dkdv_dq_blocks(dk, dv, k, v, Q, dOut, Lse, Delta, DqAcc, DqDesc, head, bh, seq, offs_n, offs_d,
                             start_n + BLOCK_N, seq, qk_scale, HEAD_DIM, BLOCK_M, BLOCK_N, False, DQ_MODE)
    tl.store(dK + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :], (dk * sm_scale).to(dK.dtype.element_ty))
    tl.store(dV + head + offs_n[:, None] * HEAD_DIM + offs_d[None, :], dv.to(dV.dtype.element_ty))


def probe_backward(grad_out, q, k, v, out, lse, config, mode):
    """(dq, dk, dv) of causal top-left attention with scale 1/sqrt(D), from the forward's ``out`` and base-2 ``lse``,
    by the one kernel in dQ mode ``mode`` with ``config`` = (BLOCK_M, BLOCK_N, num_warps, num_stages)."""
    batch, heads, seq, head_dim = q.shape
    block_m, block_n, warps, stages = config
    if seq % block_n or block_n % block_m:
        raise ValueError(f"seq {seq} must be a multiple of BLOCK_N {block_n}, itself a multiple of BLOCK_M {block_m}")
    sm_scale = 1.0 / math.sqrt(head_dim)
    delta = (out.float() * grad_out.float()).sum(-1)
    acc = torch.zeros(batch * heads, seq, head_dim, device=q.device, dtype=torch.float32)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    if mode == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor
        described = TensorDescriptor(acc, list(acc.shape), list(acc.stride()), [1, block_m, head_dim])
    else:
        described = acc
    _dkdv_dq_kernel[(seq // block_n, batch * heads)](
        q, k, v, grad_out, lse, delta, dk, dv, acc, described, seq, sm_scale * LOG2E, sm_scale,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, DQ_MODE=mode, num_warps=warps, num_stages=stages)
    dq = (acc * sm_scale).view(batch, heads, seq, head_dim).to(q.dtype)
    return dq, dk, dv


def _forward(q, k, v):
    from flashlite._attention.launch import attention_forward
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}[q.dtype]
    return attention_forward(q, k, v, None, None, 1, 1.0 / math.sqrt(q.shape[-1]), precision)


def _reference(q, k, v, grad_out):
    """float64 (dq, dk, dv) of causal top-left attention."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    return torch.autograd.grad(out, (q64, k64, v64), grad_out.double())


def _relative_errors(got, expected):
    return [((g.double() - e.double()).norm() / e.double().norm()).item() for g, e in zip(got, expected)]


def _inputs(batch, heads, seq, head_dim, dtype, device, seed=0):
    generator = torch.Generator(device="cpu").manual_seed(seed)
    q, k, v, grad_out = (torch.randn(batch, heads, seq, head_dim, generator=generator).to(device, dtype)
                         for _ in range(4))
    return q, k, v, grad_out


def check() -> int:
    """Each config and mode that can run here against float64; returns the number of failures. The bound, 2e-2 in
    relative Frobenius norm, is what 16-bit operands give (a wrong or missing dQ share is off by tens of percent)."""
    interpreting = os.environ.get("TRITON_INTERPRET") == "1"
    device = "cpu" if interpreting else "cuda"
    # The interpreter computes bf16 dots wrongly (fp16 is right), and has no descriptor reductions.
    dtype, configs, modes = ((torch.float16, INTERPRETER_CONFIGS, ("none", "atomic")) if interpreting
                             else (torch.bfloat16, CONFIGS, TIMED_MODES))
    failures = 0
    for batch, heads, seq, head_dim in ((1, 2, 64, 16), (2, 1, 96, 32)) if interpreting else ((2, 3, 384, 64),
                                                                                               (1, 2, 256, 128)):
        q, k, v, grad_out = _inputs(batch, heads, seq, head_dim, dtype, device, seed=seq)
        out, lse = _forward(q, k, v)
        expected = _reference(q, k, v, grad_out)
        for config in configs:
            for mode in modes:
                errors = _relative_errors(probe_backward(grad_out, q, k, v, out, lse, config, mode), expected)
                names = "dq, dk, dv"
                if mode == "none":  # its dQ is zeros
                    errors, names = errors[1:], "dk, dv"
                ok = all(e <= 2e-2 for e in errors)
                failures += not ok
                print(f"check B={batch} H={heads} S={seq} D={head_dim} {config} {mode}: relative errors {names} "
                      f"{', '.join(f'{e:.2e}' for e in errors)} {'ok' if ok else 'FAILED'}")
    return failures


def compile_report() -> None:
    """Compile every config and mode for sm_90 (no GPU needed): shared memory, registers, spill stores."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import tempfile
    from triton import knobs
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cached kernel skips ptxas and its report
    knobs.nvidia.dump_ptxas_log = True
    for head_dim in (64, 128):
        for config in CONFIGS:
            block_m, block_n, warps, stages = config
            for mode in TIMED_MODES:
                signature = {name: "*bf16" for name in ("Q", "K", "V", "dOut", "dK", "dV")}
                signature.update(Lse="*fp32", Delta="*fp32", DqAcc="*fp32", seq="i32", qk_scale="fp32",
                                 sm_scale="fp32", HEAD_DIM="constexpr", BLOCK_M="constexpr", BLOCK_N="constexpr",
                                 DQ_MODE="constexpr")
                signature["DqDesc"] = f"tensordesc<fp32[1,{block_m},{head_dim}]>" if mode == "tma" else "*fp32"
                order = list(_dkdv_dq_kernel.arg_names)
                signature = {name: signature[name] for name in order}
                constants = dict(HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, DQ_MODE=mode)
                attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(order)
                         if signature[name].startswith("*") or name == "seq"}
                kernel, text = _captured_stdout_stderr(lambda: triton.compile(
                    ASTSource(_dkdv_dq_kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": warps, "num_stages": stages}))
                registers = re.findall(r"Used (\d+) registers", text)
                spills = re.findall(r"(\d+) bytes spill stores", text)
                reduce = "cp.reduce.async.bulk.tensor" in kernel.asm["ptx"]
                print(f"compile D={head_dim} {config} {mode:6s}: shared {kernel.metadata.shared:6d} B, registers "
                      f"{','.join(registers)}, spill stores {','.join(spills)} B, bulk reduce in PTX: {reduce}")


def _captured_stdout_stderr(fn):
    # ptxas's report is printed by the compiler process's own file descriptors, so capture at that level.
    import tempfile
    with tempfile.TemporaryFile(mode="w+") as sink:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(sink.fileno(), 1), os.dup2(sink.fileno(), 2)
        try:
            result = fn()
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        sink.seek(0)
        return result, sink.read()


def time_shapes(head_dims, shapes) -> None:
    """GPU: do_bench medians of flashlite's backward (its launcher, autotuned as the A/B runs it) and of the probe
    kernel in every mode at every config, each checked against flashlite's gradients first ("none": dK, dV only)."""
    from triton.testing import do_bench
    from flashlite._attention.launch import attention_backward
    for head_dim in head_dims:
        for batch, seq in shapes:
            q, k, v, grad_out = _inputs(batch, 16, seq, head_dim, torch.bfloat16, "cuda", seed=seq)
            out, lse = _forward(q, k, v)
            scale = 1.0 / math.sqrt(head_dim)

            def library():
                return attention_backward(grad_out, q, k, v, out, lse, None, None, 1, scale, "bf16")
            expected = library()
            base_ms = do_bench(library, warmup=50, rep=300)
            print(f"time D={head_dim} B={batch} S={seq} H=16: flashlite backward {base_ms:.4f} ms")
            for mode in TIMED_MODES:
                best = None
                for config in CONFIGS:
                    if seq % config[1]:
                        continue
                    run = lambda: probe_backward(grad_out, q, k, v, out, lse, config, mode)  # noqa: E731
                    errors = _relative_errors(run(), expected)
                    if mode == "none":
                        errors = errors[1:]  # its dQ is zeros
                    if max(errors) > 0.05:
                        print(f"  {mode} {config}: disagrees with flashlite's gradients {errors}, not timed")
                        continue
                    ms = do_bench(run, warmup=50, rep=300)
                    print(f"  {mode} {config}: {ms:.4f} ms ({base_ms / ms:.3f}x flashlite's backward)")
                    best = min(best or (ms, config), (ms, config))
                if best:
                    print(f"  best {mode}: {best[1]} {best[0]:.4f} ms, {base_ms / best[0]:.3f}x flashlite's backward")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("check", "compile", "time"))
    parser.add_argument("--D", default="64,128")
    parser.add_argument("--shapes", default="1x8192,8x4096,4x2048,16x1024,1x32768", help="BxS, H=16")
    args = parser.parse_args()
    if args.what == "check":
        return 1 if check() else 0
    if args.what == "compile":
        compile_report()
        return 0
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
    time_shapes([int(d) for d in args.D.split(",")], shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
