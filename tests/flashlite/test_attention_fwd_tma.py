"""The tensor-descriptor (TMA) forward kernel against float64 references.

On a CPU-only machine host-side tensor descriptors run through the Triton interpreter, which emulates them with
masked loads and stores, so the kernel's logic is checked here at tiny sizes; the hardware TMA path is covered by
the CUDA-only test at the end.
"""
import math

import pytest
import torch

import flashlite  # noqa: F401  (sets TRITON_INTERPRET before the kernel module is imported)
from flashlite import _runtime
from flashlite.attention import attention_forward
from flashlite.kernels.attention_fwd_tma import attention_forward_tma, tma_supported
from pytest_kernelcheck import assert_close, policy_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# fp16: atol 2e-3, rtol 2e-3 against float64 (the probabilities are rounded to fp16 before P @ V, as in the
# pointer kernel). float32 multiplies in tf32 on a GPU, so it takes the tf32 policy; bfloat16 its default policy.
POLICY = {torch.float16: policy_for("fp16").replace(atol=2e-3, rtol=2e-3), torch.float32: policy_for("tf32"),
          torch.bfloat16: policy_for("bf16")}

# lse of float16/bfloat16 inputs comes from float32 scores of exact input values: only summation order separates it
# from float64. float32 inputs multiply in tf32 on a GPU (10-bit mantissa operands): on an H200 the base-2 lse
# differed from float64 by up to 2.7e-3 at D <= 64, hence atol 1e-2.
LSE_POLICY = {torch.float16: policy_for("fp32").replace(atol=1e-4, rtol=1e-5),
              torch.bfloat16: policy_for("fp32").replace(atol=1e-4, rtol=1e-5),
              torch.float32: policy_for("tf32").replace(atol=1e-2, rtol=1e-3)}

# (B, H, H_kv, S_q, S_k, D): lengths that are not multiples of the interpreter's blocks (32 x 16), S_q < S_k and
# S_q > S_k (bottom-right causal then leaves rows without keys), grouped-query heads, D = 16 and 64, and one case
# of exact blocks.
SHAPES = [(2, 4, 2, 37, 53, 16), (2, 2, 1, 53, 37, 64), (1, 2, 2, 64, 64, 32)]


def shape_id(shape):
    return "B{}-H{}-Hkv{}-Sq{}-Sk{}-D{}".format(*shape)


