"""Launch the Gluon attention forward (``flashlite.kernels.attention_fwd_gluon``) on Hopper: check, describe, launch.

What the kernel assumes, checked by ``gluon_supported`` (``gluon_attention_forward`` raises ValueError with the
same reason): a CUDA device of compute capability 9.0, bfloat16 or float16 q/k/v, head dim 64 or 128, causal
False / True / "lower_right", a positive scale, and layouts TMA can describe: unit stride along D, every other
stride a multiple of 16 bytes (of a dimension longer than 1: a size-1 dimension's stride is never used and is
replaced), 16-byte aligned base addresses. Grouped-query attention (H a multiple of H_kv) is native: query head h
reads key/value head h // (H // H_kv), with no copy. ``gluon_attention_forward(window=(left, right))`` runs a
causal sliding window (step 1); the dispatch rule runs windows at D=64 on it, where its A/B
(``tests/perf/test_gluon_ab.py -k gluon_window``) measured it faster than the pointer kernel.

The descriptors are 4-D, over the tensors' own [B, heads, S, D] shapes and strides with [1, 1, rows, D] tiles, so
the copy engine bounds each tile by its own (batch, head): a block past S reads zeros and stores nothing, however
the tensors are laid out ([B, H, S, D] contiguous, or [B, S, H, D] transposed views).

Where the Triton backend runs a call's forward on this kernel instead of the pointer kernel: ``forward_kernel_for``
(the measured rule, ``GLUON_MIN_ROWS``), which every Triton plan asks once; ``launch_planned`` then launches it
with the plan's problem, unchecked but for the base addresses (not part of a plan's signature). Direct calls:
``gluon_attention_forward``.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from flashlite import _direct_launch, _env
from flashlite.attn.plan import Plan
from flashlite.attn.problem import CAUSAL_TOP_LEFT, Problem, validate

try:
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from flashlite.kernels import attention_fwd_gluon as _kernels
    _GLUON_ERROR: Optional[str] = None
except ImportError as error:  # pragma: no cover - Triton without Gluon (before 3.5) or no Triton at all
    _GLUON_ERROR = f"Gluon (triton.experimental.gluon) is not available ({error})"

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_CAUSAL = {False: 0, True: 1, "top_left": 1, "lower_right": 2}
# CUDA caps grid axis 1, which holds batch * heads.
_GRID_AXIS1_LIMIT = 65535
VARIANTS = ("pipelined", "pingpong")

# Where the Triton backend runs a call's forward on the Gluon kernel, and on which config: where its A/B against the
# pointer kernel measured a win (H200, 2026-12-01, causal bf16, H=16, tests/perf/test_gluon_ab.py). Step 1's first
# config measured 1.098x at D=128, B=8 S=4096 and 1.105x at B=16 S=8192
# (benchmarks/results/h200-2026-12-01-session4/run5_gluon/ab/ at commit 8ca4529). The tile A/B of steps 1 and 3
# (benchmarks/results/h200-2026-12-01-session5/run2_gluon_step3_split_profile at commit 8ca4529) measured step 1 at
# 64x128, 2 stages, 4 warps at D=64: 1.134x, 1.178x and 1.197x the pointer kernel at B=1 S=8192, B=8 S=4096 and
# B=16 S=8192 (2**17, 2**19 and 2**21 query rows), and step 3's 64x128x2w4 at D=128 1.089x, 0.990x (a tie) and
# 1.051x (the last two against step 1: that A/B's pointer side took the Gluon step 1 the rule then ran from 2**19
# rows), where its do_bench probe ranked 64x128x3w4 first (0.512, 1.099 and 8.200 ms against 0.578, 1.208 and
# 8.637 ms; through the dispatch, the case table's forward A/B measured it at 1.003x, 0.941x and 0.975x SDPA, where
# the pointer kernel is 0.80-0.86x). Smaller calls, fp16, other causal modes and S_q != S_k were not measured, so
# they stay on the pointer kernel.
# The forward A/B of the case table through backend="triton" measured the rule without a length floor: wins from
# S=4096 up at D=64 (1.034-1.108x SDPA; benchmarks/results/h200-2026-12-01-attention-gluon-fwd-fwdbwd-ab/), but
# 0.38-0.63x SDPA at S=64 to 2048 with 2**17 or more rows (cases 5, 7-11; the whole report:
# benchmarks/results/h200-2026-12-01-session5/run3_case_table_ab_profile/ab/results/ at commit 8ca4529), where the
# Gluon launch's host work (four TMA descriptors built per call) outlasts the kernel; so the rule also needs a
# length floor per sequence, GLUON_MIN_SEQ.
# After the launch's four TMA descriptors stopped re-running the constructor's checks (18.2 us of arguments down to
# 11.5 on the development CPU), the planned launch against the pointer kernel below the old floor of 4,096
# (benchmarks/results/h200-2026-12-02/run2_floor_step4_decoding/floor at commit 8ca4529) measured at D=64 1.097x
# (S=2048), 1.061x (1024), 1.035x (512), then 0.574x (256) and 0.584x (128); at D=128 1.108x (2048), 1.010x (1024, a
# tie), 0.867x (512). So the floor is 512 at D=64 and 2,048 at D=128, where the last measured win is.
# Causal sliding windows (window_left >= 0; benchmarks/results/h200-2026-12-02/run1_gluon_window_layer_mode/gwin at
# commit 8ca4529): step 1 in the dense D=64 config measured 1.066x and 1.069x the pointer kernel's window (1,024
# keys, B=1, H=16, S=16,384 and 65,536), and step 1 at D=128 (128x128x2w8; the ping-pong kernel has no window)
# 0.976x and 0.978x, losses: so windows take the Gluon kernel at D=64 only, from the shortest measured length,
# GLUON_WINDOW_MIN_SEQ.
# fp16 (benchmarks/results/h200-2026-12-04/run3_fp16_realsize at commit 8ca4529): the dispatched configs measured
# 1.10-1.20x the pointer kernel at D=64 and 1.28-1.34x at D=128, dense causal at B=1 S=8,192, B=8 S=4,096 and
# B=16 S=8,192; so dense fp16 calls take the Gluon kernel too, from the shortest length measured in fp16,
# GLUON_FP16_MIN_SEQ (fp16 windows were not measured).
# FLASHLITE_GLUON=0 keeps every call on the pointer kernel.
GLUON_MIN_ROWS = 2 ** 17
GLUON_MIN_SEQ = {64: 512, 128: 2048}
GLUON_FP16_MIN_SEQ = 4096
GLUON_WINDOW_MIN_SEQ = 16384
GLUON_ENABLED = _env.flag("FLASHLITE_GLUON", True)
# A recording plan's Gluon launches are replayed (flashlite._direct_launch: the compiled kernel kept from the plan's
# first launch, each later call passing its own TMA descriptors and lse, Triton's per-call argument binding
# skipped), as the pointer kernel's launches are. On the H200 (benchmarks/results/h200-2026-12-04/run1_key_replay_auto
# at commit 8ca4529) it tied the ordinary launch at 8 of 10 shapes and won at the host-bound two (D=64, B=64 S=256
# and B=128 S=128: 1.30x), and its bit-for-bit GPU test passed.
# What changes from call to call of one plan, the leading arguments of every Gluon forward: the TMA descriptors of
# q, k, v and out, then lse.
_CALL_ARGUMENTS = 5


@dataclass(frozen=True)
class GluonConfig:
    """One compiled shape of the kernel: its variant ("pipelined": step 1, "pingpong": step 3), tiles,
    ring depth, warps, and whether a block's softmax overlaps the previous block's P V (``overlap``). For
    "pingpong", ``block_m`` and ``num_warps`` are one consumer warpgroup's (a program has two: 2 x block_m rows).

    Example:
        >>> GluonConfig("pipelined", 128, 128, 3, 8).shared_bytes(64)
        114688
    """

    variant: str
    block_m: int
    block_n: int
    stages: int
    num_warps: int
    overlap: bool = False
    # "pingpong" only: the consumers' turns and slot releases through hardware named barriers (bar.sync /
    # bar.arrive) instead of mbarriers.
    named_barriers: bool = False

    @property
    def step(self) -> str:
        """The step of issue 17 this config's variant is: "step 1" or "step 3"."""
        return {"pipelined": "step 1", "pingpong": "step 3"}[self.variant]

    @property
    def rows_per_program(self) -> int:
        """Query rows one program covers (grid axis 0 is cdiv(S_q, rows_per_program))."""
        return 2 * self.block_m if self.variant == "pingpong" else self.block_m

    def shared_bytes(self, head_dim: int) -> int:
        return _kernels.shared_memory_bytes(self.rows_per_program, self.block_n, self.stages, head_dim)


