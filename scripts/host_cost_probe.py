"""Host time of flashlite's launchers and of attention()'s dispatch, on the CPU, with the kernels stubbed out.

Measures Python work only (argument handling, grid and block arithmetic, allocation), never kernel speed: every
Triton kernel is replaced by a no-op before timing. Under the CPU interpreter the autotuned forward path would
benchmark configs, so the stub reports a fixed best config and the timed calls reuse it, as tuned calls do on a GPU.
Usage: python scripts/host_cost_probe.py   (prints best-of-5 timeit means in microseconds; SDPA and the
``auto`` replay best-of-15, timed in alternation, five times: the median difference and all five; on a machine with
a GPU the same pairing with CUDA tensors too). The "floor" line is the cost of the cheapest key lookup Python
allows, with fewer checks than a correct key needs: what any pure-Python plan cache pays at least per call, and
why attention() keys its plans in C++ (``flashlite._native``; the Python key where that could not be built).
"""
from __future__ import annotations

import importlib
import os
import platform
import subprocess
import timeit
import types
import warnings

import torch
import torch.nn.functional as F
import triton

attention_module = importlib.import_module("flashlite.attention")
launch_module = importlib.import_module("flashlite._attention.launch")
plans_module = importlib.import_module("flashlite._attention.plans")
validation_module = importlib.import_module("flashlite._attention.validation")
norm = importlib.import_module("flashlite.norm")
direct_launch = importlib.import_module("flashlite._direct_launch")
attention_fwd = importlib.import_module("flashlite.kernels.attention_fwd")
runtime = importlib.import_module("flashlite._runtime")


class _NoKernel:
    """Stands in for a Triton kernel: calls the grid (as a launch would) and does nothing else."""

    best_config = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if callable(grid):
                grid({"BLOCK_M": 64, **kwargs})
        return launch


def _us(stmt, env, number=5000) -> float:
    return min(timeit.repeat(stmt, number=number, repeat=5, globals=env)) / number * 1e6


def _paired_us(first, second, env, number=2000, rounds=15) -> tuple[float, float]:
    """Best-of-rounds means of two statements timed in alternation, so that load from other processes, which
    comes and goes, cannot favour one of them."""
    times = ([], [])
    for _ in range(rounds):
        for stmt, out in ((first, times[0]), (second, times[1])):
            out.append(timeit.timeit(stmt, number=number, globals=env) / number * 1e6)
    return min(times[0]), min(times[1])