def make_qkv(batch, heads, kv_heads, seq_q, seq_k, head_dim, dtype, *, seed=0, device=DEVICE):
    """Fresh N(0, 1) inputs: q [B, H, S_q, D], k and v [B, H_kv, S_k, D]."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=gen).to(device=device, dtype=dtype)

    return (rand(batch, heads, seq_q, head_dim), rand(batch, kv_heads, seq_k, head_dim),
            rand(batch, kv_heads, seq_k, head_dim))


def reference(q, k, v, causal_mode, scale):
    """float64 (out, base-2 lse) of softmax(scale * q k^T + mask) v; rows without a visible key give 0 and -inf."""
    q, k, v = (t.to(torch.float64) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = scale * q @ k.transpose(-1, -2)
    seq_q, seq_k = q.shape[2], k.shape[2]
    if causal_mode:
        shift = 0 if causal_mode == 1 else seq_k - seq_q
        rows = torch.arange(seq_q, device=q.device)[:, None]
        cols = torch.arange(seq_k, device=q.device)[None, :]
        scores = scores.masked_fill(cols > rows + shift, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    seen = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(seen, lse, 0.0)[..., None])
    out = torch.where(seen[..., None], probs @ v, 0.0)
    return out, lse * math.log2(math.e)


def check(q, k, v, causal_mode, **kwargs):
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = attention_forward_tma(q, k, v, causal_mode=causal_mode, scale=scale, **kwargs)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    ref_out, ref_lse = reference(q, k, v, causal_mode, scale)
    assert_close(out, ref_out, policy=POLICY[q.dtype])
    assert_close(lse, ref_lse, policy=LSE_POLICY[q.dtype])
    return out, lse


@pytest.mark.parametrize("shape", SHAPES, ids=shape_id)
@pytest.mark.parametrize("causal_mode", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.bfloat16],
                         ids=["fp16", "fp32", "bf16"])
def test_matches_float64_reference(shape, causal_mode, dtype):
    # bfloat16 under the interpreter: tl.dot on bf16 operands is broken there, so the kernel takes the pointer
    # kernel's "bf16_emulated" dots (operands rounded to bf16, fp32 products); loads and stores stay bf16.
    q, k, v = make_qkv(*shape, dtype)
    check(q, k, v, causal_mode)


@pytest.mark.parametrize("config", [(16, 32, 4, 1), (16, 16, 4, 2), (64, 16, 4, 1)])
@pytest.mark.parametrize("causal_mode", [1, 2])
def test_forced_configs(config, causal_mode):
    # BLOCK_N > BLOCK_M and BLOCK_M > S_q move the diagonal across whole and partial key blocks.
    q, k, v = make_qkv(1, 2, 1, 45, 29, 16, torch.float16, seed=3)
    check(q, k, v, causal_mode, config=config)


@pytest.mark.parametrize("causal_mode", [0, 1])
def test_warp_specialized_loop_matches_reference(causal_mode):
    # Under the interpreter the loop attribute changes nothing; on a GPU it changes the compiled code (see the
    # CUDA-only test below). Either way the numbers must match float64.
    q, k, v = make_qkv(1, 2, 1, 45, 61, 16, torch.float16, seed=19)
    check(q, k, v, causal_mode, config=(32, 16, 4, 1), warp_specialize=True)


def test_rows_without_keys_are_zero_with_lse_minus_inf():
    # Bottom-right causal with S_q = 40 > S_k = 19: query i sees keys j <= i - 21, so rows 0..20 see none.
    q, k, v = make_qkv(1, 2, 2, 40, 19, 16, torch.float16, seed=5)
    out, lse = check(q, k, v, 2)
    empty = 40 - 19
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all()
    assert torch.isfinite(lse[:, :, empty:]).all() and out[:, :, empty:].abs().amax() > 0


def test_gqa_reads_the_right_kv_head():
    # Distinct k/v heads with very different values: a wrong head mapping cannot stay within tolerance.
    q, k, v = make_qkv(2, 4, 2, 21, 33, 16, torch.float16, seed=7)
    v[:, 1] += 4.0
    check(q, k, v, 1)


@pytest.mark.parametrize("causal_mode", [0, 1, 2])
def test_agrees_with_pointer_kernel(causal_mode):
    q, k, v = make_qkv(2, 2, 1, 37, 53, 16, torch.float16, seed=11)
    scale = 0.3
    out, lse = attention_forward_tma(q, k, v, causal_mode=causal_mode, scale=scale)
    out_ptr, lse_ptr = attention_forward(q, k, v, None, None, causal_mode, scale, "fp16")
    torch.testing.assert_close(out, out_ptr, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, lse_ptr, atol=1e-5, rtol=1e-5)


def test_inputs_are_not_modified():
    q, k, v = make_qkv(1, 2, 1, 19, 23, 16, torch.float16, seed=13)
    before = [t.clone() for t in (q, k, v)]
    attention_forward_tma(q, k, v, causal_mode=1, scale=0.25)
    for t, t0 in zip((q, k, v), before):
        assert torch.equal(t, t0)


# --------------------------------------------------------------------------------------------------------------
# Errors


def good(**changes):
    shape = dict(batch=2, heads=4, kv_heads=2, seq_q=16, seq_k=24, head_dim=32, dtype=torch.float16)
    shape.update(changes)
    return make_qkv(*shape.values())


def misaligned(t):
    """A contiguous copy of t whose data pointer is 2 bytes past a 16-byte boundary."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    start = next(i for i in range(1, 8) if (flat.data_ptr() + i * t.element_size()) % 16)
    view = flat[start:start + t.numel()].view(t.shape)
    view.copy_(t)
    return view