def kernel_for(config: GluonConfig) -> Any:
    """The Gluon kernel that runs ``config``: ``_attn_fwd`` (step 1) or ``_attn_fwd_pingpong`` (step 3)."""
    return _kernels._attn_fwd_pingpong if config.variant == "pingpong" else _kernels._attn_fwd


def _grid(config: GluonConfig, q: torch.Tensor) -> tuple[int, ...]:
    """Query blocks by batch * heads."""
    batch, heads, seq_q, _ = q.shape
    return (math.ceil(seq_q / config.rows_per_program), batch * heads)


def configs_for(head_dim: int, variant: str = "pipelined") -> list[GluonConfig]:
    """Every config the kernel file lists for ``head_dim`` and ``variant``, the launcher's choice first.

    Example:
        >>> configs_for(64)[0]  # doctest: +NORMALIZE_WHITESPACE
        GluonConfig(variant='pipelined', block_m=128, block_n=128, stages=3, num_warps=8, overlap=False,
                    named_barriers=False)
    """
    return [GluonConfig(variant, *blocks) for blocks in _kernels.GLUON_FWD_CONFIGS[variant][head_dim]]


# The dispatched config per head dim (see GLUON_MIN_ROWS for the measurements); each is one the kernel file lists, so
# CPU CI compiles it and the GPU suite checks it against float64 (test_every_listed_config). D=128: step 3 with its
# turns and slot releases on named barriers, 1.016-1.024x the same tiles on mbarriers at cases 3, 6 and 12 (an 8ca4529
# run, H100, paired A/B); at D=64 step 3 still loses to step 1 (0.82-0.89x in that run).
_DISPATCHED = {64: GluonConfig("pipelined", 64, 128, 2, 4),
               128: GluonConfig("pingpong", 64, 128, 3, 4, named_barriers=True)}
