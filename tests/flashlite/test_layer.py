"""flashlite.TransformerLayer against a float64 plain-PyTorch block with the same weights, on tiny shapes.

Every precision mode, causal and not, with and without key padding, with grouped-query attention; outputs, input
gradients and every parameter gradient. Attention is forced onto the Triton kernel (on the CPU it runs through
the interpreter), so these tests cover the kernels the layer is built on, not SDPA.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from flashlite._runtime import interpreting, kernel_device_ok
from flashlite.layer import FUSIONS, CudaGraphRunner, PlainTransformerBlock, TransformerLayer, plain_to_layer_names
from pytest_kernelcheck import assert_close, policy_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# precision mode name of a test case -> TransformerLayer keywords
MODES = {
    "fp32": dict(precision="fp32"),
    "fp32-tf32": dict(precision="fp32", attention_precision="tf32"),
    "mixed-bf16": dict(precision="mixed"),
    "mixed-fp16": dict(precision="mixed", compute_dtype=torch.float16),
    "mixed-bf16-residual": dict(precision="mixed_bf16_residual"),
    "bf16-fp32-residual": dict(precision="bf16_fp32_residual"),
    "bf16": dict(precision="bf16"),
    "fp16": dict(precision="fp16"),
}
# Two layer configurations that together cover causal/non-causal, padding/none and GQA/MHA.
CONFIGS = (
    dict(B=2, S=16, d_model=64, n_heads=4, n_kv_heads=2, causal=True, padding="right"),
    dict(B=2, S=12, d_model=32, n_heads=2, n_kv_heads=2, causal=False, padding="none"),
)


def _padding_mask(batch: int, seq: int, padding: str) -> torch.Tensor | None:
    if padding == "none":
        return None
    mask = torch.ones(batch, seq, dtype=torch.bool, device=DEVICE)
    if padding == "right":  # a shorter second sequence
        mask[-1, seq - seq // 3:] = False
    elif padding == "left":  # under a causal mask the first queries of row 1 see no key at all
        mask[-1, : seq // 3] = False
    return mask


def _plain_grads(block: PlainTransformerBlock) -> dict[str, torch.Tensor]:
    """The block's parameter gradients under TransformerLayer's names (q/k/v concatenated into qkv)."""
    return plain_to_layer_names({name: p.grad for name, p in block.named_parameters()})


def _run(module, x, mask, dy):
    x = x.detach().clone().requires_grad_(True)
    y = module(x, mask)
    y.backward(dy.to(y.dtype))
    return y.detach(), x.grad


def input_dtype(policy) -> torch.dtype:
    """The dtype a test feeds the layer: float32 where its residual stream is float32, else the parameter dtype."""
    return torch.float32 if policy.residual_dtype == torch.float32 else policy.param_dtype


def _baseline(layer: TransformerLayer, x, mask, dy):
    """The same computation by PyTorch in the layer's precision: autocast for "mixed" and "bf16_fp32_residual"
    (over a float32 block holding the layer's weights, exactly: PyTorch's LayerNorm takes no bf16 parameters for a
    float32 input), the block in bf16 for "mixed_bf16_residual", the block in the layer's dtype otherwise."""
    policy = layer.policy
    block = layer.to_plain()
    if policy.mode in ("mixed", "bf16_fp32_residual"):
        block = layer.to_plain(torch.float32)
        with torch.autocast(x.device.type, dtype=policy.matmul_dtype):
            y, dx = _run(block, x, mask, dy)
    elif policy.mode == "mixed_bf16_residual":
        # A bf16 residual stream is what PyTorch's block cast to bf16 carries: that block is the yardstick.
        block = block.to(torch.bfloat16)
        y, dx = _run(block, x.to(torch.bfloat16), mask, dy)
    else:
        y, dx = _run(block, x, mask, dy)
    return y, dx, _plain_grads(block)


def _check_layer(layer: TransformerLayer, x: torch.Tensor, mask: torch.Tensor | None) -> None:
    gen = torch.Generator().manual_seed(11)
    dy = torch.randn(x.shape, generator=gen).to(device=x.device, dtype=x.dtype)
    reference = layer.to_plain(torch.float64)
    y_ref, dx_ref = _run(reference, x.double(), mask, dy.double())
    grads_ref = _plain_grads(reference)
    y_low, dx_low, grads_low = _baseline(layer, x, mask, dy)

    y, dx = _run(layer, x, mask, dy)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert torch.isfinite(y).all() and torch.isfinite(dx).all()
    policy = policy_for(layer.policy.matmul_dtype)
    if layer.policy.matmul_dtype == torch.bfloat16 and interpreting():
        # Triton's CPU interpreter rounds float32 -> bfloat16 by truncation, twice the error of the GPU's
        # round-to-nearest, and the attention kernel's bf16 rounding goes through it: its q/k/v gradients measured
        # 2.1-2.3x PyTorch's bf16 error under the interpreter (1.4x at most with SDPA in the layer instead).
        policy = policy.replace(baseline_factor=3.0)
    if layer.policy.attention_precision == "tf32":
        # PyTorch has no tf32 attention to serve as a baseline: the tf32 policy alone decides.
        policy, y_low, dx_low, grads_low = "tf32", None, None, dict.fromkeys(grads_low)
    assert_close(y, y_ref, policy=policy, baseline=y_low, notes=("output",))
    assert_close(dx, dx_ref, policy=policy, baseline=dx_low, notes=("dx",))
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        low = grads_low[name]
        grad_policy = policy
        if low is None and policy == "tf32":
            # A parameter gradient sums over every token: tf32 rounding error grows with the sum of |terms|, so an
            # element that cancels to near zero carries the error of the large ones. Floor: 1e-3 of the largest
            # element (one tf32 step, 2^-10, of it).
            grad_policy = policy_for("tf32").replace(
                atol=max(policy_for("tf32").atol, 1e-3 * grads_ref[name].abs().max().item()))
        assert_close(p.grad, grads_ref[name], policy=grad_policy, baseline=None if low is None else low.to(p.dtype),
                     notes=(f"grad of {name}",))


