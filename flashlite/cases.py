"""The standard attention shapes (d_model 1024, H=16, D=64) with their byte and FLOP estimates.

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
        forward = 4.0 * self.B * self.H * self.S * self.S * self.D
        if causal:
            forward /= 2
        return forward * (2.5 if backward else 1.0)

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
