"""GPU benchmark of the decoding kernel (``flashlite.kernels.attention_decode``) against today's
``flashlite.attention_with_kvcache``, SDPA and (with ``--flex``) FlexAttention, for issue 48's table.

Shapes: bf16, 32 query heads, 8 kv heads, D = 128. Length-masked rows (each entry's length drawn between half and
all of the cache): 1 x 32,768, 8 x 8,192, 32 x 4,096, 64 x 2,048, 16 x 32,768, and 16 x 8,192 with 4 queries per
entry; full rows (every entry full, SDPA without a mask): 1 x 32,768, 8 x 8,192, 16 x 8,192, 16 x 32,768. Each row
in a contiguous cache and paged (blocks of 16, 64 and 256 positions, shuffled table; full rows: 64 only). SDPA and
FlexAttention always read the contiguous cache (the same values).

Each row is first checked on the GPU: every configuration of the new kernel that is timed, in bf16, against a float32
reference written out here (fails loudly: the row is reported FAILED and not timed). Timing: CUDA events around
each call, an L2 flush (a 256 MiB memset) before each, all implementations of a row interleaved in a shuffled order
per round, warm-up first, ``--rounds`` rounds (default 30); per implementation the median time and the median over
rounds of (SDPA's time / its time) (above 1: faster than SDPA). GB/s counts the bytes a row must read: each entry's
visible keys and values (its length x H_kv x D x 2 tensors x 2 bytes) plus q and the output; "% bw" is of the
device-to-device copy bandwidth measured at the start on the same card (bytes read + written by a 1 GiB copy;
4.26 TB/s on an H200).

An fp8 (e4m3) copy of each contiguous cache, a float32 scale per kv head, runs the new kernel too (``new/fp8``:
checked against the dequantized cache, its accuracy cost against the bf16 cache printed; its GB/s counts the fp8
bytes).

Sweeps for the split rule and the tile: ``num_splits`` 1-32 on every row, and tiles (keys per tile, warps, stages,
tensor cores or not) on the contiguous and 16-block layouts. Host cost: one call per iteration with new lengths
each time (eager: host time per call, and a call from an idle GPU minus the kernel's time), and the whole call
captured in a CUDA graph, replayed with new lengths (the output checked against eager calls on those lengths).

Usage (one H100/H200, about 3-5 minutes):  python tools/decode_bench.py [--flex] [--quick] [--rounds N]
[--budget S]
A CSV of every timing goes to $OUT/decode_bench.csv when OUT is set. Every row runs in its own try/except.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import os
import random
import statistics
import sys
import time
import traceback
import zlib

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import flashlite  # noqa: E402
from flashlite.kernels.attention_decode_launch import (DecodeConfig, SPLIT_RULE, choose_splits,  # noqa: E402
                                                       decode_attention, default_config,
                                                       prepare_decode)

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEVICE, DTYPE = "cuda", torch.bfloat16
COPY_BANDWIDTH = 4.26e12  # bytes/s, device-to-device copy on an H200 (issue 48); replaced by this card's, measured
MASKED_ROWS = [(1, 32768, 1), (8, 8192, 1), (32, 4096, 1), (64, 2048, 1), (16, 32768, 1), (16, 8192, 4)]
FULL_ROWS = [(1, 32768, 1), (8, 8192, 1), (16, 8192, 1), (16, 32768, 1)]
LAYOUTS = [0, 16, 64, 256]  # 0: contiguous; else the paged block size
FULL_LAYOUTS = [0, 64]
SPLITS = [1, 2, 4, 8, 16, 32]
TILES = [DecodeConfig(64, 4, 3, True), DecodeConfig(32, 4, 3, True), DecodeConfig(128, 8, 3, True),
         DecodeConfig(64, 8, 4, True), DecodeConfig(64, 4, 2, True), DecodeConfig(32, 4, 3, False),
         DecodeConfig(32, 8, 3, False), DecodeConfig(16, 4, 4, False)]
TOLERANCE = 2.5e-2  # bf16 output against float32: a few bf16 ulps of values of magnitude ~1


def tile_name(c: DecodeConfig) -> str:
    return f"n{c.block_n}w{c.num_warps}s{c.num_stages}{'dot' if c.use_dot else 'fma'}"


def make_row(batch, capacity, seq_q, full, seed):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, HEADS, seq_q, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    k = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    v = torch.randn(batch, KV_HEADS, capacity, HEAD_DIM, device=DEVICE, dtype=DTYPE, generator=gen)
    if full:
        lengths = torch.full((batch,), capacity, dtype=torch.int32, device=DEVICE)
    else:
        lengths = torch.randint(capacity // 2, capacity + 1, (batch,), device=DEVICE, generator=gen,
                                dtype=torch.int32)
    return q, k, v, lengths


def paged(k, v, block_size, seed):
    """k, v [B, H_kv, S, D] as shuffled blocks [blocks, H_kv, block size, D] and the int32 table [B, S / block]."""
    batch, kv_heads, capacity, dim = k.shape
    per_entry = capacity // block_size
    order = torch.randperm(batch * per_entry, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    stores = []
    for cache in (k, v):
        blocks = cache.reshape(batch, kv_heads, per_entry, block_size, dim).permute(0, 2, 1, 3, 4)
        store = torch.empty((batch * per_entry, kv_heads, block_size, dim), dtype=cache.dtype, device=DEVICE)
        store[order] = blocks.reshape(batch * per_entry, kv_heads, block_size, dim)
        stores.append(store)
    return stores[0], stores[1], order.reshape(batch, per_entry).to(torch.int32)


def reference(q, k, v, lengths):
    """float32 [B, H, S_q, D], entry by entry from the definition (query i sees keys j <= n - S_q + i)."""
    batch, heads, seq_q, dim = q.shape
    group = heads // k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for b, n in enumerate(lengths.tolist()):
        qq = q[b].float().reshape(k.shape[1], group, seq_q, dim).reshape(k.shape[1], group * seq_q, dim)
        scores = qq @ k[b, :, :n].float().transpose(-1, -2) * dim ** -0.5  # [H_kv, G * S_q, n]
        position = (torch.arange(group * seq_q, device=q.device) % seq_q) + n - seq_q
        scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] > position[:, None], float("-inf"))
        out[b] = (scores.softmax(-1) @ v[b, :, :n].float()).reshape(heads, seq_q, dim)
    return out


def bytes_read(q, lengths):
    return int(lengths.sum().item()) * KV_HEADS * HEAD_DIM * 2 * 2 + 2 * q.numel() * q.element_size()


def fp8_call(q, k, v, lengths, name):
    """The new kernel on the cache quantized to fp8 e4m3 with a scale per kv head (largest magnitude to 448),
    checked against float32 on the dequantized cache (fails loudly); prints the accuracy cost against the bf16
    cache's float32 reference."""
    quantized = []
    for cache in (k, v):
        scale = cache.float().abs().amax(dim=(0, 2, 3)) / 448
        quantized += [(cache.float() / scale[None, :, None, None]).to(torch.float8_e4m3fn), scale]
    k8, k_scale, v8, v_scale = quantized
    call = lambda: decode_attention(q, k8, v8, lengths, k_scale=k_scale, v_scale=v_scale)  # noqa: E731
    out = call().float()
    dequantized = reference(q, k8.float() * k_scale[None, :, None, None], v8.float() * v_scale[None, :, None, None],
                            lengths)
    error = (out - dequantized).abs().max().item()
    if not error <= TOLERANCE:
        raise AssertionError(f"CORRECTNESS FAILURE {name} new/fp8: max |out - float32 ref on the dequantized "
                             f"cache| = {error}")
    exact = reference(q, k, v, lengths)
    cost = (out - exact).abs().max().item()
    rms = ((out - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()).item()
    print(f"  {name} fp8 cache: max |out - bf16-cache reference| {cost:.2e}, relative rms {rms:.2e} (kernel vs "
          f"dequantized reference {error:.2e})", flush=True)
    return call


def time_interleaved(fns, rounds, flush, seed):
    """{name: [ms per round]}: every function once per round, in a shuffled order, an L2 flush before each."""
    for fn in fns.values():  # warm-up (and compile)
        fn()
        fn()
    torch.cuda.synchronize()
    rng = random.Random(seed)
    times = {name: [] for name in fns}
    for _ in range(rounds):
        order = list(fns)
        rng.shuffle(order)
        marks = []
        for name in order:
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fns[name]()
            end.record()
            marks.append((name, start, end))
        torch.cuda.synchronize()
        for name, start, end in marks:
            times[name].append(start.elapsed_time(end))
    return times


def flex_fn(q, k, v, lengths):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    compiled = torch.compile(flex_attention)
    seq_q, capacity = q.shape[2], k.shape[2]

    def visible(b, h, i, j):
        return j <= lengths[b] - seq_q + i
    mask = create_block_mask(visible, B=q.shape[0], H=None, Q_LEN=seq_q, KV_LEN=capacity, device=DEVICE)
    return lambda: compiled(q, k, v, block_mask=mask, enable_gqa=True)


def run_row(label, batch, capacity, seq_q, full, layouts, args, flush, results, summary):
    q, k, v, lengths = make_row(batch, capacity, seq_q, full, seed=zlib.crc32(label.encode()))
    expected = reference(q, k, v, lengths)
    work = bytes_read(q, lengths)
    work_fp8 = (work - 2 * q.numel() * q.element_size()) // 2 + 2 * q.numel() * q.element_size()
    if full:
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    else:
        position = lengths.long()[:, None, None] - seq_q + torch.arange(seq_q, device=DEVICE)[None, :, None]
        mask = (torch.arange(capacity, device=DEVICE)[None, None, :] <= position)[:, None]  # [B, 1, S_q, S]
        sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    flex = None
    if args.flex:
        try:
            flex = flex_fn(q, k, v, lengths)
            flex()
        except Exception as error:  # optional baseline
            print(f"  flex unavailable: {type(error).__name__}: {error}"[:300])
            flex = None
    for page in layouts:
        name = f"{label} {'contiguous' if page == 0 else f'paged{page}'}"
        try:
            if page:
                kc, vc, table = paged(k, v, page, seed=page)
            else:
                kc, vc, table = k, v, None
            default_splits = choose_splits(batch, KV_HEADS, capacity, SM_COUNT)
            fns = {"new": lambda: decode_attention(q, kc, vc, lengths, block_table=table)}
            if default_splits > 1:  # the merge fused into the split kernel (the last share of a pair merges)
                fused = DecodeConfig(*dataclasses.astuple(default_config(HEAD_DIM, HEADS // KV_HEADS * seq_q,
                                                                         DTYPE))[:4], fused_merge=True)
                fns["new/fused"] = lambda: decode_attention(q, kc, vc, lengths, block_table=table, config=fused)
            if not args.quick:
                for s in SPLITS:
                    fns[f"new/s{s}"] = (lambda s=s: decode_attention(q, kc, vc, lengths, block_table=table,
                                                                     num_splits=s))
                if page in (0, 16):
                    for c in TILES:
                        if not c.use_dot and (HEADS // KV_HEADS) * seq_q > 8:
                            continue  # the CUDA-core product of 16+ rows does not fit the registers
                        fns[f"new/{tile_name(c)}"] = (lambda c=c: decode_attention(
                            q, kc, vc, lengths, block_table=table, config=c))
            # Correctness first: every configuration of the new kernel that will be timed.
            for impl, fn in fns.items():
                out = fn()
                error = (out.float() - expected).abs().max().item()
                if not error <= TOLERANCE:  # NaN fails too
                    raise AssertionError(f"CORRECTNESS FAILURE {name} {impl}: max |out - float32 ref| = {error}")
            api = (lambda: flashlite.attention_with_kvcache(q, kc, vc, lengths, block_table=table))
            api_error = (api().float() - expected).abs().max().item()
            if not api_error <= TOLERANCE:
                print(f"  note: attention_with_kvcache off by {api_error} on {name}")
            if page == 0 and not args.quick:
                fns["new/fp8"] = fp8_call(q, k, v, lengths, name)
            fns["api"], fns["sdpa"] = api, sdpa
            fns["old"] = general_kernel_call(q, kc, vc, lengths, table)
            if flex is not None:
                fns["flex"] = flex
            times = time_interleaved(fns, args.rounds, flush, seed=len(results))
            medians = {impl: statistics.median(t) for impl, t in times.items()}
            for impl, t in times.items():
                speedup = statistics.median(s / x for s, x in zip(times["sdpa"], t))
                us = medians[impl] * 1e3
                rate = (work if impl != "new/fp8" else work_fp8) / (medians[impl] * 1e-3)
                results.append(dict(row=label, layout=page, impl=impl, us=round(us, 2), gbps=round(rate / 1e9),
                                    pct_copy_bw=round(100 * rate / COPY_BANDWIDTH, 1),
                                    vs_sdpa=round(speedup, 3), default_splits=default_splits))
            sweep = {i: medians[i] for i in medians if i.startswith("new/s")}
            best = min(sweep, key=sweep.get) if sweep else "new"
            tiles = {i: medians[i] for i in medians if i.startswith("new/n")}
            best_tile = min(tiles, key=tiles.get) if tiles else "-"
            line = dict(name=name, new=medians["new"] * 1e3, splits=default_splits, best=best,
                        best_us=medians[best] * 1e3, best_tile=best_tile,
                        best_tile_us=medians[best_tile] * 1e3 if tiles else float("nan"),
                        api=medians["api"] * 1e3, sdpa=medians["sdpa"] * 1e3,
                        flex=medians["flex"] * 1e3 if "flex" in medians else float("nan"),
                        fp8=medians["new/fp8"] * 1e3 if "new/fp8" in medians else float("nan"),
                        fused=medians["new/fused"] * 1e3 if "new/fused" in medians else float("nan"),
                        fp8_vs=statistics.median(s / x for s, x in zip(times["sdpa"], times["new/fp8"]))
                        if "new/fp8" in times else float("nan"),
                        gbps=work / (medians["new"] * 1e-3) / 1e9,
                        new_vs=[r for r in results if r["row"] == label and r["layout"] == page
                                and r["impl"] == "new"][0]["vs_sdpa"],
                        api_vs=[r for r in results if r["row"] == label and r["layout"] == page
                                and r["impl"] == "api"][0]["vs_sdpa"])
            summary.append(line)
            print(f"  {name}: new {line['new']:.1f} us ({default_splits} splits, {line['gbps']:.0f} GB/s, "
                  f"{100 * line['gbps'] * 1e9 / COPY_BANDWIDTH:.0f}%), best split {best} {line['best_us']:.1f} us, "
                  f"best tile {best_tile} {line['best_tile_us']:.1f} us, api {line['api']:.1f} us, "
                  f"sdpa {line['sdpa']:.1f} us, flex {line['flex']:.1f} us, fused merge {line['fused']:.1f} us, "
                  f"fp8 {line['fp8']:.1f} us; new vs sdpa {line['new_vs']:.2f}x",
                  flush=True)
            print("    splits: " + ", ".join(f"{i[5:]}={medians[i] * 1e3:.1f}" for i in sweep)
                  + (" | tiles: " + ", ".join(f"{i[4:]}={medians[i] * 1e3:.1f}" for i in tiles) if tiles else ""),
                  flush=True)
            del kc, vc
        except Exception:
            print(f"  ROW FAILED {name}:\n" + traceback.format_exc()[-2500:], flush=True)
            summary.append(dict(name=name, failed=True))


def host_probe(batch, capacity, results):
    """Host cost with new lengths each call: eager (host time per call; a call from an idle GPU minus the kernel's
    time) and the whole call captured in a CUDA graph, replayed with new lengths and checked."""
    label = f"host {batch}x{capacity}"
    q, k, v, lengths = make_row(batch, capacity, 1, False, seed=7)
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    pool = [torch.randint(1, capacity + 1, (batch,), device=DEVICE, generator=gen, dtype=torch.int32)
            for _ in range(8)]
    calls = [("new", lambda: decode_attention(q, k, v, lengths)),
             ("api", lambda: flashlite.attention_with_kvcache(q, k, v, lengths))]
    try:  # the launches recorded once and replayed with Triton's binding skipped (what an op layer can keep)
        from flashlite._direct_launch import record
        prepared = prepare_decode(q, k, v, lengths)
        recorded = [record(launch.kernel, launch.grid, launch.args, launch.kwargs, launch.n_tensors)
                    for launch in prepared.launches]
        if all(r is not None for r in recorded):
            def replayed():
                for r, launch in zip(recorded, prepared.launches):
                    r.launch(*launch.args[:launch.n_tensors])
                return prepared.out
            calls.append(("new-recorded", replayed))
        else:
            print("  recording the launches is not available here")
    except Exception:
        print("  RECORDING FAILED:\n" + traceback.format_exc()[-1500:], flush=True)
    for impl, call in calls:
        try:
            for _ in range(5):
                call()
            torch.cuda.synchronize()
            count = 200
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            for i in range(count):
                lengths.copy_(pool[i % 8])
                call()
            end.record()
            host = (time.perf_counter() - t0) / count * 1e6
            torch.cuda.synchronize()
            gpu = start.elapsed_time(end) / count * 1e3
            idle = []
            for i in range(50):
                lengths.copy_(pool[i % 8])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                call()
                torch.cuda.synchronize()
                idle.append((time.perf_counter() - t0) * 1e6)
            idle_us = statistics.median(idle)
            print(f"  {label} {impl} eager: host {host:.1f} us/call (back to back; GPU {gpu:.1f} us/call incl. a "
                  f"lengths copy), from an idle GPU {idle_us:.1f} us wall, {idle_us - gpu:.1f} us over the GPU time",
                  flush=True)
            results.append(dict(row=label, layout=0, impl=f"{impl}/eager-host", us=round(host, 2)))
            results.append(dict(row=label, layout=0, impl=f"{impl}/idle-over-gpu", us=round(idle_us - gpu, 2)))
        except Exception:
            print(f"  HOST PROBE FAILED {label} {impl} eager:\n" + traceback.format_exc()[-1500:], flush=True)
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    call()
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = call()
            outputs = []
            for new in pool[:3]:
                lengths.copy_(new)
                graph.replay()
                torch.cuda.synchronize()
                outputs.append(static_out.clone())
                eager = decode_attention(q, k, v, lengths)
                error = (static_out.float() - eager.float()).abs().max().item()
                if not error <= 1e-2:
                    raise AssertionError(f"graph replay with new lengths differs from an eager call by {error}")
            if torch.equal(outputs[0], outputs[1]):
                raise AssertionError("the graph's output did not change with the lengths")
            replays = []
            for i in range(50):
                lengths.copy_(pool[i % 8])
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                replays.append((time.perf_counter() - t0) * 1e6)
            print(f"  {label} {impl} CUDA graph: replay with new lengths correct; {statistics.median(replays):.1f} us "
                  f"wall from an idle GPU", flush=True)
            results.append(dict(row=label, layout=0, impl=f"{impl}/graph-replay-wall",
                                us=round(statistics.median(replays), 2)))
        except Exception:
            print(f"  HOST PROBE FAILED {label} {impl} graph:\n" + traceback.format_exc()[-1500:], flush=True)


def copy_bandwidth() -> float:
    """Bytes per second read and written by a device-to-device copy of 1 GiB on this card (median of 20)."""
    source = torch.empty(2 ** 30, dtype=torch.uint8, device=DEVICE).random_()
    target = torch.empty_like(source)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        target.copy_(source)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e-3)
    del source, target
    return 2 * 2 ** 30 / statistics.median(times)


def write_csv(results):
    """Every timing so far to $OUT/decode_bench.csv (rewritten after each row, so a run cut short keeps its rows)."""
    if not os.environ.get("OUT") or not results:
        return
    path = os.path.join(os.environ["OUT"], "decode_bench.csv")
    fields = sorted({key for r in results for key in r})
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(results)


def general_kernel_call(q, k_cache, v_cache, lengths, table):
    """``attention_with_kvcache`` on the general forward kernel it used before the decoding kernel (its split-KV
    path), for the before/after column: the decoding kernel's predicate is turned off for the call."""
    import flashlite.attn.kvcache as kvcache_module

    def call():
        serves = kvcache_module.decode_kernel_serves
        kvcache_module.decode_kernel_serves = lambda problem: False
        try:
            return flashlite.attention_with_kvcache(q, k_cache, v_cache, lengths, block_table=table,
                                                    backend="triton")
        finally:
            kvcache_module.decode_kernel_serves = serves
    return call


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--flex", action="store_true", help="also time FlexAttention (compiles per row)")
    parser.add_argument("--quick", action="store_true", help="no split, tile or fp8 runs")
    parser.add_argument("--budget", type=float, default=270,
                        help="seconds after which the rows not yet started are skipped (the summary still prints)")
    args = parser.parse_args()
    global SM_COUNT
    props = torch.cuda.get_device_properties(0)
    SM_COUNT = props.multi_processor_count
    import triton
    print(f"GPU: {props.name}, {SM_COUNT} SMs; torch {torch.__version__}, triton {triton.__version__}; "
          f"split rule {SPLIT_RULE}; default tile (D=128, bf16) {default_config(128, 4, torch.bfloat16)}", flush=True)
    flush = torch.empty(256 * 2 ** 20, dtype=torch.uint8, device=DEVICE)
    global COPY_BANDWIDTH
    COPY_BANDWIDTH = copy_bandwidth()
    print(f"device-to-device copy: {COPY_BANDWIDTH / 1e12:.2f} TB/s (read + written, median of 20 copies of 1 GiB)",
          flush=True)
    results, summary = [], []
    started = time.time()
    print(f"host cost ({time.time() - started:.0f} s)", flush=True)
    for batch, capacity in ((1, 4096), (8, 8192)):
        host_probe(batch, capacity, results)
    for rows, full, layouts in ((MASKED_ROWS, False, LAYOUTS), (FULL_ROWS, True, FULL_LAYOUTS)):
        for batch, capacity, seq_q in rows:
            label = f"{batch}x{capacity}{f' q{seq_q}' if seq_q > 1 else ''}{' full' if full else ''}"
            if time.time() - started > args.budget:
                print(f"{label}: SKIPPED, past the --budget of {args.budget} s", flush=True)
                continue
            print(f"{label} ({time.time() - started:.0f} s)", flush=True)
            try:
                run_row(label, batch, capacity, seq_q, full, layouts, args, flush, results, summary)
            except Exception:
                print(f"  ROW FAILED {label}:\n" + traceback.format_exc()[-2500:], flush=True)
            torch.cuda.empty_cache()
            write_csv(results)
    print(f"\nSUMMARY ({props.name}; us are medians of {args.rounds} interleaved rounds, L2 flushed; vs SDPA: median "
          f"of SDPA time / time, >1 faster; % of this card's measured copy bandwidth, {COPY_BANDWIDTH / 1e12:.2f} TB/s)")
    print(f"{'row':<28}{'new us':>8}{'spl':>4}{'GB/s':>7}{'%bw':>5}{'vsSDPA':>7}{'best split':>13}{'best tile':>20}"
          f"{'api us':>8}{'api vs':>7}{'sdpa us':>8}{'flex us':>8}{'fp8 us':>8}{'fp8 vs':>7}{'fused':>8}")
    for line in summary:
        if line.get("failed"):
            print(f"{line['name']:<28} FAILED")
            continue
        best = f"{line['best'].replace('new/', '')} {line['best_us']:.1f}"
        tile = f"{line['best_tile'].replace('new/', '')} {line['best_tile_us']:.1f}"
        print(f"{line['name']:<28}{line['new']:>8.1f}{line['splits']:>4}{line['gbps']:>7.0f}"
              f"{100 * line['gbps'] * 1e9 / COPY_BANDWIDTH:>5.0f}{line['new_vs']:>7.2f}"
              f" {best:>12} {tile:>19}"
              f"{line['api']:>8.1f}{line['api_vs']:>7.2f}{line['sdpa']:>8.1f}{line['flex']:>8.1f}"
              f"{line['fp8']:>8.1f}{line['fp8_vs']:>7.2f}{line['fused']:>8.1f}")
    write_csv(results)
    print(f"total {time.time() - started:.0f} s")


SM_COUNT = 132

if __name__ == "__main__":
    main()
