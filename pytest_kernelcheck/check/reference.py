"""Float64 attention references with SDPA's semantics: whole, in chunks of query rows, or on sampled rows.

Semantics (q, k, v are [B, H, S, D]; k and v may have H_kv heads):

- ``causal=False``: no causal mask. ``causal=True`` (or ``"top_left"``): query i sees keys j <= i, as SDPA's
  ``is_causal``. ``causal="lower_right"``: query i sees keys j <= i + S_k - S_q (the diagonal ends in the
  bottom-right corner, as ``torch.nn.attention.bias.causal_lower_right``).
- ``attn_mask``: bool (True = attend) or floating (added to the scores), broadcastable to [B, H, S_q, S_k]. It
  may be combined with ``causal`` here (SDPA refuses that; the baseline then gets the two merged into one mask).
- ``scale`` defaults to 1 / sqrt(D).
- ``enable_gqa=True``: H must be a multiple of H_kv and head h uses kv head h // (H // H_kv). Different head
  counts without the flag are an error, as in SDPA.
- ``softcap=c`` (a finite number > 0): the scaled scores s become ``c * tanh(s / c)``.
- ``alibi_slopes`` (floating, [H] or [B, H], H the query heads; float32 is what kernels take): then
  ``-slope[b, h] * |i' - j|`` is added, where ``i'`` is query row i aligned to the diagonal ``causal`` names: i for
  ``causal`` False or top-left, ``i + S_k - S_q`` for "lower_right".
- ``window=(left, right)`` (ints >= -1; -1 is unbounded on that side): query i sees keys
  ``i' - left <= j <= i' + right``; ``causal`` still hides ``j > i'``.
- Order: ``scale * q.k``, then softcap, then ALiBi, then the masks (causal, window, attn_mask) last.
- A query row that sees no key gets zeros, as flash-style kernels give (older torch builds return NaN there from
  SDPA's math path; a kernel returning NaN for such rows fails the check).

Cost control: the scores of one block of (heads, query rows) are materialized in float64, never the whole
S_q x S_k matrix when it does not fit. :func:`plan_reference` picks the block sizes from a memory budget (a
fraction of the device's free memory) and, when the float64 work over all rows would exceed a FLOP budget,
picks a seeded random sample of query rows (always with the first and the last row) to check instead. For
B=32, S=100,000, H=16, D=64 this computes a few thousand rows per (batch, head) against all keys, one batch
entry and a block of rows at a time. Softcap works in place on the scores; ALiBi's float64 distances and the
window's bool masks are per query row of a block (shared by its heads) and are counted in the plan.

The baseline (:func:`sdpa_baseline`, PyTorch's own error in the input precision, which the check's baseline rule
compares the kernel's error with) is what a user without a fused kernel would write:

- no variant: ``scaled_dot_product_attention`` as is (``is_causal``, the lower-right bias or the merged mask).
- window and ALiBi: SDPA with the equivalent dense mask over the rows checked, in the input dtype: a float
  bias [B or 1, H, rows, S_k] of ``-slope * |i' - j|`` with -inf outside the visible keys (a bool mask for a
  window alone). It costs rows x S_k per head; when it cannot be allocated the check says so and falls back to the
  per-dtype policy.
- softcap: SDPA cannot apply tanh to its scores, so the baseline is the same math written out, one batch entry at a
  time: ``q k^T * scale`` and the softcap in the input dtype, the bias added and the softmax in float32 (in the
  input dtype when that is wider), the probabilities rounded to the input dtype before ``P V``.
- A float bias (ALiBi, a float ``attn_mask`` of another dtype than q's) is built in float32 or wider and rounded to
  the input dtype once, after a shift that makes each row's largest bias 0 (softmax does not change): rounded as it
  comes, the bias alone would cost up to 20 times the output's rounding error in bfloat16, and the baseline would
  allow a kernel with that defect to pass. An ``attn_mask`` of the input dtype is passed as is.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from collections.abc import Sequence
from typing import Any, Union

import torch

from .memory import free_memory, human_bytes
from .tolerance import CloseReport, PolicyLike, assert_close, override_sets_policy

Causal = Union[bool, str]

# Share of the free device memory the reference may use for its float64 blocks.
DEFAULT_MEMORY_FRACTION = 0.5
# Float64 work allowed before the check falls back to sampled rows: about a second on an H100/H200 (fp64
# tensor cores near 60 TFLOP/s) and a few seconds on a few host cores.
DEFAULT_FLOP_BUDGET = {"cuda": 5e13, "cpu": 2e10}
# Float64 score-sized temporaries alive at once per (head, row, key): scores, exponentials, one mask/spare.
_SCORE_TEMPORARIES = 3


@dataclasses.dataclass(frozen=True)
class AttentionProblem:
    """Validated sizes and options of one attention call."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    v_dim: int
    causal: str | None  # None, "top_left" or "lower_right"
    scale: float
    device: torch.device
    window: tuple[int, int] | None = None  # (left, right), -1 = unbounded on that side
    softcap: float | None = None
    alibi: bool = False  # the slopes themselves travel beside the problem, as attn_mask does

    @property
    def group_size(self) -> int:
        return self.heads // self.kv_heads

    @property
    def diagonal_offset(self) -> int:
        """What is added to a query row to align it with the causal diagonal (the ``i'`` of the module docstring)."""
        return self.k_len - self.q_len if self.causal == "lower_right" else 0

    @property
    def has_variant(self) -> bool:
        """Whether a window, softcap or ALiBi is in play (SDPA alone cannot be the baseline then)."""
        return self.window is not None or self.softcap is not None or self.alibi

    def flops_per_row(self) -> float:
        """Float64 FLOPs of one query row of one (batch, head) against all keys (QK^T and PV)."""
        return 2.0 * self.k_len * (self.head_dim + self.v_dim)