def _commit() -> str:
    # .commit (git-ignored) is written before a remote run whose copy of the tree has no reliable history.
    if os.path.isfile(".commit"):
        with open(".commit") as f:
            return f.read().strip()
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def _cuda_replay_lines() -> None:
    """The same pairing with CUDA tensors (case 1's shape, bf16): SDPA's launch against attention() replaying a plan
    that runs SDPA. Host time per call of back-to-back calls; the GPU is synchronized between rounds only, and at
    this size it runs each kernel faster than the host issues them, so the host's time is what is measured."""
    q, k, v = (torch.randn(1, 16, 128, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    env = {"F": F, "attention": attention_module.attention, "q": q, "k": k, "v": v, "sync": torch.cuda.synchronize}
    decision = attention_module.explain_dispatch(q, k, v, causal=True)
    for backend in ("sdpa", "auto"):
        pairs = []
        for _ in range(5):
            env["sync"]()
            pairs.append(_paired_us("F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                                    f"attention(q, k, v, causal=True, backend={backend!r})", env))
        sdpa_us, replay_us = sorted(pairs, key=lambda pair: pair[1] - pair[0])[2]
        extras = ", ".join(f"{replay - sdpa:+.2f}" for sdpa, replay in pairs)
        runs = "SDPA" if backend == "sdpa" else f"{decision.backend} ({decision.reason})"
        print(f"CUDA B=1 H=16 S=128 D=64 bf16: SDPA {sdpa_us:.2f} us, attention(backend={backend!r}) {replay_us:.2f} "
              f"us (+{replay_us - sdpa_us:.2f} us, the median of {extras} us; runs {runs})")


def _replayed_triton_us() -> float:
    """Host time of a replayed inference call of a Triton plan, up to the compiled kernel's launch: the plan is
    made with the stubbed kernel, then given a recorded launch (``flashlite._direct_launch``) whose compiled
    kernel and driver do nothing, as a CUDA plan's would be after its first call. Everything a replay runs in
    Python is timed; the driver's launch itself (about 5 us on the H200 host) is not."""
    q, k, v = (torch.randn(1, 16, 128, 64, dtype=torch.float16) for _ in range(3))
    with torch.no_grad():
        attention_module.attention(q, k, v, causal=True, backend="triton")
        key = plans_module.key_of(q, k, v, None, None, True, None, "triton", None)
        plan = plans_module._PLANS[key]
        plan.recorded.clear()
        driver = types.SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: None)
        compiled = types.SimpleNamespace(run=lambda *args: None, function=None, packed_metadata=None)
        hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
        # The forward kernel's 11 tensors and about 30 other arguments; the CPU's device index is -1.
        plan.recorded["inference"] = direct_launch.RecordedLaunch(compiled, (2, 16, 1), [None] * 11 + [0] * 30, 11,
                                                                 -1, driver=driver, hooks=hooks)
        env = {"attention": attention_module.attention, "q": q, "k": k, "v": v}
        return _us("attention(q, k, v, causal=True, backend='triton')", env, number=5000)


def _replayed_triton_training_us() -> tuple[float, float]:
    """Host time of a replayed training call of a Triton plan (forward, then backward through autograd, as a
    training step calls it) and of its ``launch_backward`` alone, up to the compiled kernels' launches: as
    ``_replayed_triton_us``, every launch site the call reaches gets a recorded launch whose compiled kernel and
    driver do nothing (the sites of the backward are read off ``_replayed``'s calls during one backward). B=1 H=2
    S=16 D=16 fp16: the host's work does not depend on the size, and the interpreter runs the first call."""
    q, k, v = (torch.randn(1, 2, 16, 16, dtype=torch.float16, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, 2, 16, 16, dtype=torch.float16)
    # The forward kernel is stubbed by now, so the backward kernels run on whatever out and lse hold: their
    # overflow warnings say nothing about the timing.
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    attention_module.attention(q, k, v, causal=True, backend="triton").backward(grad)
    plan = plans_module._PLANS[plans_module.key_of(q, k, v, None, None, True, None, "triton", None)]
    sites, replayed = [], launch_module._replayed

    def spy(plan_, site, tensors):
        sites.append((site, len(tensors)))
        return replayed(plan_, site, tensors)
    launch_module._replayed = spy
    try:
        attention_module.attention(q, k, v, causal=True, backend="triton").backward(grad)
    finally:
        launch_module._replayed = replayed
    driver = types.SimpleNamespace(get_current_device=lambda: -1, get_current_stream=lambda device: None)
    compiled = types.SimpleNamespace(run=lambda *args: None, function=None, packed_metadata=None)
    hooks = types.SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None)
    # The forward kernel's 11 tensors, and each backward site's own; about 30 other arguments each.
    for site, tensors in [("forward", 11), ("inference", 11), *sites]:
        plan.recorded[site] = direct_launch.RecordedLaunch(compiled, (2, 2, 1), [None] * tensors + [0] * 30,
                                                           tensors, -1, driver=driver, hooks=hooks)

    def step():
        q.grad = k.grad = v.grad = None
        attention_module.attention(q, k, v, causal=True, backend="triton").backward(grad)
    with torch.no_grad():
        out, lse = launch_module.launch_forward(q, k, v, None, None, plan)
    env = {"step": step, "launch_backward": launch_module.launch_backward, "args": (grad, q, k, v, out, lse, None,
                                                                                   None, plan)}
    return _us("step()", env, number=3000), _us("launch_backward(*args)", env, number=3000)


def _replay_breakdown() -> None:
    """Where a replayed ``auto`` call's time over SDPA goes: SDPA called directly, through the plan's
    ``functools.partial``, through an empty 14-parameter Python function around that partial, through the C replay
    (key, lookup, the plan's call), and ``attention()`` itself; the C++ key alone and ``is_compiling()``. Each the
    lowest of 40 alternating rounds of 2,000 calls."""
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    attention_module.attention(q, k, v, causal=True)
    plan = plans_module._PLANS[plans_module.key_of(q, k, v, None, None, True, None, "auto", None)]

    def frame(q, k, v, *, causal=False, scale=None, key_padding_mask=None, key_lengths=None, attn_mask=None,
              window=None, softcap=None, alibi_slopes=None, backend="auto", precision=None):
        return plan.run(q, k, v, None)

    env = {"F": F, "q": q, "k": k, "v": v, "run": plan.run, "frame": frame, "attention": attention_module.attention,
           "replay": plans_module.replay, "plans": plans_module._PLANS, "fallback": plans_module.replay_by_python_key,
           "key": plans_module.fast_signature, "is_compiling": torch.compiler.is_compiling}
    steps = {"SDPA": "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
             "the plan's partial": "run(q, k, v, None)",
             "a 14-parameter frame + partial": "frame(q, k, v, causal=True)",
             "the replay (C call)": "replay(plans, fallback, q, k, v, None, None, True, None, 'auto', None, None, "
                                    "None, None)",
             "attention()": "attention(q, k, v, causal=True)"}
    best = {name: float("inf") for name in steps}
    for _ in range(40):
        for name, statement in steps.items():
            best[name] = min(best[name], timeit.timeit(statement, number=2000, globals=env) / 2000 * 1e6)
    sdpa = best["SDPA"]
    print("breakdown of a replayed auto call (CPU tensors B=1 H=2 S=8 D=16; over SDPA):",
          ", ".join(f"{name} {value:.2f} us ({value - sdpa:+.2f})" for name, value in best.items()))
    call = "key(q, k, v, None, None, True, None, 'auto', None, None, None, None)"
    print(f"  the plan key alone {_us(call, env, number=20000) * 1000:.0f} ns; is_compiling() "
          f"{_us('is_compiling()', env, number=20000) * 1000:.0f} ns")


def _kernel_host_lines() -> None:
    """The replayed Triton call and the compiled graph's ops, on CPU tensors (the interpreter's host path)."""
    print(f"replayed attention(backend='triton'), B=1 H=16 S=128, driver call stubbed {_replayed_triton_us():5.2f} us")
    if direct_launch._native.launch_recorded is not None:  # the same with the launch's checks in Python
        launch_in_cpp, direct_launch._native.launch_recorded = direct_launch._native.launch_recorded, None
        try:
            print(f"  the same with the launch's address checks in Python        {_replayed_triton_us():5.2f} us")
        finally:
            direct_launch._native.launch_recorded = launch_in_cpp
    step_us, backward_us = _replayed_triton_training_us()
    print(f"replayed attention(backend='triton') forward+backward, B=1 H=2 S=16 D=16, driver calls stubbed "
          f"{step_us:6.2f} us; its launch_backward {backward_us:5.2f} us")
    # What a compiled graph calls (kernels stubbed, so the launcher's ordinary path: CPU launches are not recorded).
    op_env = {"torch": torch, **{name: torch.randn(1, 16, 128, 64, dtype=torch.float16) for name in "qkv"}}
    with torch.no_grad():
        for op in ("attention_forward", "attention_inference"):
            statement = f"torch.ops.flashlite.{op}.default(q, k, v, None, None, 1, 0.125, 'fp16')"
            print(f"op flashlite::{op:20s} B=1 H=16 S=128, no grad {_us(statement, op_env):7.2f} us")


def main() -> None:
    sdpa_env = {"F": F, "attention": attention_module.attention}
    q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
    sdpa_env.update(q=q, k=k, v=v)
    # Five paired measurements: the best-of-rounds difference still moves by about half a microsecond from one to
    # the next on a shared host, so the median of five is the figure to quote.
    pairs = [_paired_us("F.scaled_dot_product_attention(q, k, v, is_causal=True)",
                        "attention(q, k, v, causal=True)", sdpa_env) for _ in range(5)]
    sdpa_us, auto_us = sorted(pairs, key=lambda pair: pair[1] - pair[0])[2]
    extras = ", ".join(f"{auto - sdpa:+.2f}" for sdpa, auto in pairs)
    # The op a dynamic-size compiled graph calls for backend="auto" inference (flashlite::attention_auto): the same
    # replayed call behind the dispatcher, paired with a plain call in the same way.
    sdpa_env["auto_op"] = torch.ops.flashlite.attention_auto.default
    op_pairs = [_paired_us("attention(q, k, v, causal=True)",
                           "auto_op(q, k, v, None, None, 1, None, None, None, None, None)", sdpa_env)
                for _ in range(5)]
    call_us, op_us = sorted(op_pairs, key=lambda pair: pair[1] - pair[0])[2]
    op_extras = ", ".join(f"{op - call:+.2f}" for call, op in op_pairs)

    stub = _NoKernel()
    launch_module._FORWARD = launch_module._Kernel("forward", stub, stub, attention_fwd.FWD_GPU_BLOCKS,
                                                   attention_fwd.prune_fwd_configs)
    for name in dir(norm):
        if name.startswith("_") and name.endswith("_kernel"):
            setattr(norm, name, _NoKernel())
    q, k, v = (torch.randn(1, 16, 128, 64) for _ in range(3))
    problem = validation_module.validate(q, k, v, True, None, None, None, "triton", None)
    plan = plans_module.Plan(problem, None)
    args = (q, k, v, None, None, plan)  # q, k, v, key mask, ALiBi slopes, plan
    launch_module.launch_forward(*args)  # the plan keeps the stub's config as the tuned one
    x, w, b = torch.randn(1, 128, 1024), torch.randn(1024), torch.randn(1024)
    env = {"A": launch_module, "N": norm, "args": args, "x": x, "w": w, "b": b, "torch": torch}
    commit = _commit()
    print(f"commit {commit} | python {platform.python_version()} | torch {torch.__version__} | triton "
          f"{triton.__version__} | {platform.processor() or platform.machine()} | CPU tensors, kernels stubbed")
    print(f"SDPA call, B=1 H=2 S=8 D=16              {sdpa_us:7.2f} us")
    key = "C++" if plans_module.fast_signature is not plans_module.signature else "Python"
    print(f"attention(backend='auto') replaying SDPA  {auto_us:7.2f} us  (+{auto_us - sdpa_us:.2f} us, the median of "
          f"{extras} us; plan key in {key})")
    print(f"op flashlite::attention_auto, same call      {op_us:7.2f} us  (+{op_us - call_us:.2f} us over attention() "
          f"itself, the median of {op_extras} us)")
    # The least a plan lookup in Python can cost: the three shapes, one dtype and one device (fewer checks than a
    # correct key needs: no strides, no dtype or device of k and v) and the arguments, hashed into one dict lookup.
    floor_env = {"q": q, "k": k, "v": v, "plans": {}}
    floor_env["plans"][(q.shape, k.shape, v.shape, q.dtype, q.device, True, None, "auto")] = None
    floor_us = _us("plans.get((q.shape, k.shape, v.shape, q.dtype, q.device, True, None, 'auto'))", floor_env,
                   number=20000)
    print(f"floor of a Python plan lookup (3 shapes, 1 dtype, 1 device) {floor_us:5.2f} us")
    _replay_breakdown()
    if torch.cuda.is_available():
        _cuda_replay_lines()
    print(f"attention forward launcher, B=1 H=16 S=128 {_us('A.launch_forward(*args)', env):7.2f} us")
    if not runtime.interpreting():
        # The lines below run the attention kernel's host path on CPU tensors, which it takes only through the
        # interpreter; with TRITON_INTERPRET=1 the CUDA lines above would time interpreted kernels instead.
        print("replayed attention(backend='triton') and the ops on CPU tensors: skipped (run with TRITON_INTERPRET=1)")
    else:
        _kernel_host_lines()
    print(f"layer-norm forward launcher, 128 x 1024    "
          f"{_us('N._launch_layer_norm_fwd(x, w, b, 1e-5, None, torch.bfloat16)', env):7.2f} us")
    print(f"bias+GELU forward launcher, 128 x 1024     "
          f"{_us('N._launch_bias_gelu_fwd(x, w, torch.bfloat16)', env):7.2f} us")


if __name__ == "__main__":
    main()
