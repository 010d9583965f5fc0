"""What one decoding-shaped ``flashlite.attention`` call costs over SDPA itself, timed with the CPU clock.

A decoding step attends one new query (S_q = 1, ``causal="lower_right"``) to every cached key, and the key length
grows by one each step, as in generation: each call has sizes no earlier call had. Both sides run the same calls
(views of one preallocated cache, cycling through 512 lengths), so the difference is flashlite's host work: how it
checks and plans a call whose key length it has not seen. The second comparison repeats one key length, the cost of
a replayed plan. These are benchmarks, not timed assertions: the report carries the verdict and both sides' times.

On a CUDA GPU a third comparison times ``attention_with_kvcache`` on the decoding kernel (new lengths every call, a
replayed plan: its launches recorded once) against the decoding launcher called directly (``decode_attention``,
Triton's ordinary launch): the host work a replayed cache call saves or adds. It is skipped on the CPU, where the
kernel runs in Triton's interpreter.
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from flashlite.attention import attention, attention_with_kvcache

# A small decoding step on the CPU (SDPA itself takes about 10-20 us here), so that host costs show.
BATCH, HEADS, HEAD_DIM, FIRST_LENGTH, LENGTHS = 1, 8, 64, 256, 512


def _decode_inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    capacity = FIRST_LENGTH + LENGTHS
    q = torch.randn(BATCH, HEADS, 1, HEAD_DIM, generator=gen)
    k_cache, v_cache = (torch.randn(BATCH, HEADS, capacity, HEAD_DIM, generator=gen) for _ in range(2))
    return q, k_cache, v_cache


def _growing(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, call):
    """A zero-argument step that calls ``call(q, k, v)`` with the key length one longer each time (cycling)."""
    lengths = itertools.cycle(range(FIRST_LENGTH, FIRST_LENGTH + LENGTHS))
    return lambda: (lambda n: call(q, k_cache[:, :, :n], v_cache[:, :, :n]))(next(lengths))


def _flashlite(q, k, v):
    return attention(q, k, v, causal="lower_right")


def _sdpa(q, k, v):
    # One query at the bottom-right diagonal sees every key: SDPA without a mask is the same attention.
    return F.scaled_dot_product_attention(q, k, v)


def test_decode_step_with_growing_keys_vs_sdpa(kernel_ab):
    q, k_cache, v_cache = _decode_inputs()
    for n in (FIRST_LENGTH, FIRST_LENGTH + 1):  # the two sides agree before anything is timed
        k, v = k_cache[:, :, :n], v_cache[:, :, :n]
        torch.testing.assert_close(_flashlite(q, k, v), _sdpa(q, k, v))
    kernel_ab.compare(_growing(q, k_cache, v_cache, _flashlite), _growing(q, k_cache, v_cache, _sdpa),
                      name="cpu decode: key length +1 per call, flashlite vs sdpa", max_time=1.0,
                      check_output=False)  # each call has another key length, so another output


@pytest.mark.parametrize("keys", [FIRST_LENGTH + LENGTHS // 2])
def test_decode_step_replayed_vs_sdpa(kernel_ab, keys):
    q, k_cache, v_cache = _decode_inputs()
    k, v = k_cache[:, :, :keys], v_cache[:, :, :keys]
    torch.testing.assert_close(_flashlite(q, k, v), _sdpa(q, k, v))
    kernel_ab.compare(lambda: _flashlite(q, k, v), lambda: _sdpa(q, k, v),
                      name="cpu decode: one key length (plan replayed), flashlite vs sdpa", max_time=1.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the decoding kernel's launches are recorded on CUDA only")
def test_kvcache_decode_replayed_vs_decoding_launcher(kernel_ab):
    from flashlite.kernels.attention_decode_launch import decode_attention
    gen = torch.Generator(device="cuda").manual_seed(1)
    batch, heads, kv_heads, capacity, head_dim = 8, 32, 8, 4096, 128
    q = torch.randn(batch, heads, 1, head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k_cache, v_cache = (torch.randn(batch, kv_heads, capacity, head_dim, device="cuda", dtype=torch.bfloat16,
                                    generator=gen) for _ in range(2))
    # Lengths that change every call, preallocated on the device (a decoding loop keeps them there).
    lengths = itertools.cycle([torch.randint(1, capacity, (batch,), device="cuda", dtype=torch.int32, generator=gen)
                               for _ in range(64)])
    with torch.no_grad():
        first = next(lengths)
        torch.testing.assert_close(attention_with_kvcache(q, k_cache, v_cache, first, backend="triton"),
                                   decode_attention(q, k_cache, v_cache, first), atol=2e-2, rtol=2e-2)
        kernel_ab.compare(lambda: attention_with_kvcache(q, k_cache, v_cache, next(lengths), backend="triton"),
                          lambda: decode_attention(q, k_cache, v_cache, next(lengths)),
                          name="cuda decode: attention_with_kvcache (plan replayed) vs decoding launcher",
                          max_time=2.0, check_output=False)  # each call has other lengths, so another output