@pytest.mark.shape(*CONFIGS, mode=list(MODES))
def test_matches_float64_plain_block(shape):
    torch.manual_seed(0)
    kwargs = MODES[shape.mode]
    plain = PlainTransformerBlock(shape.d_model, shape.n_heads, n_kv_heads=shape.n_kv_heads, causal=shape.causal,
                                  device=DEVICE)
    layer = TransformerLayer.from_plain(plain, attention_backend="triton", **kwargs)
    x = torch.randn(shape.B, shape.S, shape.d_model, device=DEVICE).to(input_dtype(layer.policy))
    _check_layer(layer, x, _padding_mask(shape.B, shape.S, shape.padding))


@pytest.mark.shape(dict(B=2, S=12, d_model=32, n_heads=2), mode=["fp32", "mixed-bf16"])
def test_unfused_path_matches_float64_plain_block(shape):
    # The variant an A/B comparison runs against: PyTorch LayerNorm, separate residual add, F.gelu.
    torch.manual_seed(1)
    plain = PlainTransformerBlock(shape.d_model, shape.n_heads, device=DEVICE)
    layer = TransformerLayer.from_plain(plain, attention_backend="triton", fusions=(), **MODES[shape.mode])
    x = torch.randn(shape.B, shape.S, shape.d_model, device=DEVICE)
    _check_layer(layer, x, _padding_mask(shape.B, shape.S, "right"))


@pytest.mark.parametrize("fusion", sorted(FUSIONS))
def test_each_fusion_alone_matches_the_unfused_layer(fusion):
    torch.manual_seed(2)
    unfused = TransformerLayer(32, 2, precision="fp32", attention_backend="sdpa", fusions=(), device=DEVICE)
    fused = TransformerLayer.from_plain(unfused.to_plain(), precision="fp32", attention_backend="sdpa",
                                        fusions={fusion})
    x = torch.randn(2, 8, 32, device=DEVICE)
    dy = torch.randn_like(x)
    y0, dx0 = _run(unfused, x, None, dy)
    y1, dx1 = _run(fused, x, None, dy)
    torch.testing.assert_close(y1, y0, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx1, dx0, rtol=1e-5, atol=1e-5)
    for (name, p0), p1 in zip(unfused.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p1.grad, p0.grad, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("mode", ["fp32", "mixed-bf16"])
def test_fully_masked_rows_stay_finite_forward_and_backward(mode):
    # Left padding under a causal mask: the first queries of the second sequence see no key. Their attention gives
    # zeros (the kernel's convention, and the plain block's), and no NaN reaches any output or gradient.
    torch.manual_seed(3)
    plain = PlainTransformerBlock(32, 2, causal=True, device=DEVICE)
    layer = TransformerLayer.from_plain(plain, attention_backend="triton", **MODES[mode])
    x = torch.randn(2, 12, 32, device=DEVICE)
    _check_layer(layer, x, _padding_mask(2, 12, "left"))


def test_state_dict_keys_and_shapes_are_the_documented_ones():
    layer = TransformerLayer(64, 4, 96, n_kv_heads=2, device=DEVICE)
    d, h, h_kv, d_ff = 16, 4, 2, 96
    expected = {
        "ln1.weight": (64,), "ln1.bias": (64,),
        "qkv.weight": ((h + 2 * h_kv) * d, 64), "qkv.bias": ((h + 2 * h_kv) * d,),
        "out.weight": (64, h * d), "out.bias": (64,),
        "ln2.weight": (64,), "ln2.bias": (64,),
        "fc1.weight": (d_ff, 64), "fc1.bias": (d_ff,),
        "fc2.weight": (64, d_ff), "fc2.bias": (64,),
    }
    assert {k: tuple(v.shape) for k, v in layer.state_dict().items()} == expected
    assert TransformerLayer(64, 4).d_ff == 256  # default 4 * d_model


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_plain_round_trip_is_exact(precision):
    plain = PlainTransformerBlock(32, 4, n_kv_heads=2, causal=False, device=DEVICE)
    layer = TransformerLayer.from_plain(plain, precision=precision)
    assert (layer.n_heads, layer.n_kv_heads, layer.d_ff, layer.causal) == (4, 2, 128, False)
    back = layer.to_plain(torch.float32)
    dtype = layer.policy.param_dtype
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(back.state_dict()[key], value.to(dtype).float(), rtol=0, atol=0, msg=key)
    # q, k, v rows land where the docstring says: query rows first, then key, then value.
    torch.testing.assert_close(layer.qkv.weight[32:48].float(), plain.k_proj.weight.to(dtype).float(), rtol=0, atol=0)


def test_plain_conversions_carry_the_training_mode():
    torch.manual_seed(7)
    x = torch.randn(2, 8, 32, device=DEVICE)
    # An eval block with dropout: the layer made from it must not drop (it came out in training mode).
    plain = PlainTransformerBlock(32, 2, dropout=0.5, causal=False, device=DEVICE).eval()
    layer = TransformerLayer.from_plain(plain, precision="fp32", attention_backend="sdpa")
    assert not layer.training
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
    back = layer.to_plain()
    assert not back.training
    torch.testing.assert_close(back(x), plain(x), rtol=0, atol=0)
    assert TransformerLayer.from_plain(plain.train(), precision="fp32").training


def test_from_plain_takes_the_eps_the_blocks_norms_use():
    torch.manual_seed(8)
    # The eps the block's forward uses is its LayerNorms': the layer takes that one, not the block's stored eps.
    plain = PlainTransformerBlock(32, 2, causal=False, device=DEVICE).eval()
    with torch.no_grad():
        for norm in (plain.ln1, plain.ln2):
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.5, 0.5)
            norm.eps = 0.3  # large, so that reading 1e-5 instead shows far above the fp32 tolerance
    small = torch.randn(2, 8, 32, device=DEVICE) * 0.5
    layer = TransformerLayer.from_plain(plain, precision="fp32", attention_backend="sdpa")
    assert layer.eps == 0.3
    reference = plain.double()(small.double())
    torch.testing.assert_close(layer(small).double(), reference, rtol=1e-5, atol=1e-5)
    plain.ln2.eps = 0.1
    with pytest.raises(ValueError, match=r"block's norms have different eps \(ln1 0.3, ln2 0.1\)"):
        TransformerLayer.from_plain(plain)
    # The layer's norms have no eps of their own: setting one would change nothing, so it is refused.
    with pytest.raises(AttributeError, match="set TransformerLayer.eps"):
        layer.ln1.eps = 1e-3


