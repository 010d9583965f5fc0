"""Measure what each TransformerLayer precision mode costs in accuracy, against a float64 plain PyTorch block.

For each mode: the relative Frobenius error ||got - ref|| / ||ref|| of the layer's output, of the input gradient,
and of the parameter gradients (all parameters together, and the worst single one), next to the same figures for
PyTorch's own block run in that precision (autocast for "mixed", the block cast to the dtype for "bf16"/"fp16").
Fixed seed, small size, CPU; attention forced onto flashlite's Triton kernel (through the interpreter on a CPU).

Usage:
    python tools/measure_precision.py > docs/precision_measurements.txt
"""
from __future__ import annotations

import datetime
import platform

import torch

# flashlite first: it selects the Triton interpreter on a CPU-only machine, which must happen before triton loads.
from flashlite._runtime import interpreting
from flashlite.layer import PlainTransformerBlock, TransformerLayer, plain_to_layer_names

import triton  # noqa: E402  (after flashlite, see above)

SIZE = dict(batch=2, seq=32, d_model=64, n_heads=4, d_ff=256)
SEED = 0
# (label, TransformerLayer keywords, how PyTorch runs the same precision: autocast dtype or block dtype)
MODES = [
    ("fp32 (attention ieee)", dict(precision="fp32"), ("block", torch.float32)),
    ("fp32 (attention tf32)", dict(precision="fp32", attention_precision="tf32"), ("block", torch.float32)),
    ("fp32 (attention bf16)", dict(precision="fp32", attention_precision="bf16"), ("block", torch.float32)),
    ("mixed (bf16 operands)", dict(precision="mixed"), ("autocast", torch.bfloat16)),
    ("mixed (fp16 operands)", dict(precision="mixed", compute_dtype=torch.float16), ("autocast", torch.float16)),
    ("mixed (bf16 residual)", dict(precision="mixed_bf16_residual"), ("block", torch.bfloat16)),
    ("bf16, fp32 residual", dict(precision="bf16_fp32_residual"), ("autocast", torch.bfloat16)),
    ("bf16", dict(precision="bf16"), ("block", torch.bfloat16)),
    ("fp16", dict(precision="fp16"), ("block", torch.float16)),
]


def _qkv_grads(block: PlainTransformerBlock) -> dict[str, torch.Tensor]:
    """Parameter gradients of the plain block under TransformerLayer's names."""
    return plain_to_layer_names({name: p.grad for name, p in block.named_parameters()})


def _forward_backward(module, x, dy, autocast_dtype=None):
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        y = module(x)
    y.backward(dy.to(y.dtype))
    grads = _qkv_grads(module) if isinstance(module, PlainTransformerBlock) else {
        name: p.grad for name, p in module.named_parameters()}
    return y.detach(), x.grad, grads


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def _errors(result, reference) -> tuple[float, float, float, str]:
    y, dx, grads = result
    y_ref, dx_ref, grads_ref = reference
    names = sorted(grads_ref)
    joined = _rel(torch.cat([grads[n].double().flatten() for n in names]),
                  torch.cat([grads_ref[n].flatten() for n in names]))
    worst = max(names, key=lambda n: _rel(grads[n], grads_ref[n]))
    return _rel(y, y_ref), _rel(dx, dx_ref), joined, f"{_rel(grads[worst], grads_ref[worst]):.1e} ({worst})"


def main() -> None:
    torch.manual_seed(SEED)
    plain = PlainTransformerBlock(SIZE["d_model"], SIZE["n_heads"], SIZE["d_ff"], causal=True)
    x = torch.randn(SIZE["batch"], SIZE["seq"], SIZE["d_model"])
    dy = torch.randn_like(x)
    reference_block = plain.double()
    reference = _forward_backward(reference_block, x.double(), dy.double())
    plain = plain.float()

    where = "CPU, Triton interpreter" if interpreting() else f"GPU {torch.cuda.get_device_name()}"
    print(f"# TransformerLayer precision modes vs a float64 plain block ({datetime.date.today().isoformat()})")
    print(f"# torch {torch.__version__}, triton {triton.__version__}, python {platform.python_version()}; {where}")
    print(f"# size {SIZE}, causal, seed {SEED}; attention_backend='triton'")
    print("# relative Frobenius error ||got - ref|| / ||ref||; 'params' = all parameter gradients together,")
    print("# 'worst param' = the largest single-parameter error; 'pytorch' rows: the plain block in that precision")
    header = f"{'mode':<24} {'who':<9} {'output':>9} {'dx':>9} {'params':>9}  worst param"
    print(header)
    print("-" * len(header))
    for label, kwargs, (how, dtype) in MODES:
        layer = TransformerLayer.from_plain(plain, attention_backend="triton", **kwargs)
        # The input in float32 where the layer's residual stream is float32, else in the parameter dtype.
        fp32_stream = layer.policy.residual_dtype == torch.float32
        ours = _forward_backward(layer, x if fp32_stream else x.to(layer.policy.param_dtype), dy)
        if how == "autocast":
            # A float32 block with the layer's weights (exactly: bf16 values are float32 values) under autocast;
            # PyTorch's LayerNorm takes no bf16 parameters for a float32 input.
            theirs = _forward_backward(layer.to_plain(torch.float32), x, dy, autocast_dtype=dtype)
        else:
            theirs = _forward_backward(layer.to_plain(dtype), x.to(dtype), dy)
        for who, result in (("flashlite", ours), ("pytorch", theirs)):
            out, dx, params, worst = _errors(result, reference)
            print(f"{label:<24} {who:<9} {out:9.1e} {dx:9.1e} {params:9.1e}  {worst}")


if __name__ == "__main__":
    main()
