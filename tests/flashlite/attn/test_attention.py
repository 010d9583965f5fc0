"""Forward correctness of flashlite.attention's Triton kernel against float64 references.

On a CPU-only machine the kernel runs through the Triton interpreter, so every shape here is tiny; the same
checks at real sizes live in test_attention_gpu.py.
"""
import inspect

import pytest
import torch
import triton

import flashlite
import flashlite.attn.triton as launch_module
import flashlite.attn.plan as plans_module
import flashlite.attn.problem as validation_module
from flashlite.attention import attention, attention_forward, explain_dispatch
from flashlite.kernels import attention_bwd, attention_fwd, tuning
from pytest_kernelcheck import Shape, assert_close
from tests.flashlite.sm90 import SM90_COMPILER, run_script
from tests.flashlite.tables import use_table

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_POLICY = {"ieee": "fp32", "tf32": "tf32", "bf16": "bf16"}


def make_qkv(shape, *, dtype=None, seed=0):
    """Fresh N(0, 1) q [B, H, S, D] and k, v [B, H_kv, S_k, D] in ``dtype`` (default shape.dtype)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = dtype or shape.get("dtype", torch.float16)
    kv_heads = shape.get("H_kv", shape.H)
    seq_k = shape.get("S_k", shape.S)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=DEVICE, dtype=dtype)

    return rand(shape.B, shape.H, shape.S, shape.D), rand(shape.B, kv_heads, seq_k, shape.D), \
        rand(shape.B, kv_heads, seq_k, shape.D)


def policy_of(dtype, precision=None):
    """The tolerance policy name for a call, or None for the default per-dtype policy with its baseline rule."""
    if dtype != torch.float32:
        return None
    return FP32_POLICY[precision or validation_module.DEFAULT_FP32_PRECISION]


def padding_mask(batch, seq_k, *, seed=1, empty_batch=0):
    """Random key padding (True = attend) with batch entry ``empty_batch`` fully masked."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.rand(batch, seq_k, generator=gen) > 0.35
    mask[:, 0] = True
    if empty_batch is not None:
        mask[empty_batch] = False
    return mask.to(DEVICE)


@pytest.mark.shape(dict(B=2, H=4, S=64, D=32), dict(B=1, H=2, S=37, D=24), dict(B=2, H=2, S=50, D=40),
                   dict(B=1, H=2, S=33, D=80), dict(B=1, H=1, S=19, D=64),
                   dtype=[torch.float16, torch.bfloat16, torch.float32], causal=[False, True])
def test_forward_matches_reference(shape, sdpa_reference):
    q, k, v = make_qkv(shape)
    out = attention(q, k, v, causal=shape.causal, backend="triton")
    assert out.dtype == q.dtype and out.shape == q.shape
    sdpa_reference.check(out, q, k, v, causal=shape.causal, policy=policy_of(shape.dtype))


@pytest.mark.shape(dict(B=2, H=2, S=24, S_k=56, D=32), dict(B=1, H=2, S=50, S_k=20, D=16),
                   dtype=[torch.float16, torch.float32], causal=[False, True, "lower_right"])
def test_query_and_key_lengths_differ(shape, sdpa_reference):
    # lower_right with S_q > S_k leaves the first S_q - S_k rows without keys: they must be zeros.
    q, k, v = make_qkv(shape)
    out = attention(q, k, v, causal=shape.causal, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, policy=policy_of(shape.dtype))
    if shape.causal == "lower_right" and shape.S > shape.S_k:
        assert torch.equal(out[:, :, : shape.S - shape.S_k], torch.zeros_like(out[:, :, : shape.S - shape.S_k]))


@pytest.mark.shape(dict(B=2, H=4, S=40, D=32), H_kv=[2, 1], causal=[False, True], dtype=torch.float16)
def test_grouped_query_attention(shape, sdpa_reference):
    q, k, v = make_qkv(shape)
    k_before, v_before = k.clone(), v.clone()
    out = attention(q, k, v, causal=shape.causal, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, enable_gqa=True)
    assert torch.equal(k, k_before) and torch.equal(v, v_before)


@pytest.mark.shape(dict(B=2, H=2, S=45, D=32), dict(B=2, H=4, H_kv=2, S=30, S_k=52, D=16),
                   dtype=[torch.float16, torch.float32], causal=[False, True, "lower_right"])