def test_to_plain_defaults_to_the_parameters_dtype():
    # After a conversion too: a half layer's plain block was float32.
    assert TransformerLayer(32, 2).half().to_plain().fc1.weight.dtype == torch.float16


def test_load_plain_state_dict_rejects_mismatches():
    layer = TransformerLayer(32, 2)
    state = PlainTransformerBlock(32, 2).state_dict()
    with pytest.raises(KeyError, match="missing.*q_proj.weight"):
        layer.load_plain_state_dict({k: v for k, v in state.items() if k != "q_proj.weight"})
    state["fc1.weight"] = torch.zeros(64, 32)
    with pytest.raises(ValueError, match=r"fc1.weight: plain weights have shape \(64, 32\)"):
        layer.load_plain_state_dict(state)


def test_load_plain_state_dict_checks_each_projection_before_concatenating():
    # q, k and v are concatenated into qkv: each must have its own shape, not only their concatenation (else rows
    # of k would load as rows of q), and a wrong width is named rather than left to torch.cat's message.
    layer = TransformerLayer(32, 2)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    gen = torch.Generator().manual_seed(14)
    state = PlainTransformerBlock(32, 2).state_dict()
    shifted = dict(state, **{"q_proj.weight": torch.randn(24, 32, generator=gen),
                             "k_proj.weight": torch.randn(40, 32, generator=gen)})  # 24 + 40 + 32 = 96 rows
    with pytest.raises(ValueError, match=r"q_proj.weight: plain weights have shape \(24, 32\), the layer expects "
                                         r"\(32, 32\)"):
        layer.load_plain_state_dict(shifted)
    with pytest.raises(ValueError, match=r"v_proj.weight: plain weights have shape \(32, 16\)"):
        layer.load_plain_state_dict(dict(state, **{"v_proj.weight": torch.randn(32, 16, generator=gen)}))
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())  # nothing loaded


def test_inference_follows_optimizer_steps():
    # The "mixed" layer computes with bf16 casts of its fp32 weights; after an optimizer step, an inference forward
    # must use the new weights, exactly as a grad-mode forward does.
    torch.manual_seed(4)
    layer = TransformerLayer(32, 2, attention_backend="sdpa", device=DEVICE)
    x = torch.randn(1, 8, 32, device=DEVICE)
    with torch.no_grad():
        before = layer(x)
    layer(x).sum().backward()
    torch.optim.SGD(layer.parameters(), lr=0.5).step()
    with torch.no_grad():
        after = layer(x)
    expected = layer(x).detach()  # grad mode: casts the current weights afresh
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, expected, rtol=0, atol=0)


def _fresh_like(t: torch.Tensor, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(t.shape, generator=gen)).to(device=t.device, dtype=t.dtype)


# Ways a user (an EMA update, a hand edit, a checkpoint loader) changes a parameter's values after the layer has
# run. Writes through ``.data`` bypass the parameter's version counter (the ``.data`` tensor has its own), and
# ``param.data = t`` swaps the storage: the layer must see all of them.
WEIGHT_UPDATES = {
    "data_zero_": lambda p, new: p.data.zero_(),
    "data_copy_": lambda p, new: p.data.copy_(new),
    "data_mul_": lambda p, new: p.data.mul_(-0.5),
    "no_grad_copy_": lambda p, new: _no_grad(p.copy_, new),
    "data_assign": lambda p, new: setattr(p, "data", new.clone()),
}


def _no_grad(fn, *args):
    with torch.no_grad():
        fn(*args)


def _mixed_layer_reference(layer: TransformerLayer, x: torch.Tensor):
    """A fresh float64 block with the layer's current weights, and PyTorch under bf16 autocast as the baseline."""
    with torch.no_grad():
        reference = layer.to_plain(torch.float64)(x.double())
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            baseline = layer.to_plain(torch.float32)(x)  # the fp32 block autocast expects, whatever the parameters
    return reference, baseline.float()


def _inference(layer: TransformerLayer, x: torch.Tensor, context: str) -> torch.Tensor:
    with torch.inference_mode() if context == "inference_mode" else torch.no_grad():
        return layer(x).clone()


