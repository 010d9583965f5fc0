"""Launch the attention kernels for a plan: check what they assume, allocate, build grids, configs, and launch.

Every launch belongs to a ``Plan`` (``plan``): its config comes from the plan (forced, or the autotuner's choice
for the plan's tuning key, asked once), and on CUDA its first launch with a known config is recorded in the plan so
that later calls replay the compiled kernel with their own tensors (``flashlite._direct_launch``). Each launch
site names its kernel's leading tensors once, in one tuple, for the ordinary launch, the recording and the replay.
The public launcher ``attention_forward`` checks its flat arguments and keeps a plan per signature too
(``_launcher_plan``, which the backward's launcher shares; the custom ops run the plans of the eager calls they
stand for instead: ``decide.op_plan``). A plan whose forward the Gluon kernel
runs (sm_90, where it measured faster: ``gluon``) launches it there instead of the pointer kernel. The backward
launches are ``triton_bwd``'s. Imports ``problem``, ``plan`` and ``gluon``.
"""
import math
from dataclasses import dataclass
from typing import Any, Optional

import torch

from flashlite import _direct_launch, _env, _runtime
from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd, plan as plans
from flashlite.attn.plan import Plan
from flashlite.attn.problem import _CAUSAL_ARGUMENT, _TRITON_ERROR, Problem, kernel_unsupported, validate
from flashlite._intmath import cdiv, next_power_of_2
from flashlite.dispatch import Decision

if _TRITON_ERROR is None:  # without Triton, kernel_unsupported keeps every call away from these launchers
    import triton

    from flashlite.kernels import attention_bwd as _bwd
    from flashlite.kernels import attention_fwd as _fwd
    from flashlite.kernels import tuning as _tuning

# Grid axis 1 holds batch * heads; past CUDA's cap the kernels use a flattened 1-D grid (a module name, so that tests
# can lower it).
_GRID_AXIS1_LIMIT = _runtime.GRID_AXIS1_LIMIT

# (BLOCK_M, BLOCK_N, num_warps, num_stages), and for the forward kernel optionally BH_PER_PROGRAM fifth
BlockConfig = tuple[int, ...]


def _dot_mode(precision: str) -> str:
    # The interpreter's tl.dot on bf16 operands is broken: round operands to bf16, multiply in fp32 instead.
    if precision == "bf16" and _runtime.interpreting():
        return "bf16_emulated"
    return precision


@dataclass(frozen=True)
class _Kernel:
    """One tunable kernel: its autotuned and fixed-config entry points, GPU configs and pruning."""

    name: str  # the key of its config in ``Plan.configs``
    autotuned: Any
    fixed: Any
    gpu_blocks: list
    prune: Any


if _TRITON_ERROR is None:
    _FORWARD = _Kernel("forward", _fwd.attn_fwd, _fwd.attn_fwd_fixed, _fwd.FWD_DECODE_BLOCKS + _fwd.FWD_GPU_BLOCKS,
                       _fwd.prune_fwd_configs)
    _DKDV = _Kernel("dkdv", _bwd.attn_bwd_dkdv, _bwd.attn_bwd_dkdv_fixed, _bwd.DKDV_GPU_BLOCKS,
                    _bwd.prune_dkdv_configs)
    _DQ = _Kernel("dq", _bwd.attn_bwd_dq, _bwd.attn_bwd_dq_fixed, _bwd.DQ_GPU_BLOCKS, _bwd.prune_dq_configs)


