"""How a float64 reference fits: blocks of heads and query rows sized to a memory budget, and a seeded sample
of query rows when all of them would exceed a FLOP budget."""
from __future__ import annotations

import dataclasses

import torch

from .attention_problem import AttentionProblem
from .memory import free_memory, human_bytes

# Share of the free device memory the reference may use for its float64 blocks.
DEFAULT_MEMORY_FRACTION = 0.5


# Float64 work allowed before the check falls back to sampled rows: about a second on an H100/H200 (fp64
# tensor cores near 60 TFLOP/s) and a few seconds on a few host cores.
DEFAULT_FLOP_BUDGET = {"cuda": 5e13, "cpu": 2e10}


# Float64 score-sized temporaries alive at once per (head, row, key): scores, exponentials, one mask/spare.
_SCORE_TEMPORARIES = 3


@dataclasses.dataclass(frozen=True)
class ReferencePlan:
    """How a reference is computed: ``mode`` is "full" (everything in one block per batch entry), "chunked"
    (blocks of heads and query rows) or "sampled" (only ``rows``, in blocks)."""

    mode: str
    rows: torch.Tensor | None  # sorted query-row indices (CPU, int64); None means every row
    heads_per_block: int
    rows_per_block: int
    block_bytes: int
    total_flops: float
    memory_budget: int
    flop_budget: float
    reason: str

    @property
    def rows_checked(self) -> int | None:
        return None if self.rows is None else int(self.rows.numel())


def sample_query_rows(q_len: int, count: int, seed: int = 0) -> torch.Tensor:
    """``count`` distinct query rows out of ``q_len``, seeded, sorted, always with the first and the last.

    Example::

        >>> rows = sample_query_rows(100_000, 64, seed=1)
        >>> int(rows[0]), int(rows[-1]), rows.numel()
        (0, 99999, 64)
    """
    if q_len <= 0:
        raise ValueError(f"cannot sample rows of an empty sequence (q_len={q_len})")
    count = max(1, min(int(count), q_len))
    if count >= q_len:
        return torch.arange(q_len)
    if count == 1:
        return torch.tensor([0])
    generator = torch.Generator().manual_seed(seed)
    inner = torch.randperm(q_len - 2, generator=generator)[: count - 2] + 1
    return torch.cat([torch.tensor([0, q_len - 1]), inner]).sort().values


def default_memory_budget(device: torch.device) -> int:
    """DEFAULT_MEMORY_FRACTION of the free memory of ``device`` (4 GiB when it cannot be measured)."""
    free = free_memory("cpu" if device.type == "cpu" else str(device))
    return int(DEFAULT_MEMORY_FRACTION * free) if free is not None else 4 * 2**30


