"""The standard attention shapes (d_model 1024, H=16, D=64) with their byte and FLOP estimates, and the FLOP and
byte counts of one attention call that the A/B suite rates kernels by (:func:`attention_flops`,
:func:`attention_io_bytes`).

Case 14 (B=32, S=100,000) is the one whose materialized score matrix cannot exist on any GPU: the estimates make
that explicit so tests can mark it intractable for a materialized reference while still running the kernel.

Example:
    >>> case = CASES[13]
    >>> case.number, case.B, case.S
    (14, 32, 100000)
    >>> round(case.materialized_score_bytes() / 1e12, 1)  # fp32 scores, terabytes
    20.5
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_BYTES = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a floating dtype.

    Example:
        >>> dtype_bytes(torch.bfloat16)
        2
    """
    try:
        return _BYTES[dtype]
    except KeyError:
        raise ValueError(f"no byte size known for dtype {dtype}") from None


# FLOPs of each pass, in units of the forward's 4*B*H*S_q*S_k*D: the forward is two matmuls (Q K^T and P V); the
# backward five of the same size (the scores recomputed, dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q).
_PASS_FLOPS = {"forward": 1.0, "backward": 2.5, "forward+backward": 3.5}


def attention_flops(B: int, H: int, S_q: int, S_k: int, D: int, *, causal: bool, passes: str = "forward") -> float:
    """Matmul FLOPs of attention over ``H`` query heads, counting only what a kernel that skips masked blocks
    computes: 4*B*H*S_q*S_k*D for the forward, half of it when causal (S_q == S_k: the upper triangle is never
    computed); ``passes`` "backward" is 2.5x the forward, "forward+backward" 3.5x. Softmax and scaling are not
    counted (a few FLOPs per score, against 4*D).

    Example:
        >>> attention_flops(1, 16, 1024, 1024, 64, causal=False) / 1e9
        4.294967296
        >>> attention_flops(1, 16, 1024, 1024, 64, causal=True, passes="forward+backward") / 1e9
        7.516192768
    """
    if passes not in _PASS_FLOPS:
        raise ValueError(f"passes must be one of {', '.join(_PASS_FLOPS)}, got {passes!r}")
    if causal and S_q != S_k:
        raise ValueError(f"causal FLOPs are counted for S_q == S_k only, got S_q={S_q}, S_k={S_k}")
    forward = 4.0 * B * H * S_q * S_k * D / (2 if causal else 1)
    return forward * _PASS_FLOPS[passes]


def attention_io_bytes(B: int, H: int, S_q: int, S_k: int, D: int, dtype: torch.dtype, *,
                       kv_heads: int | None = None, passes: str = "forward") -> int:
    """Bytes of device memory attention must move at least: the forward reads q, k, v and writes the output; the
    backward reads q, k, v, the output and its gradient and writes dq, dk, dv. The fp32 per-row statistics
    (log-sum-exp, the backward's row sums) are not counted: 4 bytes a row against 2*D or 4*D of each tensor.

    Example:
        >>> attention_io_bytes(1, 16, 1024, 1024, 64, torch.bfloat16) / 2**20
        8.0
        >>> attention_io_bytes(1, 16, 1024, 1024, 64, torch.bfloat16, kv_heads=4, passes="forward+backward") / 2**20
        15.0
    """
    if passes not in _PASS_FLOPS:
        raise ValueError(f"passes must be one of {', '.join(_PASS_FLOPS)}, got {passes!r}")
    elem = dtype_bytes(dtype)
    q_sized = B * H * S_q * D * elem  # q, the output, their gradients
    kv_sized = B * (H if kv_heads is None else kv_heads) * S_k * D * elem  # k, v, their gradients
    forward = 2 * q_sized + 2 * kv_sized
    backward = 4 * q_sized + 4 * kv_sized
    return {"forward": forward, "backward": backward, "forward+backward": forward + backward}[passes]


@dataclass(frozen=True)
class Case:
    """One attention shape of the standard table: q, k, v are [B, H, S, D].

    Example:
        >>> Case(0, B=2, S=128).tensor_bytes(torch.float16)
        524288
    """

    number: int
    B: int
    S: int
    H: int = 16
    D: int = 64

    @property
    def d_model(self) -> int:
        return self.H * self.D

    @property
    def id(self) -> str:
        return f"case{self.number}-B{self.B}-S{self.S}"

    def as_dict(self) -> dict[str, int]:
        return {"B": self.B, "S": self.S, "H": self.H, "D": self.D}

    def tensor_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one of q, k, v or the output."""
        return self.B * self.H * self.S * self.D * dtype_bytes(dtype)

    def flops(self, causal: bool = True, backward: bool = False) -> float:
        """Forward attention FLOPs, 4*B*H*S*S*D, halved when causal; backward counts 2.5x the forward."""
        return attention_flops(self.B, self.H, self.S, self.S, self.D, causal=causal,
                               passes="backward" if backward else "forward")

    def kernel_bytes(self, dtype: torch.dtype) -> int:
        """Least device memory a fused forward touches: q, k, v, the output and the fp32 log-sum-exp per row."""
        return 4 * self.tensor_bytes(dtype) + self.B * self.H * self.S * 4

    def materialized_score_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """Bytes of the full [B, H, S, S] score matrix that naive attention materializes."""
        return self.B * self.H * self.S * self.S * dtype_bytes(dtype)

    def reference_bytes(self) -> int:
        """Memory of a float64 materialized reference: the inputs and output in float64 plus float64 scores."""
        return 4 * self.tensor_bytes(torch.float64) + self.materialized_score_bytes(torch.float64)


CASES: list[Case] = [
    Case(n, B, S)
    for n, (B, S) in enumerate(
        [(1, 128), (1, 1024), (1, 8192), (1, 32768), (4, 2048), (8, 4096), (16, 1024), (32, 512), (64, 256),
         (128, 128), (256, 64), (16, 8192), (4, 32768), (32, 100_000)],
        start=1,
    )
]


def case(number: int) -> Case:
    """The case with this number (1-14).

    Example:
        >>> case(9).B, case(9).S
        (64, 256)
    """
    for c in CASES:
        if c.number == number:
            return c
    raise KeyError(f"no case {number}; cases are numbered 1 to {len(CASES)}")