def test_key_padding_mask(shape, sdpa_reference):
    q, k, v = make_qkv(shape)
    mask = padding_mask(shape.B, k.shape[2])
    out = attention(q, k, v, causal=shape.causal, key_padding_mask=mask, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, attn_mask=mask[:, None, None, :],
                         enable_gqa=q.shape[1] != k.shape[1], policy=policy_of(shape.dtype))
    # Batch entry 0 has no key at all: zeros, never NaN.
    assert torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.shape(dict(B=3, H=2, S=40, S_k=47, D=32), dtype=torch.float16, causal=[False, True, "lower_right"])
def test_key_lengths_match_the_equivalent_mask(shape, sdpa_reference):
    q, k, v = make_qkv(shape)
    lengths = torch.tensor([0, 20, shape.S_k + 5], device=DEVICE)  # none, some, more than S_k (clamped)
    mask = torch.arange(shape.S_k, device=DEVICE)[None, :] < lengths[:, None]
    out = attention(q, k, v, causal=shape.causal, key_lengths=lengths, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, attn_mask=mask[:, None, None, :])
    masked = attention(q, k, v, causal=shape.causal, key_padding_mask=mask, backend="triton")
    assert_close(out, masked.double(), policy="exact")  # the same kernel arithmetic either way


@pytest.mark.shape(dict(B=1, H=2, S=48, D=32), precision=["ieee", "tf32", "bf16"], causal=[False, True])
def test_float32_precisions(shape, sdpa_reference):
    q, k, v = make_qkv(shape, dtype=torch.float32)
    out = attention(q, k, v, causal=shape.causal, backend="triton", precision=shape.precision)
    assert out.dtype == torch.float32
    sdpa_reference.check(out, q, k, v, causal=shape.causal, policy=FP32_POLICY[shape.precision])
    if shape.precision == "bf16":
        # The bf16 mode really rounds its operands: it differs from true float32 by more than float32 noise.
        exact = attention(q, k, v, causal=shape.causal, backend="triton", precision="ieee")
        assert (out - exact).abs().max() > 1e-4


@pytest.mark.shape(dict(B=2, H=3, S=29, D=48), dtype=[torch.float16, torch.float32], causal=[False, True])
def test_non_contiguous_inputs(shape, sdpa_reference):
    # q, k, v as views of a [B, S, H, D] layout, and k with a padded last dimension.
    q_bshd, k_bshd, v_bshd = (t.transpose(1, 2).contiguous() for t in make_qkv(shape))
    q, v = q_bshd.transpose(1, 2), v_bshd.transpose(1, 2)
    k_wide = torch.zeros(*k_bshd.transpose(1, 2).shape[:3], shape.D + 8, dtype=shape.dtype, device=DEVICE)
    k_wide[..., : shape.D] = k_bshd.transpose(1, 2)
    k = k_wide[..., : shape.D]
    assert not q.is_contiguous() and not k.is_contiguous()
    out = attention(q, k, v, causal=shape.causal, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, policy=policy_of(shape.dtype))


@pytest.mark.shape(dict(B=2, H=2, S=45, S_k=70, D=32),
                   config=[(16, 32, 4, 1), (64, 64, 4, 1), (16, 16, 4, 1), (16, 16, 4, 1, 2), (32, 16, 4, 1, 3)],
                   causal=[True, "lower_right"], dtype=torch.float16)
def test_block_configs(shape, sdpa_reference):
    # Tile sizes the interpreter's default config does not use: BLOCK_N > BLOCK_M, one block over S, square; and
    # several (batch, head) pairs per program, 3 of them leaving the last program of the 4 pairs part empty.
    q, k, v = make_qkv(shape)
    mask = padding_mask(shape.B, shape.S_k, empty_batch=None)
    mode = validation_module.CAUSAL_MODES[shape.causal]
    out, lse = attention_forward(q, k, v, mask, None, mode, shape.D ** -0.5, "fp16", config=shape.config)
    sdpa_reference.check(out, q, k, v, causal=shape.causal, attn_mask=mask[:, None, None, :])
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]


@pytest.mark.parametrize("config", [(16, 16, 4), (16, 16, 4, 1, 2, 3), (16, 0, 4, 1), [16, 16, 4, 1], (16, 16.0, 4, 1)])
def test_a_malformed_block_config_is_refused(config):
    q, k, v = make_qkv(Shape(dict(B=1, H=2, S=8, D=16, dtype=torch.float32)))
    with pytest.raises(ValueError, match=r"config must be \(BLOCK_M, BLOCK_N, num_warps, num_stages"):
        attention_forward(q, k, v, None, None, 0, 0.25, "ieee", config=config)