def describe_problem(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
) -> AttentionProblem:
    """Check q, k, v, mask and options against SDPA's rules (and the variants of the module docstring) and
    return the sizes.

    Example::

        >>> q = k = v = torch.randn(1, 2, 8, 4)
        >>> describe_problem(q, k, v, causal="lower_right").causal
        'lower_right'
        >>> p = describe_problem(q, k, v, window=(3, 0), softcap=30, alibi_slopes=torch.tensor([0.5, 0.25]))
        >>> p.window, p.softcap, p.alibi
        ((3, 0), 30.0, True)

    Raises:
        TypeError: a non-tensor input, an integer or complex tensor, a mask of an unsupported dtype, a window
            that is not a pair of ints, a softcap that is not a number, slopes that are not a floating tensor.
        ValueError: wrong ranks, sizes that do not agree, an empty dimension (B, H, H_kv, S_q, S_k, D or D_v
            of 0), a bad ``causal`` value, heads that need ``enable_gqa``, tensors on different devices, a window
            side below -1, a softcap that is not finite and > 0, slopes of a shape other than [H] or [B, H].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D]; got shape {tuple(t.shape)}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point; got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"q is on {q.device} but {name} is on {t.device}")
    batch, heads, q_len, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"q and k head dims differ: {head_dim} vs {k.shape[3]}")
    if k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v sequence lengths differ: {k.shape[2]} vs {v.shape[2]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v head counts differ: {k.shape[1]} vs {v.shape[1]}")
    sizes = {"B": batch, "H": heads, "H_kv": k.shape[1], "S_q": q_len, "S_k": k.shape[2], "D": head_dim,
             "D_v": v.shape[3]}
    empty = [f"{name}={size}" for name, size in sizes.items() if size == 0]
    if empty:
        # An empty problem has no output element to check, and a check that compares nothing would pass whatever
        # the kernel returned; refused here, before the planning and the reference divide or loop by these sizes.
        raise ValueError(
            f"the attention problem is empty ({', '.join(empty)}; q {tuple(q.shape)}, k {tuple(k.shape)}, v "
            f"{tuple(v.shape)}): there is nothing to compute or check; every size of q, k and v must be at least 1"
        )
    kv_heads = k.shape[1]
    if kv_heads != heads:
        if not enable_gqa:
            raise ValueError(
                f"q has {heads} heads but k and v have {kv_heads}; pass enable_gqa=True for grouped-query attention"
            )
        if kv_heads == 0 or heads % kv_heads:
            raise ValueError(f"grouped-query attention needs q heads ({heads}) divisible by kv heads ({kv_heads})")
    if causal is True or causal == "top_left":
        mode = "top_left"
    elif causal is False or causal is None:
        mode = None
    elif causal == "lower_right":
        mode = "lower_right"
    else:
        raise ValueError(f"causal must be False, True, 'top_left' or 'lower_right'; got {causal!r}")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor; got {type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
            raise TypeError(f"attn_mask must be bool (True = attend) or floating (added); got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"q is on {q.device} but attn_mask is on {attn_mask.device}")
        full = (batch, heads, q_len, k.shape[2])
        try:
            broadcast = torch.broadcast_shapes(attn_mask.shape, full)
        except RuntimeError:
            broadcast = None
        if broadcast != torch.Size(full):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to [B, H, S_q, S_k] = {full}"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number; got {scale!r}")
    if alibi_slopes is not None:
        _check_alibi_slopes(alibi_slopes, batch, heads, q.device)
    return AttentionProblem(
        batch=batch, heads=heads, kv_heads=kv_heads, q_len=q_len, k_len=k.shape[2], head_dim=head_dim,
        v_dim=v.shape[3], causal=mode, scale=float(scale), device=q.device, window=_check_window(window),
        softcap=_check_softcap(softcap), alibi=alibi_slopes is not None,
    )


def _check_window(window: Any) -> tuple[int, int] | None:
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be a (left, right) pair of ints, -1 for unbounded; got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        # bool is an int to Python, but window=(True, 0) is surely a mistake, not a one-key window.
        if isinstance(side, bool) or not isinstance(side, numbers.Integral):
            raise TypeError(f"window {name} side must be an int >= -1 (-1 = unbounded); got {side!r}")
        if side < -1:
            raise ValueError(f"window {name} side must be >= -1 (-1 = unbounded); got {side}")
        sides.append(int(side))
    return sides[0], sides[1]


def _check_softcap(softcap: Any) -> float | None:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap must be a finite number > 0; got {softcap!r}")
    value = float(softcap)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"softcap must be a finite number > 0; got {softcap!r}")
    return value


def _check_alibi_slopes(slopes: Any, batch: int, heads: int, device: torch.device) -> None:
    """Refuse ALiBi slopes that are not a floating tensor of shape [H] or [B, H] on ``device``."""
    if not isinstance(slopes, torch.Tensor):
        raise TypeError(
            f"alibi_slopes must be a floating torch.Tensor of shape [H] or [B, H]; got {type(slopes).__name__}"
        )
    if not slopes.dtype.is_floating_point:
        raise TypeError(f"alibi_slopes must be floating point (float32 is what kernels take); got {slopes.dtype}")
    if tuple(slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape [H] = ({heads},) or [B, H] = ({batch}, {heads}); got {tuple(slopes.shape)}"
        )
    if slopes.device != device:
        raise ValueError(f"q is on {device} but alibi_slopes is on {slopes.device}")


def _slopes_for(problem: AttentionProblem, alibi_slopes: torch.Tensor | None) -> torch.Tensor | None:
    """The slopes as float64 [B, H] (a broadcast view for [H]), after checking they agree with ``problem``."""
    if alibi_slopes is None:
        if problem.alibi:
            raise ValueError("the problem was described with alibi_slopes, but none were passed")
        return None
    if not problem.alibi:
        raise ValueError("alibi_slopes were passed, but the problem was described without them")
    _check_alibi_slopes(alibi_slopes, problem.batch, problem.heads, problem.device)
    return alibi_slopes.to(torch.float64).expand(problem.batch, problem.heads)


def _visible_keys(problem: AttentionProblem, aligned: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
    """[rows, S_k] bool, True where a query row (``aligned``: its index plus the diagonal offset) may see a key
    under ``causal`` and ``window``; None when both leave every key visible."""
    upper = 0 if problem.causal is not None else None  # the largest j - i' allowed
    lower = None  # the smallest j - i' allowed
    if problem.window is not None:
        left, right = problem.window
        if right >= 0:
            upper = right if upper is None else min(upper, right)
        if left >= 0:
            lower = -left
    allowed = None
    if upper is not None:
        allowed = keys[None, :] <= aligned[:, None] + upper
    if lower is not None:
        above = keys[None, :] >= aligned[:, None] + lower
        allowed = above if allowed is None else allowed.logical_and_(above)
    return allowed


# --------------------------------------------------------------------------------------------------------------
# Planning


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


# --------------------------------------------------------------------------------------------------------------
# Computing


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    rows: torch.Tensor | Sequence[int] | None = None,
    memory_budget: int | None = None,
) -> torch.Tensor:
    """Float64 attention ``softmax(q k^T * scale + mask) v`` with SDPA's semantics (module docstring), and
    optionally a sliding ``window=(left, right)``, ``softcap=c`` and ALiBi ``alibi_slopes`` ([H] or [B, H]).

    Returns [B, H, S_q, D_v] in float64 on q's device, or [B, H, len(rows), D_v] for the given query ``rows``.
    Works in blocks of heads and query rows when the float64 scores exceed ``memory_budget`` (bytes; default
    half the device's free memory). Rows that see no key are zeros.

    Example::

        >>> q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float16) for _ in range(3))
        >>> attention_reference(q, k, v, causal=True).dtype
        torch.float64
        >>> slopes = 2.0 ** -torch.arange(1.0, 5.0)  # one per query head
        >>> out = attention_reference(q, k, v, causal=True, window=(4, -1), softcap=30.0, alibi_slopes=slopes)
        >>> out.shape
        torch.Size([2, 4, 16, 8])
        >>> attention_reference(q, k, v, window=(0, 0))[0, 0, 3].tolist() == v[0, 0, 3].double().tolist()
        True
    """
    problem = describe_problem(
        q, k, v, causal=causal, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, window=window,
        softcap=softcap, alibi_slopes=alibi_slopes,
    )
    plan = plan_reference(
        problem, memory_budget=memory_budget, flop_budget=math.inf, allow_sampling=False,
        rows=_as_rows(rows, problem.q_len),
    )
    out, _ = compute_reference(q, k, v, problem, plan, attn_mask, alibi_slopes=alibi_slopes)
    return out


def _as_rows(rows: Any, q_len: int) -> torch.Tensor | None:
    if rows is None:
        return None
    index = torch.as_tensor(rows).reshape(-1).cpu()
    if index.numel() == 0:
        raise ValueError("rows is empty")
    # Converting to long would read a bool mask of rows as the indices 0 and 1 and truncate 2.7 to row 2.
    if index.dtype == torch.bool or index.is_floating_point() or index.is_complex():
        hint = " (for a bool mask of rows pass mask.nonzero().flatten())" if index.dtype == torch.bool else ""
        raise TypeError(f"rows must be integer query-row indices (ints or an integer tensor); got {index.dtype}{hint}")
    index = index.long()
    if int(index.min()) < 0 or int(index.max()) >= q_len:
        raise ValueError(f"rows must lie in [0, {q_len}); got values from {int(index.min())} to {int(index.max())}")
    return index


@torch.no_grad()
def compute_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    plan: ReferencePlan,
    attn_mask: torch.Tensor | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``plan``: returns the float64 output [B, H, rows, D_v] and a bool [B, H, rows] that is False
    where a query row saw no key (its output row is zero).

    ``window`` and ``softcap`` come with ``problem`` (from :func:`describe_problem`); ``attn_mask`` and
    ``alibi_slopes`` are tensors and come beside it, the slopes exactly when the problem was described with them.

    Example::

        >>> q, k, v = (torch.randn(1, 2, 9, 4) for _ in range(3))
        >>> slopes = torch.tensor([0.5, 0.25])
        >>> problem = describe_problem(q, k, v, causal="lower_right", window=(2, -1), softcap=5.0, alibi_slopes=slopes)
        >>> plan = plan_reference(problem, rows=torch.tensor([0, 8]))
        >>> out, has_keys = compute_reference(q, k, v, problem, plan, alibi_slopes=slopes)
        >>> out.shape, has_keys.all().item()
        (torch.Size([1, 2, 2, 4]), True)
    """
    device = problem.device
    slopes = _slopes_for(problem, alibi_slopes)
    all_rows = plan.rows.to(device) if plan.rows is not None else torch.arange(problem.q_len, device=device)
    row_count = all_rows.numel()
    out = torch.empty(problem.batch, problem.heads, row_count, problem.v_dim, dtype=torch.float64, device=device)
    has_keys = torch.empty(problem.batch, problem.heads, row_count, dtype=torch.bool, device=device)
    mask4 = None
    if attn_mask is not None:
        mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    keys = torch.arange(problem.k_len, device=device)
    key_positions = keys.to(torch.float64) if slopes is not None else None

    for b in range(problem.batch):
        for h0 in range(0, problem.heads, plan.heads_per_block):
            h1 = min(problem.heads, h0 + plan.heads_per_block)
            kv_index = torch.arange(h0, h1, device=device) // problem.group_size
            k64 = k[b].index_select(0, kv_index).to(torch.float64)  # [h, S_k, D]
            v64 = v[b].index_select(0, kv_index).to(torch.float64)  # [h, S_k, D_v]
            for r0 in range(0, row_count, plan.rows_per_block):
                r1 = min(row_count, r0 + plan.rows_per_block)
                block_rows = all_rows[r0:r1]
                q64 = q[b, h0:h1].index_select(1, block_rows).to(torch.float64)  # [h, r, D]
                scores = torch.matmul(q64, k64.transpose(1, 2)).mul_(problem.scale)  # [h, r, S_k]
                del q64
                aligned = block_rows + problem.diagonal_offset
                if problem.softcap is not None:
                    scores.div_(problem.softcap).tanh_().mul_(problem.softcap)
                if slopes is not None:
                    # |i' - j| in float64 is exact for any realistic length (< 2**53); addcmul broadcasts the
                    # per-head slopes over it without a [h, r, S_k] temporary.
                    distance = (aligned.to(torch.float64)[:, None] - key_positions[None, :]).abs_()  # [r, S_k]
                    scores.addcmul_(slopes[b, h0:h1, None, None], distance, value=-1.0)
                    del distance
                allowed = _visible_keys(problem, aligned, keys)  # [r, S_k] or None
                if mask4 is not None:
                    block_mask = _mask_block(mask4, b, h0, h1, block_rows, problem.q_len)
                    if block_mask.dtype == torch.bool:
                        allowed = block_mask if allowed is None else allowed & block_mask
                    else:
                        scores += block_mask.to(torch.float64)
                if allowed is not None:
                    scores.masked_fill_(~allowed, -math.inf)
                row_max = scores.amax(dim=-1, keepdim=True)
                # Rows with no visible key have max -inf; shifting by 0 keeps exp(-inf) = 0 instead of NaN.
                row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
                weights = scores.sub_(row_max).exp_()
                total = weights.sum(dim=-1, keepdim=True)
                block_out = torch.matmul(weights, v64)
                del weights, scores
                seen = total > 0
                block_out = torch.where(seen, block_out / torch.where(seen, total, torch.ones_like(total)), 0.0)
                out[b, h0:h1, r0:r1] = block_out
                has_keys[b, h0:h1, r0:r1] = seen.squeeze(-1)
    return out, has_keys