@pytest.mark.parametrize("context", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("update", sorted(WEIGHT_UPDATES))
def test_inference_sees_every_weight_update(update, context):
    # The forward before the update is the one that would have filled a cache of bf16 weight copies.
    torch.manual_seed(8)
    layer = TransformerLayer(32, 2, precision="mixed", attention_backend="sdpa", device=DEVICE)
    x = torch.randn(3, 5, 32, device=DEVICE)
    before = _inference(layer, x, context)
    for i, param in enumerate((layer.fc2.weight, layer.qkv.bias, layer.out.weight)):
        WEIGHT_UPDATES[update](param, _fresh_like(param, seed=30 + i))
    after = _inference(layer, x, context)
    reference, baseline = _mixed_layer_reference(layer, x)
    assert not torch.allclose(before, after)
    assert_close(after, reference, policy=torch.bfloat16, baseline=baseline)
    # And every forward after that, not only the first one.
    torch.testing.assert_close(_inference(layer, x, context), after, rtol=0, atol=0)


def test_inference_sees_load_state_dict():
    torch.manual_seed(9)
    layer = TransformerLayer(32, 2, precision="mixed", attention_backend="sdpa", device=DEVICE)
    x = torch.randn(3, 5, 32, device=DEVICE)
    before = _inference(layer, x, "no_grad")
    state = {k: _fresh_like(v, seed=50 + i) for i, (k, v) in enumerate(layer.state_dict().items())}
    layer.load_state_dict(state)
    after = _inference(layer, x, "no_grad")
    reference, baseline = _mixed_layer_reference(layer, x)
    assert not torch.allclose(before, after)
    assert_close(after, reference, policy=torch.bfloat16, baseline=baseline)


def test_dropout_only_in_training():
    torch.manual_seed(5)
    layer = TransformerLayer(32, 2, dropout=0.5, precision="fp32", attention_backend="sdpa", device=DEVICE)
    plain = layer.to_plain().eval()
    x = torch.randn(2, 8, 32, device=DEVICE)
    layer.eval()
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
    layer.train()
    assert not torch.allclose(layer(x), plain(x), atol=1e-3)


@pytest.mark.parametrize("mode", ["fp32", "mixed-bf16"])
def test_torch_compile_matches_eager(mode):
    torch.manual_seed(6)
    layer = TransformerLayer(32, 2, n_kv_heads=1, attention_backend="triton", device=DEVICE, **MODES[mode])
    x = torch.randn(2, 8, 32, device=DEVICE)
    mask = _padding_mask(2, 8, "right")
    dy = torch.randn_like(x)
    y_eager, dx_eager = _run(layer, x, mask, dy)
    grads_eager = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    y, dx = _run(compiled, x, mask, dy)
    torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_eager, rtol=1e-5, atol=1e-5)
    for p, g in zip(layer.parameters(), grads_eager):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("training", [False, True])
def test_torch_compile_leaves_no_guard_on_the_attention_front_end(training):
    # The compiled layer's attention is validated and decided outside dynamo's trace (decide.traced_call_plan):
    # traced, the validation, the dispatch table and the Gluon rule left about 160 guards, checked before every call
    # (16.7 us a call on the H200's host). The guard tree must name none of their modules, in inference and
    # where the attention's gradient flows. The graph still computes the eager layer's output.
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    torch._dynamo.reset()
    torch.manual_seed(8)
    layer = TransformerLayer(32, 2, n_kv_heads=1, attention_backend="auto", fusions=(), device=DEVICE,
                             **MODES["fp32"]).train(training)
    x = torch.randn(2, 8, 32, device=DEVICE)
    compiled = torch.compile(layer, backend="eager", fullgraph=True, dynamic=False)
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(compiled(x), layer(x), rtol=1e-5, atol=1e-5)
    entries = _debug_get_cache_entry_list(type(layer).forward.__code__)
    guards = "\n".join(str(entry.guard_manager) for entry in entries)
    assert "check_tensor(L['x']" in guards
    for module in ("flashlite_dot_dispatch", "flashlite_dot__attention_dot_validation",
                   "flashlite_dot__attention_dot_launch_gluon", "flashlite_dot__attention_dot_plans"):
        assert module not in guards, module
    torch._dynamo.reset()


def test_torch_compile_with_the_cpp_wrapper_runs_the_attention_op_against_float64(monkeypatch):
    # Inductor's C++ wrapper (options={"cpp_wrapper": True}, timed against the default on a GPU in
    # tests/perf/test_layer_ab.py) calls the layer's attention op from generated C++: one full graph, the op's kernel
    # run once per call, and float64's accuracy. fp16 operands: the interpreter's bf16 dot is not exact. No fusions:
    # what the layer runs under torch.compile on a CUDA device.
    import flashlite.attn.ops as ops_module
    launched = []
    forward = ops_module.launch_forward
    monkeypatch.setattr(ops_module, "launch_forward", lambda *a, **kw: launched.append(1) or forward(*a, **kw))
    torch.manual_seed(7)
    layer = TransformerLayer(32, 2, n_kv_heads=1, attention_backend="triton", fusions=(), device=DEVICE,
                             **MODES["mixed-fp16"]).eval()
    x = torch.randn(2, 8, 32, device=DEVICE)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False, options={"cpp_wrapper": True})
    with torch.no_grad():
        out = compiled(x)
        reference = layer.to_plain(torch.float64)(x.double())
        with torch.autocast(x.device.type, dtype=torch.float16):
            baseline = layer.to_plain()(x).float()
    assert launched, "the compiled graph did not call flashlite's attention op"
    calls = len(launched)
    with torch.no_grad():
        compiled(x)
    assert len(launched) == 2 * calls
    assert_close(out, reference, policy=torch.float16, baseline=baseline)


