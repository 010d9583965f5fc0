"""Where the compiled TransformerLayer spends its GPU time against the compiled plain block (GPU only).

For each case, both sides under ``torch.compile`` (the layer with ``fullgraph=True``, precision "mixed"; the plain
block in bf16, same weights), in inference and in a training step (forward, backward of a projection loss, fused
AdamW): the GPU time per call summed over every kernel (torch.profiler, CUDA activity, 10 calls after warm-up),
the kernels that take most of it, the wall time per call of back-to-back calls (host work included), and how
many graphs dynamo compiled. The A/B suite says whether the layer is
faster; this says which kernels make the difference.

Mode "host" asks where the host time of a host-bound case goes (inference, both sides built as
``tests/perf/test_layer_ab.py`` builds them: the plain block compiled once for every shape, the layer with
``fullgraph=True, dynamic=False``): each side's time per call three ways in one process (back-to-back wall time;
CUDA events around each call in paired sequences, which is how the A/B times; GPU time), then the CPU events that
take most of each side's host time per call (torch.profiler, CPU activity): guard evaluation, the compiled
wrapper, each op's dispatch, the launches; and the Python functions that do (cProfile), which name what inside the
wrapper holds its time.

Mode "graph" profiles ``CudaGraphRunner`` instead (inference): over the eager layer and over the compiled layer,
its kernels per replay, its wall time per call, the wall time of bare ``graph.replay()`` calls (the graph's own
time, host work almost nil) and the host time of the runner's replay check (``_ReplayLayout.holds_for``), beside the
compiled plain block.

Example:
    python3 scripts/layer_profile.py --cases 1,5,10 --top 8
    python3 scripts/layer_profile.py --cases 1 --modes inference --inductor combo_kernels=True
    python3 scripts/layer_profile.py --cases 1,2 --modes graph
    python3 scripts/layer_profile.py --cases 1,2 --modes host
"""
from __future__ import annotations

import argparse
import ast
import copy
import cProfile
import pstats
import random
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from flashlite.cases import CASES
from flashlite.layer import CudaGraphRunner, PlainTransformerBlock, TransformerLayer

D_MODEL, N_HEADS, D_FF = 1024, 16, 4096
CALLS = 10


def profiled(fn, activity: ProfilerActivity, calls: int) -> list:
    """torch.profiler's events (``key_averages``) of ``calls`` back-to-back calls of ``fn`` after three warm-up
    calls, with ``activity`` (CUDA: kernels; CPU: host work)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[activity]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return prof.key_averages()


def kernel_times(fn, calls: int = CALLS) -> tuple[float, list[tuple[str, float, int]]]:
    """(GPU microseconds per call summed over all kernels, [(kernel, us per call, launches per call)] sorted)."""
    rows = []
    for event in profiled(fn, ProfilerActivity.CUDA, calls):
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = getattr(event, "self_device_time_total", None)
        us = event.self_cuda_time_total if us is None else us
        rows.append((event.key, us / calls, event.count // calls))
    rows.sort(key=lambda row: -row[1])
    return sum(row[1] for row in rows), rows


def training_step(model, x: torch.Tensor, projection: torch.Tensor):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, fused=True)

    def step():
        optimizer.zero_grad(set_to_none=True)
        x.grad = None
        (model(x).float() * projection).sum().backward()
        optimizer.step()
    return step


def wall_time(fn, calls: int = 50) -> float:
    """Microseconds per call of ``calls`` back-to-back calls between two device synchronisations: the time the
    caller waits, host work included (where it exceeds the GPU time, the host is the bottleneck)."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def report(label: str, fn, top: int) -> tuple[float, float]:
    total, rows = kernel_times(fn)
    wall = wall_time(fn)
    print(f"  {label}: {total:9.1f} us of GPU time per call, {sum(r[2] for r in rows)} launches; "
          f"{wall:9.1f} us of wall time per call")
    for name, us, launches in rows[:top]:
        print(f"      {us:8.1f} us  x{launches:<3d} {name[:110]}")
    return total, wall


def host_time(fn, calls: int = 2000) -> float:
    """Microseconds per call of a host-only function (no GPU work)."""
    for _ in range(100):
        fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