def _key_mask_args(q: torch.Tensor, key_mask: Optional[torch.Tensor],
                   problem: Problem) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(mask pointer, lengths pointer, mask strides); unused pointers get a placeholder tensor (q)."""
    if problem.key_masking == "bool":
        mask = key_mask.view(torch.uint8)  # same bytes; Triton loads bytes more predictably than i1
        return mask, q, mask.stride(0), mask.stride(1)
    if problem.key_masking == "lengths":
        # The kernels read lengths[b] at offset b: a strided view (lengths[::2]) is copied, [B] elements.
        return q, key_mask.contiguous(), 0, 0
    return q, q, 0, 0


def _variant_args(alibi_slopes: Optional[torch.Tensor], problem: Problem) -> tuple[tuple, dict]:
    """((stride_alibi_b, stride_alibi_h, window_left, window_right, softcap), constexpr flags): the variants'
    arguments beside the tensors. (The ALiBi pointer is a leading tensor: the slopes, or q where none are read.)

    The kernels take window sides >= 0: an unbounded side (-1) becomes max(S_q, S_k), which reaches past every key
    from every row (|i' - j| < max(S_q, S_k) for all rows and keys), and a huge one is clamped to it so that
    i' + side cannot overflow 32 bits. WINDOW is off when nothing is bounded, or only the right side under causal
    (the diagonal hides more): those calls compile exactly as dense ones. Slopes [H] get batch stride 0."""
    p = problem
    unbounded = max(p.seq_q, p.seq_k)
    left = unbounded if p.window_left < 0 else min(p.window_left, unbounded)
    right = unbounded if p.window_right < 0 else min(p.window_right, unbounded)
    window = p.window_left >= 0 or (p.window_right >= 0 and p.causal_mode == 0)
    if p.alibi == "none":
        strides = (0, 0)
    elif p.alibi == "heads":
        strides = (0, alibi_slopes.stride(0))
    else:
        strides = (alibi_slopes.stride(0), alibi_slopes.stride(1))
    flags = dict(WINDOW=window, SOFTCAP=p.softcap > 0, ALIBI=p.alibi != "none", VARLEN=p.varlen)
    return (*strides, left, right, float(p.softcap)), flags


def packed_view(tokens: torch.Tensor, sequences: int) -> torch.Tensor:
    """A packed [total, H, D] tensor as the kernels' [B, H, total, D] view with batch stride 0 (no copy): each
    program of packed sequence b offsets into the token axis by cu_seqlens[b] itself.

    Example:
        >>> packed_view(torch.zeros(7, 2, 4), 3).stride()
        (0, 4, 8, 1)
    """
    return tokens.transpose(0, 1).unsqueeze(0).expand(sequences, -1, -1, -1)


def _new_output(like: torch.Tensor, problem: Problem) -> torch.Tensor:
    """A contiguous tensor shaped like ``like`` (q, k or v of a call); for packed sequences a fresh packed
    [total, H, D] tensor in the kernels' view, not B copies."""
    if problem.varlen:
        return packed_view(torch.empty_like(like[0].transpose(0, 1), memory_format=torch.contiguous_format),
                           problem.batch)
    return torch.empty_like(like, memory_format=torch.contiguous_format)


def _check_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                  key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float, precision: str,
                  window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                  alibi_slopes: Optional[torch.Tensor] = None) -> Problem:
    # The custom ops are public through torch.ops: check what the kernels would otherwise get silently wrong.
    if causal_mode not in _CAUSAL_ARGUMENT:
        raise ValueError(f"causal_mode must be 0, 1 or 2, got {causal_mode}")
    # The ops' flat form of "no variant" (window sides -1, softcap 0.0) is validate's None.
    window = None if (window_left, window_right) == (-1, -1) else (window_left, window_right)
    problem = validate(q, k, v, _CAUSAL_ARGUMENT[causal_mode], scale, key_padding_mask, key_lengths, "triton",
                       precision if q.dtype == torch.float32 else None, window=window,
                       softcap=None if softcap == 0.0 else softcap, alibi_slopes=alibi_slopes)
    if precision != problem.precision:
        raise ValueError(f"precision {precision!r} does not fit {q.dtype} inputs (expected {problem.precision!r})")
    reason = kernel_unsupported(q, k, v, key_padding_mask)
    if reason is not None:
        raise ValueError(f"the Triton kernel cannot run this call: {reason}")
    return problem


@dataclass(frozen=True)
class _Grid:
    """Grid: sequence blocks on axis 0 (no practical limit), groups of BH_PER_PROGRAM (batch, head) pairs (one
    pair unless the config says more) on axis 1, flattened into axis 0 if batch * heads passes axis 1's limit."""

    seq: int
    block_key: str
    batch_heads: int
    splits: int = 1  # split-KV: programs per sequence block, on axis 0

    def __call__(self, meta: dict) -> tuple[int, ...]:
        pair_groups = cdiv(self.batch_heads, meta.get("BH_PER_PROGRAM", 1))
        blocks = cdiv(self.seq, meta[self.block_key]) * self.splits
        if self.batch_heads > _GRID_AXIS1_LIMIT:
            return (blocks * pair_groups,)
        return (blocks, pair_groups)


def _block_d(head_dim: int) -> int:
    return max(16, next_power_of_2(head_dim))


def _config_kwargs(config: "triton.Config") -> dict:
    return {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages}


