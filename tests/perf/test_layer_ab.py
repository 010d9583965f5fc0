"""A/B of flashlite.TransformerLayer against the plain PyTorch block, same weights, per case (GPU only).

The baseline is what a user already has: ``PlainTransformerBlock`` in bf16 (nn.LayerNorm, nn.Linear, SDPA, exact
GELU) under ``torch.compile`` (default mode), and the same block eager. The candidate is the layer in "mixed"
precision (fp32 residual stream and statistics, bf16 matmul operands), inference, bf16 input; eager, through CUDA
graphs, and itself under torch.compile, where "mixed_bf16_residual" (the stream in bf16) runs beside it so that the
fp32 stream's cost shows.

Both sides are rated by one count of the block's work (:func:`_layer_work`): FLOPs of its six matmuls and of causal
attention (LayerNorm, GELU and residual adds, a few FLOPs per element, are not counted); bytes of its bf16 weights
read once plus the bf16 input read and output written, which is what a block fused end to end must move (the
intermediate activations that unfused kernels write and read back are not counted).
"""
from __future__ import annotations

import copy

import pytest
import torch

from flashlite.cases import CASES, attention_flops
from flashlite.layer import FUSIONS, CudaGraphRunner, PlainTransformerBlock, TransformerLayer
from pytest_kernelcheck import assert_close

from .conftest import needs_cuda

pytestmark = needs_cuda

D_MODEL, N_HEADS, D_FF = 1024, 16, 4096
LAYER_SHAPES = [dict(case=c.number, B=c.B, S=c.S) for c in CASES if c.number <= 13]


def _layer_work(shape) -> dict:
    """``flops``, ``bytes`` and ``dtype`` of one forward of the block on [B, S, D_MODEL] (see the module docstring)."""
    tokens = shape.B * shape.S
    weights = 4 * D_MODEL * D_MODEL + 2 * D_MODEL * D_FF  # q, k, v, out projections; fc1, fc2
    flops = 2.0 * tokens * weights + attention_flops(shape.B, N_HEADS, shape.S, shape.S, D_MODEL // N_HEADS,
                                                     causal=True)
    return {"flops": flops, "bytes": 2 * (weights + 2 * tokens * D_MODEL), "dtype": torch.bfloat16}


def _activation_bytes(shape) -> int:
    # bf16 input/output, fp32 residual copies and the d_ff-wide hidden activation, with room for both sides.
    return int(shape.B * shape.S * (D_MODEL * 24 + D_FF * 8) * 1.5)


@pytest.fixture(scope="module")
def blocks():
    torch.manual_seed(0)
    plain = PlainTransformerBlock(D_MODEL, N_HEADS, D_FF, device="cuda", dtype=torch.bfloat16).eval()
    layer = TransformerLayer.from_plain(plain, precision="mixed").eval()
    # One compiled module for every shape: after the second shape, dynamic shapes avoid a compile per case.
    compiled = torch.compile(plain)
    plain_fp32 = copy.deepcopy(plain).float()
    return plain, compiled, layer, plain_fp32


def _inputs(shape):
    return torch.randn(shape.B, shape.S, D_MODEL, device="cuda", dtype=torch.bfloat16)


@pytest.mark.shape(*LAYER_SHAPES)
@pytest.mark.memory(lambda shape: _activation_bytes(shape))
@torch.no_grad()
def test_layer_vs_compiled_plain_block(shape, kernel_ab, blocks):
    plain, compiled, layer, plain_fp32 = blocks
    x = _inputs(shape)
    if shape.B * shape.S <= 8192:  # the layer agrees with the same weights in fp32 before it is timed
        assert_close(layer(x).float(), plain_fp32(x.float()).double(), policy="bf16", baseline=compiled(x).float())
    kernel_ab.compare(lambda: layer(x), lambda: compiled(x), name="layer mixed vs compiled plain bf16",
                      **_layer_work(shape))


@pytest.fixture(scope="module")
def compiled_layers(blocks):
    """The layer under torch.compile in each precision whose cost the A/B shows: "mixed" (fp32 residual stream)
    and "mixed_bf16_residual" (the stream in bf16), same weights as the plain block."""
    plain = blocks[0]
    return {mode: torch.compile(TransformerLayer.from_plain(plain, precision=mode).eval())
            for mode in ("mixed", "mixed_bf16_residual")}