# The dispatched config of a causal sliding window, per head dim (see GLUON_WINDOW_MIN_SEQ).
_DISPATCHED_WINDOW = {64: GluonConfig("pipelined", 64, 128, 2, 4)}


def _tma_strides(t: torch.Tensor) -> list[int]:
    """t's strides with those of size-1 dimensions (never stepped along) replaced by a contiguous tensor's: a
    multiple of the head dim, so of 16 bytes at D >= 8 for 16-bit values, whatever torch reports for them."""
    strides = list(t.stride())
    for d in range(t.dim() - 1):
        if t.shape[d] == 1:
            strides[d] = math.prod(t.shape[d + 1:])
    return strides


def _layout_problem(name: str, t: torch.Tensor, addresses: bool = True) -> Optional[str]:
    if t.stride(-1) != 1:
        return f"{name} has stride {t.stride(-1)} along the head dim; TMA needs it contiguous (stride 1)"
    elem = t.element_size()
    for d, stride in enumerate(_tma_strides(t)[:-1]):
        if stride <= 0:
            return (f"{name} has stride {stride} in dimension {d} (an expanded tensor); TMA needs real strides "
                    f"(pass .contiguous())")
        if (stride * elem) % 16:
            return f"{name}'s stride {stride} in dimension {d} is not a multiple of 16 bytes, as TMA requires"
    if addresses and t.data_ptr() % 16:
        return f"{name}'s data is not 16-byte aligned, as TMA requires"
    return None