def _forced_config(config: BlockConfig, kernel: "_Kernel") -> dict:
    if (not isinstance(config, tuple) or len(config) not in (4, 5)
            or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in config)):
        raise ValueError(f"config must be (BLOCK_M, BLOCK_N, num_warps, num_stages[, BH_PER_PROGRAM]) of positive "
                         f"integers, got {config!r}")
    block_m, block_n, num_warps, num_stages, *pairs = config
    if pairs and kernel.name != "forward":
        raise ValueError(f"config {config!r}: only the forward kernel takes a fifth entry (BH_PER_PROGRAM)")
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": num_warps, "num_stages": num_stages,
            **({"BH_PER_PROGRAM": pairs[0]} if pairs else {})}


def _autotuning() -> bool:
    return _runtime.interpreting() or _env.flag("FLASHLITE_AUTOTUNE", True)


def _replayed(plan: Plan, site: Any, tensors: tuple) -> bool:
    """Whether the plan's recording of ``site`` launched with ``tensors`` (False: none, or it refused them)."""
    recorded = plan.recorded.get(site)
    return recorded is not None and recorded.launch(*tensors)


def _launch(kernel: Any, site: Any, plan: Plan, grid: Any, tensors: tuple, scalars: tuple, meta: dict,
            seq_q_bucket: Optional[int] = None) -> None:
    """Launch ``kernel`` (a ``_Kernel``, or a plain jit function that takes no config) with ``tensors`` (its leading
    tensor arguments, in order) and ``scalars`` (the rest), the ordinary way, recording it as the plan's ``site``
    the first time a config is known. A tunable kernel runs the plan's config for it; without one, the autotuner
    chooses it (benchmarking only the first time its tuning key is seen; FLASHLITE_AUTOTUNE=0: the first of its
    GPU configs that fits, no benchmarking; ``seq_q_bucket``, the launch's query bucket, lets the forward's pruning
    pick decoding tiles), and the plan keeps the choice."""
    args = (*tensors, *scalars)
    if isinstance(kernel, _Kernel):
        config = plan.configs.get(kernel.name)
        if config is None:
            if _autotuning():
                kernel.autotuned[grid](*args, **meta)
                plan.configs[kernel.name] = _config_kwargs(kernel.autotuned.best_config)
                return
            config = plan.configs[kernel.name] = _config_kwargs(
                kernel.prune(_tuning.make_configs(kernel.gpu_blocks),
                             {"Q": tensors[0], **({} if seq_q_bucket is None else {"SEQ_Q_BUCKET": seq_q_bucket})},
                             BLOCK_D=meta["BLOCK_D"])[0])
        fixed, meta = kernel.fixed, {**meta, **config}
    else:
        fixed = kernel
    if plan.record and site not in plan.recorded:
        plan.recorded[site] = _direct_launch.record(fixed, grid, args, meta, len(tensors))
    else:
        fixed[grid](*args, **meta)


def _launcher_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_padding_mask: Optional[torch.Tensor],
                   key_lengths: Optional[torch.Tensor], causal_mode: int, scale: float, precision: str,
                   window_left: int, window_right: int, softcap: float, alibi_slopes: Optional[torch.Tensor],
                   configs: dict) -> Plan:
    """The plan of a direct launcher call (``attention_forward``, ``triton_bwd.attention_backward``): checked and
    kept per signature under the cache's "launcher" entry, or, with forced configs, made for this call alone."""
    key = None
    if not configs:
        # The launchers' own entry of the plan cache: their plans have no run, so no attention() call may find one.
        key = plans.key_of("launcher", q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision,
                           window_left, window_right, softcap, alibi_slopes)
        plan = None if key is None else plans._PLANS.get(key)
        if plan is not None:
            return plan
    problem = _check_launch(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left,
                            window_right, softcap, alibi_slopes)
    return plans.keep(key, launcher_plan(problem, q, k, v, Decision("triton", "a direct launcher call"), configs))