def test_torch_compile_dynamic_shapes_one_graph_for_two_batch_and_sequence_sizes():
    # torch.compile(dynamic=True) traces the batch and sequence sizes as symbols: a second (B, S) reuses the first
    # graph (no recompile) and both match eager, forward and backward. Sizes of at least 2: dynamo specializes 0
    # and 1. (dynamic=True also traces float attributes such as the layer's eps as symbols; the eps check in
    # flashlite.norm compares instead of calling math.isfinite, which a symbolic float refuses.)
    from torch._dynamo.utils import counters

    torch.manual_seed(8)
    layer = TransformerLayer(32, 2, n_kv_heads=1, attention_backend="triton", device=DEVICE)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    try:
        for batch, seq in ((2, 8), (3, 12)):
            x = torch.randn(batch, seq, 32, device=DEVICE)
            mask = _padding_mask(batch, seq, "right")
            dy = torch.randn_like(x)
            layer.zero_grad()
            y_eager, dx_eager = _run(layer, x, mask, dy)
            grads_eager = [p.grad.clone() for p in layer.parameters()]
            layer.zero_grad()
            y, dx = _run(compiled, x, mask, dy)
            torch.testing.assert_close(y, y_eager, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(dx, dx_eager, rtol=1e-5, atol=1e-5)
            for p, g in zip(layer.parameters(), grads_eager):
                torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-5)
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_torch_compile_dynamic_inference_with_auto_is_one_graph(monkeypatch):
    # The layer's default attention_backend="auto" under torch.compile(dynamic=True), inference: the choice between
    # the kernel and SDPA is made per call (flashlite::attention_auto), so sizes that a (made-up) table sends to
    # different backends share one graph. Each output against the float64 plain block with the same weights.
    from torch._dynamo.utils import counters

    from flashlite.attention import explain_dispatch
    from tests.flashlite.tables import use_table
    use_table(monkeypatch, {"float32/D16/causal/B3/S64": {"backend": "sdpa", "why": "made up"},
                            "float32/D16/causal/B2/S128": {"backend": "sdpa", "why": "made up"}})
    torch.manual_seed(9)
    layer = TransformerLayer(32, 2, device=DEVICE, precision="fp32", attention_precision="ieee").eval()
    reference = layer.to_plain(torch.float64)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, backend="aot_eager", dynamic=True, fullgraph=True)
    backends = set()
    try:
        with torch.no_grad():
            for batch, seq in ((3, 40), (2, 70), (4, 33), (2, 100)):
                x = torch.randn(batch, seq, 32, device=DEVICE)
                y = compiled(x)
                assert_close(y, reference(x.double()), policy="fp32")
                q = torch.empty(batch, 2, seq, 16, device=DEVICE)
                backends.add(explain_dispatch(q, q, q, causal=True, precision="ieee").backend)
        assert backends == {"triton", "sdpa"}
        assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        torch._dynamo.reset()


def test_autocast_bf16():
    torch.manual_seed(7)
    x = torch.randn(2, 8, 32, device=DEVICE)
    # "mixed" already casts its operands to bf16: autocast changes nothing.
    mixed = TransformerLayer(32, 2, attention_backend="triton", device=DEVICE)
    eager = mixed(x)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        under = mixed(x)
    assert under.dtype == torch.float32
    torch.testing.assert_close(under, eager, rtol=1e-5, atol=1e-5)
    # "fp32" projections follow autocast into bf16: within bf16 error of the float64 block, like PyTorch's own.
    fp32 = TransformerLayer.from_plain(mixed.to_plain(), precision="fp32", attention_backend="triton")
    reference = fp32.to_plain(torch.float64)(x.double())
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        under = fp32(x)
        baseline = fp32.to_plain()(x)
    assert under.dtype == torch.float32
    assert_close(under, reference, policy=torch.bfloat16, baseline=baseline)


def test_output_keeps_input_dtype_and_layer_repr_names_the_policy():
    layer = TransformerLayer(32, 2, precision="bf16", attention_backend="sdpa", device=DEVICE)
    assert layer(torch.randn(1, 4, 32, device=DEVICE)).dtype == torch.float32
    assert layer.qkv.weight.dtype == torch.bfloat16
    assert "precision='bf16'" in repr(layer) and "fusions='auto'" in repr(layer)
    assert "fusions=['bias_gelu']" in repr(TransformerLayer(32, 2, fusions={"bias_gelu"}, device=DEVICE))


def test_every_precision_mode_is_in_both_policy_tables_with_its_dtypes():
    # The policy (flashlite.precision.POLICIES) is documented twice, in the module's docstring and in
    # docs/precision.md: each table has one row per mode, and the row's param / residual / matmul columns are
    # the policy's.
    import flashlite.precision as precision
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    lines = precision.__doc__.splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("=====")]  # the table's three rule lines
    doc_rows = {line.split()[0]: line.split()[1:4] for line in lines[rules[1] + 1:rules[2]]}
    md = (Path(__file__).resolve().parents[2] / "docs" / "precision.md").read_text()
    md_rows = {cells[0].removesuffix(" (default)"): cells[1:4] for cells in
               ([c.strip() for c in line.strip("|").split("|")] for line in md.splitlines() if line.startswith("| "))
               if cells[0].removesuffix(" (default)") in precision.POLICIES and len(cells) == 10}
    assert list(doc_rows) == list(precision.MODES) and set(md_rows) == set(precision.MODES)
    for mode, policy in precision.POLICIES.items():
        dtypes = [short[policy.param_dtype], short[policy.residual_dtype], short[policy.matmul_dtype]]
        assert doc_rows[mode] == dtypes, mode
        assert [cell.split()[0] for cell in md_rows[mode]] == dtypes, mode
    layer = TransformerLayer(32, 2, precision="bf16_fp32_residual", attention_backend="sdpa", device=DEVICE)
    assert layer.qkv.weight.dtype == torch.bfloat16 and layer.ln1.weight.dtype == torch.bfloat16
    x = torch.randn(1, 4, 32, device=DEVICE)
    assert layer(x).dtype == torch.float32 and layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA the token rule applies (test_layer_gpu.py)")