def _mask_block(mask4: torch.Tensor, b: int, h0: int, h1: int, rows: torch.Tensor, q_len: int) -> torch.Tensor:
    """The [h or 1, r or 1, S_k] piece of a broadcastable 4-D mask for batch entry b, heads h0:h1, rows."""
    piece = mask4[b if mask4.shape[0] > 1 else 0]
    piece = piece[h0:h1] if piece.shape[0] > 1 else piece
    if piece.shape[1] > 1 or q_len == 1:
        piece = piece.index_select(1, rows) if piece.shape[1] > 1 else piece
    return piece


# --------------------------------------------------------------------------------------------------------------
# Baseline and check


def sdpa_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    problem: AttentionProblem,
    attn_mask: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    *,
    alibi_slopes: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention in the input precision as PyTorch computes it, on the given query rows (all by default): what
    the check's baseline rule measures a kernel's error against.

    SDPA itself, with a window and ALiBi as the equivalent dense mask or bias; with a softcap, which SDPA cannot
    express, the same math written out in the input precision (module docstring). ``window`` and ``softcap`` come
    with ``problem``, ``alibi_slopes`` beside it as for :func:`compute_reference`. Rows that see no key may hold
    NaN (the check zeroes them).

    Example::

        >>> q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
        >>> slopes = torch.tensor([0.5, 0.25])
        >>> problem = describe_problem(q, k, v, causal=True, window=(2, -1), alibi_slopes=slopes)
        >>> base = sdpa_baseline(q, k, v, problem, alibi_slopes=slopes)
        >>> ref = attention_reference(q, k, v, causal=True, window=(2, -1), alibi_slopes=slopes)
        >>> bool(torch.allclose(base, ref))
        True

    Raises whatever SDPA (or matmul, for the softcap) raises when it cannot run this dtype or device, and
    ``MemoryError``/``torch.OutOfMemoryError`` when the dense mask does not fit.
    """
    _slopes_for(problem, alibi_slopes)  # the same agreement check as the reference's
    if attn_mask is not None and attn_mask.dim() < 4:
        # SDPA indexes a mask's last two dimensions: a [S_k] mask, which broadcasts as the reference reads it,
        # raised IndexError there. As 4-D it broadcasts the same way in both.
        attn_mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    q_in = q if rows is None else q.index_select(2, rows.to(q.device))
    is_causal = False
    whole_causal_bias = False  # torch's CausalBias object: passed through as is
    mask = attn_mask
    if problem.has_variant:
        query_rows = rows.to(q.device) if rows is not None else torch.arange(problem.q_len, device=q.device)
        rows_mask = _mask_rows(attn_mask, rows, problem.q_len)
        mask = _dense_variant_mask(problem, query_rows, rows_mask, alibi_slopes, q.dtype)
        if problem.softcap is not None:
            return _softcapped_attention(q_in, k, v, problem, mask)
    elif problem.causal is not None:
        whole = rows is None and attn_mask is None
        if whole and problem.causal == "top_left":
            is_causal = True
        elif whole:
            from torch.nn.attention.bias import causal_lower_right

            with warnings.catch_warnings():  # its NaN warning for S_q > S_k: those rows are zeroed afterwards
                warnings.simplefilter("ignore")
                mask = causal_lower_right(problem.q_len, problem.k_len)
            whole_causal_bias = True
        else:
            query_rows = rows.to(q.device) if rows is not None else torch.arange(problem.q_len, device=q.device)
            keys = torch.arange(problem.k_len, device=q.device)
            allowed = _visible_keys(problem, query_rows + problem.diagonal_offset, keys)
            mask = _merge_masks(allowed, _mask_rows(attn_mask, rows, problem.q_len), q.dtype)
    elif attn_mask is not None and rows is not None:
        mask = _mask_rows(attn_mask, rows, problem.q_len)
    if mask is not None and not whole_causal_bias and mask.dtype != torch.bool:
        mask = _rounded_bias(mask, q.dtype)  # SDPA wants a float mask in the query's dtype
    return _run_sdpa(q_in, k, v, problem, mask, is_causal)


def _run_sdpa(
    q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, mask: Any, is_causal: bool
) -> torch.Tensor:
    import torch.nn.functional as F

    extra: dict[str, Any] = {}
    if problem.kv_heads != problem.heads:
        extra["enable_gqa"] = True
    with torch.no_grad():
        try:
            return F.scaled_dot_product_attention(
                q_in, k, v, attn_mask=mask, is_causal=is_causal, scale=problem.scale, **extra
            )
        except TypeError:
            if not extra:
                raise
            # Older torch without enable_gqa: repeat the kv heads instead.
            k_in = k.repeat_interleave(problem.group_size, dim=1)
            v_in = v.repeat_interleave(problem.group_size, dim=1)
            return F.scaled_dot_product_attention(
                q_in, k_in, v_in, attn_mask=mask, is_causal=is_causal, scale=problem.scale
            )


def _dense_variant_mask(
    problem: AttentionProblem,
    query_rows: torch.Tensor,
    attn_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """The mask a user would hand SDPA for causal + window + ALiBi + attn_mask on ``query_rows``: bool when
    nothing is added to the scores, else a float bias with -inf where a key is hidden, in float32 (or the input
    dtype or attn_mask's when wider); the caller rounds it (:func:`_rounded_bias`) or adds it in float32."""
    keys = torch.arange(problem.k_len, device=query_rows.device)
    aligned = query_rows + problem.diagonal_offset
    allowed = _visible_keys(problem, aligned, keys)  # [r, S_k] or None
    if alibi_slopes is None:
        if allowed is None:
            return attn_mask
        return _merge_masks(allowed, attn_mask, dtype)
    # Built in float32 (or the input dtype when wider), never in a narrower dtype: rounding happens once, in
    # _rounded_bias. [H] slopes give a bias shared by the batch.
    build = torch.promote_types(dtype, torch.float32)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        build = torch.promote_types(build, attn_mask.dtype)
    slopes = alibi_slopes.to(build).reshape(-1, problem.heads)[:, :, None, None]  # [B or 1, H, 1, 1]
    distance = (aligned[:, None] - keys[None, :]).abs_().to(build)  # [r, S_k]
    bias = slopes * -distance
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        bias = bias + attn_mask
    elif attn_mask is not None:
        allowed = attn_mask if allowed is None else allowed & attn_mask
    return bias if allowed is None else bias.masked_fill(~allowed, -math.inf)


def _rounded_bias(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float bias (-inf where hidden) in ``dtype``, as a correct implementation rounds it: exactly when
    ``dtype`` holds its values, else shifted first so that each row's largest value is 0.

    Softmax is unchanged by a shift along a row, and the keys that carry the weight are those near the row's
    largest bias: after the shift their bias is small and keeps nearly all its bits in ``dtype``. Rounded as it
    comes, ALiBi's -slope * |i' - j| at a distance of 60 lands on bfloat16's grid of 0.25: errors of up to 20 times
    the output's own rounding, which a baseline computed that way would have allowed a kernel too. A bias already
    of ``dtype`` (an attn_mask in the input dtype) is passed as is: the shift could only round it."""
    if bias.dtype == dtype or torch.promote_types(bias.dtype, dtype) == dtype:
        return bias.to(dtype)
    peak = bias.amax(dim=-1, keepdim=True)
    peak = torch.where(torch.isfinite(peak), peak, 0.0)  # rows that see no key stay -inf (the check zeroes them)
    return (bias - peak).to(dtype)


def _softcapped_attention(
    q_in: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: AttentionProblem, mask: torch.Tensor | None
) -> torch.Tensor:
    """Softcapped attention in the input precision, one batch entry at a time (see the module docstring)."""
    softmax_dtype = torch.promote_types(q_in.dtype, torch.float32)
    if problem.kv_heads != problem.heads:
        k = k.repeat_interleave(problem.group_size, dim=1)
        v = v.repeat_interleave(problem.group_size, dim=1)
    mask4 = None if mask is None else mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    outs = []
    with torch.no_grad():
        for b in range(q_in.shape[0]):
            scores = torch.matmul(q_in[b], k[b].transpose(-1, -2)) * problem.scale  # [H, r, S_k], input dtype
            scores = torch.tanh(scores / problem.softcap) * problem.softcap
            scores = scores.to(softmax_dtype)
            if mask4 is not None:
                # The bias is added unrounded, in the softmax's precision: rounded to bfloat16 it would move the
                # scores by more than a correct kernel's whole error (_rounded_bias says how much).
                piece = mask4[b if mask4.shape[0] > 1 else 0]
                scores = (scores.masked_fill(~piece, -math.inf) if piece.dtype == torch.bool
                          else scores + piece.to(torch.promote_types(piece.dtype, softmax_dtype)))
            weights = torch.softmax(scores, dim=-1).to(q_in.dtype)
            outs.append(torch.matmul(weights, v[b]))
    return torch.stack(outs)


def _mask_rows(attn_mask: torch.Tensor | None, rows: torch.Tensor | None, q_len: int) -> torch.Tensor | None:
    if attn_mask is None or rows is None:
        return attn_mask
    mask4 = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape))
    return mask4.index_select(2, rows.to(attn_mask.device)) if mask4.shape[2] > 1 else mask4


def _merge_masks(allowed: torch.Tensor, attn_mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if attn_mask is None:
        return allowed
    if attn_mask.dtype == torch.bool:
        return allowed & attn_mask
    # Unrounded: sdpa_baseline rounds the merged bias once (_rounded_bias).
    return torch.where(allowed, attn_mask, -math.inf)


def _non_finite_outside(out: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> str | None:
    """What is wrong with ``out`` [B, H, S_q, D_v] in the query rows outside ``rows`` that no reference is needed
    to see, or None: NaN anywhere, and Inf when ``v`` is finite.

    Each output row is a convex combination of rows of v (zeros for a row that sees no key), so with finite v it
    is finite whatever q, k, the masks and the variants are; and NaN is never right (where inputs make the
    reference NaN, the comparison fails too). One batch entry at a time: the scan of a 100,000-row output holds a
    bool mask of one entry, never of the whole output.
    """
    if not out.dtype.is_floating_point:
        return None

    def widened(t: torch.Tensor) -> torch.Tensor:
        return t.float() if t.dtype.itemsize == 1 else t  # isfinite/isinf have no float8_e4m3fn kernel

    v_finite = all(bool(torch.isfinite(widened(v[b])).all()) for b in range(v.shape[0]))
    index = rows.to(out.device)
    nan = inf = 0
    first: tuple[int, ...] | None = None
    for b in range(out.shape[0]):
        entry = widened(out[b])
        bad = torch.isnan(entry)
        if v_finite:
            bad |= torch.isinf(entry)
        bad.index_fill_(1, index, False)  # the compared rows: the comparison reports those itself
        if not bool(bad.any()):
            continue
        nan += int((bad & torch.isnan(entry)).sum())
        inf += int((bad & ~torch.isnan(entry)).sum())
        if first is None:
            first = (b, *(int(i) for i in bad.nonzero()[0]))
    if first is None:
        return None
    counts = [f"{nan} NaN" if nan else "", f"{inf} Inf" if inf else ""]
    why = ["NaN is never a correct attention output" if nan else "",
           "with finite v every correct output is finite, within max |v|" if inf else ""]
    return (f"out holds {' and '.join(c for c in counts if c)} in query rows the sampled check does not compare, the "
            f"first at index {first}: {'; '.join(w for w in why if w)}")


@dataclasses.dataclass
class ReferenceCheck:
    """The outcome of :meth:`SdpaReference.check`: how the reference was computed and what the comparison found."""

    mode: str
    rows_checked: int
    rows_total: int
    rows: torch.Tensor | None
    baseline_used: bool
    notes: tuple[str, ...]
    close: CloseReport | None
    passed: bool
    message: str


class SdpaReference:
    """The ``sdpa_reference`` fixture: a float64 SDPA reference and a check against it.

    Example::

        def test_kernel(sdpa_reference):
            q, k, v = (torch.randn(2, 4, 128, 64, dtype=torch.float16) for _ in range(3))
            out = my_attention(q, k, v, causal=True)
            sdpa_reference.check(out, q, k, v, causal=True)
            assert torch.equal(sdpa_reference(q, k, v)[0, 0], ...)  # the float64 reference itself
    """

    def __init__(
        self, *, memory_budget: int | None = None, flop_budget: float | None = None, seed: int = 0
    ) -> None:
        self.memory_budget = memory_budget
        self.flop_budget = flop_budget
        self.seed = seed
        self.last_check: ReferenceCheck | None = None

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: Causal = False,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The whole float64 reference [B, H, S_q, D_v], chunked when it must be (never sampled); the options
        are those of :func:`attention_reference`.

        Example::

            >>> q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
            >>> SdpaReference()(q, k, v, window=(1, 1), softcap=20.0).shape
            torch.Size([1, 2, 5, 4])
        """
        return attention_reference(
            q, k, v, causal=causal, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, window=window,
            softcap=softcap, alibi_slopes=alibi_slopes, memory_budget=self.memory_budget,
        )

    def check(
        self,
        out: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal: Causal = False,
        attn_mask: torch.Tensor | None = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        window: tuple[int, int] | None = None,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        policy: PolicyLike | None = None,
        sample_rows: int | None = None,
        use_baseline: bool | None = None,
    ) -> ReferenceCheck:
        """Assert that ``out`` matches the float64 reference, with the policy for ``out.dtype`` (or ``policy``)
        and, when SDPA can run in the input precision, the baseline-relative rule.

        ``use_baseline=None`` (the default) uses the baseline unless ``policy=`` is given or the test's
        ``tolerance`` marker names a policy (``tolerance("tf32")``); marker fields such as ``baseline_factor=3``
        keep it. Under the baseline rule atol and rtol are not used; ``use_baseline=False`` applies them instead.

        Large problems are checked on a seeded sample of query rows (``sample_rows`` forces one); the result, also
        kept as ``self.last_check``, says how many rows were checked, and so does the failure message.

        ``window``, ``softcap`` and ``alibi_slopes`` are those of :func:`attention_reference`; the baseline then
        is SDPA with the equivalent dense mask, or for a softcap the same math in the input precision (module
        docstring), and a note in the result says which.

        Example::

            >>> q, k, v = (torch.randn(1, 2, 12, 8).half() for _ in range(3))
            >>> slopes = torch.tensor([0.5, 0.125])
            >>> out = attention_reference(q, k, v, causal=True, window=(3, 0), alibi_slopes=slopes).half()
            >>> SdpaReference().check(out, q, k, v, causal=True, window=(3, 0), alibi_slopes=slopes).baseline_used
            True

        Raises:
            AssertionError: the output is not close; the message gives the error figures and the rows checked.
            ValueError / TypeError: inputs that do not describe an attention call, or ``out`` of the wrong shape.
        """
        __tracebackhide__ = True
        problem = describe_problem(
            q, k, v, causal=causal, attn_mask=attn_mask, scale=scale, enable_gqa=enable_gqa, window=window,
            softcap=softcap, alibi_slopes=alibi_slopes,
        )
        expected_shape = (problem.batch, problem.heads, problem.q_len, problem.v_dim)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor; got {type(out).__name__}")
        if tuple(out.shape) != expected_shape:
            raise ValueError(f"out has shape {tuple(out.shape)}; attention of these inputs gives {expected_shape}")
        if out.device != problem.device:
            raise ValueError(f"out is on {out.device} but q is on {problem.device}")
        plan = plan_reference(
            problem, memory_budget=self.memory_budget, flop_budget=self.flop_budget, sample_rows=sample_rows,
            seed=self.seed,
        )
        rows = plan.rows
        if rows is not None:
            # The sample spares the float64 reference, not the look at the output: a NaN in a row it skips would pass.
            unsampled = _non_finite_outside(out.detach(), v.detach(), rows)
            if unsampled is not None:
                message = (f"{unsampled} (the check compares {rows.numel()} of {problem.q_len} query rows with the "
                           f"reference, a seeded sample: {plan.reason})")
                self.last_check = ReferenceCheck(
                    mode=plan.mode, rows_checked=int(rows.numel()), rows_total=problem.q_len, rows=rows,
                    baseline_used=False, notes=(), close=None, passed=False, message=message,
                )
                raise AssertionError(message)
        expected, has_keys = compute_reference(q, k, v, problem, plan, attn_mask, alibi_slopes=alibi_slopes)
        actual = out.detach() if rows is None else out.detach().index_select(2, rows.to(out.device))
        notes = []
        if rows is not None:
            notes.append(
                f"checked {rows.numel()} of {problem.q_len} query rows in every (batch, head) (seeded sample, seed "
                f"{self.seed}, first and last row included): {plan.reason}"
            )
        elif plan.mode == "chunked":
            notes.append(f"reference computed in blocks of {plan.rows_per_block} query rows: {plan.reason}")

        baseline = None
        if use_baseline is None:
            # A policy chosen for this call or by the test's marker names a precision of its own (say tf32 for a
            # float32 output); SDPA's float32 result says nothing about that precision, so its atol/rtol rule.
            use_baseline = policy is None and not override_sets_policy(out.dtype)
            if not use_baseline:
                notes.append("a policy was chosen explicitly, so its per-element rule was used without a baseline")
        if use_baseline:
            try:
                baseline = sdpa_baseline(
                    q.detach(), k.detach(), v.detach(), problem, attn_mask, rows,
                    alibi_slopes=None if alibi_slopes is None else alibi_slopes.detach(),
                )
            except (RuntimeError, NotImplementedError, TypeError, ValueError, MemoryError) as exc:
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                notes.append(f"no SDPA baseline for {q.dtype} on {q.device} ({first_line}); per-dtype policy used")
            if baseline is not None and problem.softcap is not None:
                notes.append(
                    "baseline: SDPA cannot softcap, so the same math in the input precision (float32 softmax)"
                )
            elif baseline is not None and problem.has_variant:
                notes.append("baseline: SDPA with the window/ALiBi as a dense mask in the input dtype")
            if baseline is not None:
                # Some torch builds leave NaN in rows that see no key; the reference defines them as zeros.
                baseline = baseline.masked_fill(~has_keys[..., None], 0)
                if not torch.isfinite(baseline).all():
                    notes.append("the SDPA baseline holds NaN or Inf; per-dtype policy used")
                    baseline = None

        rows_checked = problem.q_len if rows is None else int(rows.numel())
        try:
            report = assert_close(actual, expected, policy=policy, baseline=baseline, notes=tuple(notes))
        except AssertionError as failure:
            self.last_check = ReferenceCheck(
                mode=plan.mode, rows_checked=rows_checked, rows_total=problem.q_len, rows=rows,
                baseline_used=baseline is not None, notes=tuple(notes), close=None, passed=False,
                message=str(failure),
            )
            raise
        self.last_check = ReferenceCheck(
            mode=plan.mode, rows_checked=rows_checked, rows_total=problem.q_len, rows=rows,
            baseline_used=baseline is not None, notes=tuple(notes), close=report, passed=True,
            message=report.message,
        )
        return self.last_check