def launcher_plan(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decision: Decision,
                  configs: Optional[dict] = None, record: bool = True) -> Plan:
    """The plan of a call that runs the Triton kernels directly (a launcher call, a packed or cache call): the
    Gluon rules decided once, for the forward (``gluon.forward_kernel_for``) and the backward
    (``gluon_bwd.backward_on_gluon``); with ``record`` (for a plan that will be kept), launches are recorded on
    CUDA."""
    return Plan(problem, decision, configs=configs or {},
                gluon=launch_gluon.forward_kernel_for(problem, q, k, v) is not None,
                gluon_bwd=launch_gluon_bwd.backward_on_gluon(problem, q, k, v),
                record=record and plans.records_launches(q))


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      key_padding_mask: Optional[torch.Tensor], key_lengths: Optional[torch.Tensor],
                      causal_mode: int, scale: float, precision: str, window_left: int = -1,
                      window_right: int = -1, softcap: float = 0.0, alibi_slopes: Optional[torch.Tensor] = None,
                      config: Optional[BlockConfig] = None, need_lse: bool = True
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Launch the forward kernel; returns (out [B, H, S_q, D] in q's dtype, laid out as ``torch.empty_like(q)``,
    base-2 lse [B, H, S_q] float32; None without ``need_lse``, when the kernel skips its store).

    Checks its arguments as ``attention()`` validates them (once per signature). ``window_left``/``window_right``
    (-1: unbounded), ``softcap`` (0.0: off) and ``alibi_slopes`` (float32 [H] or [B, H], or None) as
    ``attention()``'s ``window``, ``softcap`` and ``alibi_slopes``. ``config`` = (BLOCK_M, BLOCK_N, num_warps,
    num_stages[, BH_PER_PROGRAM]) skips autotuning.

    Example:
        >>> q = torch.randn(1, 2, 20, 16)
        >>> out, lse = attention_forward(q, q, q, None, None, 1, 0.25, "ieee")  # doctest: +SKIP
    """
    configs = {} if config is None else {"forward": _forced_config(config, _FORWARD)}
    plan = _launcher_plan(q, k, v, key_padding_mask, key_lengths, causal_mode, scale, precision, window_left,
                          window_right, softcap, alibi_slopes, configs)
    return launch_forward(q, k, v, key_padding_mask if key_lengths is None else key_lengths, alibi_slopes, plan,
                          need_lse=need_lse, like_q=True)


def launch_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                   alibi_slopes: Optional[torch.Tensor], plan: Plan, need_lse: bool = True,
                   cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
                   block_table: Optional[torch.Tensor] = None,
                   like_q: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(out, lse; None without ``need_lse``) of a call of ``plan``'s signature. Without ``need_lse`` the kernel
    skips its log-sum-exp store (inference: no backward pass will read it) and ``out`` fills the unused slot.
    ``out`` is contiguous [B, H, S_q, D], or with ``like_q`` laid out as ``torch.empty_like(q)`` lays it out (q's
    strides where q is dense: the [B, S, H, D] storage of a layer's projections stays viewable as [B, S, H * D]).
    Window and softcap come from ``plan.problem``; ``alibi_slopes`` is this call's (None unless the problem has
    ALiBi), a leading tensor of the launch, so a recorded launch replays with each call's slopes. Packed
    sequences (``plan.problem.varlen``): q, k, v are ``packed_view``s, ``cu_seqlens`` the int32 (q, k) starts;
    ``out`` is then a packed view too, and lse [B, H, max S_q] padded. A paged cache
    (``plan.problem.page_size``): k, v are [blocks, H_kv, page_size, D] and ``block_table`` int32 [B, max blocks]."""
    p = plan.problem
    if plan.gluon:
        on_gluon = launch_gluon.launch_planned(q, k, v, p, plan, like_q)
        if on_gluon is not None:
            return on_gluon if need_lse else (on_gluon[0], None)
    if p.key_splits > 1:
        return _launch_split_forward(q, k, v, key_mask, alibi_slopes, plan, need_lse, block_table, like_q)
    # The kernel writes through out's strides (empty_like parses fewer arguments than empty).
    if p.varlen:
        out = _new_output(q, p)
    else:
        out = torch.empty_like(q) if like_q else torch.empty_like(q, memory_format=torch.contiguous_format)
    if not need_lse:
        lse = out
    elif p.varlen:  # padded rows: the kernel writes each sequence's own; the rest read as rows that see no key
        lse = torch.full((p.batch, p.heads, p.seq_q), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        lse = torch.empty((p.batch, p.heads, p.seq_q), dtype=torch.float32, device=q.device)
    site = "forward" if need_lse else "inference"
    _launch_forward_kernel(q, k, v, out, lse, key_mask, alibi_slopes, plan, site, need_lse, cu_seqlens, block_table)
    return out, (lse if need_lse else None)


def _launch_forward_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           key_mask: Optional[torch.Tensor], alibi_slopes: Optional[torch.Tensor], plan: Plan,
                           site: str, store_lse: bool, cu_seqlens: Optional[tuple[torch.Tensor, torch.Tensor]],
                           block_table: Optional[torch.Tensor]) -> None:
    """One launch of the forward kernel writing ``out`` and ``lse`` (with ``plan.problem.key_splits`` > 1: the
    float32 partials, [splits, *out's shape] and [splits, B, H, S_q])."""
    p = plan.problem
    mask_arg, lengths_arg, stride_mask_b, stride_mask_n = _key_mask_args(q, key_mask, p)
    # Each entry's first visible key (the kernel skips the key blocks before it), on the device: argmax returns
    # the first maximum, so a row's first True, and 0 for a row without one (which then skips nothing).
    start_arg = mask_arg.argmax(1) if p.key_masking == "bool" else q
    cu_q, cu_k = (q, q) if cu_seqlens is None else cu_seqlens
    # the kernel's Q, K, V, Out, Lse, KeyMask, KeyLen, KeyStart, Alibi (q unless the problem has ALiBi), CuSeqQ,
    # CuSeqK, BlockTable
    tensors = (q, k, v, out, lse, mask_arg, lengths_arg, start_arg, q if p.alibi == "none" else alibi_slopes, cu_q,
               cu_k, q if block_table is None else block_table)
    recorded = plan.recorded.get(site)  # _replayed, inline: this is the hot path of a replayed inference call
    if recorded is None or not recorded.launch(*tensors):
        # The scalars and flags only an ordinary launch reads (a replay keeps the recorded ones).
        variant_scalars, variant_flags = _variant_args(alibi_slopes, p)
        stride_table = 0 if block_table is None else block_table.stride(0)
        block_d = _block_d(p.head_dim)
        buckets = _tuning.tuning_buckets(p.seq_q, p.seq_k, p.batch * p.heads)
        dot = _dot_mode(p.precision)
        splits = {} if p.key_splits == 1 else {"NUM_SPLITS": p.key_splits}
        _launch(_FORWARD, site, plan, _Grid(p.seq_q, "BLOCK_M", p.batch * p.heads, p.key_splits), tensors,
                (*q.stride(), *k.stride(), *v.stride(), *out.stride(), stride_mask_b, stride_mask_n,
                 *variant_scalars[:2], stride_table, p.heads, p.group_size, p.seq_q, p.seq_k,
                 p.scale * math.log2(math.e),
                 p.batch * p.heads, *variant_scalars[2:], *buckets),
                dict(HEAD_DIM=p.head_dim, BLOCK_D=block_d, CAUSAL=p.causal_mode, KEY_MASK=p.key_masking, DOT=dot,
                     FLAT_GRID=p.batch * p.heads > _GRID_AXIS1_LIMIT, STORE_LSE=store_lse, PAGE_SIZE=p.page_size,
                     **variant_flags, **splits), seq_q_bucket=buckets[0])