def gluon_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    causal: Union[bool, str] = False, scale: Optional[float] = None, *,
                    addresses: bool = True, window: Optional[tuple[int, int]] = None) -> Optional[str]:
    """None if the Gluon forward can run this call, otherwise the reason it cannot (naming the argument).

    The call's own properties are checked before the machine's, so that the reasons can be read on any machine.
    ``addresses=False`` leaves out the 16-byte alignment of the tensors' data: for a decision that holds for every
    call of a signature (a plan keys on shapes and strides, and checks addresses per call with ``bases_aligned``),
    and one that torch.compile makes while tracing, on fake tensors that have no data. ``window`` (left, right), as
    in ``flashlite.attention``: the kernel has causal windows, bounded on the left (the diagonal closes the right).

    Example:
        >>> q = torch.randn(1, 2, 16, 32, dtype=torch.bfloat16)
        >>> gluon_supported(q, q, q)
        'head dim 32: the Gluon kernel has head dims 64 and 128'
    """
    try:
        problem = validate(q, k, v, causal, scale, None, None, "triton", None, window)
    except (TypeError, ValueError) as error:
        return str(error)
    if window is not None and (problem.causal_mode == 0 or problem.window_left < 0):
        return (f"window {tuple(window)} with causal {causal!r}: the Gluon kernel's windows are causal and bounded "
                f"on the left (left >= 0)")
    if q.dtype not in _DTYPES:
        return f"q has dtype {q.dtype}; the Gluon kernel takes bfloat16 and float16"
    if problem.head_dim not in (64, 128):
        return f"head dim {problem.head_dim}: the Gluon kernel has head dims 64 and 128"
    if not (isinstance(causal, (bool, str)) and causal in _CAUSAL):
        return f"causal {causal!r}: the Gluon kernel has False, True (top-left) and 'lower_right'"
    if not problem.scale > 0:
        return f"scale {problem.scale}: the Gluon kernel needs a positive scale"
    for name, t in (("q", q), ("k", k), ("v", v)):
        reason = _layout_problem(name, t, addresses)
        if reason is not None:
            return reason
    if problem.batch * problem.heads > _GRID_AXIS1_LIMIT:
        return f"batch * heads = {problem.batch * problem.heads} passes grid axis 1's limit of {_GRID_AXIS1_LIMIT}"
    if not q.is_cuda:
        return f"tensors on {q.device}; the Gluon kernel runs on CUDA devices of compute capability 9.0"
    capability = torch.cuda.get_device_capability(q.device)
    if capability != (9, 0):
        return f"the device has compute capability {capability}; the Gluon kernel is for sm_90 (9, 0)"
    if _GLUON_ERROR is not None:
        return _GLUON_ERROR
    return None


def dispatched_config(head_dim: int, windowed: bool = False) -> Optional["GluonConfig"]:
    """The config the Triton backend's Gluon forward runs at ``head_dim`` (the measured rule above), for dense
    calls or (``windowed``) causal sliding windows; None where the rule keeps the pointer kernel.

    Example:
        >>> dispatched_config(64)  # doctest: +NORMALIZE_WHITESPACE
        GluonConfig(variant='pipelined', block_m=64, block_n=128, stages=2, num_warps=4, overlap=False,
                    named_barriers=False)
        >>> dispatched_config(128, windowed=True) is None
        True
    """
    return (_DISPATCHED_WINDOW if windowed else _DISPATCHED).get(head_dim)