ERRORS = {
    "not a tensor": (lambda: ([[1.0]], *good()[1:]), {}, TypeError, r"q must be a torch.Tensor"),
    "rank": (lambda: (good()[0][0], *good()[1:]), {}, ValueError, r"q must have 4 dimensions"),
    "dtype": (lambda: good(dtype=torch.float64), {}, TypeError, r"float64.*supports float16, bfloat16 and float32"),
    "dtype mix": (lambda: (good()[0], *good(dtype=torch.float32)[1:]), {}, TypeError, r"share one dtype"),
    "device mix": (lambda: (good()[0].to("meta"), *good()[1:]), {}, ValueError, r"must be on one device"),
    "device": (lambda: tuple(t.to("meta") for t in good()), {}, ValueError, r"tensors are on meta"),
    "k vs v": (lambda: (*good()[:2], good(seq_k=9)[2]), {}, ValueError, r"k and v must have the same shape"),
    "batch": (lambda: (good()[0], *good(batch=3)[1:]), {}, ValueError, r"batch size differs"),
    "head dim differs": (lambda: (good()[0], *good(head_dim=16)[1:]), {}, ValueError, r"head dim differs"),
    "gqa": (lambda: good(heads=3, kv_heads=2), {}, ValueError, r"multiple of the k/v heads"),
    "head dim 24": (lambda: good(head_dim=24), {}, ValueError, r"head dim 24 is not supported.*power of two"),
    "head dim 8": (lambda: good(head_dim=8), {}, ValueError, r"head dim 8 is not supported"),
    "head dim 512": (lambda: good(head_dim=512), {}, ValueError, r"head dim 512 is not supported"),
    "empty": (lambda: good(seq_q=0), {}, ValueError, r"empty input"),
    "not contiguous": (lambda: (good()[0].transpose(1, 2).contiguous().transpose(1, 2), *good()[1:]), {},
                       ValueError, r"q is not contiguous"),
    "misaligned": (lambda: (good()[0], misaligned(good()[1]), good()[2]), {}, ValueError,
                   r"k's data pointer .* is not 16-byte aligned"),
    "causal 3": (lambda: good(), {"causal_mode": 3}, ValueError, r"causal_mode must be 0 \(none\)"),
    "causal bool": (lambda: good(), {"causal_mode": True}, TypeError, r"causal_mode must be the int"),
    "scale": (lambda: good(), {"scale": float("nan")}, TypeError, r"scale must be a finite float"),
    "config length": (lambda: good(), {"config": (32, 16, 4)}, ValueError, r"config must be \(BLOCK_M"),
    "config block": (lambda: good(), {"config": (48, 16, 4, 1)}, ValueError, r"BLOCK_M must be a power of two"),
    "warp_specialize type": (lambda: good(), {"warp_specialize": 1, "config": (32, 16, 4, 1)}, TypeError,
                             r"warp_specialize must be a bool"),
    "warp_specialize without config": (lambda: good(), {"warp_specialize": True}, ValueError,
                                       r"warp_specialize=True needs an explicit config"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_bad_input_is_named(case):
    make, kwargs, error, message = ERRORS[case]
    q, k, v = make()
    kwargs = {"causal_mode": 0, "scale": 0.125, **kwargs}
    with pytest.raises(error, match=message):
        attention_forward_tma(q, k, v, **kwargs)
    if not {"causal_mode", "scale", "config", "warp_specialize"} & set(ERRORS[case][1]):
        # tma_supported gives the same reason without raising.
        assert tma_supported(q, k, v) is not None


def test_tma_supported_accepts_good_input():
    assert tma_supported(*good()) is None
    assert tma_supported(*good(dtype=torch.bfloat16, head_dim=64)) is None


@pytest.mark.skipif(_runtime.interpreting(), reason="CPU tensors are accepted under the interpreter")
def test_cpu_tensors_rejected_when_compiled():
    q, k, v = make_qkv(1, 2, 2, 16, 16, 32, torch.float16, device="cpu")
    assert "interpreter" in tma_supported(q, k, v)


# --------------------------------------------------------------------------------------------------------------
# Real sizes on a GPU (hardware TMA)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("causal_mode", [0, 1])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gpu_real_size(dtype, head_dim, causal_mode):
    q, k, v = make_qkv(2, 16, 16, 1000, 1000, head_dim, dtype, seed=17)
    reason = tma_supported(q, k, v)
    if reason is not None:
        pytest.skip(reason)
    check(q, k, v, causal_mode)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [(128, 64, 8, 3), (128, 128, 8, 2)])
@pytest.mark.parametrize("causal_mode", [0, 1])
def test_gpu_warp_specialized_loop(config, causal_mode):
    q, k, v = make_qkv(2, 16, 16, 1000, 1000, 64, torch.bfloat16, seed=23)
    reason = tma_supported(q, k, v)
    if reason is not None:
        pytest.skip(reason)
    check(q, k, v, causal_mode, config=config, warp_specialize=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_warp_specialization_failure_is_named():
    # On an H200 with Triton 3.6 the warp-specialization pass fails for 4-warp configs: the error must say so.
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=29)
    reason = tma_supported(q, k, v)
    if reason is not None:
        pytest.skip(reason)
    try:
        check(q, k, v, 1, config=(128, 64, 4, 3), warp_specialize=True)
    except RuntimeError as error:
        assert "could not warp-specialize the key loop with config (128, 64, 4, 3)" in str(error)
    # A Triton that compiles it must give correct numbers, which check() asserted.
