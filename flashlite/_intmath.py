"""Integer helpers for host code: ceiling division, powers of two, sequence-length buckets (no Triton, no torch).

``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions meant for kernels: called from Python they
go through Triton's wrapper, several times per launch (benchmarks/results/cpu-host-2026-11-29/ at commit 8ca4529 has
the launchers'
host time before and after). These plain versions give the same results for the positive sizes launch code passes.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """Ceiling of a / b for integers, b > 0.

    Example:
        >>> cdiv(129, 64), cdiv(128, 64), cdiv(0, 64)
        (3, 2, 0)
    """
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1).

    Example:
        >>> next_power_of_2(80), next_power_of_2(64), next_power_of_2(1)
        (128, 64, 1)
    """
    return 1 << (n - 1).bit_length() if n > 1 else 1


def seq_bucket(seq_len: int) -> int:
    """Round a sequence length up to a power of two (minimum 64): the sequence granularity of the dispatch table
    (``flashlite.dispatch``) and, capped, of the kernels' autotuning key (``flashlite.kernels.tuning``).

    Example:
        >>> seq_bucket(100), seq_bucket(128), seq_bucket(100_000)
        (128, 128, 131072)
    """
    if seq_len < 1:
        raise ValueError(f"sequence length must be positive, got {seq_len}")
    return max(64, 1 << (seq_len - 1).bit_length())
