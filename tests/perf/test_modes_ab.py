"""The measurement modes on the GPU: dense attention, a variant and a decoding-shaped call, each timed back to back
(throughput), one call from an idle GPU (latency) and as a CUDA graph replay (graph), and an A/A check of the
false-verdict rate per mode.

Run (about 3 minutes of GPU time on an H100/H200)::

    python -m pytest tests/perf/test_modes_ab.py --kernel-ab -s -p no:cacheprovider \
        --kernel-ab-report benchmarks/results/modes/ab.json

The report's "Measurement modes" table gives each mode's times, speedup, interval and verdict and each side's host
overhead per call (latency minus the device time of the same call); rows whose verdicts disagree across modes are
flagged. The A/A test prints one line per mode: comparisons, false verdicts (a win or loss of a callable against
itself) and their rate, which should stay at or below alpha (0.05).
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from pytest_kernelcheck import assert_close
from pytest_kernelcheck.speed.budget import Budget
from pytest_kernelcheck.speed.comparison import run_comparison
from pytest_kernelcheck.speed.modes import MODES

from .conftest import attention_work, needs_cuda, qkv

pytestmark = needs_cuda

ALL_MODES = ("throughput", "latency", "graph")
A_A_COMPARISONS = 100  # per mode: the target
A_A_BUDGET = Budget(max_time=0.1, warmup=0.01, max_pairs=640)


class Shape(dict):
    """B, H, S, D and dtype as attributes, as attention_work reads them."""

    __getattr__ = dict.__getitem__


def _agrees(candidate_out: torch.Tensor, baseline_out: torch.Tensor) -> None:
    # SDPA's own bf16 output is the yardstick, as in test_attention_ab.py; float64 checks live in tests/flashlite.
    assert_close(candidate_out.float(), baseline_out.double(), policy=candidate_out.dtype)


@pytest.mark.parametrize("D", [64, 128])
def test_dense_causal_flashlite_vs_sdpa_in_every_mode(kernel_ab, D):
    from flashlite.attention import attention

    shape = Shape(B=4, H=16, S=2048, D=D, dtype=torch.bfloat16)
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    kernel_ab.compare(lambda: attention(q, k, v, causal=True, backend="triton"),
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                      name=f"modes: dense causal B4 S2048 D{D} bf16, flashlite triton vs sdpa", modes=ALL_MODES,
                      check=_agrees, **attention_work(shape))


def test_key_padding_variant_in_every_mode(kernel_ab):
    from flashlite.attention import attention

    B, H, S, D = 8, 16, 2048, 64
    q, k, v = qkv(B, H, S, D, torch.bfloat16)
    lengths = torch.randint(S // 2, S + 1, (B,), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    causal = torch.ones(S, S, dtype=torch.bool, device="cuda").tril()

    def sdpa_with_mask():
        keep = torch.arange(S, device="cuda")[None, :] < lengths[:, None]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal[None, None] & keep[:, None, None, :])

    kernel_ab.compare(lambda: attention(q, k, v, causal=True, key_lengths=lengths), sdpa_with_mask,
                      name="modes: key padding B8 S2048 D64 bf16, flashlite auto vs sdpa+mask", modes=ALL_MODES,
                      check=_agrees)


def test_decoding_shaped_call_in_every_mode(kernel_ab):
    # One new query against a 4096-key cache (S_q = 1, bottom-right causal: every key is visible), as in generation.
    from flashlite.attention import attention

    gen = torch.Generator("cuda").manual_seed(1)
    q = torch.randn(1, 32, 1, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(1, 32, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    kernel_ab.compare(lambda: attention(q, k, v, causal="lower_right"),
                      lambda: F.scaled_dot_product_attention(q, k, v),
                      name="modes: decode S_q=1 S_k=4096 H32 D128 bf16, flashlite vs sdpa", modes=ALL_MODES,
                      check=_agrees)


def _binomial_tail(n: int, p: float, at_least: int) -> float:
    """P(X >= at_least) for X ~ Binomial(n, p)."""
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(at_least, n + 1))


@pytest.mark.parametrize("mode", MODES)
def test_a_against_a_false_verdict_rate(mode):
    # A 1 MiB copy against itself: every win or loss is a false verdict. Timed through run_comparison (no report
    # rows: a hundred A/A rows would bury the real ones); one line per mode goes to stdout (-s).
    src = torch.randn(2**18, device="cuda")
    dst = torch.empty_like(src)
    copy = lambda: dst.copy_(src)  # noqa: E731
    verdicts = [run_comparison(copy, copy, A_A_BUDGET.replace(seed=seed), modes=(mode,), check=False).verdict
                for seed in range(A_A_COMPARISONS)]
    false = sum(v in ("win", "loss") for v in verdicts)
    alpha = A_A_BUDGET.alpha
    print(f"\nA/A {mode:10s}: {A_A_COMPARISONS} comparisons, {false} false verdicts ({false / A_A_COMPARISONS:.1%}; "
          f"alpha {alpha:.0%}); tie {verdicts.count('tie')}, inconclusive {verdicts.count('inconclusive')}")
    # More false verdicts than a 1% tail of Binomial(n, alpha) says the mode's verdicts are not at level alpha.
    assert _binomial_tail(A_A_COMPARISONS, alpha, false) > 0.01, f"{false} false verdicts of {A_A_COMPARISONS}"