def test_log_sum_exp_is_base_2():
    q, k, v = make_qkv(Shape(dict(B=1, H=2, S=21, S_k=30, D=16, dtype=torch.float32)))
    scale = 0.3
    _, lse = attention_forward(q, k, v, None, None, validation_module.CAUSAL_BOTTOM_RIGHT, scale, "ieee")
    scores = (q.double() @ k.double().transpose(-1, -2)) * scale
    visible = torch.ones(21, 30, dtype=torch.bool, device=DEVICE).tril(30 - 21)
    expected = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1) / torch.log(
        torch.tensor(2.0, dtype=torch.float64))
    assert_close(lse, expected.to(DEVICE), policy="fp32")


@pytest.mark.parametrize("causal_mode", [0, 1])
def test_inference_launch_skips_the_log_sum_exp_and_gives_the_same_output(causal_mode, monkeypatch):
    # S = 45 is not a multiple of the blocks, so the masked store path (EVEN_M false) runs without its lse store.
    q, k, v = make_qkv(Shape(dict(B=2, H=2, S=45, D=32, dtype=torch.float16)), seed=3)
    expected, expected_lse = attention_forward(q, k, v, None, None, causal_mode, 0.2, "fp16")
    launches = []
    original = launch_module._launch

    def spy(kernel, site, plan, grid, tensors, scalars, meta, **keywords):
        launches.append((site, tensors[4] is tensors[3], meta["STORE_LSE"]))
        return original(kernel, site, plan, grid, tensors, scalars, meta, **keywords)

    monkeypatch.setattr(launch_module, "_launch", spy)
    monkeypatch.setattr(plans_module, "_PLANS", {})
    problem = validation_module.validate(q, k, v, bool(causal_mode), 0.2, None, None, "triton", None)
    out, lse = launch_module.launch_forward(q, k, v, None, None, plans_module.Plan(problem, None),
                                            need_lse=False)
    with torch.no_grad():
        public = attention(q, k, v, causal=bool(causal_mode), scale=0.2, backend="triton")
    assert lse is None
    # Both inference calls: out fills the lse slot and the store is compiled out.
    assert launches == [("inference", True, False), ("inference", True, False)]
    assert torch.isfinite(expected_lse).all()
    assert torch.equal(out, expected) and torch.equal(public, expected)


def test_flattened_grid(monkeypatch, sdpa_reference):
    # B * H over grid axis 1's limit switches to a 1-D grid; lower the limit to exercise that path cheaply.
    monkeypatch.setattr(launch_module, "_GRID_AXIS1_LIMIT", 3)
    shape = Shape(dict(B=2, H=2, S=40, D=16, dtype=torch.float16))
    q, k, v = make_qkv(shape)
    out = attention(q, k, v, causal=True, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=True)
    # With 3 (batch, head) pairs per program the flat grid holds 2 groups per query block, the second part empty.
    out, _ = attention_forward(q, k, v, None, None, validation_module.CAUSAL_TOP_LEFT, 0.25, "fp16",
                               config=(16, 16, 4, 1, 3))
    sdpa_reference.check(out, q, k, v, causal=True)


@pytest.mark.shape(dict(B=2, H=4, H_kv=2, S=33, S_k=41, D=32), dtype=[torch.float16, torch.float32],
                   causal=[False, True, "lower_right"], padding=["mask", "lengths", "none"])
def test_sdpa_backend_agrees_with_kernel(shape, sdpa_reference):
    q, k, v = make_qkv(shape)
    masks = {"mask": dict(key_padding_mask=padding_mask(shape.B, shape.S_k)),
             "lengths": dict(key_lengths=torch.tensor([0, 17], device=DEVICE)), "none": {}}[shape.padding]
    via_sdpa = attention(q, k, v, causal=shape.causal, backend="sdpa", **masks)
    via_kernel = attention(q, k, v, causal=shape.causal, backend="triton", **masks)
    assert not via_sdpa.isnan().any()
    if masks:
        mask = masks.get("key_padding_mask")
        if mask is None:
            mask = torch.arange(shape.S_k, device=DEVICE)[None, :] < masks["key_lengths"][:, None]
        attn_mask = mask[:, None, None, :]
    else:
        attn_mask = None
    sdpa_reference.check(via_sdpa, q, k, v, causal=shape.causal, attn_mask=attn_mask, enable_gqa=True,
                         policy="fp32" if shape.dtype == torch.float32 else None)
    # Both paths near the float64 truth means they agree; check them against each other too.
    assert_close(via_kernel, via_sdpa.double(), policy=policy_of(shape.dtype) or shape.dtype)


