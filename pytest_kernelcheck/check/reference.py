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
from collections.abc import Sequence
from typing import Any

import torch

from .attention_problem import (
    AttentionProblem,
    Causal,
    describe_problem,
    slopes_for,
    visible_keys,
)
from .reference_plan import ReferencePlan, plan_reference
from .reference_plan import (
    sample_query_rows as sample_query_rows,  # re-exported: a public name of the package
)
from .sdpa_baseline import sdpa_baseline
from .tolerance import CloseReport, PolicyLike, assert_close, override_sets_policy

# --------------------------------------------------------------------------------------------------------------
# Planning


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
    slopes = slopes_for(problem, alibi_slopes)
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
                allowed = visible_keys(problem, aligned, keys)  # [r, S_k] or None
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