def forward_kernel_for(problem: Problem, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Optional[str]:
    """Why a Triton plan's forward runs on the Gluon kernel (a reason for ``explain_dispatch``), or None for the
    pointer kernel: the call must be one the measurement covered (causal, S_q == S_k, at least ``GLUON_MIN_ROWS``
    query rows in all; bf16 dense at D=64 or 128 from ``GLUON_MIN_SEQ[D]`` per sequence, or a bf16 causal sliding
    window at D=64 from ``GLUON_WINDOW_MIN_SEQ``; fp16 dense at D=64 or 128 from ``GLUON_FP16_MIN_SEQ``) and one the
    kernel can run (``gluon_supported``).

    Example:
        >>> q = torch.randn(1, 2, 16, 128, dtype=torch.bfloat16)
        >>> forward_kernel_for(validate(q, q, q, True, None, None, None, "triton", None), q, q, q) is None
        True
    """
    rows = problem.batch * problem.heads * problem.seq_q
    windowed = problem.variant == "window" and problem.window_left >= 0
    config = dispatched_config(problem.head_dim, windowed)
    if problem.dtype == torch.bfloat16:
        min_seq = GLUON_WINDOW_MIN_SEQ if windowed else GLUON_MIN_SEQ.get(problem.head_dim, 0)
    elif problem.dtype == torch.float16 and not windowed:
        min_seq = GLUON_FP16_MIN_SEQ
    else:
        return None
    if not (GLUON_ENABLED and config is not None and (windowed or problem.variant == "dense")
            and problem.key_masking == "none" and not problem.varlen and problem.page_size == 0
            and problem.causal_mode == CAUSAL_TOP_LEFT
            and problem.seq_q == problem.seq_k and rows >= GLUON_MIN_ROWS and problem.seq_q >= min_seq):
        return None
    # No address check: the plan is kept for every call of this signature (launch_planned checks each call's), and
    # under torch.compile it is made on fake tensors.
    window = (problem.window_left, problem.window_right) if windowed else None
    if gluon_supported(q, k, v, True, problem.scale, addresses=False, window=window) is not None:
        return None
    what = f"causal windows of {problem.window_left} keys" if windowed else "causal"
    return (f"forward on the Gluon kernel ({config.step}, {config.block_m}x{config.block_n}, {config.stages} stages, "
            f"{config.num_warps} warps; sm_90, TMA and wgmma: measured faster than the pointer kernel for {what} "
            f"{_DTYPES[problem.dtype]} at D={problem.head_dim} from {GLUON_MIN_ROWS} query rows and {min_seq} per "
            f"sequence; this call has {rows})")


def bases_aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether this call's q, k and v start on 16-byte boundaries, as TMA needs: a plan keys on shapes and strides,
    not addresses, so a plan that chose a Gluon kernel still takes the pointer kernel for a call that does not.

    Example:
        >>> t = torch.zeros(65)[1:]
        >>> bases_aligned(t, t, t)
        False
    """
    return not (q.data_ptr() % 16 or k.data_ptr() % 16 or v.data_ptr() % 16)


def launch_planned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, problem: Problem,
                   plan: Optional[Plan] = None, like_q: bool = False) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(out, lse) of a call whose plan chose the Gluon kernel, or None when this call's base addresses are not
    16-byte aligned (a plan keys on shapes and strides, not addresses: such a call takes the pointer kernel).
    With a recording ``plan``, the plan records its first launch and replays the later ones; out's
    layout (``like_q``) as in ``triton.launch_forward``."""
    if not bases_aligned(q, k, v):
        return None
    # The rule takes dense calls and causal windows bounded on the left (window_left is -1 for dense ones).
    config = dispatched_config(problem.head_dim, windowed=problem.window_left >= 0)
    return _launch(q, k, v, problem.causal_mode, problem.scale, config, problem.window_left, plan, like_q)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_mode: int, scale: float,
            config: GluonConfig, window_left: int = -1,
            plan: Optional[Plan] = None, like_q: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate out (q's dtype; contiguous, or with ``like_q`` laid out as ``torch.empty_like(q)``) and lse, and
    launch ``config``'s kernel on a checked call: the ordinary way, or, for a recording ``plan`` with
    through the plan's recorded launch (recorded at the first call; a launch the recording
    refuses, or one that could not be recorded, goes the ordinary way). The output's TMA descriptor takes any
    layout the checks accept for q (``tile_descriptor``), so q's layout is one."""
    batch, heads, seq_q, _ = q.shape
    out = torch.empty_like(q) if like_q else torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty((batch, heads, seq_q), dtype=torch.float32, device=q.device)
    args, meta = kernel_arguments(q, k, v, out, lse, causal_mode, scale, config, window_left)
    kernel, grid = kernel_for(config), _grid(config, q)
    if plan is None or not plan.record:
        kernel[grid](*args, **meta)
        return out, lse
    site = ("gluon forward", config)
    recorded = plan.recorded.get(site)
    if recorded is not None and recorded.launch(*args[:_CALL_ARGUMENTS]):
        return out, lse
    if site in plan.recorded:
        kernel[grid](*args, **meta)
    else:
        plan.recorded[site] = _direct_launch.record(kernel, grid, args, meta, _CALL_ARGUMENTS)
    return out, lse


@functools.lru_cache(maxsize=None)
def _shared_layout(rows: int, head_dim: int, bf16: bool) -> Any:
    # The tiles' 128-byte-swizzled shared layout, made once per tile shape and dtype: building it costs about 8 us
    # of host time on the development CPU, paid four times per launch before (the layout is a frozen dataclass).
    return _gl.NVMMASharedLayout.get_default_for([1, 1, rows, head_dim], _gl.bfloat16 if bf16 else _gl.float16)


def tile_descriptor(t: torch.Tensor, rows: int) -> Any:
    """A TMA descriptor of 16-bit [B, heads, S, D] ``t``: 4-D, [1, 1, rows, D] tiles in the 128-byte swizzle the
    Gluon kernels' shared tiles use. Host-side only (CPU tensors work, for compiling).

    Made without ``TensorDescriptor.__post_init__``: its asserts (rank, a 16-byte aligned base and strides, a unit
    last stride, power-of-two tiles, the layout's type) are what ``gluon_supported`` checks of every call that
    gets here, and they were a third of a launch's argument building (18.2 us with them, 11.5 without, for the
    forward's four descriptors on the development CPU:
    benchmarks/results/cpu-host-2026-12-01/gluon_launch_arguments_host_time.txt at commit 8ca4529). The fields are the
    constructor's; a test compares them, field by field, with a descriptor the constructor made, so a Triton whose
    descriptor has other fields fails there."""
    head_dim = t.shape[-1]
    described = object.__new__(TensorDescriptor)
    described.__dict__.update(_descriptor_defaults())
    described.__dict__.update(base=t, shape=list(t.shape), strides=_tma_strides(t),
                              block_shape=[1, 1, rows, head_dim],
                              layout=_shared_layout(rows, head_dim, t.dtype == torch.bfloat16), padding="zero")
    return described


@functools.lru_cache(maxsize=None)
def _descriptor_defaults() -> dict[str, Any]:
    # The descriptor's fields that have defaults, at them: Triton 3.9 added ``round_f32_to_tf32``, which its launcher
    # reads, so a descriptor made without the constructor has to carry every field this Triton's constructor sets.
    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


def descriptors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                config: GluonConfig) -> tuple[Any, Any, Any, Any]:
    """TMA descriptors of q, k, v and out (``tile_descriptor``): BLOCK_M rows per tile for q and out, BLOCK_N for
    k and v."""
    return (tile_descriptor(q, config.block_m), tile_descriptor(k, config.block_n),
            tile_descriptor(v, config.block_n), tile_descriptor(out, config.block_m))