@pytest.mark.shape(dict(B=1, H=2, S=70, D=32), dtype=[torch.float16], causal=[False, True])
@pytest.mark.parametrize("scale", [-0.4, 0.0, 0.7])
def test_negative_and_zero_scales(shape, scale, sdpa_reference):
    # Unmasked key blocks take their row maximum from the raw scores times the scale, so a negative scale must use
    # the raw minimum; a zero scale gives a uniform average over the visible keys.
    q, k, v = make_qkv(shape, seed=5)
    out = attention(q, k, v, causal=shape.causal, scale=scale, backend="triton")
    sdpa_reference.check(out, q, k, v, causal=shape.causal, scale=scale)


def test_auto_backend_follows_explain_dispatch():
    q, k, v = make_qkv(Shape(dict(B=1, H=2, S=24, D=32, dtype=torch.float16)))
    decision = flashlite.explain_dispatch(q, k, v, causal=True)
    auto = attention(q, k, v, causal=True)
    forced = attention(q, k, v, causal=True, backend=decision.backend)
    assert torch.equal(auto, forced)


def test_autotune_keys_are_bucketed():
    # Sizes reach the autotuner only as power-of-two buckets, and the kernels do not specialise on them.
    keys = ["SEQ_Q_BUCKET", "SEQ_K_BUCKET", "BATCH_HEADS_BUCKET", "HEAD_DIM", "CAUSAL", "KEY_MASK", "DOT", "WINDOW",
            "SOFTCAP", "ALIBI", "VARLEN"]
    for kernel, paged in ((attention_fwd.attn_fwd, True), (attention_bwd.attn_bwd_dkdv, False),
                          (attention_bwd.attn_bwd_dq, False)):
        # The variants join the key: a windowed or packed call is tuned apart from a dense one of the same sizes.
        # Only the forward reads a paged cache (decoding is forward only).
        assert kernel.keys == keys + ["PAGE_SIZE"] * paged
        # Every key names an argument: newer Triton (3.9) refuses another name when the autotuner is built (3.6
        # skipped it), and the backward's PAGE_SIZE made importing it fail there.
        assert set(kernel.keys) <= set(kernel.arg_names)
        python_fn = kernel.fn.fn.fn  # autotuner -> heuristics -> jit (or interpreted) function -> Python function
        constexprs = {name for name, p in inspect.signature(python_fn).parameters.items()
                      if "constexpr" in str(p.annotation)}
        assert {"HEAD_DIM", "BLOCK_M", "BLOCK_N", "CAUSAL"} <= constexprs
        assert not {"seq_q", "seq_k", "batch_heads", "SEQ_Q_BUCKET", "SEQ_K_BUCKET",
                    "BATCH_HEADS_BUCKET"} & constexprs


@pytest.mark.parametrize("head_dim, dtype", [(64, torch.float16), (128, torch.bfloat16), (256, torch.float16),
                                             (256, torch.float32)])
def test_gpu_configs_are_pruned_to_fit(head_dim, dtype):
    block_d = max(16, 1 << (head_dim - 1).bit_length())
    q = torch.empty(0, dtype=dtype)
    for blocks, prune in ((attention_fwd.FWD_GPU_BLOCKS, attention_fwd.prune_fwd_configs),
                          (attention_bwd.DKDV_GPU_BLOCKS, attention_bwd.prune_dkdv_configs),
                          (attention_bwd.DQ_GPU_BLOCKS, attention_bwd.prune_dq_configs)):
        configs = tuning.make_configs(blocks)
        # A short sequence: the forward's several-pairs-per-program configs are candidates too.
        kept = prune(configs, {"Q": q, "SEQ_Q_BUCKET": 128}, BLOCK_D=block_d)
        assert kept and all(config in configs for config in kept)
        biggest = max(configs, key=lambda c: c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] * c.num_stages)
        if head_dim <= 64 and dtype == torch.float16:
            assert len(kept) == len(configs)  # nothing is lost at the common head dims
        if head_dim == 256 and dtype == torch.float32:
            assert biggest not in kept and len(kept) < len(configs)
        # Longer sequences (and calls that do not say) keep one pair per program.
        for named in ({"Q": q, "SEQ_Q_BUCKET": 4096}, {"Q": q}):
            assert all(c.kwargs.get("BH_PER_PROGRAM", 1) == 1 for c in prune(configs, named, BLOCK_D=block_d))


