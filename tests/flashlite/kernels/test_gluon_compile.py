"""The Gluon attention forward builds for sm_90 on any machine, within Hopper's resources; its launcher's refusals.

Gluon kernels do not run in Triton's interpreter, but they compile for sm_90 without a GPU. Every config the kernel
file lists (every variant: "pipelined", step 1, "pingpong", step 3; with and without the softmax/P V
overlap) is compiled for each head dim: for step 1 the one the launcher picks in bf16 and fp16 and every
causal mode, the others (A/B candidates) in bf16, non-causal and bottom-right causal; step 3's kernel takes longer
to build, so its first config is compiled in bf16 non-causal and bottom-right causal and in fp16 top-left, the
others in bf16 bottom-right (the most general mask). Step 1 also compiles its first config with a causal window
(bf16, bottom-right). Each compile runs in a fresh interpreter with TRITON_INTERPRET=0 and a cache in
pytest's tmp dir, specialized as ``gluon_attention_forward`` would (descriptors built by the launcher itself over
CPU tensors). Each compiled kernel must fit the 227 KB of shared memory a Hopper thread block may have and use at
most 255 registers without spilling or serializing its wgmmas, as ptxas reports them. For step 3 the PTX must also
show the register split its partitions asked for and a separate named barrier for each consumer warpgroup, Triton's
barrier ids below those of the named-barrier protocol, and with that protocol no mbarrier arrival by a consumer.
"""
import importlib
import json

import pytest
import torch

from flashlite.attn import gluon as launch_gluon
from flashlite.attn.gluon import GluonConfig, gluon_attention_forward, gluon_supported
from tests.flashlite.sm90 import GLUON_COMPILER, run_script

HOPPER_SHARED_MEMORY = 232448  # bytes per thread block on an H100/H200, as Triton reports the limit

_COMPILE = GLUON_COMPILER + r'''
import json
import torch
import flashlite
from flashlite.attn import gluon as launch_gluon

def compile_config(config, dtype, head_dim, causal, window_left=-1):
    # The launcher's own arguments for small CPU tensors (GQA: 4 query heads on 2 key/value heads); tensor
    # descriptors and pointers are typed as a launch would type them, scalars as i32 / fp32.
    q = torch.empty(2, 4, 300, head_dim, dtype=dtype)
    k = torch.empty(2, 2, 300, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    lse = torch.empty(2, 4, 300)
    args, meta = launch_gluon.kernel_arguments(q, k, k, out, lse, causal, 0.125, config, window_left)
    options = {"num_warps": config.num_warps}
    if "maxnreg" in meta:
        options["maxnreg"] = meta["maxnreg"]
    kernel, registers, spills, serialized = compile_gluon(launch_gluon.kernel_for(config), args, meta, options)
    ptx = kernel.asm["ptx"]
    # Register reallocation (setmaxnreg) and the partitions' own barriers (bar.sync id, threads).
    setmaxnreg = sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))
    named = sorted(set(re.findall(r"\bbar\.sync\s+(\d+),\s*(\d+);", ptx)))
    whole_cta = len(re.findall(r"\bbar\.sync\s+\d+;", ptx))  # a barrier of every thread of the block
    # Triton's own barrier ids (bar.sync / barrier.sync with a constant id), and what the named-barrier protocol
    # emits: hardware barriers with the id and thread count in registers, and plain mbarrier arrivals (not the
    # producer's arrive.expect_tx).
    triton_ids = sorted({int(i) for i in re.findall(r"\b(?:bar|barrier)\.sync\s+(\d+)\b", ptx)})
    register_barriers = len(re.findall(r"\bbar\.(?:sync|arrive)\s+%r\d+,\s*%r\d+;", ptx))
    mbarrier_arrivals = len(re.findall(r"\bmbarrier\.arrive\.shared::cta\.b64", ptx))
    return {"shared": kernel.metadata.shared, "registers": registers, "spill_bytes": spills,
            "wgmma_serialized": serialized,
            "tiles": config.shared_bytes(head_dim), "setmaxnreg": setmaxnreg, "named_barriers": named,
            "whole_cta_barriers": whole_cta, "triton_barrier_ids": triton_ids,
            "register_barriers": register_barriers, "mbarrier_arrivals": mbarrier_arrivals}

variant, head_dim = VARIANT, HEAD_DIM  # set by the test before this script
default, *others = launch_gluon.configs_for(head_dim, variant)
if variant == "pingpong":
    # The first config in bf16 without and with the bottom-right diagonal (top-left is the same mask with a zero
    # shift) and in fp16 top-left; the others in bf16 bottom-right.
    jobs = [(default, torch.bfloat16, 0, -1), (default, torch.bfloat16, 2, -1), (default, torch.float16, 1, -1)]
    jobs += [(config, torch.bfloat16, 2, -1) for config in others]
else:
    # The launcher's pick in both dtypes and every causal mode; the configs listed for A/B in bf16, without and with
    # the bottom-right diagonal (top-left is the same mask with a zero shift).
    jobs = [(default, dtype, causal, -1) for dtype in (torch.bfloat16, torch.float16)
            for causal in launch_gluon._kernels.CAUSAL_MODES]
    jobs += [(config, torch.bfloat16, causal, -1) for config in others for causal in (0, 2)]
    # The causal window (its own constexpr): the launcher's pick, bottom-right (the most general diagonal); the GPU
    # suite runs every step-1 config with a window (test_window_configs_and_refusals).
    jobs += [(default, torch.bfloat16, 2, 100)]
for config, dtype, causal, window_left in jobs:
    result = compile_config(config, dtype, head_dim, causal, window_left)
    print(json.dumps({"config": [config.block_m, config.block_n, config.stages, config.num_warps, config.overlap,
                                 config.named_barriers],
                      "dtype": str(dtype), "head_dim": head_dim, "causal": causal, "window_left": window_left,
                      **result}))
'''