# Rounds of back-to-back wall times per side in mode "host", alternating between the sides.
WALL_ROUNDS = 5


def paired_event_times(fns, rounds: int = 200) -> list[float]:
    """Median microseconds per call of each of ``fns`` timed by CUDA events around each call, the calls of a round
    queued in random order and the device synchronized once per round: the A/B engine's pairing, without it."""
    samples = [[] for _ in fns]
    order = list(range(len(fns)))
    for _ in range(rounds):
        random.shuffle(order)
        events = {}
        for index in order:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[index]()
            end.record()
            events[index] = (start, end)
        torch.cuda.synchronize()
        for index, (start, end) in events.items():
            samples[index].append(start.elapsed_time(end) * 1000)
    return [statistics.median(times) for times in samples]


def cpu_events(fn, calls: int = 20, top: int = 14) -> list[tuple[str, float, float]]:
    """[(CPU event, self microseconds per call, occurrences per call)], most self time first: torch.profiler with
    CPU activity over ``calls`` back-to-back calls after warm-up."""
    rows = [(event.key, event.self_cpu_time_total / calls, event.count / calls)
            for event in profiled(fn, ProfilerActivity.CPU, calls)]
    rows.sort(key=lambda row: -row[1])
    return rows[:top]


def python_functions(fn, calls: int = 300, top: int = 14) -> list[tuple[str, float, float, float]]:
    """[(Python function, own microseconds per call, with callees, calls per call)], most own time first: cProfile
    over ``calls`` back-to-back calls after warm-up. It sees what torch.profiler's CPU events cannot: which Python
    functions of a compiled graph's wrapper (kernel launchers, allocation, the custom ops' Python) hold the host
    time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler).stats
    rows = [(f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line} {name}", own / calls * 1e6,
             total / calls * 1e6, count / calls)
            for (path, line, name), (_, count, own, total, _) in stats.items()]
    rows.sort(key=lambda row: -row[1])
    return rows[:top]


def profile_host(plain: PlainTransformerBlock, x: torch.Tensor, precision: str, options: dict, top: int) -> None:
    """Where each side's host time goes (inference), both sides built as the A/B suite builds them."""
    torch._dynamo.reset()
    base = copy.deepcopy(plain).eval()
    layer = TransformerLayer.from_plain(base, precision=precision).eval()
    compiled_plain = torch.compile(base, options=options)
    compiled_layer = torch.compile(layer, fullgraph=True, dynamic=False, options=options)
    sides = {"compiled layer": lambda: compiled_layer(x), "compiled plain block": lambda: compiled_plain(x)}
    with torch.no_grad():
        for fn in sides.values():
            fn()
        events = paired_event_times(list(sides.values()))
        # Back-to-back wall times in alternating rounds: in run N1 the same compiled plain block measured 453.1 and
        # then 353.6 us per call in one process (h200-2026-12-04-d/n1_grouped_cast/profile_after.log), so one
        # measurement per side says little about the difference between them.
        walls = {label: [] for label in sides}
        for _ in range(WALL_ROUNDS):
            for label, fn in sides.items():
                walls[label].append(wall_time(fn))
        for (label, fn), event_us in zip(sides.items(), events):
            gpu_us, rows = kernel_times(fn)
            rounds = ", ".join(f"{us:.1f}" for us in walls[label])
            print(f"  host {label}: wall {statistics.median(walls[label]):7.1f} us per back-to-back call (rounds: "
                  f"{rounds}), events {event_us:7.1f} us per paired call, GPU {gpu_us:6.1f} us in "
                  f"{sum(r[2] for r in rows)} launches")
        for label, fn in sides.items():
            print(f"  host {label}: CPU events by self time (us per call, occurrences per call)")
            for name, us, count in cpu_events(fn, top=top):
                print(f"      {us:8.1f} us  x{count:<5.1f} {name[:100]}")
        for label, fn in sides.items():
            print(f"  host {label}: Python functions by own time (cProfile; us per call: own, with callees; calls "
                  f"per call)")
            for name, own, total, count in python_functions(fn, top=top + 6):
                print(f"      {own:8.1f} {total:8.1f} us  x{count:<5.1f} {name[:110]}")
        print(f"  host: plain/layer by events {events[1] / events[0]:.3f}x")