def test_three_stage_128_by_128_tiles_are_candidates_at_head_dim_128():
    # 3 stages x (K and V: 128 x 128 bf16) + the 128 x 128 query tile = 224 KB, under the H200's 227 KB per block.
    configs = tuning.make_configs(attention_fwd.FWD_GPU_BLOCKS)
    kept = attention_fwd.prune_fwd_configs(configs, {"Q": torch.empty(0, dtype=torch.bfloat16),
                                                     "SEQ_Q_BUCKET": 8192}, BLOCK_D=128)
    shapes = {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in kept}
    assert (128, 128, 8, 3) in shapes
    # float32 operands are twice the bytes: the same tiles would need 448 KB and are dropped.
    kept32 = attention_fwd.prune_fwd_configs(configs, {"Q": torch.empty(0, dtype=torch.float32),
                                                       "SEQ_Q_BUCKET": 8192}, BLOCK_D=128)
    assert (128, 128, 8, 3) not in {(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
                                    for c in kept32}


class _RecordingKernel:
    """Stands in for a Triton kernel: records each launch's meta-parameters."""

    def __init__(self, best=None):
        self.launches = []
        self.best_config = best

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(kwargs)


def _stub_kernel(autotuned, fixed):
    return launch_module._Kernel("forward", autotuned, fixed, attention_fwd.FWD_GPU_BLOCKS,
                                 attention_fwd.prune_fwd_configs)


def _problem(seq=128, dtype=torch.float32):
    q = torch.empty(1, 1, seq, 64, dtype=dtype)
    return q, validation_module.validate(q, q, q, False, None, None, None, "triton", None)


def test_autotuning_can_be_switched_off(monkeypatch):
    # FLASHLITE_AUTOTUNE=0 on a GPU: the first GPU config that fits, launched directly, no benchmarking.
    monkeypatch.setattr(launch_module._runtime, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "0")
    q, problem = _problem()
    autotuned, fixed = _RecordingKernel(), _RecordingKernel()
    plan = plans_module.Plan(problem, None)
    launch_module._launch(_stub_kernel(autotuned, fixed), "forward", plan, None, (q,), (),
                          {"HEAD_DIM": 256, "BLOCK_D": 256})
    assert autotuned.launches == []
    (forced,) = fixed.launches
    assert (forced["BLOCK_M"], forced["BLOCK_N"], forced["num_warps"], forced["num_stages"]) == (64, 32, 4, 2)
    assert forced["HEAD_DIM"] == 256
    assert plan.configs["forward"] == {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}


def test_tuned_config_is_kept_by_the_plan_and_reused_without_the_autotuner(monkeypatch):
    # With autotuning on, a plan's first launch goes through the autotuner (which benchmarks only tuning keys it
    # has not seen); the plan keeps the config it chose and later launches go straight to the kernel with it.
    monkeypatch.setattr(launch_module._runtime, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "1")
    best = triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4, num_stages=3)
    autotuned, fixed = _RecordingKernel(best), _RecordingKernel()
    kernel = _stub_kernel(autotuned, fixed)
    q, problem = _problem(dtype=torch.float16)
    plan = plans_module.Plan(problem, None)
    launch = lambda plan: launch_module._launch(kernel, "forward", plan, None, (q,), (),  # noqa: E731
                                                {"HEAD_DIM": 64, "BLOCK_D": 64})
    launch(plan)
    assert len(autotuned.launches) == 1 and fixed.launches == []
    launch(plan)
    launch(plan)
    assert len(autotuned.launches) == 1
    assert fixed.launches == [{"HEAD_DIM": 64, "BLOCK_D": 64, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4,
                               "num_stages": 3}] * 2
    launch(plans_module.Plan(problem, None))  # another signature's plan asks the autotuner again
    assert len(autotuned.launches) == 2


def test_a_forced_config_is_used_and_never_kept(monkeypatch):
    # attention_forward(config=...) launches that config and leaves no plan behind; without one, the launcher
    # keeps a plan per signature, as attention() does.
    monkeypatch.setattr(plans_module, "_PLANS", {})
    q, k, v = make_qkv(Shape(dict(B=1, H=2, S=37, D=16, dtype=torch.float16)), seed=5)
    forced, _ = attention_forward(q, k, v, None, None, 1, 0.25, "fp16", config=(16, 16, 4, 1))
    assert plans_module._PLANS == {}
    tuned, _ = attention_forward(q, k, v, None, None, 1, 0.25, "fp16")
    (plan,) = plans_module._PLANS.values()
    kept = plan.configs["forward"]
    blocks = attention_fwd.FWD_INTERPRETER_BLOCKS if launch_module._runtime.interpreting() else \
        attention_fwd.FWD_GPU_BLOCKS
    assert (kept["BLOCK_M"], kept["BLOCK_N"], kept["num_warps"], kept["num_stages"]) in {b[:4] for b in blocks}
    again, _ = attention_forward(q, k, v, None, None, 1, 0.25, "fp16")
    expected = attention(q, k, v, causal=True, scale=0.25, backend="sdpa")
    for out in (forced, tuned, again):
        assert_close(out, expected, policy="fp16")
    with pytest.raises(ValueError, match="config must be"):
        attention_forward(q, k, v, None, None, 1, 0.25, "fp16", config=(16, 16, 4))


