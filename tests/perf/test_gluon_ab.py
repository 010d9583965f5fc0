"""A/B of the Gluon attention forward (issue 17) on Hopper: steps 1 and 3 against SDPA's default, against
flashlite's pointer-kernel forward and against each other, with and without the softmax/P V overlap, and the D=64
block shapes listed beside step 1's default against it (sm_90 only).

Run with ``pytest tests/perf/test_gluon_ab.py --kernel-ab`` (``-k step3``: only step 3 and the D=64 block
shapes; ``-k forward_ab``: only step 1). Causal bf16, H=16, cases 3, 6 and 12 of
``flashlite.cases`` (B=1 S=8192; B=8 S=4096; B=16 S=8192) at D=64 and D=128. Every side computes out and the
log-sum-exp a backward would need (SDPA's default: its forward without grad, as the other A/B files time it);
each candidate is first checked against SDPA so that a wrong kernel is never timed. ``-k gluon_backward_ab``: the Gluon
backward (dK/dV single-partition, dQ warp-specialized), forward+backward of ``flashlite.attention`` with it against
the pointer backward and against SDPA; ``-k backward_kernels``: each further listed config of each backward kernel
against its first, the kernels alone.
``-k gluon_window``: the causal sliding window on the Gluon forward against the pointer kernel's and FlexAttention.
``-k below_the_floor``: the dispatched Gluon forward at cases 5 and 7-10, under the rule's length floor.
``-k replayed``: the planned launch replayed
(a recording plan) against the ordinary one, the pointer kernel and SDPA at cases 5 and 7-10. ``-k fp16``: fp16
on the dispatched configs against the pointer kernel and SDPA. ``-k named_barriers``: step 3 with its turns and
slot releases through hardware named barriers against the same tiles with mbarriers, the dispatched config and SDPA.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from flashlite.attn import gluon as launch_gluon, gluon_bwd as launch_gluon_bwd
from flashlite.attn.gluon import GluonConfig, configs_for, gluon_attention_forward
from flashlite.attention import attention
from flashlite.cases import case
from pytest_kernelcheck import assert_close

from .conftest import attention_bytes, attention_work, pointer_forward, qkv
from .test_variants_ab import WINDOW, WINDOWED, _flex
from .test_variants_ab import _work as _window_work

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)),
    reason="the Gluon kernel is for sm_90: needs a CUDA GPU of compute capability 9.0")

SHAPES = [dict(case=n, B=case(n).B, S=case(n).S, H=case(n).H, D=D) for D in (64, 128) for n in (3, 6, 12)]


def _gluon(q, k, v, variant: str, overlap: bool):
    config = next(c for c in configs_for(q.shape[-1], variant) if c.overlap == overlap)
    return _run(q, k, v, config)


def _run(q, k, v, config: GluonConfig):
    return lambda: gluon_attention_forward(q, k, v, causal=True, variant=config.variant, config=config)[0]


def _shape_name(config: GluonConfig) -> str:
    """"gluon step 1 64x128x2w4": the step, then BLOCK_M x BLOCK_N x stages and warps (pingpong: per consumer)."""
    return (f"gluon {config.step} {config.block_m}x{config.block_n}x{config.stages}w{config.num_warps}"
            + (" overlap" if config.overlap else ""))


# D=64 block shapes beside each variant's first config: step 1's one-warpgroup shapes (4 warps, 2 or 3 programs per
# SM where step 1's default fits one) and step 3's 128-rows-per-consumer shape, each against step 1's default.
D64_SHAPES = [c for c in configs_for(64, "pipelined")[1:] if c.num_warps == 4 and not c.overlap]
D64_SHAPES += [c for c in configs_for(64, "pingpong")[1:] if not c.overlap]


def _callables(shape, pairs):
    """The sides the pairs name, each Gluon one checked against SDPA first."""
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    scale = shape.D ** -0.5
    dot = {torch.bfloat16: "bf16", torch.float16: "fp16"}[shape.dtype]  # the pointer kernel's operand precision
    pointer = pointer_forward(q, k, v, scale=scale, precision=dot)
    sides = {
        "gluon step 1": _gluon(q, k, v, "pipelined", False),
        "gluon step 1 overlap": _gluon(q, k, v, "pipelined", True),
        "gluon step 3": _gluon(q, k, v, "pingpong", False),
        "gluon step 3 overlap": _gluon(q, k, v, "pingpong", True),
        # What the rule runs today.
        "gluon dispatched": _run(q, k, v, launch_gluon.dispatched_config(shape.D)),
        "pointer kernel": lambda: pointer()[0],
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    named = [c for c in configs_for(shape.D, "pingpong") if c.named_barriers]
    sides["gluon step 3 named barriers"] = _run(q, k, v, next(c for c in named if not c.overlap))
    sides["gluon step 3 mbarriers"] = _run(q, k, v, dataclasses.replace(named[0], named_barriers=False))
    for config in (c for c in named if c.overlap):  # D=128: the overlapped schedule with named barriers
        sides["gluon step 3 overlap named barriers"] = _run(q, k, v, config)
    if shape.D == 64:
        sides.update({_shape_name(c): _run(q, k, v, c) for c in D64_SHAPES})
    sides = {name: sides[name] for name in {side for pair in pairs for side in pair} | {"sdpa"}}
    expected = sides["sdpa"]()
    if "pointer kernel" in sides:
        sides["pointer kernel"]()  # its autotuning, outside the timed calls
    for name in sides:
        if name.startswith("gluon"):
            # SDPA's own low-precision output is the yardstick here; the float64 checks live in tests/flashlite.
            assert_close(sides[name]()[:, :, :4096].float(), expected[:, :, :4096].double(), policy=shape.dtype,
                         notes=(name,))
    return sides


# (candidate, baseline). Step 1 (an 8ca4529 run) against SDPA and the pointer kernel, and the softmax/P V overlap
# against the same schedule without it. (Steps 2 and 4 lost their A/Bs and were deleted; BENCHMARKS.md keeps their
# numbers.)
PAIRS = [("gluon step 1", "sdpa"), ("gluon step 1", "pointer kernel"), ("gluon step 1 overlap", "gluon step 1")]
# Step 3 against SDPA, the pointer kernel and step 1 (the kept one), its overlap against itself without; at D=64
# also each D=64 block shape against step 1's default and against the pointer kernel (the kernel D=64 runs on).
STEP3_PAIRS = [("gluon step 3", "sdpa"), ("gluon step 3 overlap", "sdpa"), ("gluon step 3", "pointer kernel"),
               ("gluon step 3", "gluon step 1"), ("gluon step 3 overlap", "gluon step 3")]
D64_PAIRS = [(_shape_name(c), baseline) for c in D64_SHAPES for baseline in ("gluon step 1", "pointer kernel")]
# Step 3's turns and slot releases through hardware named barriers against the same tiles with mbarriers (at
# D=128 the dispatched config), against what the rule dispatches and against SDPA; at D=128 also the overlapped
# schedule with named barriers against the one without overlap. ``-k named_barriers``.
NAMED_PAIRS = [("gluon step 3 named barriers", "gluon step 3 mbarriers"),
               ("gluon step 3 named barriers", "gluon dispatched"), ("gluon step 3 named barriers", "sdpa")]


# fp16 on the configs the rule runs for bf16, against the pointer kernel (what fp16 runs today: the rule takes bf16
# only, since fp16 was never measured) and SDPA. ``-k fp16``: what would extend the rule to fp16.
FP16_PAIRS = [("gluon dispatched", "pointer kernel"), ("gluon dispatched", "sdpa")]


def _compare(shape, kernel_ab, pairs):
    sides = _callables(shape, pairs)
    work = attention_work(shape)
    for candidate, baseline in pairs:
        kernel_ab.compare(sides[candidate], sides[baseline], name=f"fwd D{shape.D} {candidate} vs {baseline}",
                          **work)


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=9))
def test_gluon_forward_ab(shape, kernel_ab):
    _compare(shape, kernel_ab, PAIRS)


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=9))
def test_gluon_named_barriers_ab(shape, kernel_ab):
    overlapped = [("gluon step 3 overlap named barriers", "gluon step 3 named barriers")] if shape.D == 128 else []
    _compare(shape, kernel_ab, NAMED_PAIRS + overlapped)


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=9))
def test_gluon_step3_and_d64_shapes_ab(shape, kernel_ab):
    _compare(shape, kernel_ab, STEP3_PAIRS + (D64_PAIRS if shape.D == 64 else []))


# The Gluon backward (flashlite/kernels/attention_bwd_gluon.py), measured as users meet it: forward and backward
# of flashlite.attention(backend="triton") with dK/dV and dQ on the Gluon kernels (delta on the pointer kernel)
# against the same on the pointer kernels, and against SDPA. The Gluon side stands in for the rule's size floor
# (measured_faster), so that every shape runs it, D=64 too, where the rule keeps the pointer backward; the pointer
# side refuses it. A plan decides its backward kernels when it is made, so each side keeps plans of its own.
_PLANS_MODULE = importlib.import_module("flashlite.attn.plan")


@contextlib.contextmanager
def _backward_on(on_gluon: bool, kept: dict):
    saved = _PLANS_MODULE._PLANS, launch_gluon_bwd.measured_faster
    _PLANS_MODULE._PLANS, launch_gluon_bwd.measured_faster = kept, lambda problem: on_gluon
    try:
        yield
    finally:
        _PLANS_MODULE._PLANS, launch_gluon_bwd.measured_faster = saved


def _forward_backward(q, k, v, grad_out, *, on_gluon: bool):
    kept = {}

    def run():
        with _backward_on(on_gluon, kept):
            q.grad = k.grad = v.grad = None
            attention(q, k, v, causal=True, backend="triton").backward(grad_out)
        return q.grad, k.grad, v.grad
    return run


def _sdpa_forward_backward(q, k, v, grad_out):
    def sdpa():
        q.grad = k.grad = v.grad = None
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)
        return q.grad, k.grad, v.grad
    return sdpa


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=14))
def test_gluon_backward_ab(shape, kernel_ab):
    q, k, v = (t.requires_grad_() for t in qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype))
    grad_out = torch.randn_like(q)
    gluon, pointer = (_forward_backward(q, k, v, grad_out, on_gluon=on) for on in (True, False))
    expected = [g.clone() for g in pointer()]
    for name, a, b in zip(("dq", "dk", "dv"), [g.clone() for g in gluon()], expected):
        # The pointer backward's gradients in the same precision are the yardstick; float64 checks live in
        # tests/flashlite/attn/test_attention_gluon_bwd_gpu.py.
        assert_close(a[:, :, :4096].float(), b[:, :, :4096].double(), policy=shape.dtype, notes=(name, "gluon"))
    work = attention_work(shape, passes="forward+backward")
    # check_output=False: the backward's dQ accumulates in an order that may differ between calls.
    for baseline, name in ((pointer, "pointer backward"), (_sdpa_forward_backward(q, k, v, grad_out), "sdpa")):
        kernel_ab.compare(gluon, baseline, check_output=False, **work,
                          name=f"fwd+bwd D{shape.D} gluon backward vs {name}")


# The Gluon backward's kernels alone, launched directly on one forward's out and lse with delta computed once: every
# further listed config of each kernel against its first, each writing buffers of its own. This tells which config
# to list first, and how much of forward+backward's change is the kernels'. The dK/dV kernel's other configs differ
# in kind: at D=128 they fit two programs per SM, where the first config's 8 warps of 255 registers fill it alone
# (cpu-host-2026-12-05-b/backward_sass_mix/). ``-k backward_kernels``.
def _bwd_config_name(config) -> str:
    return f"{config.own_rows}x{config.streamed_rows} s{config.stages} w{config.num_warps}"


@pytest.mark.shape(*SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=14))
def test_gluon_backward_kernels_ab(shape, kernel_ab):
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    grad_out = torch.randn_like(q)
    scale = shape.D ** -0.5
    out, lse = gluon_attention_forward(q, k, v, causal=True, scale=scale)
    delta = (grad_out.float() * out.float()).sum(-1)

    def dkdv(config):
        dk, dv = torch.empty_like(k), torch.empty_like(v)

        def run():
            launch_gluon_bwd.launch_dkdv(q, k, v, grad_out, lse, delta, dk, dv, 1, scale, config)
            return dk, dv
        return run

    def dq(config):
        grad_q = torch.empty_like(q)

        def run():
            launch_gluon_bwd.launch_dq(q, k, v, grad_out, lse, delta, grad_q, 1, scale, config)
            return (grad_q, )
        return run

    for kind, make in (("dkdv", dkdv), ("dq", dq)):
        first, *others = launch_gluon_bwd.bwd_configs_for(shape.D, kind)
        baseline = make(first)
        expected = [t.clone() for t in baseline()]
        for config in others:
            candidate = make(config)
            for got, want in zip(candidate(), expected):
                # The first config in the same precision is the yardstick; the float64 checks of every listed
                # config live in tests/flashlite/attn/test_attention_gluon_bwd_gpu.py.
                assert_close(got[:, :, :4096].float(), want[:, :, :4096].double(), policy=shape.dtype,
                             notes=(kind, _bwd_config_name(config)))
            # check_output=False: each side returns its own buffers, checked above.
            kernel_ab.compare(candidate, baseline, check_output=False,
                              name=f"{kind} D{shape.D} gluon {_bwd_config_name(config)} vs "
                                   f"{_bwd_config_name(first)}")


# The causal sliding window (1024 keys to the left, issue 15's shapes) on the Gluon forward: step 1 in the config
# the rule runs at D=64 and in its first listed config at D=128 (the ping-pong kernel has no window), against the
# pointer kernel's window (what backend="triton" and "auto" run today) and against FlexAttention with the same
# block mask (issue 15's yardstick). ``-k gluon_window``.
def _gluon_window_config(head_dim: int) -> GluonConfig:
    dispatched = launch_gluon.dispatched_config(head_dim)
    return dispatched if dispatched.variant != "pingpong" else configs_for(head_dim, "pipelined")[0]


@pytest.mark.shape(*WINDOWED, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=10))
def test_gluon_window_ab(shape, kernel_ab):
    flex_attention, create_block_mask = _flex()
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    config = _gluon_window_config(shape.D)
    window = (WINDOW, 0)

    def gluon():
        return gluon_attention_forward(q, k, v, causal=True, variant=config.variant, config=config,
                                       window=window)[0]

    pointer_kernel = pointer_forward(q, k, v, scale=shape.D ** -0.5, precision="bf16", window=window)

    def pointer():
        return pointer_kernel()[0]

    block_mask = create_block_mask(lambda b, h, i, j: (j <= i) & (i - j <= WINDOW), B=None, H=None,
                                   Q_LEN=shape.S, KV_LEN=shape.S, device="cuda")
    flex = lambda: flex_attention(q, k, v, block_mask=block_mask)  # noqa: E731
    expected = pointer()
    # The pointer kernel's window in the same precision is the yardstick here; the float64 checks of the Gluon
    # window live in tests/flashlite/attn/test_attention_gluon_gpu.py (test_forward_causal_window).
    assert_close(gluon().float(), expected.double(), policy=shape.dtype, notes=("gluon window",))
    work = _window_work(shape, window=WINDOW)
    name = f"window {WINDOW} D{shape.D} {_shape_name(config)}"
    kernel_ab.compare(gluon, pointer, name=f"{name} vs pointer kernel", **work)
    kernel_ab.compare(gluon, flex, name=f"{name} vs flex", **work)


# Below the rule's length floor (GLUON_MIN_SEQ): cases 5 and 7-10 (S = 2,048 down to 128, 2^17 query rows each),
# where the H200 A/B of 2026-12-01 measured the Gluon forward host-bound (0.38-0.63x SDPA, with 18 us of launch
# arguments on the development CPU; 11.5 us since the descriptors skip the constructor's re-checks). The Gluon side
# is the launch a plan runs (``launch_planned``: the base addresses checked, nothing else), the pointer side the
# kernel's direct launcher; both compute out and lse. ``-k below_the_floor``: what would move the floor.
SHORT_SHAPES = [dict(case=n, B=case(n).B, S=case(n).S, H=case(n).H, D=D) for D in (64, 128) for n in (5, 7, 8, 9, 10)]


@pytest.mark.shape(*SHORT_SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=8))
def test_gluon_below_the_floor_ab(shape, kernel_ab):
    from flashlite.attn.problem import validate
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    scale = shape.D ** -0.5
    problem = validate(q, k, v, True, None, None, None, "triton", None)
    gluon = lambda: launch_gluon.launch_planned(q, k, v, problem)[0]  # noqa: E731
    pointer_kernel = pointer_forward(q, k, v, scale=scale, precision="bf16")
    pointer = lambda: pointer_kernel()[0]  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    expected = sdpa()
    pointer()  # its autotuning, outside the timed calls
    assert_close(gluon().float(), expected.double(), policy=shape.dtype, notes=("gluon below the floor",))
    work = attention_work(shape)
    name = f"fwd D{shape.D} {_shape_name(launch_gluon.dispatched_config(shape.D))} (planned launch)"
    kernel_ab.compare(gluon, pointer, name=f"{name} vs pointer kernel", **work)
    kernel_ab.compare(gluon, sdpa, name=f"{name} vs sdpa", **work)


# The planned launch replayed (a recording plan: the compiled kernel kept from the plan's first launch, Triton's
# argument binding skipped) against the ordinary planned launch, SDPA and the pointer kernel, below and at the
# rule's floors (cases 5 and 7-10), where the launch's host time is what decides. ``-k replayed``: the measurement
# that turned Gluon launch replay on by default (2026-12-04: ties or wins against the ordinary launch).
@pytest.mark.shape(*SHORT_SHAPES, dtype=[torch.bfloat16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=8))
def test_gluon_replayed_launch_ab(shape, kernel_ab, monkeypatch):
    from flashlite.attn.plan import Plan
    from flashlite.attn.problem import validate
    q, k, v = qkv(shape.B, shape.H, shape.S, shape.D, shape.dtype)
    problem = validate(q, k, v, True, None, None, None, "triton", None)
    plan = Plan(problem, None, record=True)  # as a kept plan on CUDA
    replayed = lambda: launch_gluon.launch_planned(q, k, v, problem, plan)[0]  # noqa: E731
    ordinary = lambda: launch_gluon.launch_planned(q, k, v, problem)[0]  # noqa: E731
    pointer_kernel = pointer_forward(q, k, v, scale=shape.D ** -0.5, precision="bf16")
    pointer = lambda: pointer_kernel()[0]  # noqa: E731
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    expected = ordinary()
    assert torch.equal(replayed(), expected)  # the first call records
    (recorded,) = plan.recorded.values()
    assert recorded is not None, "the Gluon launch could not be recorded"
    replays = []
    real_replay = recorded.launch
    recorded.launch = lambda *leading: replays.append(real_replay(*leading)) or replays[-1]
    assert torch.equal(replayed(), expected) and replays == [True], "the replay fell back to the ordinary launch"
    recorded.launch = real_replay  # the timed calls replay without the count
    pointer()  # its autotuning, outside the timed calls
    work = attention_work(shape)
    name = f"fwd D{shape.D} {_shape_name(launch_gluon.dispatched_config(shape.D))} (replayed launch)"
    kernel_ab.compare(replayed, ordinary, name=f"{name} vs ordinary launch", **work)
    kernel_ab.compare(replayed, pointer, name=f"{name} vs pointer kernel", **work)
    kernel_ab.compare(replayed, sdpa, name=f"{name} vs sdpa", **work)


@pytest.mark.shape(*SHAPES, dtype=[torch.float16])
@pytest.mark.memory(lambda shape: attention_bytes(shape, copies=9))
def test_gluon_fp16_ab(shape, kernel_ab):
    _compare(shape, kernel_ab, FP16_PAIRS)