# Rows per program of the split-KV merge: decoding has a few thousand rows at most.
_COMBINE_ROWS = 16


def _launch_split_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor],
                          alibi_slopes: Optional[torch.Tensor], plan: Plan, need_lse: bool,
                          block_table: Optional[torch.Tensor],
                          like_q: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Split-KV: the forward kernel with ``key_splits`` programs per query block, each over a share of the
    keys, into float32 partials, then ``_attn_fwd_combine`` merging them into out (and lse). The merge writes
    contiguous rows, so ``like_q`` (as in ``launch_forward``) copies out where q's layout is another."""
    p = plan.problem
    splits = p.key_splits
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    part_out = torch.empty((splits, *q.shape), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((splits, p.batch, p.heads, p.seq_q), dtype=torch.float32, device=q.device)
    _launch_forward_kernel(q, k, v, part_out[0], part_lse, key_mask, alibi_slopes, plan, "split", True, None,
                           block_table)
    lse = torch.empty((p.batch, p.heads, p.seq_q), dtype=torch.float32, device=q.device) if need_lse else out
    rows = p.batch * p.heads * p.seq_q
    _launch(_fwd._attn_fwd_combine, "combine", plan, (cdiv(rows, _COMBINE_ROWS),), (part_out, part_lse, out, lse),
            (rows,), dict(HEAD_DIM=p.head_dim, BLOCK_D=_block_d(p.head_dim), BLOCK_R=_COMBINE_ROWS,
                          NUM_SPLITS=splits, STORE_LSE=need_lse, DOT=_dot_mode(p.precision)))
    if like_q:
        out = like_layout(out, q)
    return out, (lse if need_lse else None)


def like_layout(out: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``out`` itself where its strides are those ``torch.empty_like(q)`` would have, else a copy laid out so.

    Example:
        >>> q = torch.randn(2, 5, 3, 4).transpose(1, 2)  # [B, H, S, D] viewing [B, S, H, D] storage
        >>> like_layout(torch.randn(2, 3, 5, 4), q).stride() == q.stride()
        True
    """
    if out.stride() == q.stride():  # out is dense, so q is too, and empty_like(q) keeps q's strides
        return out
    like = torch.empty_like(q)
    return out if like.stride() == out.stride() else like.copy_(out)