_COMPILE_FOR_HOPPER = SM90_COMPILER + r'''
def report(fn, blocks):
    ttgir = compile_for_sm90(fn, blocks).asm["ttgir"]
    # Tensor-core (wgmma) dots and software-pipelined (cp.async) loads of the streamed tiles.
    print(fn.__name__, "warp_group_dot" in ttgir, "async_copy_global_to_local" in ttgir)

report(attention_fwd._attn_fwd, dict(BLOCK_M=128, BLOCK_N=64, BH_PER_PROGRAM=1))
report(attention_fwd._attn_fwd, dict(BLOCK_M=64, BLOCK_N=64, BH_PER_PROGRAM=2))
report(attention_bwd._attn_bwd_dkdv, dict(BLOCK_M=32, BLOCK_N=128))
report(attention_bwd._attn_bwd_dq, dict(BLOCK_M=128, BLOCK_N=32))
'''

@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles the kernels for real")
def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter runs the kernels as Python; this compiles them the way a GPU run would (to sm_90 machine
    # code), so errors that only compilation finds show up on a CPU-only machine too.
    pytest.importorskip("triton.backends.nvidia")
    assert run_script(_COMPILE_FOR_HOPPER).split() == ["_attn_fwd", "True", "True", "_attn_fwd", "True", "True",
                                                        "_attn_bwd_dkdv", "True", "True", "_attn_bwd_dq", "True",
                                                        "True"]


_WITHOUT_TRITON = r'''
import builtins
real_import = builtins.__import__

def no_triton(name, *args, **kwargs):
    if name == "triton" or name.startswith("triton."):
        raise ImportError("no triton on this platform")
    return real_import(name, *args, **kwargs)

builtins.__import__ = no_triton
import torch
import flashlite
q = torch.randn(1, 2, 8, 16)
out = flashlite.attention(q, q, q, causal=True)
expected = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
print(torch.equal(out, expected), flashlite.explain_dispatch(q, q, q).reason)
'''


def test_without_triton_attention_imports_and_runs_on_sdpa():
    # Triton has wheels for Linux x86_64 only: elsewhere flashlite must import and send every call to SDPA, saying
    # why. A fresh interpreter where importing triton fails stands in for such a platform.
    out = run_script(_WITHOUT_TRITON)
    assert out.strip() == "True kernel cannot run this call: Triton is not available (no triton on this platform)"


def test_auto_runs_calls_with_a_gradient_by_the_forward_backward_measurement(monkeypatch):
    # A made-up GPU's table: at S=40 the kernel won the forward but lost forward+backward; at S=72 the reverse. One
    # signature serves calls with and without a gradient, so the kept plan (replayed from the second call on) must
    # pick per call, and explain_dispatch must say which.
    import flashlite.attn.decide as decide_module
    use_table(monkeypatch, {"float32/D16/causal/B1/S64": {"backend": "triton", "why": "forward win"},
                            "float32/D16/causal/B1/S64/fwd+bwd": {"backend": "sdpa", "why": "forward+backward loss"},
                            "float32/D16/causal/B1/S128": {"backend": "sdpa", "why": "forward loss"},
                            "float32/D16/causal/B1/S128/fwd+bwd": {"backend": "triton",
                                                                   "why": "forward+backward win"}})
    monkeypatch.setattr(plans_module, "_PLANS", {})
    triton_calls = []

    def counted_run_triton(*args, **kwargs):
        triton_calls.append(1)
        return real_run_triton(*args, **kwargs)

    real_run_triton = decide_module.run_triton
    monkeypatch.setattr(decide_module, "run_triton", counted_run_triton)
    gen = torch.Generator().manual_seed(11)
    for seq, gradient_backend in ((40, "sdpa"), (72, "triton")):
        # On the device the kernel runs on (on a GPU machine a CPU tensor would go to SDPA whatever the table says).
        q, k, v = (torch.randn(1, 2, seq, 16, generator=gen, dtype=torch.float32).to(DEVICE) for _ in range(3))
        ref_in = [t.double().requires_grad_() for t in (q, k, v)]
        mask = torch.ones(seq, seq, dtype=torch.bool, device=DEVICE).tril()
        scores = (ref_in[0] @ ref_in[1].transpose(-2, -1) / 4.0).masked_fill(~mask, float("-inf"))
        expected = torch.softmax(scores, -1) @ ref_in[2]
        grad_out = torch.randn(expected.shape, generator=gen, dtype=torch.float64).to(DEVICE)
        expected.backward(grad_out)
        forward_backend = "sdpa" if gradient_backend == "triton" else "triton"
        for _ in range(2):  # the plan's first call, then its replay
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            assert explain_dispatch(*leaves, causal=True).backend == gradient_backend
            before = len(triton_calls)
            out = attention(*leaves, causal=True)
            assert len(triton_calls) - before == (gradient_backend == "triton")
            out.backward(grad_out.float())
            assert_close(out, expected, policy="tf32")
            for leaf, ref in zip(leaves, ref_in):
                assert_close(leaf.grad, ref.grad, policy="tf32")
            with torch.no_grad():
                assert explain_dispatch(*leaves, causal=True).backend == forward_backend
                before = len(triton_calls)
                assert_close(attention(*leaves, causal=True), expected, policy="tf32")
                assert len(triton_calls) - before == (forward_backend == "triton")
            before = len(triton_calls)
            attention(q, k, v, causal=True)  # no input requires grad: the forward's decision
            assert len(triton_calls) - before == (forward_backend == "triton")
    assert "(forward+backward)" in explain_dispatch(*leaves, causal=True).reason
    assert len(plans_module._PLANS) == 2


def test_repeated_calls_replay_the_plan_and_never_a_stale_one():
    # The second identical call is served from the cached plan; any changed argument or shape is not.
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(1, 2, 24, 16, device=DEVICE, generator=gen) for _ in range(3))
    for backend in ("sdpa", "triton"):
        first = attention(q, k, v, causal=True, backend=backend)
        key = plans_module.attention_key(q, k, v, None, None, True, None, backend, None, None, None, None)
        assert plans_module._PLANS[key].decision.backend == backend
        again = attention(q, k, v, causal=True, backend=backend)
        torch.testing.assert_close(again, first, rtol=0, atol=0)
        full = attention(q, k, v, causal=False, backend=backend)
        expected_full = torch.softmax(q.double() @ k.double().transpose(-2, -1) / 4.0, -1) @ v.double()
        assert_close(full, expected_full, policy="tf32")
        assert not torch.allclose(full, first)
        shorter = attention(q[:, :, :20], k, v, causal=True, backend=backend)
        assert shorter.shape == (1, 2, 20, 16)
    # Bottom-right causal on SDPA is not a plain SDPA call (SDPA's is_causal is top-left): its replay goes through
    # flashlite's mask building, and matches the reference every time.
    q_short = q[:, :, :10]
    visible = torch.ones(10, 24, dtype=torch.bool, device=DEVICE).tril(24 - 10)
    scores = (q_short.double() @ k.double().transpose(-2, -1) / 4.0).masked_fill(~visible, float("-inf"))
    expected = torch.softmax(scores, -1) @ v.double()
    for _ in range(2):
        assert_close(attention(q_short, k, v, causal="lower_right", backend="sdpa"), expected, policy="fp32")
    with pytest.raises(TypeError, match="dtype"):
        attention(q, k.double(), v, causal=True)