def test_auto_fusions_run_every_kernel_under_the_interpreter():
    # The token threshold is about GPU launch cost; under the CPU interpreter all kernels run (and get checked).
    layer = TransformerLayer(32, 2, device=DEVICE)
    x = torch.randn(1, 4, 32, device=DEVICE)
    assert layer._fusions_for(x) == (FUSIONS if kernel_device_ok(x) else frozenset())


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_construction_names_the_problem():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        TransformerLayer(30, 4)
    with pytest.raises(ValueError, match=r"n_heads \(4\) must be divisible by n_kv_heads \(3\)"):
        TransformerLayer(32, 4, n_kv_heads=3)
    with pytest.raises(ValueError, match="unknown precision mode 'fp8'"):
        TransformerLayer(32, 4, precision="fp8")
    with pytest.raises(ValueError, match="compute_dtype applies to precision='mixed' only"):
        TransformerLayer(32, 4, precision="fp32", compute_dtype=torch.float16)
    with pytest.raises(ValueError, match="compute_dtype must be torch.bfloat16 or torch.float16"):
        TransformerLayer(32, 4, compute_dtype=torch.float32)
    with pytest.raises(ValueError, match="attention_precision applies to precision='fp32' only"):
        TransformerLayer(32, 4, attention_precision="tf32")
    with pytest.raises(ValueError, match="dtype=torch.float16 conflicts with precision='mixed'"):
        TransformerLayer(32, 4, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"unknown fusions \['bias_relu'\]"):
        TransformerLayer(32, 4, fusions={"bias_relu"})
    with pytest.raises(TypeError, match="fusions must be a collection of names"):
        TransformerLayer(32, 4, fusions="bias_gelu")
    with pytest.raises(ValueError, match=_DROPOUT_ACCEPTED + " 1.0"):
        TransformerLayer(32, 4, dropout=1.0)
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'"):
        TransformerLayer(32, 4, attention_backend="flash")


# (keyword arguments, error type, message pattern): each wrong value of each constructor argument, for both classes.
_INT_ACCEPTED = r"must be a positive integer \(a Python or NumPy int, not bool\), got"
_DROPOUT_ACCEPTED = r"dropout must be a number in \[0, 1\) \(a Python or NumPy float or int\), got"
BAD_ARGUMENTS = [
    (dict(d_model=True, n_heads=1), TypeError, "d_model " + _INT_ACCEPTED + " bool True"),
    (dict(d_model=32.0, n_heads=2), TypeError, "d_model " + _INT_ACCEPTED + " float 32.0"),
    (dict(d_model="32", n_heads=2), TypeError, "d_model " + _INT_ACCEPTED + " str '32'"),
    (dict(d_model=-32, n_heads=2), ValueError, "d_model " + _INT_ACCEPTED + " -32"),
    (dict(d_model=32, n_heads=np.bool_(True)), TypeError, "n_heads " + _INT_ACCEPTED),
    (dict(d_model=32, n_heads=0), ValueError, "n_heads " + _INT_ACCEPTED + " 0"),
    (dict(d_model=32, n_heads=2, n_kv_heads=False), TypeError, "n_kv_heads " + _INT_ACCEPTED),
    (dict(d_model=32, n_heads=2, d_ff=True), TypeError, "d_ff " + _INT_ACCEPTED),
    (dict(d_model=32, n_heads=2, d_ff=2.5), TypeError, "d_ff " + _INT_ACCEPTED),
    (dict(d_model=32, n_heads=2, causal="no"), TypeError, r"causal must be a bool \(True or False\), got str 'no'"),
    (dict(d_model=32, n_heads=2, causal=1), TypeError, r"causal must be a bool \(True or False\), got int 1"),
    (dict(d_model=32, n_heads=2, dropout="0.1"), TypeError, _DROPOUT_ACCEPTED + " str '0.1'"),
    (dict(d_model=32, n_heads=2, dropout=True), TypeError, _DROPOUT_ACCEPTED + " bool True"),
    (dict(d_model=32, n_heads=2, dropout=float("nan")), ValueError, _DROPOUT_ACCEPTED + " nan"),
    (dict(d_model=32, n_heads=2, eps="1e-5"), TypeError, "eps must be a positive finite number"),
    (dict(d_model=32, n_heads=2, eps=True), TypeError, "eps must be a positive finite number"),
    (dict(d_model=32, n_heads=2, eps=float("nan")), ValueError, "eps must be a positive finite number"),
    (dict(d_model=32, n_heads=2, device="gpu0"), ValueError,
     r"device must be a torch.device, a device string such as 'cpu' or 'cuda:0', or None; got 'gpu0'"),
    (dict(d_model=32, n_heads=2, dtype="float32"), TypeError, r"dtype must be a torch.dtype or None, got str"),
]
# Only TransformerLayer has these.
BAD_LAYER_ARGUMENTS = [
    (dict(precision=["mixed"]), TypeError,
     r"precision must be one of 'mixed', 'mixed_bf16_residual', 'bf16_fp32_residual', 'fp32', 'bf16', 'fp16', got list"),
    (dict(precision=None), TypeError,
     r"precision must be one of 'mixed', 'mixed_bf16_residual', 'bf16_fp32_residual', 'fp32', 'bf16', 'fp16', got NoneType"),
    (dict(compute_dtype="bf16"), TypeError, r"compute_dtype must be torch.bfloat16 or torch.float16, got str 'bf16'"),
    (dict(fusions=3), TypeError, r"fusions must be 'auto' or a collection of fusion names .*, got int 3"),
    (dict(fusions=[["bias_gelu"]]), TypeError, r"fusions must be 'auto' or a collection of fusion names"),
    # A tuple, not a set: test ids must not depend on hash order (pytest-xdist workers collect separately).
    (dict(fusions=(3, "bias_relu")), ValueError, r"unknown fusions \['bias_relu', 3\]"),
    (dict(attention_backend=None), ValueError, r"unknown attention_backend None"),
]


@pytest.mark.parametrize("cls", [TransformerLayer, PlainTransformerBlock])
@pytest.mark.parametrize("kwargs,error,message", BAD_ARGUMENTS, ids=[str(case[0]) for case in BAD_ARGUMENTS])
def test_bad_constructor_arguments_are_named(cls, kwargs, error, message):
    with pytest.raises(error, match=message):
        cls(**kwargs)


