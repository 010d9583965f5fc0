"""CPU-host probe of ``attention_with_kvcache``: its host work per replayed decoding call, and the fp8 cache's
accuracy cost. Prints every figure it measures; run it on an otherwise idle machine.

Host work (B=8, 32 query heads, 8 kv heads, D=128, a 4,096-position cache, float32 CPU tensors): the kernel's
launches are stubbed out (each recorded launch replaced by one that launches nothing), so what is timed is the API's
own per-call work on a kept plan: the key, the checks, the output buffers, binding the tensors. Beside it, the
pieces it replaced or avoids: ``prepare_decode`` per call (what a replayed call redid before the plan kept its
``DecodeLayout``) against ``DecodeLayout.bind``, and the cache call's key packed in C++ (``plan.key_of``) against its
Python form (``plan.python_key_of``). Medians of 9 repeats of 5,000 calls, one thread.

fp8 accuracy: the scheme of ``test_the_accuracy_cost_of_an_fp8_cache_is_bounded`` (tests/flashlite/attn/
test_attention_kvcache_fp8.py) over seeds 1000..1009: unit-normal float16 q and caches at the test's odd sizes,
each kv head's largest magnitude at 448, S_q 1 and 3, the decoding kernel (Triton's interpreter) and SDPA; the
largest |out_fp8 - out_fp16| over all of them.

Usage: python tools/kvcache_cpu_probe.py   (about a minute; sets TRITON_INTERPRET=1 for the fp8 part)
"""
from __future__ import annotations

import os
import statistics
import sys
import timeit

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from flashlite.attention import attention_with_kvcache  # noqa: E402
from flashlite.attn import plan as plans  # noqa: E402
from flashlite.attn.kvcache import _plan_key  # noqa: E402
from flashlite.attn.kvcache_fp8 import FP8_MAX, quantized  # noqa: E402
from flashlite.kernels.attention_decode_launch import prepare_decode  # noqa: E402


def per_call_us(fn, number=5000, repeats=9) -> float:
    fn()
    return statistics.median(timeit.timeit(fn, number=number) / number * 1e6 for _ in range(repeats))


class _NoLaunch:
    """A recorded launch that launches nothing: the call's own host work is what remains."""

    def launch(self, *tensors) -> bool:
        return True


def host_work() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(8, 32, 1, 128, generator=gen)
    cache = torch.randn(8, 8, 4096, 128, generator=gen)
    lengths = torch.randint(1, 4096, (8,), dtype=torch.int32, generator=gen)
    call = (q, cache, cache, lengths)
    plans._PLANS.clear()
    attention_with_kvcache(*call, backend="triton", check_values=False)  # the plan, its layout, one launch
    (plan,) = [p for key, p in plans._PLANS.items() if plans.entry_of(key) == "kvcache"]
    layout = plan.layouts["decode"]
    sites = 1 + (layout.merge_grid is not None)
    for site in range(sites):
        plan.recorded[site] = _NoLaunch()
    print(f"shares {layout.split_grid[1]}, launches per call {sites}")
    print(f"attention_with_kvcache, plan replayed, launches stubbed: "
          f"{per_call_us(lambda: attention_with_kvcache(*call, backend='triton', check_values=False)):.2f} us/call")
    print(f"prepare_decode per call: {per_call_us(lambda: prepare_decode(*call)):.2f} us")
    print(f"DecodeLayout.bind per call: {per_call_us(lambda: layout.bind(*call, None, None, None)):.2f} us")
    fields = (*call, None, None, None, None, None, None, None, "triton", None, None, None)
    assert isinstance(_plan_key(*fields), bytes)  # the API's key is the packed one here
    print(f"kvcache key, C++ (key_of): {per_call_us(lambda: plans.key_of('kvcache', *fields)):.2f} us")
    print(f"kvcache key, Python (python_key_of): "
          f"{per_call_us(lambda: plans.python_key_of('kvcache', *fields)):.2f} us")


def fp8_accuracy() -> None:
    batch, heads, kv_heads, capacity, dim = 4, 4, 2, 45, 16  # tests/flashlite/attn/test_attention_kvcache.py's
    worst = 0.0
    for seed in range(1000, 1010):
        gen = torch.Generator().manual_seed(seed)
        for seq_q in (1, 3):
            def rand(*size):
                return torch.randn(*size, generator=gen).to(torch.float16)
            q, k16, v16 = rand(batch, heads, seq_q, dim), rand(batch, kv_heads, capacity, dim), \
                rand(batch, kv_heads, capacity, dim)
            lengths = torch.tensor([0, 1, 17, capacity - seq_q], dtype=torch.int32)
            k_scale = k16.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX
            v_scale = v16.float().abs().amax(dim=(0, 2, 3)) / FP8_MAX
            k8, v8 = quantized(k16, k_scale), quantized(v16, v_scale)
            for backend in ("triton", "sdpa"):
                fp8 = attention_with_kvcache(q, k8, v8, lengths, backend=backend, k_scale=k_scale, v_scale=v_scale)
                fp16 = attention_with_kvcache(q, k16, v16, lengths, backend=backend)
                error = (fp8.double() - fp16.double()).abs().max().item()
                worst = max(worst, error)
                print(f"seed {seed} S_q {seq_q} {backend}: max |fp8 - fp16| {error:.4f}")
    print(f"fp8 accuracy: largest max |out_fp8 - out_fp16| over seeds 1000..1009: {worst:.4f}")


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, one thread")
    host_work()
    fp8_accuracy()