@pytest.mark.shape(dict(B=2, H=4, H_kv=2, S=12, S_k=17, D=16), causal=[False, True, "lower_right"],
                   mask_kind=["bias", "bool"])
def test_explicit_attn_mask_runs_on_sdpa_and_matches_the_reference(shape, sdpa_reference):
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    q = torch.randn(shape.B, shape.H, shape.S, shape.D, device=DEVICE, generator=gen)
    k, v = (torch.randn(shape.B, shape.H_kv, shape.S_k, shape.D, device=DEVICE, generator=gen) for _ in range(2))
    if shape.mask_kind == "bias":  # broadcast over batch; one query row of batch 0 masked out entirely
        attn_mask = torch.randn(1, shape.H, shape.S, shape.S_k, device=DEVICE, generator=gen)
        attn_mask[0, :, 3] = float("-inf")
    else:
        attn_mask = torch.rand(shape.B, 1, shape.S, shape.S_k, device=DEVICE, generator=gen) > 0.3
        attn_mask[1, :, 5] = False
    out = attention(q, k, v, causal=shape.causal, attn_mask=attn_mask)
    assert not out.isnan().any()
    sdpa_reference.check(out, q, k, v, causal=shape.causal, attn_mask=attn_mask, enable_gqa=True)
    decision = flashlite.explain_dispatch(q, k, v, causal=shape.causal, attn_mask=attn_mask)
    assert decision.backend == "sdpa" and "attn_mask" in decision.reason
    with pytest.raises(ValueError, match="attn_mask"):
        attention(q, k, v, causal=shape.causal, attn_mask=attn_mask, backend="triton")