@pytest.mark.parametrize("kwargs,error,message", BAD_LAYER_ARGUMENTS, ids=[str(c[0]) for c in BAD_LAYER_ARGUMENTS])
def test_bad_layer_arguments_are_named(kwargs, error, message):
    with pytest.raises(error, match=message):
        TransformerLayer(32, 2, **kwargs)


@pytest.mark.parametrize("cls", [TransformerLayer, PlainTransformerBlock])
def test_numpy_numbers_are_accepted_as_python_numbers(cls):
    module = cls(np.int64(32), np.int32(2), np.int16(48), n_kv_heads=np.int64(1), causal=np.bool_(False),
                 dropout=np.float32(0.0), eps=np.float64(1e-5), device=DEVICE)
    assert (module.d_model, module.n_heads, module.d_ff, module.n_kv_heads, module.causal) == (32, 2, 48, 1, False)
    for value in (module.d_model, module.n_heads, module.d_ff, module.n_kv_heads, module.head_dim):
        assert type(value) is int
    assert type(module.causal) is bool and type(module.dropout) is float and type(module.eps) is float
    x = torch.randn(2, 5, 32, device=DEVICE)
    with torch.no_grad():
        y = module(x)
        reference = PlainTransformerBlock(32, 2, 48, n_kv_heads=1, causal=False, device=DEVICE, dtype=torch.float64)
        reference.load_state_dict(module.state_dict() if cls is PlainTransformerBlock else module.plain_state_dict())
        expected = reference(x.double())
    assert y.shape == x.shape
    tolerance = torch.float32 if cls is PlainTransformerBlock else torch.bfloat16  # the layer's default: "mixed"
    assert_close(y, expected, policy=tolerance)


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
@pytest.mark.parametrize("shape", [(0, 5, 32), (3, 0, 32)], ids=["B0", "S0"])
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_empty_input_gives_an_empty_output_like_the_plain_block(shape, with_mask, precision):
    # As torch modules do: an output of x's shape and dtype, and in training a zero gradient for every parameter.
    torch.manual_seed(10)
    layer = TransformerLayer(32, 2, precision=precision, device=DEVICE)
    plain = layer.to_plain()
    mask = torch.ones(shape[:2], dtype=torch.bool, device=DEVICE) if with_mask else None
    x = torch.randn(shape, device=DEVICE).requires_grad_()
    y = layer(x, mask)
    assert y.shape == x.shape and y.dtype == x.dtype
    y.backward(torch.randn_like(y))
    assert x.grad is not None and x.grad.shape == x.shape
    plain(x.detach().to(layer.policy.param_dtype), mask).sum().backward()
    expected_grads = _plain_grads(plain)
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype, name
        assert torch.equal(p.grad, torch.zeros_like(p)) and torch.equal(expected_grads[name].to(p.dtype), p.grad), name
    with torch.inference_mode():
        assert layer(x.detach(), mask).shape == x.shape


@pytest.mark.parametrize("fusions", ["auto", ()])
@pytest.mark.parametrize("precision", ["mixed", "fp32"])
def test_float64_parameters_are_refused_with_the_way_to_a_float64_reference(precision, fusions):
    # layer.double() does not make a float64 layer: the policy still computes in its own dtypes (bf16 matmuls in
    # "mixed"), and the LayerNorm and GELU kernels take no float64 parameters. Refused, before any branch runs.
    torch.manual_seed(12)
    layer = TransformerLayer(32, 2, precision=precision, fusions=fusions, attention_backend="sdpa", device=DEVICE)
    x = torch.randn(2, 6, 32, device=DEVICE, dtype=torch.float64)
    doubled = TransformerLayer(32, 2, precision=precision, fusions=fusions, attention_backend="sdpa",
                               device=DEVICE).double()
    doubled.load_state_dict(layer.state_dict())
    with pytest.raises(TypeError, match=rf"the layer's parameters are torch.float64, .*precision='{precision}' "
                                        r".*layer.to_plain\(torch.float64\)"):
        doubled(x)
    with pytest.raises(TypeError, match="the layer's parameters are torch.float64"):
        doubled(x[:, :0])
    # The way the message names: the same weights in a float64 plain block.
    reference = layer.to_plain(torch.float64)(x)
    assert_close(layer(x), reference, policy=torch.bfloat16 if precision == "mixed" else torch.float32,
                 baseline=None if precision == "fp32" else _mixed_layer_reference(layer, x.float())[1].double())


def test_bf16_parameters_of_a_mixed_layer_still_run():
    # What FSDP's mixed precision does to the parameters (bf16 views of the fp32 master weights) stays allowed.
    torch.manual_seed(13)
    layer = TransformerLayer(32, 2, precision="mixed", fusions=(), attention_backend="sdpa", device=DEVICE)
    layer.to(torch.bfloat16)
    x = torch.randn(2, 6, 32, device=DEVICE)
    reference, baseline = _mixed_layer_reference(layer, x)
    assert_close(layer(x), reference, policy=torch.bfloat16, baseline=baseline)