def plan_reference(
    problem: AttentionProblem,
    *,
    memory_budget: int | None = None,
    flop_budget: float | None = None,
    sample_rows: int | None = None,
    allow_sampling: bool = True,
    seed: int = 0,
    rows: torch.Tensor | None = None,
) -> ReferencePlan:
    """Choose full, chunked or sampled computation for ``problem`` under the two budgets.

    ``rows`` (sorted int64 indices) fixes the query rows to compute. ``sample_rows`` forces a sample of that many
    query rows (all rows when it is >= S_q). Without either, rows are sampled only when the float64 work over all
    rows exceeds ``flop_budget`` and ``allow_sampling`` is true.

    Example::

        >>> from pytest_kernelcheck.check.attention_problem import describe_problem
        >>> p = describe_problem(*[torch.randn(1, 1, 64, 8)] * 3)
        >>> plan_reference(p, flop_budget=1e3, allow_sampling=True).mode
        'sampled'

    Raises:
        MemoryError: not even one query row of one head fits ``memory_budget`` (or, without sampling, the float64
            output itself does not fit).
    """
    if memory_budget is None:
        memory_budget = default_memory_budget(problem.device)
    if flop_budget is None:
        flop_budget = DEFAULT_FLOP_BUDGET["cpu" if problem.device.type == "cpu" else "cuda"]
    heads_total = problem.batch * problem.heads
    full_flops = heads_total * problem.q_len * problem.flops_per_row()

    reason = "the float64 reference fits the budgets"
    if rows is not None:
        reason = f"{rows.numel()} query rows were requested"
    elif sample_rows is not None:
        if isinstance(sample_rows, bool) or not isinstance(sample_rows, int) or sample_rows < 1:
            raise ValueError(f"sample_rows must be a positive int; got {sample_rows!r}")
        if sample_rows < problem.q_len:
            rows = sample_query_rows(problem.q_len, sample_rows, seed)
            reason = f"sample_rows={sample_rows} was requested"
    elif full_flops > flop_budget and allow_sampling:
        affordable = int(flop_budget // (heads_total * problem.flops_per_row()))
        if affordable < problem.q_len:
            rows = sample_query_rows(problem.q_len, max(2, affordable), seed)
            reason = (
                f"the float64 reference over all {problem.q_len} query rows needs {full_flops:.3g} FLOPs, over the "
                f"budget of {flop_budget:.3g}"
            )
    row_count = problem.q_len if rows is None else int(rows.numel())

    # Bytes: the float64 output and row-validity flags, then per block the float64 K/V of its heads (plus their
    # gathered copies in the input precision for GQA) and the score temporaries per (head, row).
    output_bytes = heads_total * row_count * (problem.v_dim * 8 + 1)
    per_head = problem.k_len * (problem.head_dim + problem.v_dim) * (8 + 4)
    per_head_row = problem.k_len * (8 * _SCORE_TEMPORARIES + 1) + (problem.head_dim + problem.v_dim) * 8
    # Softcap runs in place on the scores. The window's bool masks (two alive while combined, one more when
    # inverted for the fill) and ALiBi's float64 |i' - j| are per query row, shared by the heads of a block; ALiBi
    # also keeps the key positions in float64 once per block.
    per_row = problem.k_len * ((3 if problem.window is not None else 0) + (8 if problem.alibi else 0))
    per_block = problem.k_len * 8 if problem.alibi else 0
    available = memory_budget - output_bytes - per_block
    heads_per_block = problem.heads
    rows_per_block = 0
    while heads_per_block >= 1:
        rows_per_block = (available - heads_per_block * per_head) // (heads_per_block * per_head_row + per_row)
        if rows_per_block >= 1 or heads_per_block == 1:
            break
        heads_per_block = max(1, heads_per_block // 2)
    if rows_per_block < 1:
        need = output_bytes + per_block + per_head + per_head_row + per_row
        if rows is None and allow_sampling:
            # The float64 output over all rows does not fit: check as many rows as memory allows.
            spare = memory_budget - per_block - per_head - per_head_row - per_row
            affordable = spare // (heads_total * (problem.v_dim * 8 + 1) + per_head_row + per_row) if spare > 0 else 0
            if affordable >= 2:
                return plan_reference(
                    problem, memory_budget=memory_budget, flop_budget=flop_budget, sample_rows=int(affordable),
                    allow_sampling=True, seed=seed,
                )
        raise MemoryError(
            f"the float64 attention reference needs at least {human_bytes(need)} (output "
            f"{human_bytes(output_bytes)} plus one row of one head), over the memory budget of "
            f"{human_bytes(memory_budget)}"
        )
    rows_per_block = int(min(rows_per_block, row_count))
    block_bytes = heads_per_block * (per_head + rows_per_block * per_head_row) + per_block + rows_per_block * per_row
    if rows is not None:
        mode = "sampled"
    elif heads_per_block == problem.heads and rows_per_block == row_count:
        mode = "full"
    else:
        mode = "chunked"
        reason = (
            f"the float64 scores ({human_bytes(heads_total * problem.q_len * problem.k_len * 8)}) exceed the memory "
            f"budget of {human_bytes(memory_budget)}"
        )
    return ReferencePlan(
        mode=mode, rows=rows, heads_per_block=int(heads_per_block), rows_per_block=rows_per_block,
        block_bytes=int(block_bytes), total_flops=heads_total * row_count * problem.flops_per_row(),
        memory_budget=int(memory_budget), flop_budget=float(flop_budget), reason=reason,
    )