@pytest.mark.parametrize("causal", [False, "lower_right"])
def test_a_float32_bias_beyond_float16s_range_reaches_sdpa_as_the_same_softmax(causal):
    # A float16 call's bias reaches SDPA in float16, whose range ends at 65504. Rounded there as given, a row
    # biased by -1e9 on every key became -inf on every key (zeros, as if it saw no key) and a key biased by +1e5
    # became +inf (NaN). In the math the first row is softmax(scores) (a bias equal along a row cancels) and the
    # second row's weight all goes to that key; float32 SDPA gives both.
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 2, 9, 16, generator=gen).to(device=DEVICE, dtype=torch.float16) for _ in range(3))
    bias = torch.randn(2, 1, 9, 9, generator=gen)
    bias[:, :, 2] = -1e9
    bias[:, :, 4] -= 3e5  # large and uneven along the row: only the differences count
    bias[1, :, 6, 3] = 1e5
    bias = bias.to(DEVICE)
    out = attention(q, k, v, causal=causal, attn_mask=bias)
    q64, k64, v64 = (t.double() for t in (q, k, v))
    scores = q64 @ k64.transpose(-2, -1) / 4.0 + bias.double()
    if causal:
        scores = scores.masked_fill(~torch.ones(9, 9, dtype=torch.bool, device=DEVICE).tril(), float("-inf"))
    expected = torch.softmax(scores, dim=-1) @ v64
    assert_close(out, expected, policy="fp16")


def test_attn_mask_bad_input_is_named():
    q = k = v = torch.randn(1, 2, 8, 16, device=DEVICE)
    with pytest.raises(ValueError, match=r"does not broadcast to \[B, H, S_q, S_k\]"):
        attention(q, k, v, attn_mask=torch.zeros(3, 8, 8, device=DEVICE))
    with pytest.raises(TypeError, match="bool .* or floating"):
        attention(q, k, v, attn_mask=torch.zeros(8, 8, dtype=torch.int64, device=DEVICE))
    with pytest.raises(TypeError, match="must be a tensor"):
        attention(q, k, v, attn_mask=[[1.0]])


def test_tuning_buckets_separate_batch_sizes_of_one_sequence_length():
    _tuning_buckets = tuning.tuning_buckets
    # Case 2 (B=1) and case 7 (B=16) share S=1024 but not a tuned config.
    assert _tuning_buckets(1024, 1024, 1 * 16) == (1024, 1024, 16)
    assert _tuning_buckets(1024, 1024, 16 * 16) == (1024, 1024, 256)
    assert _tuning_buckets(1000, 77, 3 * 5) == (1024, 128, 16)
    # Past the caps the best tiles stop changing: case 14 reuses the 16,384 bucket, huge batches the 4,096 one.
    assert _tuning_buckets(100_000, 100_000, 32 * 16) == (16384, 16384, 512)
    assert _tuning_buckets(64, 64, 256 * 16 * 4) == (64, 64, 4096)


def test_decoding_sized_queries_take_sixteen_row_tiles_with_autotuning_off(monkeypatch):
    # FLASHLITE_AUTOTUNE=0 on a GPU: a call of at most 16 query rows gets the first decoding config, others the
    # usual first config.
    monkeypatch.setattr(launch_module._runtime, "interpreting", lambda: False)
    monkeypatch.setenv("FLASHLITE_AUTOTUNE", "0")
    q, problem = _problem()
    for bucket, expected in ((16, attention_fwd.FWD_DECODE_BLOCKS[0]), (128, attention_fwd.FWD_GPU_BLOCKS[0])):
        autotuned, fixed = _RecordingKernel(), _RecordingKernel()
        plan = plans_module.Plan(problem, None)
        kernel = launch_module._Kernel("forward", autotuned, fixed, launch_module._FORWARD.gpu_blocks,
                                       attention_fwd.prune_fwd_configs)  # the launcher's own config list
        launch_module._launch(kernel, "forward", plan, None, (q.half(),), (), {"HEAD_DIM": 64, "BLOCK_D": 64},
                              seq_q_bucket=bucket)
        (forced,) = fixed.launches
        assert (forced["BLOCK_M"], forced["BLOCK_N"], forced["num_warps"], forced["num_stages"]) == expected[:4]