def kernel_arguments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                     causal_mode: int, scale: float, config: GluonConfig,
                     window_left: int = -1) -> tuple[tuple, dict]:
    """(positional arguments, constexprs and launch options) of one launch, in the kernel's parameter order.
    ``window_left`` >= 0: a causal sliding window (step 1; -1: none)."""
    heads, kv_heads = q.shape[1], k.shape[1]
    args = (*descriptors(q, k, v, out, config), lse, heads, heads // kv_heads, q.shape[2], k.shape[2],
            scale * math.log2(math.e))
    meta = dict(HEAD_DIM=q.shape[-1], BLOCK_M=config.block_m, BLOCK_N=config.block_n, STAGES=config.stages,
                CAUSAL=causal_mode, OVERLAP=config.overlap, num_warps=config.num_warps)
    if config.named_barriers and config.variant != "pingpong":
        raise ValueError(f"named_barriers: only the ping-pong kernel (step 3) has them, not {config.variant!r}")
    if config.variant == "pingpong":
        if window_left >= 0:
            raise ValueError("window: the ping-pong kernel (step 3) has no window; use variant 'pipelined'")
        meta["maxnreg"] = _kernels.PINGPONG_MAXNREG
        meta["NAMED_BARRIERS"] = config.named_barriers
    else:
        args = (*args, max(window_left, 0))
        meta["WINDOW"] = window_left >= 0
    return args, meta


def gluon_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: Union[bool, str] = False,
                            scale: Optional[float] = None, variant: str = "pipelined",
                            config: Optional[GluonConfig] = None,
                            window: Optional[tuple[int, int]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S_q, D] in q's dtype, lse [B, H, S_q] float32) of attention on Hopper, through the Gluon kernel.

    ``lse`` is in the pointer kernel's convention (base-2 log-sum-exp of the scaled scores; -inf, with out 0, for
    rows that see no key), so ``flashlite.attn.triton.attention_backward`` takes it. ``variant``: "pipelined"
    (one partition, step 1) or "pingpong" (a TMA producer warp and two consumer warpgroups taking turns at the
    tensor cores, step 3); ``config`` forces tiles.
    ``window`` = (left, right) with causal True or "lower_right": a causal sliding window as in
    ``flashlite.attention`` (step 1; key blocks before the window are not loaded).
    Raises ValueError with ``gluon_supported``'s reason when the kernel cannot run the call.

    Example:
        >>> q = torch.randn(2, 16, 1000, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> out, lse = gluon_attention_forward(q, q, q, causal=True)  # doctest: +SKIP
    """
    reason = gluon_supported(q, k, v, causal, scale, window=window)
    if reason is not None:
        raise ValueError(f"the Gluon attention kernel cannot run this call: {reason}")
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    head_dim = q.shape[-1]
    if config is None:
        config = configs_for(head_dim, variant)[0]
    elif config.variant != variant:
        raise ValueError(f"config {config} is for variant {config.variant!r}, not {variant!r}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    return _launch(q, k, v, _CAUSAL[causal], scale, config, -1 if window is None else int(window[0]))