@pytest.mark.shape(*LAYER_SHAPES, precision=["mixed", "mixed_bf16_residual"])
@pytest.mark.memory(lambda shape: _activation_bytes(shape))
@torch.no_grad()
def test_compiled_layer_vs_compiled_plain_block(shape, kernel_ab, blocks, compiled_layers):
    _, compiled, _, plain_fp32 = blocks
    layer = compiled_layers[shape.precision]
    x = _inputs(shape)
    if shape.B * shape.S <= 8192:  # the compiled layer agrees with the same weights in fp32 before it is timed
        assert_close(layer(x).float(), plain_fp32(x.float()).double(), policy="bf16", baseline=compiled(x).float())
    kernel_ab.compare(lambda: layer(x), lambda: compiled(x),
                      name=f"compiled layer {shape.precision} vs compiled plain bf16", **_layer_work(shape))


@pytest.mark.shape(*LAYER_SHAPES)
@pytest.mark.memory(lambda shape: _activation_bytes(shape))
@torch.no_grad()
def test_layer_vs_eager_plain_block(shape, kernel_ab, blocks):
    plain, _, layer, _ = blocks
    x = _inputs(shape)
    kernel_ab.compare(lambda: layer(x), lambda: plain(x), name="layer mixed vs eager plain bf16",
                      **_layer_work(shape))


@pytest.mark.shape(dict(case=1, B=1, S=128), dict(case=2, B=1, S=1024), dict(case=10, B=128, S=128))
@torch.no_grad()
def test_cuda_graph_layer_vs_compiled_plain_block(shape, kernel_ab, blocks):
    _, compiled, layer, _ = blocks
    x = _inputs(shape)
    runner = CudaGraphRunner(layer)
    assert_close(runner(x).float(), layer(x).double(), policy="bf16")
    kernel_ab.compare(lambda: runner(x), lambda: compiled(x), name="layer cuda-graph vs compiled plain bf16",
                      **_layer_work(shape))


# Token counts 128 to 16,384, so that the crossover behind flashlite.layer.FUSED_MIN_TOKENS is measured.
@pytest.mark.shape(dict(case=1, B=1, S=128), dict(case=2, B=1, S=1024), dict(B=2, S=1024), dict(B=1, S=4096),
                   dict(case=5, B=4, S=2048), dict(case=8, B=32, S=512))
@torch.no_grad()
def test_fusion_tournament(shape, kernel_ab, blocks):
    plain, _, _, _ = blocks
    x = _inputs(shape)
    variants = {
        "all fusions": TransformerLayer.from_plain(plain, precision="mixed", fusions=FUSIONS).eval(),
        "no fusions": TransformerLayer.from_plain(plain, precision="mixed", fusions=()).eval(),
        "layer_norm only": TransformerLayer.from_plain(plain, precision="mixed",
                                                       fusions={"triton_layer_norm"}).eval(),
        "norms, no bias_gelu": TransformerLayer.from_plain(plain, precision="mixed",
                                                           fusions={"triton_layer_norm", "add_layer_norm"}).eval(),
    }
    result = kernel_ab.tournament({name: (lambda m=m: m(x)) for name, m in variants.items()},
                                  name="layer fusion variants", **_layer_work(shape))
    assert result.best in variants


def _peak_extra_bytes(fn) -> int:
    fn()  # compile, tune and capture outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


@pytest.mark.shape(dict(case=5, B=4, S=2048), dict(case=8, B=32, S=512))
@torch.no_grad()
def test_layer_peak_memory_not_above_plain_block(shape, blocks):
    # Target: the layer's inference peak is no more than the eager plain block's, same weights and input.
    plain, _, layer, _ = blocks
    x = _inputs(shape)
    layer_peak, plain_peak = _peak_extra_bytes(lambda: layer(x)), _peak_extra_bytes(lambda: plain(x))
    assert layer_peak <= plain_peak, f"layer peak {layer_peak} bytes above its input, plain block {plain_peak}"