def test_bad_forward_inputs_name_the_problem():
    layer = TransformerLayer(32, 2, attention_backend="sdpa", device=DEVICE)
    x = torch.randn(2, 8, 32, device=DEVICE)
    with pytest.raises(ValueError, match="x's last dimension is 16 but the layer's d_model is 32"):
        layer(torch.randn(2, 8, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"x must have shape \[batch, seq, d_model\]"):
        layer(torch.randn(8, 32, device=DEVICE))
    with pytest.raises(ValueError, match=r"key_padding_mask must have shape \[batch, seq\] = \(2, 8\), got \(2, 7\)"):
        layer(x, torch.ones(2, 7, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="key_padding_mask must be a bool tensor"):
        layer(x, torch.ones(2, 8, device=DEVICE))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(2, 8, 32, dtype=torch.int64, device=DEVICE))


def test_cuda_graph_runner_refuses_modules_that_are_not_the_layer():
    with pytest.raises(TypeError, match="layer must be a TransformerLayer or one under torch.compile, got"):
        CudaGraphRunner(PlainTransformerBlock(32, 2))
    with pytest.raises(TypeError, match="got OptimizedModule"):
        CudaGraphRunner(torch.compile(PlainTransformerBlock(32, 2)))


@pytest.mark.parametrize("kwargs, error, message", [
    # No warm-up: the first forward (Triton's compiling and autotuning, torch.compile's tracing) would run inside
    # the capture.
    (dict(warmup_calls=0), ValueError, r"warmup_calls must be a positive integer .*, got 0"),
    (dict(warmup_calls=-2), ValueError, r"warmup_calls must be a positive integer .*, got -2"),
    (dict(warmup_calls=2.5), TypeError, r"warmup_calls must be a positive integer .*, got float 2.5"),
    (dict(warmup_calls=True), TypeError, r"warmup_calls must be a positive integer .*, got bool True"),
    # None or a string would silently choose the static output, overwritten by the next call.
    (dict(clone_output=None), TypeError, r"clone_output must be a bool \(True or False\), got NoneType None"),
    (dict(clone_output="no"), TypeError, r"clone_output must be a bool \(True or False\), got str 'no'"),
])
def test_cuda_graph_runner_names_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        CudaGraphRunner(TransformerLayer(32, 2, device=DEVICE).eval(), **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal; the GPU path is in test_layer_gpu.py")
def test_cuda_graph_runner_refuses_cpu_layers():
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        CudaGraphRunner(TransformerLayer(32, 2))


# ----------------------------------------------------------------------------------------------------------------
# CudaGraphRunner's replay check (the runner itself needs CUDA: test_layer_gpu.py)
# ----------------------------------------------------------------------------------------------------------------

# Changes after which a captured graph would read the wrong memory or run baked-in settings that no longer hold.
LAYOUT_CHANGES = {
    "data_assign": lambda layer: setattr(layer.fc2.weight, "data", layer.fc2.weight.detach().clone()),
    "data_assign_transposed_view": lambda layer: setattr(layer.out.weight, "data", layer.out.weight.data.t()),
    "data_assign_reshaped_view": lambda layer: setattr(layer.qkv.bias, "data", layer.qkv.bias.data.view(-1, 4)),
    "new_parameter": lambda layer: setattr(layer.ln1, "weight", torch.nn.Parameter(layer.ln1.weight.detach() * 2)),
    "new_submodule": lambda layer: setattr(layer, "fc1", torch.nn.Linear(layer.d_model, layer.d_ff)),
    "to_float64": lambda layer: layer.to(torch.float64),
    "causal": lambda layer: setattr(layer, "causal", False),
    "train": lambda layer: layer.train(),
    "attention_backend": lambda layer: setattr(layer, "attention_backend", "sdpa"),
    "fusions": lambda layer: setattr(layer, "fusions", frozenset()),
}
# Changes a replay sees by itself: the graph re-reads the parameters' memory every time.
LAYOUT_KEEPING_CHANGES = {
    "in_place_mul_": lambda layer: _no_grad(layer.fc2.weight.mul_, 0.5),
    "data_copy_": lambda layer: layer.qkv.weight.data.copy_(torch.randn_like(layer.qkv.weight)),
    "load_state_dict": lambda layer: layer.load_state_dict({k: v * 2 for k, v in layer.state_dict().items()}),
    "eval_again": lambda layer: layer.eval(),
}


@pytest.mark.parametrize("change", sorted(LAYOUT_CHANGES))
def test_replay_layout_notices_what_a_graph_cannot_see(change):
    from flashlite.cuda_graph import _ReplayLayout

    layer = TransformerLayer(32, 2, precision="mixed").eval()
    layout = _ReplayLayout.of(layer)
    assert layout.holds_for(layer)
    LAYOUT_CHANGES[change](layer)
    assert not layout.holds_for(layer)
    assert _ReplayLayout.of(layer).holds_for(layer)


@pytest.mark.parametrize("change", sorted(LAYOUT_KEEPING_CHANGES))
def test_replay_layout_holds_through_in_place_updates(change):
    from flashlite.cuda_graph import _ReplayLayout

    layer = TransformerLayer(32, 2, precision="mixed").eval()
    layout = _ReplayLayout.of(layer)
    LAYOUT_KEEPING_CHANGES[change](layer)
    assert layout.holds_for(layer)


@pytest.mark.parametrize("context", ["no_grad", "grad"])
def test_mixed_layer_with_strided_projection_parameters(context):
    # Projection weights and biases that are views (a transposed storage, a step, a storage offset) go through the
    # grouped cast of an inference forward, and through autograd's casts with grad on; both as float64 says.
    torch.manual_seed(11)
    layer = TransformerLayer(32, 2, 48, precision="mixed", attention_backend="sdpa", device=DEVICE)
    with torch.no_grad():
        for module in (layer.qkv, layer.fc2):
            module.weight.data = module.weight.detach().t().contiguous().t()  # same values, transposed storage
        wide = torch.zeros(2 * layer.fc1.bias.numel() + 1, device=DEVICE)
        wide[1::2] = layer.fc1.bias.detach()
        layer.fc1.bias.data = wide[1::2]  # a step of 2 and an offset
    assert not layer.qkv.weight.is_contiguous() and layer.fc1.bias.stride() == (2,)
    x = torch.randn(3, 7, 32, device=DEVICE)
    with torch.no_grad() if context == "no_grad" else torch.enable_grad():
        got = layer(x).detach()
    reference, baseline = _mixed_layer_reference(layer, x)
    assert_close(got, reference, policy=torch.bfloat16, baseline=baseline)