def profile_graphs(plain: PlainTransformerBlock, x: torch.Tensor, precision: str, options: dict, top: int) -> None:
    """CudaGraphRunner over the eager and over the compiled layer, against the compiled plain block (inference)."""
    torch._dynamo.reset()
    base = copy.deepcopy(plain).eval()
    layer = TransformerLayer.from_plain(base, precision=precision).eval()
    compiled_plain = torch.compile(base, options=options)
    with torch.no_grad():
        _, plain_wall = report("inference compiled plain block", lambda: compiled_plain(x), top)
        for label, model in (("eager", layer), ("compiled", torch.compile(layer, fullgraph=True, options=options))):
            try:
                runner = CudaGraphRunner(model)
                runner(x)
            except Exception as error:  # noqa: BLE001 - a probe: report what failed and go on
                print(f"  cuda-graph runner over the {label} layer: failed: {type(error).__name__}: {error}")
                continue
            _, wall = report(f"cuda-graph runner over the {label} layer", lambda: runner(x), top)
            captured = next(iter(runner._captured.values()))
            replay = wall_time(captured.graph.replay, calls=200)
            check = host_time(lambda: captured.layout.holds_for(runner._inner))
            print(f"    bare graph.replay(): {replay:7.1f} us per call; replay check: {check:5.1f} us of host time; "
                  f"compiled plain block / runner wall time {plain_wall / wall:.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="1,5,10", help="comma-separated case numbers (flashlite.cases)")
    parser.add_argument("--top", type=int, default=8, help="kernels listed per side")
    parser.add_argument("--modes", default="inference,training", help="comma-separated: inference, training, graph, host")
    parser.add_argument("--precision", default="mixed", help="the layer's precision")
    parser.add_argument("--inductor", default="", metavar="NAME=VALUE,...",
                        help="Inductor options for both sides' torch.compile (values are Python literals), e.g. "
                             "combo_kernels=True")
    args = parser.parse_args()
    options = {name: ast.literal_eval(value) for name, value in
               (item.split("=", 1) for item in args.inductor.split(",") if item)}
    torch._dynamo.config.recompile_limit = 512
    torch.manual_seed(0)
    plain = PlainTransformerBlock(D_MODEL, N_HEADS, D_FF, device="cuda", dtype=torch.bfloat16)
    cases = {c.number: c for c in CASES}
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | layer precision {args.precision} | "
          f"Inductor options {options or 'none'}")
    for number in (int(n) for n in args.cases.split(",")):
        case = cases[number]
        x = torch.randn(case.B, case.S, D_MODEL, device="cuda", dtype=torch.bfloat16)
        print(f"case {number} (B={case.B}, S={case.S}, {case.B * case.S} tokens)")
        for mode in args.modes.split(","):
            if mode == "graph":
                profile_graphs(plain, x, args.precision, options, args.top)
                continue
            if mode == "host":
                profile_host(plain, x, args.precision, options, max(args.top, 14))
                continue
            torch._dynamo.reset()
            base = copy.deepcopy(plain).train(mode == "training")
            layer = TransformerLayer.from_plain(base, precision=args.precision).train(mode == "training")
            compiled_plain = torch.compile(base, options=options)
            compiled_layer = torch.compile(layer, fullgraph=True, options=options)
            if mode == "training":
                xg = x.clone().requires_grad_(True)
                projection = torch.randn(x.shape, device="cuda")
                fns = (training_step(compiled_layer, xg, projection), training_step(compiled_plain, xg, projection))
            else:
                fns = (lambda: compiled_layer(x), lambda: compiled_plain(x))
            with torch.no_grad() if mode == "inference" else torch.enable_grad():
                layer_us, layer_wall = report(f"{mode} compiled layer", fns[0], args.top)
                plain_us, plain_wall = report(f"{mode} compiled plain block", fns[1], args.top)
            graphs = torch._dynamo.utils.counters["stats"].get("unique_graphs", 0)
            breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
            print(f"  {mode}: plain/layer GPU time {plain_us / layer_us:.3f}x, "
                  f"wall time {plain_wall / layer_wall:.3f}x; dynamo graphs {graphs}, graph breaks {breaks}")


if __name__ == "__main__":
    main()