def _gluon_available() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma  # noqa: F401
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


needs_gluon = pytest.mark.skipif(not _gluon_available(),
                                 reason="triton.experimental.gluon (with its Hopper modules) is not available")


@needs_gluon
@pytest.mark.parametrize("head_dim", list(launch_gluon._kernels.HEAD_DIMS))
@pytest.mark.parametrize("variant", launch_gluon.VARIANTS)
def test_every_config_compiles_for_sm90_within_resources(variant, head_dim, tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    script = f"VARIANT, HEAD_DIM = {variant!r}, {head_dim}\n" + _COMPILE
    results = [json.loads(line) for line in run_script(script).splitlines() if line.startswith("{")]
    others = len(launch_gluon.configs_for(head_dim, variant)) - 1
    expected = {"pingpong": 3 + others}.get(variant, 7 + 2 * others)
    assert len(results) == expected, results
    for r in results:
        where = (f"{variant} {r['dtype']} D={r['head_dim']} causal={r['causal']} window={r['window_left']} "
                 f"config={r['config']}: {r}")
        assert r["shared"] <= HOPPER_SHARED_MEMORY, where
        # The tiles are all the kernel keeps in shared memory, besides its barriers.
        assert r["tiles"] <= r["shared"] < r["tiles"] + 1024, where
        assert r["registers"] and max(r["registers"]) <= 255, where  # no report would be a silent pass
        assert r["spill_bytes"] and not any(r["spill_bytes"]), where
        assert r["wgmma_serialized"] == [], where
        if variant == "pingpong":
            # Consumer 0 (the default partition) gives up registers down to 240 on entering the partitions,
            # consumer 1 takes 240, the producer's warpgroup goes down to 24: Triton emits none of them when the
            # requested split does not fit, so their presence is the check that it did.
            consumer = str(launch_gluon._kernels.PINGPONG_CONSUMER_REGS.value)
            producer = str(launch_gluon._kernels.PRODUCER_REGS.value)
            assert {("dec", consumer), ("inc", consumer), ("dec", producer)} <= set(map(tuple, r["setmaxnreg"])), where
            # Each consumer's thread barrier (before it hands a slot back) is a named barrier of its own 128 threads;
            # one id shared by both would let 128 threads of the two warpgroups together release it.
            ids = {name for name, threads in r["named_barriers"] if threads == "128"}
            assert len(ids) >= 2, where
            # A barrier of all the block's threads inside a partition would wait for warps that never come to it.
            assert r["whole_cta_barriers"] == 0, where
            # The named-barrier protocol's ids (SLOT_BARRIER up) must be ones Triton leaves alone; with it the
            # consumers arrive on no mbarrier (the partition-wide barrier Triton puts before each arrival is gone)
            # and the hardware barriers are there; without it, the other way round.
            assert max(r["triton_barrier_ids"]) < launch_gluon._kernels.SLOT_BARRIER.value, where
            if r["config"][5]:
                assert r["mbarrier_arrivals"] == 0 and r["register_barriers"] > 0, where
            else:
                assert r["mbarrier_arrivals"] > 0 and r["register_barriers"] == 0, where


def _bf16(*shape: int) -> torch.Tensor:
    return torch.randn(*shape).to(torch.bfloat16)


def _misaligned(*shape: int) -> torch.Tensor:
    flat = _bf16(torch.Size(shape).numel() + 1)
    return flat[1:].view(*shape)  # 2 bytes past an aligned start


@pytest.mark.parametrize("make, causal, scale, reason", [
    (lambda: [torch.randn(1, 2, 16, 64)] * 3, False, None, "q has dtype torch.float32; the Gluon kernel takes"),
    (lambda: [_bf16(1, 2, 16, 96)] * 3, False, None, "head dim 96: the Gluon kernel has head dims 64 and 128"),
    (lambda: [_bf16(1, 2, 16, 32)] * 3, True, None, "head dim 32"),
    (lambda: [_bf16(1, 2, 16, 64)] * 3, "bottom", None, "causal must be False, True"),
    (lambda: [_bf16(1, 2, 16, 64)] * 3, False, -0.5, "scale -0.5: the Gluon kernel needs a positive scale"),
    (lambda: [_bf16(1, 2, 64, 64).transpose(2, 3)] * 3, False, None,
     "q has stride 64 along the head dim; TMA needs it contiguous"),
    (lambda: [_bf16(1, 2, 16, 68)[..., :64]] * 3, False, None,
     "q's stride 68 in dimension 2 is not a multiple of 16 bytes"),
    (lambda: [_bf16(1, 2, 16, 64), _bf16(1, 1, 16, 64).expand(1, 2, 16, 64), _bf16(1, 2, 16, 64)], False, None,
     "k has stride 0 in dimension 1 (an expanded tensor)"),
    (lambda: [_bf16(1, 2, 16, 64), _bf16(1, 2, 16, 64), _misaligned(1, 2, 16, 64)], False, None,
     "v's data is not 16-byte aligned"),
    (lambda: [_bf16(1, 3, 16, 64), _bf16(1, 2, 16, 64), _bf16(1, 2, 16, 64)], False, None,
     "the number of q heads must be a multiple of the k/v heads"),
    (lambda: [torch.empty(1, 65536, 1, 64, dtype=torch.bfloat16)] * 3, False, None,
     "batch * heads = 65536 passes grid axis 1's limit"),
    (lambda: [_bf16(2, 4, 33, 128), _bf16(2, 2, 40, 128), _bf16(2, 2, 40, 128)], "lower_right", None,
     "tensors on cpu; the Gluon kernel runs on CUDA devices of compute capability 9.0"),
])
def test_gluon_supported_names_what_it_refuses(make, causal, scale, reason):
    q, k, v = make()
    got = gluon_supported(q, k, v, causal, scale)
    assert got is not None and reason in got, got
    with pytest.raises(ValueError, match="the Gluon attention kernel cannot run this call"):
        gluon_attention_forward(q, k, v, causal=causal, scale=scale)


def test_layouts_tma_can_describe_pass_the_layout_checks():
    # [B, S, H, D] storage seen as [B, H, S, D] (a transposed view), and size-1 dimensions with odd strides: only
    # the device is left to refuse on a CPU.
    q = _bf16(2, 40, 4, 64).transpose(1, 2)
    k = _bf16(2, 40, 2, 64).transpose(1, 2)
    assert gluon_supported(q, k, k, True).startswith("tensors on cpu")
    single = _bf16(1, 1, 1, 128)
    assert gluon_supported(single, single, single, "lower_right").startswith("tensors on cpu")
    assert launch_gluon._tma_strides(_bf16(1, 1, 5, 64)) == [320, 320, 64, 1]


# Where the Triton backend's forward runs on the Gluon kernel: the measured rule, the plan's choice, the reason
# explain_dispatch gives, and the fallback for unaligned calls. gluon_supported and the launch are stood in (the
# kernel needs an sm_90 GPU); everything else is the real path.
def _seeded_bf16(batch, heads, seq, dim=128):
    gen = torch.Generator().manual_seed(batch * 1000 + seq)
    return torch.randn(batch, heads, seq, dim, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("batch, heads, seq, dim, dtype, causal, chosen", [
    (8, 16, 4096, 128, torch.bfloat16, True, True),  # measured: step 1 1.098x the pointer kernel (H200, 2026-12-01)
    (2, 16, 16384, 128, torch.bfloat16, True, True),  # 2**19 rows
    (1, 16, 8192, 128, torch.bfloat16, True, True),  # 2**17 rows: step 3 measured 1.089x (H200, 2026-12-01)
    (1, 16, 8192, 64, torch.bfloat16, True, True),  # step 1 64x128x2w4 measured 1.134x
    (8, 16, 4096, 64, torch.bfloat16, True, True),  # and 1.178x
    (1, 15, 8192, 64, torch.bfloat16, True, False),  # one row under 2**17: not measured
    # Below 4,096 (H200, 2026-12-02: the planned launch against the pointer kernel)
    (4, 16, 2048, 64, torch.bfloat16, True, True),  # 1.097x
    (32, 16, 512, 64, torch.bfloat16, True, True),  # 1.035x, D=64's floor
    (64, 16, 256, 64, torch.bfloat16, True, False),  # 0.574x
    (4, 16, 2048, 128, torch.bfloat16, True, True),  # 1.108x, D=128's floor
    (16, 16, 1024, 128, torch.bfloat16, True, False),  # 1.010x, a tie
    (256, 16, 64, 128, torch.bfloat16, True, False),  # 2**18 rows, S=64: measured 0.500x SDPA
    (1, 16, 8192, 96, torch.bfloat16, True, False),  # no Gluon config at D=96
    # fp16 (H200, 2026-12-04): 1.10-1.34x the pointer kernel at S=4,096 and 8,192, the shortest measured
    (8, 16, 4096, 128, torch.float16, True, True),  # 1.279x
    (1, 16, 8192, 64, torch.float16, True, True),  # 1.133x
    (8, 16, 4096, 64, torch.float16, True, True),  # 1.096x
    (16, 16, 2048, 64, torch.float16, True, False),  # not measured in fp16 (bf16 takes Gluon here)
    (8, 16, 4096, 128, torch.float16, False, False),  # not measured
    (8, 16, 4096, 128, torch.float32, True, False),  # the kernel takes bf16 and fp16 only
    (8, 16, 4096, 128, torch.bfloat16, False, False),  # not measured
    (8, 16, 4096, 128, torch.bfloat16, "lower_right", False),  # not measured
])
def test_the_measured_rule_picks_the_gluon_forward(monkeypatch, batch, heads, seq, dim, dtype, causal, chosen):
    from flashlite.attn.problem import validate
    monkeypatch.setattr(launch_gluon, "gluon_supported", lambda *a, **kw: None)
    q = torch.empty(batch, heads, seq, dim, dtype=dtype)  # the rule reads shapes only: no data is needed
    problem = validate(q, q, q, causal, None, None, None, "triton", None)
    reason = launch_gluon.forward_kernel_for(problem, q, q, q)
    assert (reason is not None) is chosen
    if chosen:
        assert "Gluon kernel" in reason and str(batch * heads * seq) in reason
        assert ("fp16" if dtype == torch.float16 else "bf16") in reason
        config = launch_gluon.dispatched_config(dim)
        assert f"{config.block_m}x{config.block_n}, {config.stages} stages" in reason


@pytest.mark.parametrize("seq, dim, causal, window, lengths, chosen", [
    (16384, 64, True, (1024, 0), False, True),  # measured: 1.066x the pointer kernel's window (H200, 2026-12-02)
    (65536, 64, True, (1024, -1), False, True),  # 1.069x; a causal window's right side is the diagonal either way
    (16384, 128, True, (1024, 0), False, False),  # step 1 at D=128: 0.976x, a loss
    (8192, 64, True, (1024, 0), False, False),  # shorter than the measured lengths
    (16384, 64, False, (1024, 1024), False, False),  # not causal: the kernel's windows are causal
    (16384, 64, True, (-1, 0), False, False),  # no left bound: plain causal attention under another name
    (16384, 64, True, (1024, 0), True, False),  # a window over padded keys: not measured
    (16384, 64, True, (1024, 0), False, "fp16"),  # fp16 windows: not measured
])
def test_the_measured_rule_takes_causal_windows_at_d64(monkeypatch, seq, dim, causal, window, lengths, chosen):
    from flashlite.attn.problem import validate
    monkeypatch.setattr(launch_gluon, "gluon_supported", lambda *a, **kw: None)
    q = torch.empty(1, 16, seq, dim, dtype=torch.float16 if chosen == "fp16" else torch.bfloat16)
    chosen = chosen is True
    key_lengths = torch.full((1,), seq - 5, dtype=torch.int32) if lengths else None
    problem = validate(q, q, q, causal, None, None, key_lengths, "triton", None, window)
    reason = launch_gluon.forward_kernel_for(problem, q, q, q)
    assert (reason is not None) is chosen, reason
    if chosen:
        assert f"causal windows of {window[0]} keys" in reason and str(16 * seq) in reason


def test_a_windowed_plan_launches_the_window_config_with_its_left_bound(monkeypatch):
    from flashlite.attn.problem import validate
    # A window config of its own (the shipped one is the dense D=64 config), so that taking the wrong one shows.
    windowed_config = launch_gluon.GluonConfig("pipelined", 128, 128, 3, 8)
    monkeypatch.setattr(launch_gluon, "_DISPATCHED_WINDOW", {64: windowed_config})
    launched = []
    monkeypatch.setattr(launch_gluon, "_launch",
                        lambda q, k, v, causal_mode, scale, config, window_left=-1, plan=None, like_q=False:
                        launched.append((causal_mode, config, window_left)))
    q = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16)
    windowed = validate(q, q, q, True, None, None, None, "triton", None, (37, 0))
    dense = validate(q, q, q, True, None, None, None, "triton", None)
    launch_gluon.launch_planned(q, q, q, windowed)
    launch_gluon.launch_planned(q, q, q, dense)
    assert launched == [(1, windowed_config, 37), (1, launch_gluon.dispatched_config(64), -1)]
    assert windowed_config != launch_gluon.dispatched_config(64)


def test_every_dispatched_config_is_one_the_kernel_file_lists():
    # Listed configs are the ones CPU CI compiles (test_every_config_compiles_for_sm90_within_resources) and the
    # GPU suite checks against float64 (test_every_listed_config).
    for head_dim in (64, 128):
        config = launch_gluon.dispatched_config(head_dim)
        assert config in launch_gluon.configs_for(head_dim, config.variant)
    windowed = launch_gluon.dispatched_config(64, windowed=True)
    assert windowed in launch_gluon.configs_for(64, windowed.variant) and windowed.variant != "pingpong"
    assert launch_gluon.dispatched_config(96) is None


def test_the_rule_needs_a_call_the_kernel_can_run_and_no_mask(monkeypatch):
    from flashlite.attn.problem import validate
    q = torch.empty(8, 16, 4096, 128, dtype=torch.bfloat16)
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    assert launch_gluon.forward_kernel_for(problem, q, q, q) is None  # CPU tensors: gluon_supported refuses
    monkeypatch.setattr(launch_gluon, "gluon_supported", lambda *a, **kw: None)
    lengths = torch.full((8,), 4000, dtype=torch.int32)
    masked = validate(q, q, q, True, None, None, lengths, "triton", None)
    assert launch_gluon.forward_kernel_for(masked, q, q, q) is None
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", False)  # FLASHLITE_GLUON=0
    assert launch_gluon.forward_kernel_for(problem, q, q, q) is None


def test_a_plan_on_the_gluon_kernel_launches_it_and_says_so(monkeypatch):
    import flashlite
    decide_module = importlib.import_module("flashlite.attn.decide")
    launch_module = importlib.import_module("flashlite.attn.triton")
    monkeypatch.setattr(launch_gluon, "gluon_supported", lambda *a, **kw: None)
    # On a GPU machine the tensors go there (without the interpreter the Triton backend refuses CPU tensors); the
    # Gluon launch itself is faked either way.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v = (_seeded_bf16(1, 2, 64).to(device) for _ in range(3))
    monkeypatch.setattr(launch_gluon, "GLUON_MIN_ROWS", 128)  # a tiny call stands for a large one
    monkeypatch.setattr(launch_gluon, "GLUON_MIN_SEQ", {64: 64, 128: 64})
    launched = []

    def fake_launch(q, k, v, problem, plan=None, like_q=False):
        launched.append((problem.seq_q, like_q))
        return q.new_full(q.shape, 7.0), torch.zeros(q.shape[:3], device=q.device)

    monkeypatch.setattr(launch_gluon, "launch_planned", fake_launch)
    plan = decide_module.make_plan(q, k, v, True, None, None, None, "triton", None)
    assert plan.gluon and "forward on the Gluon kernel" in plan.decision.reason
    assert "forced by backend='triton'" in plan.decision.reason
    out, lse = launch_module.launch_forward(q, k, v, None, None, plan)
    assert launched == [(64, False)] and torch.equal(out, q.new_full(q.shape, 7.0))
    # attention()'s calls ask for out laid out like q (launch_forward's like_q), on the Gluon kernel too.
    attention_out = flashlite.attention(q, k, v, causal=True, backend="triton")
    assert launched[1:] == [(64, True)] and torch.equal(attention_out, q.new_full(q.shape, 7.0))
    explained = flashlite.explain_dispatch(q, k, v, causal=True, backend="triton")
    assert "Gluon kernel" in explained.reason


def test_an_unaligned_call_of_a_gluon_plan_takes_the_pointer_kernel():
    storage = torch.randn(1 * 2 * 64 * 128 + 1).to(torch.bfloat16)
    q = storage[1:].view(1, 2, 64, 128)  # 2 bytes past a 16-byte boundary
    from flashlite.attn.problem import validate
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    assert q.data_ptr() % 16 and launch_gluon.launch_planned(q, q, q, problem) is None


@needs_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tile_descriptors_carry_the_default_layout_of_their_tiles(dtype):
    # The layout is made once per tile shape and dtype (a cache): it must be the one Gluon would make each time.
    from triton.experimental.gluon import language as gl
    q = torch.randn(2, 300, 4, 128).to(dtype).transpose(1, 2)
    for rows in (64, 128):
        described = launch_gluon.tile_descriptor(q, rows)
        gl_dtype = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
        assert described.layout == gl.NVMMASharedLayout.get_default_for([1, 1, rows, 128], gl_dtype)
        assert described.block_shape == [1, 1, rows, 128] and described.strides == launch_gluon._tma_strides(q)
        assert described.shape == [2, 4, 300, 128] and described.base is q
        # The descriptor is made without the constructor's checks (gluon_supported has made them): it must be
        # the very object the constructor makes, field for field, and have no field the constructor would not set.
        from dataclasses import fields
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
        made = TensorDescriptor(q, list(q.shape), launch_gluon._tma_strides(q), [1, 1, rows, 128], described.layout)
        assert type(described) is TensorDescriptor and set(vars(described)) == {f.name for f in fields(made)}
        for f in fields(made):
            assert getattr(described, f.name) is made.base if f.name == "base" else (
                getattr(described, f.name) == getattr(made, f.name)), f.name


def test_the_rule_reads_no_address_so_torch_compile_can_trace_it(monkeypatch):
    # torch.compile traces the plan's decision (dynamo, fullgraph): reading a data pointer there is a graph break,
    # which failed the compiled layer at every shape the Gluon forward covers. The rule decides from shapes and
    # strides alone; each call's addresses are checked at launch (bases_aligned).
    from flashlite.attn import gluon_bwd as launch_gluon_bwd
    from flashlite.attn.problem import validate
    monkeypatch.setattr(launch_gluon, "GLUON_MIN_ROWS", 1)  # a small tensor then passes the rule's size floor
    monkeypatch.setattr(launch_gluon, "GLUON_MIN_SEQ", {64: 1, 128: 1})
    monkeypatch.setattr(launch_gluon, "GLUON_ENABLED", True)
    monkeypatch.setattr(launch_gluon_bwd, "measured_faster", lambda problem: True)  # the backward's size floor too
    q = _seeded_bf16(1, 2, 48, 64)
    problem = validate(q, q, q, True, None, None, None, "triton", None)

    def decide(q):
        return launch_gluon.forward_kernel_for(problem, q, q, q), launch_gluon_bwd.backward_on_gluon(problem, q, q, q)
    assert torch.compile(decide, fullgraph=True, backend="eager")(q) == (None, False)  # the device refuses


def test_the_address_check_stays_for_a_single_call():
    unaligned = torch.empty(1 * 2 * 16 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 16, 64)
    assert "not 16-byte aligned" in gluon_supported(unaligned, unaligned, unaligned)
    assert gluon_supported(unaligned, unaligned, unaligned, addresses=False).startswith("tensors on cpu")


# A recording plan's Gluon launches replayed: recorded at the plan's first
# call, replayed with each later call's descriptors and lse, the ordinary launch otherwise. The kernel, its arguments
# and the recording are stood in (the launch needs an sm_90 GPU); the plan and the choice between them are real.
class _FakeGluonKernel:
    def __init__(self):
        self.ordinary = []

    def __getitem__(self, grid):
        return lambda *args, **meta: self.ordinary.append((grid, args))


class _FakeRecordedLaunch:
    def __init__(self, accept=True):
        self.accept, self.replayed = accept, []

    def launch(self, *leading):
        if self.accept:
            self.replayed.append(leading)
        return self.accept


@pytest.fixture
def gluon_stand_ins(monkeypatch):
    kernel, recordings, calls = _FakeGluonKernel(), [], iter(range(1000))

    def fake_arguments(q, k, v, out, lse, causal_mode, scale, config, window_left=-1):
        call = next(calls)  # each call's descriptors are new objects
        return (f"q{call}", f"k{call}", f"v{call}", f"o{call}", lse, 16, 1, 64, 64, 0.5, -1), {"num_warps": 4}

    def fake_record(kernel, grid, args, meta, n_tensors):
        assert n_tensors == 5
        kernel[grid](*args, **meta)
        recordings.append(_FakeRecordedLaunch())
        return recordings[-1]

    monkeypatch.setattr(launch_gluon, "kernel_arguments", fake_arguments)
    monkeypatch.setattr(launch_gluon, "kernel_for", lambda config: kernel)
    monkeypatch.setattr(launch_gluon, "_grid", lambda config, q: (1, 2))
    monkeypatch.setattr(launch_gluon._direct_launch, "record", fake_record)
    return kernel, recordings


def _gluon_plan(record=True):
    from flashlite.attn.plan import Plan
    from flashlite.attn.problem import validate
    q = torch.empty(1, 2, 64, 64, dtype=torch.bfloat16)
    problem = validate(q, q, q, True, None, None, None, "triton", None)
    return q, problem, Plan(problem, None, record=record)


def test_a_plan_replays_its_gluon_launch_with_each_calls_descriptors(gluon_stand_ins, monkeypatch):
    kernel, recordings = gluon_stand_ins
    q, problem, plan = _gluon_plan()
    launch_gluon.launch_planned(q, q, q, problem, plan)  # recorded: launched once the ordinary way
    out, lse = launch_gluon.launch_planned(q, q, q, problem, plan)  # replayed
    assert len(kernel.ordinary) == 1 and kernel.ordinary[0][1][:4] == ("q0", "k0", "v0", "o0")
    assert len(recordings) == 1 and recordings[0].replayed == [("q1", "k1", "v1", "o1", lse)]
    assert set(plan.recorded) == {("gluon forward", launch_gluon.dispatched_config(64))}
    recordings[0].accept = False  # refused (an unaligned or foreign tensor, a launch hook): the ordinary launch
    launch_gluon.launch_planned(q, q, q, problem, plan)
    assert len(kernel.ordinary) == 2 and len(recordings) == 1


def test_gluon_launches_go_the_ordinary_way_without_a_recording_plan_or_a_plan(gluon_stand_ins):
    kernel, recordings = gluon_stand_ins
    q, problem, unrecorded = _gluon_plan(record=False)  # a plan that records nothing (off CUDA, or not kept)
    for _ in range(2):
        launch_gluon.launch_planned(q, q, q, problem, unrecorded)
        launch_gluon.launch_planned(q, q, q, problem)  # no plan: a direct call
    assert len(kernel.ordinary) == 4 and recordings == [] and unrecorded.recorded == {}


def test_named_barriers_reach_the_pingpong_kernel_only():
    q = _bf16(1, 2, 200, 64)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 200)
    named = GluonConfig("pingpong", 64, 128, 3, 4, named_barriers=True)
    assert named in launch_gluon.configs_for(64, "pingpong")
    _, meta = launch_gluon.kernel_arguments(q, q, q, out, lse, 1, 0.125, named)
    assert meta["NAMED_BARRIERS"] is True
    _, meta = launch_gluon.kernel_arguments(q, q, q, out, lse, 1, 0.125, launch_gluon.configs_for(64, "pingpong")[0])
    assert meta["NAMED_BARRIERS"] is False
    with pytest.raises(ValueError, match="named_barriers: only the ping-pong kernel"):
        launch_gluon.kernel_arguments(q, q, q, out, lse, 1, 0.125, GluonConfig("pipelined", 64, 128, 2, 4,
                                                                                named_barriers=True))
