"""TransformerLayer, its CUDA-graph runner and layer_norm at real sizes on a CUDA GPU.

The same checks as test_layer.py / test_layer_norm.py (float64 plain-PyTorch reference with the same weights,
PyTorch in the layer's precision as the baseline), at d_model 1024, 16 heads, d_ff 4096; and the norm kernels on
views of every layout (strided, offset, expanded) at real row lengths, compiled rather than interpreted.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flashlite.layer import FUSED_MIN_TOKENS, FUSIONS, CudaGraphRunner, PlainTransformerBlock, TransformerLayer
from flashlite.norm import add_layer_norm, bias_gelu, layer_norm
from pytest_kernelcheck import assert_close, policy_for

from .test_layer import WEIGHT_UPDATES, _fresh_like, _mixed_layer_reference, _plain_grads, _run, input_dtype
from .test_layer_norm import (
    PARAM_LAYOUTS,
    ROW_LAYOUTS,
    _check_layouts,
    _param_layout,
    _row_layout,
    _torch_add_layer_norm,
    _torch_layer_norm,
)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU; test_layer.py and test_layer_norm.py run the same checks at tiny sizes on the CPU",
)

D_MODEL, HEADS, D_FF = 1024, 16, 4096
REAL_SHAPES = (dict(B=1, S=128), dict(B=4, S=2048), dict(B=32, S=512))


def _right_padding(batch: int, seq: int) -> torch.Tensor:
    mask = torch.ones(batch, seq, dtype=torch.bool, device="cuda")
    mask[-1, seq - seq // 4:] = False
    return mask


@pytest.mark.shape(*REAL_SHAPES, precision=["mixed", "bf16", "bf16_fp32_residual"], padding=[False, True])
def test_layer_matches_float64_block_at_real_sizes(shape):
    torch.manual_seed(0)
    plain = PlainTransformerBlock(D_MODEL, HEADS, D_FF, causal=True, device="cuda")
    layer = TransformerLayer.from_plain(plain, precision=shape.precision)
    x = torch.randn(shape.B, shape.S, D_MODEL, device="cuda").to(input_dtype(layer.policy))
    dy = torch.randn_like(x)
    mask = _right_padding(shape.B, shape.S) if shape.padding else None

    reference = layer.to_plain(torch.float64)
    y_ref, dx_ref = _run(reference, x.double(), mask, dy.double())
    grads_ref = _plain_grads(reference)
    del reference
    baseline = layer.to_plain()
    if shape.precision in ("mixed", "bf16_fp32_residual"):
        baseline = layer.to_plain(torch.float32)  # the layer's weights exactly, under autocast as in "mixed"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y_low, dx_low = _run(baseline, x, mask, dy)
    else:
        y_low, dx_low = _run(baseline, x, mask, dy)
    grads_low = _plain_grads(baseline)

    y, dx = _run(layer, x, mask, dy)
    policy = policy_for(torch.bfloat16)
    assert_close(y, y_ref, policy=policy, baseline=y_low, notes=("output",))
    assert_close(dx, dx_ref, policy=policy, baseline=dx_low, notes=("dx",))
    for name, p in layer.named_parameters():
        assert_close(p.grad, grads_ref[name], policy=policy, baseline=grads_low[name].to(p.dtype),
                     notes=(f"grad of {name}",))


@pytest.mark.parametrize("fusion", sorted(FUSIONS))
def test_each_fusion_matches_the_unfused_layer(fusion):
    torch.manual_seed(1)
    unfused = TransformerLayer(D_MODEL, HEADS, D_FF, fusions=(), device="cuda")
    fused = TransformerLayer.from_plain(unfused.to_plain(), fusions={fusion})
    x = torch.randn(4, 256, D_MODEL, device="cuda")
    with torch.no_grad():
        reference = unfused.to_plain(torch.float64)(x.double())
        # Both variants are bf16-operand computations; they may round differently but equally well.
        assert_close(fused(x), reference, policy=torch.bfloat16, baseline=unfused(x))


def test_auto_fusions_follow_token_count_and_graph_capture():
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda").eval()
    small = torch.randn(1, 128, D_MODEL, device="cuda")
    large = torch.randn(2, FUSED_MIN_TOKENS // 2, D_MODEL, device="cuda")
    assert layer._fusions_for(small) == frozenset() and layer._fusions_for(large) == FUSIONS
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer._fusions_for(small)
        small.mul(2)  # something to capture
    assert captured == FUSIONS
    assert TransformerLayer(D_MODEL, HEADS, D_FF, fusions={"bias_gelu"}, device="cuda")._fusions_for(large) == \
        frozenset({"bias_gelu"})


def test_auto_fusions_under_torch_compile_are_none_at_every_token_count(monkeypatch):
    # The compiled tournament ranked "no fusions" first from 128 to 16,384 tokens; explicit fusions still apply.
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda").eval()
    large = torch.randn(2, FUSED_MIN_TOKENS, D_MODEL, device="cuda")
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert layer._fusions_for(large) == frozenset()
    assert TransformerLayer(D_MODEL, HEADS, D_FF, fusions=FUSIONS, device="cuda")._fusions_for(large) == FUSIONS
    monkeypatch.undo()
    assert layer._fusions_for(large) == FUSIONS
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        reference = layer.to_plain(torch.float64)(large.double())
        assert_close(compiled(large), reference, policy=torch.bfloat16, baseline=layer(large))


@pytest.mark.parametrize("shape", [(1, 128), (4, 256)], ids=lambda s: f"B{s[0]}-S{s[1]}")
@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_cuda_graph_runner_equals_eager(shape, with_mask):
    torch.manual_seed(2)
    # Fixed fusions: with "auto", capture runs the fused kernels where eager at these sizes runs none, and a replay
    # is checked here against the very same computation.
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, fusions=FUSIONS, device="cuda").eval()
    runner = CudaGraphRunner(layer)
    batch, seq = shape
    for call in range(3):  # capture on the first call, replay with new inputs afterwards
        x = torch.randn(batch, seq, D_MODEL, device="cuda")
        mask = _right_padding(batch, seq) if with_mask else None
        with torch.no_grad():
            eager = layer(x, mask)
        replayed = runner(x, mask)
        torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {call}: {m}")
    assert len(runner._captured) == 1


@pytest.mark.parametrize("with_mask", [False, True], ids=["nomask", "mask"])
def test_cuda_graph_runner_over_the_compiled_layer(with_mask):
    # The runner captures Inductor's kernels: replays agree with the compiled layer called directly, with float64,
    # and keep agreeing after in-place and .data updates of the weights.
    torch.manual_seed(9)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda").eval()
    compiled = torch.compile(layer, fullgraph=True)
    runner = CudaGraphRunner(compiled)
    batch, seq = 2, 256
    mask = _right_padding(batch, seq) if with_mask else None
    for call, update in enumerate((None, "data_mul_", "data_assign")):
        if update is not None:
            WEIGHT_UPDATES[update](layer.fc1.weight, _fresh_like(layer.fc1.weight, seed=60 + call))
        x = torch.randn(batch, seq, D_MODEL, device="cuda")
        replayed = runner(x, mask)
        with torch.no_grad():
            direct = compiled(x, mask)
            reference = layer.to_plain(torch.float64)(x.double(), mask)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                baseline = layer.to_plain()(x, mask).float()
        torch.testing.assert_close(replayed, direct, rtol=1e-5, atol=1e-5, msg=lambda m: f"call {call}: {m}")
        assert_close(replayed, reference, policy=torch.bfloat16, baseline=baseline, notes=(f"call {call}",))
    # "data_assign" moved fc1.weight's storage, and the last call still matched the direct call above: the runner
    # captured again, and the new graph replaced the stale one instead of sitting beside it.
    assert len(runner._captured) == 1


def test_cuda_graph_runner_sees_in_place_parameter_updates():
    torch.manual_seed(3)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, fusions=FUSIONS, device="cuda").eval()
    runner = CudaGraphRunner(layer)
    x = torch.randn(1, 128, D_MODEL, device="cuda")
    before = runner(x)
    with torch.no_grad():
        layer.fc2.weight.mul_(0.5)
        eager = layer(x)
    after = runner(x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, eager, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("update", sorted(WEIGHT_UPDATES))
def test_cuda_graph_runner_sees_every_weight_update(update):
    # Writes through .data move no version counter and `param.data = t` moves the storage: a replay must still
    # compute with the current weights (LayerNorm parameters included), as the eager layer does.
    torch.manual_seed(6)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, fusions=FUSIONS, device="cuda").eval()
    runner = CudaGraphRunner(layer)
    x = torch.randn(1, 128, D_MODEL, device="cuda")
    before = runner(x)
    for i, param in enumerate((layer.fc2.weight, layer.qkv.bias, layer.ln2.weight)):
        WEIGHT_UPDATES[update](param, _fresh_like(param, seed=30 + i))
    after = runner(x)
    with torch.no_grad():
        eager = layer(x)
    reference, baseline = _mixed_layer_reference(layer, x)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, eager, rtol=1e-5, atol=1e-5)
    assert_close(after, reference, policy=torch.bfloat16, baseline=baseline)
    assert len(runner._captured) == 1


def test_cuda_graph_runner_sees_load_state_dict_and_setting_changes():
    torch.manual_seed(7)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, fusions=FUSIONS, device="cuda").eval()
    runner = CudaGraphRunner(layer)
    x = torch.randn(1, 128, D_MODEL, device="cuda")
    before = runner(x)
    layer.load_state_dict({k: _fresh_like(v, seed=50 + i) for i, (k, v) in enumerate(layer.state_dict().items())})
    loaded = runner(x)
    reference, baseline = _mixed_layer_reference(layer, x)
    assert not torch.allclose(before, loaded)
    assert_close(loaded, reference, policy=torch.bfloat16, baseline=baseline)
    layer.causal = False  # baked into the captured kernels: the runner must capture again
    uncausal = runner(x)
    reference, baseline = _mixed_layer_reference(layer, x)
    assert not torch.allclose(loaded, uncausal)
    assert_close(uncausal, reference, policy=torch.bfloat16, baseline=baseline)


def test_cuda_graph_runner_is_inference_only():
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda")
    runner = CudaGraphRunner(layer)
    with pytest.raises(ValueError, match="inference"):
        runner(torch.randn(1, 16, D_MODEL, device="cuda", requires_grad=True))


def test_torch_compile_inductor_matches_eager():
    torch.manual_seed(4)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda")
    x = torch.randn(2, 256, D_MODEL, device="cuda")
    compiled = torch.compile(layer)
    with torch.no_grad():
        reference = layer.to_plain(torch.float64)(x.double())
        assert_close(compiled(x), reference, policy=torch.bfloat16, baseline=layer(x))


def test_torch_compile_inductor_training_gradients_match_float64():
    # Inductor's code for the backward (GPU kernels, not the CPU's): every parameter's and the input's gradient of
    # the compiled "mixed" layer against float64, within the bf16 policy and the eager layer's own error. A grouped
    # weight cast whose compiled backward gave zero weight gradients on the H200 is the reason this exists.
    torch.manual_seed(5)
    layer = TransformerLayer(D_MODEL, HEADS, D_FF, device="cuda")
    x = torch.randn(2, 256, D_MODEL, device="cuda")
    dy = torch.randn(2, 256, D_MODEL, device="cuda")
    block = layer.to_plain(torch.float64)
    _, dx_ref = _run(block, x.double(), None, dy.double())
    reference = {**_plain_grads(block), "input": dx_ref}
    grads = {}
    for name, module in (("eager", layer), ("compiled", torch.compile(layer, fullgraph=True))):
        layer.zero_grad(set_to_none=True)
        _, dx = _run(module, x, None, dy)
        grads[name] = {**{n: p.grad.clone() for n, p in layer.named_parameters()}, "input": dx}
    for name, want in reference.items():
        assert_close(grads["compiled"][name], want, policy=torch.bfloat16, baseline=grads["eager"][name],
                     notes=(f"gradient of {name}",))


@pytest.mark.parametrize("n", [4096, 8192, 16384, 32768])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_large_rows(n, dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    x = (3.0 + torch.randn(64, n, device="cuda", generator=gen)).to(dtype).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=gen)).to(dtype).requires_grad_()
    b = torch.randn(n, device="cuda", generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(64, n, device="cuda", generator=gen).to(dtype)
    y = layer_norm(x, w, b)
    y.backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, w, b)]
    ref = F.layer_norm(leaves[0], (n,), leaves[1], leaves[2])
    ref.backward(dy.double())
    base_leaves = [t.detach().clone().requires_grad_() for t in (x, w, b)]
    base = F.layer_norm(base_leaves[0], (n,), base_leaves[1], base_leaves[2])
    base.backward(dy)
    assert_close(y, ref, baseline=base.detach())
    for got, expected, low, name in zip((x.grad, w.grad, b.grad), (l.grad for l in leaves),
                                        (l.grad for l in base_leaves), ("dx", "dweight", "dbias")):
        assert_close(got, expected, baseline=low, notes=(name,))


# Odd on purpose: 4097 columns fill a 8192-wide block to just over half, 129 rows leave a partial row tile.
GPU_LAYOUT_SHAPE = (3, 129, 4097)


@pytest.mark.parametrize("param_layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("x_layout", ROW_LAYOUTS)
def test_layer_norm_any_layout_at_real_sizes(x_layout, param_layout):
    # The compiled kernels specialize a unit stride; strided, stride-0 and offset parameters take the other path.
    n = GPU_LAYOUT_SHAPE[-1]
    layouts = [_row_layout(x_layout, GPU_LAYOUT_SHAPE), _param_layout(param_layout, n), _param_layout(param_layout, n)]
    _check_layouts(layer_norm, _torch_layer_norm, layouts, [_row_layout(x_layout, GPU_LAYOUT_SHAPE)],
                   (f"x and dy {x_layout}, weight and bias {param_layout}",))


@pytest.mark.parametrize("param_layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("x_layout", ROW_LAYOUTS)
def test_add_layer_norm_any_layout_at_real_sizes(x_layout, param_layout):
    n = GPU_LAYOUT_SHAPE[-1]
    # The residual takes the layout next in the list, so that x and residual differ.
    residual_layout = ROW_LAYOUTS[(ROW_LAYOUTS.index(x_layout) + 1) % len(ROW_LAYOUTS)]
    layouts = [_row_layout(x_layout, GPU_LAYOUT_SHAPE), _row_layout(residual_layout, GPU_LAYOUT_SHAPE),
               _param_layout(param_layout, n), _param_layout(param_layout, n)]
    grads = [_row_layout(x_layout, GPU_LAYOUT_SHAPE), _row_layout(residual_layout, GPU_LAYOUT_SHAPE)]
    _check_layouts(add_layer_norm, _torch_add_layer_norm, layouts, grads,
                   (f"x {x_layout}, residual {residual_layout}, weight and bias {param_layout}",))


@pytest.mark.parametrize("bias_layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("x_layout", ROW_LAYOUTS)
def test_bias_gelu_any_layout_at_real_sizes(x_layout, bias_layout):
    n = GPU_LAYOUT_SHAPE[-1]
    layouts = [_row_layout(x_layout, GPU_LAYOUT_SHAPE), _param_layout(bias_layout, n)]
    _check_layouts(bias_gelu, lambda x, b: F.gelu(x + b), layouts, [_row_layout(x_layout, GPU_LAYOUT_SHAPE)],
                   (f"x and dy {x_layout}, bias {bias_layout}",))
