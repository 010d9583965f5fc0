"""flashlite.layer_norm, add_layer_norm and bias_gelu against float64 PyTorch, forward and backward.

Runs on the CPU through the Triton interpreter (tiny sizes) and on a GPU unchanged.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from flashlite import norm
from flashlite.norm import MAX_ROW_LENGTH, add_layer_norm, bias_gelu, layer_norm
from pytest_kernelcheck import assert_close, policy_for

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Data with a large mean against a small spread, per dtype, chosen so that the rounded inputs still vary (fp16 has
# a spacing of 0.25 near 300, bf16 of 2): a float32 one-pass variance E[x^2] - E[x]^2 loses every digit on these.
OFFSET_DATA = {torch.float32: (1000.0, 0.01), torch.float16: (300.0, 1.0), torch.bfloat16: (300.0, 4.0)}


def _rows(shape, dtype, offset=0.0, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)


def _affine(n, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    weight = 1.0 + 0.5 * torch.randn(n, generator=gen, dtype=torch.float64)
    bias = torch.randn(n, generator=gen, dtype=torch.float64)
    return weight.to(dtype).to(DEVICE), bias.to(dtype).to(DEVICE)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _grads(fn, inputs, dy):
    leaves = [_leaf(t) for t in inputs]
    out = fn(*leaves)
    out.backward(dy.to(out.dtype))
    return out.detach(), [leaf.grad for leaf in leaves]


def _torch_layer_norm(x, w, b, eps=1e-5):
    return F.layer_norm(x, (x.shape[-1],), w, b, eps)


def _check_against_float64(x, w, b, *, baseline: bool):
    """Forward and backward of flashlite.layer_norm vs float64; optionally also vs PyTorch in x's dtype."""
    dy = _rows(x.shape, x.dtype, seed=7)  # the output gradient arrives in the output dtype
    out, grads = _grads(layer_norm, (x, w, b), dy)
    ref, ref_grads = _grads(_torch_layer_norm, (x.double(), w.double(), b.double()), dy)
    base, base_grads = (_grads(_torch_layer_norm, (x, w, b), dy) if baseline else (None, [None] * 3))
    assert out.dtype == x.dtype and out.shape == x.shape
    assert [g.dtype for g in grads] == [x.dtype, w.dtype, b.dtype]
    assert_close(out, ref, baseline=base)
    for name, got, expected, low in zip(("dx", "dweight", "dbias"), grads, ref_grads, base_grads):
        policy = None
        if name == "dx" and low is None:
            # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * w: one rounding of g (an FMA on a
            # GPU differs from separate multiply and add) comes back multiplied by rstd, which is 1/sqrt(eps) ~ 316
            # for a constant row. The absolute error floor scales with rstd * |g|, not with |dx|.
            xd = x.double()
            rstd = (xd.var(dim=-1, unbiased=False) + 1e-5).rsqrt().max().item()
            g_max = (dy.double() * w.double()).abs().max().item()
            default = policy_for(x.dtype)
            policy = default.replace(atol=max(default.atol, 4 * torch.finfo(x.dtype).eps * rstd * g_max))
        assert_close(got, expected, policy=policy, baseline=low, notes=(name,))


@pytest.mark.parametrize("n", [1, 37, 100, 1024])
def test_float32_large_mean_small_variance(n):
    # Checked per element against the float32 policy (no baseline): PyTorch's own float32 CPU kernel misses by
    # about 1e-3 relative on these rows, the flashlite kernel must not.
    offset, scale = OFFSET_DATA[torch.float32]
    x = _rows((3, 5, n), torch.float32, offset, scale)
    w, b = _affine(n, torch.float32)
    _check_against_float64(x, w, b, baseline=False)


def test_many_rows_split_over_programs():
    # 300 rows of 1024: several backward programs each reduce a run of row tiles (the last one partial), and
    # their dweight/dbias partial sums are added afterwards.
    x = _rows((300, 1024), torch.float32, 5.0, 2.0)
    w, b = _affine(1024, torch.float32)
    _check_against_float64(x, w, b, baseline=False)


def test_offset_data_defeats_a_one_pass_variance():
    # The test above can fail: a float32 one-pass variance on the same rows is far outside the policy.
    offset, scale = OFFSET_DATA[torch.float32]
    x = _rows((3, 5, 37), torch.float32, offset, scale)
    w, b = _affine(37, torch.float32)
    mean = x.mean(-1, keepdim=True)
    var = ((x * x).mean(-1, keepdim=True) - mean * mean).clamp_min(0)
    naive = (x - mean) * torch.rsqrt(var + 1e-5) * w + b
    with pytest.raises(AssertionError):
        assert_close(naive, _torch_layer_norm(x.double(), w.double(), b.double()))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [37, 100])
@pytest.mark.parametrize("data", ["offset", "standard"])
def test_low_precision_against_float64_and_pytorch_baseline(dtype, n, data):
    offset, scale = OFFSET_DATA[dtype] if data == "offset" else (0.0, 1.0)
    x = _rows((2, 7, n), dtype, offset, scale)
    w, b = _affine(n, dtype)
    _check_against_float64(x, w, b, baseline=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float32_parameters_with_low_precision_rows(dtype):
    # The "mixed" layer's case: fp32 weight and bias, low-precision activations; grads come back in each dtype.
    x = _rows((4, 37), dtype)
    w, b = _affine(37, torch.float32)
    dy = _rows(x.shape, dtype, seed=7)
    out, (dx, dw, db) = _grads(layer_norm, (x, w, b), dy)
    ref, (rdx, rdw, rdb) = _grads(_torch_layer_norm, (x.double(), w.double(), b.double()), dy.double())
    assert (out.dtype, dx.dtype, dw.dtype, db.dtype) == (dtype, dtype, torch.float32, torch.float32)
    assert_close(out, ref)
    assert_close(dx, rdx)
    assert_close(dw, rdw)  # float32 accumulation of the partial sums: the float32 policy applies
    assert_close(db, rdb)


def test_out_dtype_rounds_once_from_float32():
    x = _rows((3, 64), torch.float32)
    w, b = _affine(64, torch.float32)
    y = layer_norm(x, w, b, out_dtype=torch.bfloat16)
    assert y.dtype == torch.bfloat16
    expected = _torch_layer_norm(x.double(), w.double(), b.double())
    # One rounding of an accurate float32 result: the same error as rounding the float64 reference itself.
    assert_close(y, expected, baseline=expected.to(torch.bfloat16))


def test_none_weight_and_bias_and_non_contiguous_rows():
    x = _rows((6, 40), torch.float32).t()  # [40, 6], rows strided
    assert not x.is_contiguous()
    assert_close(layer_norm(x, None, None), _torch_layer_norm(x.double(), None, None))


def test_eps_is_used():
    x = _rows((2, 16), torch.float32, scale=1e-3)
    w, b = _affine(16, torch.float32)
    assert_close(layer_norm(x, w, b, eps=1e-2), _torch_layer_norm(x.double(), w.double(), b.double(), eps=1e-2))


@pytest.mark.parametrize("residual_dtype", [torch.float32, torch.bfloat16])
def test_add_layer_norm_forward_and_backward(residual_dtype):
    x = _rows((2, 5, 48), torch.float32, seed=3)
    r = _rows((2, 5, 48), residual_dtype, seed=4)
    w, b = _affine(48, torch.float32)
    dy, dh = _rows(x.shape, torch.bfloat16, seed=5), _rows(x.shape, torch.float32, seed=6)

    def run(fn, *inputs):
        leaves = [_leaf(t) for t in inputs]
        y, h = fn(*leaves)
        torch.autograd.backward([y, h], [dy.to(y.dtype), dh.to(h.dtype)])  # dy: bf16 values, exact in float64
        return y.detach(), h.detach(), [leaf.grad for leaf in leaves]

    def reference(x, r, w, b):
        h = x + r
        return _torch_layer_norm(h, w, b), h

    y, h, grads = run(lambda *a: add_layer_norm(*a, out_dtype=torch.bfloat16), x, r, w, b)
    ry, rh, rgrads = run(reference, x.double(), r.double(), w.double(), b.double())
    assert (y.dtype, h.dtype) == (torch.bfloat16, torch.float32)
    assert [g.dtype for g in grads] == [torch.float32, residual_dtype, torch.float32, torch.float32]
    assert_close(h, rh)
    assert_close(y, ry)
    assert_close(grads[0], rgrads[0])
    assert_close(grads[1], rgrads[1])
    assert_close(grads[2], rgrads[2])
    assert_close(grads[3], rgrads[3])
    torch.testing.assert_close(grads[1], grads[0].to(residual_dtype))  # both summands get the same gradient


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [100, 1500])  # 1500: more than one column block of the elementwise kernel
def test_bias_gelu_forward_and_backward(dtype, n):
    x = _rows((3, n), dtype, scale=2.0)
    bias = _rows((n,), dtype, seed=2)
    dy = _rows(x.shape, dtype, seed=7)

    def reference(x, bias):
        return F.gelu(x + bias)  # exact (erf) GELU

    out, (dx, dbias) = _grads(bias_gelu, (x, bias), dy)
    ref, (rdx, rdbias) = _grads(reference, (x.double(), bias.double()), dy)
    low = (None, [None, None])
    if dtype != torch.float32:
        low = _grads(lambda x, b: F.gelu((x.float() + b.float())).to(dtype), (x, bias), dy)
    assert out.dtype == dtype
    assert_close(out, ref, baseline=low[0])
    assert_close(dx, rdx, baseline=low[1][0])
    assert_close(dbias, rdbias, baseline=low[1][1])


def test_bias_gelu_out_dtype():
    x = _rows((4, 64), torch.float32)
    bias = _rows((64,), torch.float32, seed=2)
    y = bias_gelu(x, bias, out_dtype=torch.float16)
    expected = F.gelu(x.double() + bias.double())
    assert y.dtype == torch.float16
    assert_close(y, expected, baseline=expected.to(torch.float16))


def test_custom_ops_pass_opcheck():
    # Schema, fake (meta) implementations and autograd registration agree with the real kernels, which is what
    # torch.compile relies on.
    x = _rows((2, 3, 24), torch.float32)
    r = _rows((2, 3, 24), torch.bfloat16, seed=3)
    w, b = _affine(24, torch.float32)
    x, r, w, b = (t.requires_grad_() for t in (x, r, w, b))
    torch.library.opcheck(torch.ops.flashlite.layer_norm.default, (x, w, b, 1e-5, torch.bfloat16))
    torch.library.opcheck(torch.ops.flashlite.add_layer_norm.default, (x, r, w, b, 1e-5, None))
    torch.library.opcheck(torch.ops.flashlite.bias_gelu.default, (x, b, None))


def test_layer_norm_under_torch_compile_matches_eager():
    x = _rows((2, 5, 37), torch.float32)
    w, b = _affine(37, torch.float32)

    def fn(x, w, b):
        return layer_norm(x * 2.0, w, b) + 1.0

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, w, b), fn(x, w, b), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ any layout

# Every tensor argument may be a view: strided, sliced, offset into its storage, or expanded (stride 0). Each layout
# below is a view of a fresh random base tensor, and the base is the autograd leaf, so a gradient has to come back
# through the view (summed over an expanded dimension) to the tensor the caller holds.
ROW_LAYOUTS = ("contiguous", "transposed", "row_stride", "column_slice", "expanded_rows", "offset", "batch_transposed")
PARAM_LAYOUTS = ("contiguous", "stride2", "stride0", "offset")
# Odd on purpose: no dimension is a power of two or a multiple of a block size.
LAYOUT_SHAPE = (3, 5, 37)


def _row_layout(layout: str, shape: tuple[int, ...]):
    """(shape of the base tensor, function viewing such a base as ``shape`` in ``layout``)."""
    *lead, rows, n = shape
    lead = tuple(lead)
    if layout == "contiguous":
        return shape, lambda t: t
    if layout == "transposed":  # column stride `rows`: the kernel needs unit column stride, so the launcher copies
        return lead + (n, rows), lambda t: t.transpose(-1, -2)
    if layout == "row_stride":  # every other row of a larger tensor
        return lead + (2 * rows, n), lambda t: t[..., ::2, :]
    if layout == "column_slice":  # row stride n + 10 and a storage offset of 3
        return lead + (rows, n + 10), lambda t: t[..., 3:3 + n]
    if layout == "expanded_rows":  # row stride 0: every row is the same memory
        return lead + (1, n), lambda t: t.expand(shape)
    if layout == "offset":  # storage_offset != 0
        return (shape[0] + 1,) + shape[1:], lambda t: t[1:]
    if layout == "batch_transposed":  # unit column stride, but the leading dims do not flatten into one row stride
        return (shape[1], shape[0]) + shape[2:], lambda t: t.transpose(0, 1)
    raise AssertionError(layout)


def _param_layout(layout: str, n: int):
    """(shape of the base tensor, function viewing such a base as an [n] parameter in ``layout``)."""
    if layout == "contiguous":
        return (n,), lambda t: t
    if layout == "stride2":  # e.g. one column of a [n, 2] tensor
        return (n, 2), lambda t: t[:, 0]
    if layout == "stride0":  # one value expanded: its gradient is the sum over all n columns
        return (1,), lambda t: t.expand(n)
    if layout == "offset":
        return (n + 5,), lambda t: t[5:]
    raise AssertionError(layout)


def _fresh(base_shape, seed, dtype=torch.float32, offset=0.0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (offset + scale * torch.randn(base_shape, generator=gen, dtype=torch.float64)).to(dtype).to(DEVICE)


def _through_views(fn, bases, views, grad_bases, grad_views):
    """Outputs of ``fn`` on views of leaf copies of ``bases``, after backward with viewed output gradients, and the
    gradients of the bases. Checks that no argument was modified."""
    leaves = [base.detach().clone().requires_grad_(True) for base in bases]
    out = fn(*(view(leaf) for view, leaf in zip(views, leaves)))
    outs = out if isinstance(out, tuple) else (out,)
    grads = [view(g.to(o.dtype)) for view, g, o in zip(grad_views, grad_bases, outs)]
    torch.autograd.backward(list(outs), grads)
    for leaf, base in zip(leaves, bases):
        assert torch.equal(leaf.detach(), base), "an argument was modified"
    return [o.detach() for o in outs], [leaf.grad for leaf in leaves]


def _check_layouts(fn, reference, arg_layouts, out_layouts, notes):
    """``fn`` against ``reference`` in float64, outputs and the gradient of every argument's base tensor.

    ``arg_layouts``/``out_layouts``: (base shape, view) per argument / per output gradient, with fresh random data.
    """
    bases = [_fresh(shape, seed=20 + i) for i, (shape, _) in enumerate(arg_layouts)]
    views = [view for _, view in arg_layouts]
    grad_bases = [_fresh(shape, seed=40 + i) for i, (shape, _) in enumerate(out_layouts)]
    grad_views = [view for _, view in out_layouts]
    outs, grads = _through_views(fn, bases, views, grad_bases, grad_views)
    ref_outs, ref_grads = _through_views(reference, [b.double() for b in bases], views,
                                         [g.double() for g in grad_bases], grad_views)
    for i, (got, expected) in enumerate(zip(outs, ref_outs)):
        assert got.shape == expected.shape
        assert_close(got, expected, notes=(*notes, f"output {i}"))
    fp32 = policy_for(torch.float32)
    for i, (got, expected) in enumerate(zip(grads, ref_grads)):
        assert got.shape == expected.shape == bases[i].shape
        # A gradient that sums over rows (a parameter's, or an expanded input's) adds `terms` float32 values: its
        # rounding error grows like sqrt(terms) ulps of the largest sum, not one ulp of each element.
        terms = outs[0].numel() // bases[i].numel()
        atol = max(fp32.atol, 4 * torch.finfo(torch.float32).eps * terms ** 0.5 * expected.abs().max().item())
        assert_close(got, expected, policy=fp32.replace(atol=atol) if terms > 1 else fp32,
                     notes=(*notes, f"gradient of argument {i}"))


@pytest.mark.parametrize("b_layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("w_layout", PARAM_LAYOUTS)
def test_layer_norm_parameter_layouts(w_layout, b_layout):
    # Weight and bias of any stride (2, 0) or storage offset: forward and the gradients of x, weight and bias.
    n = LAYOUT_SHAPE[-1]
    layouts = [_row_layout("contiguous", LAYOUT_SHAPE), _param_layout(w_layout, n), _param_layout(b_layout, n)]
    _check_layouts(layer_norm, _torch_layer_norm, layouts, [_row_layout("contiguous", LAYOUT_SHAPE)],
                   (f"weight {w_layout}, bias {b_layout}",))


@pytest.mark.parametrize("dy_layout", ["contiguous", "transposed", "expanded_rows"])
@pytest.mark.parametrize("x_layout", ROW_LAYOUTS)
def test_layer_norm_input_layouts(x_layout, dy_layout):
    # x and the incoming gradient of any layout (an expanded dy is what y.sum().backward() sends).
    n = LAYOUT_SHAPE[-1]
    layouts = [_row_layout(x_layout, LAYOUT_SHAPE), _param_layout("contiguous", n), _param_layout("contiguous", n)]
    _check_layouts(layer_norm, _torch_layer_norm, layouts, [_row_layout(dy_layout, LAYOUT_SHAPE)],
                   (f"x {x_layout}, dy {dy_layout}",))


def _torch_add_layer_norm(x, residual, w, b):
    h = x + residual
    return _torch_layer_norm(h, w, b), h


ADD_LAYER_NORM_CASES = (
    [(layout, "contiguous", "contiguous", "contiguous") for layout in ROW_LAYOUTS[1:]]
    + [("contiguous", layout, "contiguous", "contiguous") for layout in ROW_LAYOUTS[1:]]
    + [("contiguous", "contiguous", layout, "contiguous") for layout in PARAM_LAYOUTS[1:]]
    + [("contiguous", "contiguous", "contiguous", layout) for layout in ("transposed", "expanded_rows")]
    + [("transposed", "expanded_rows", "stride0", "row_stride")]
)


@pytest.mark.parametrize("x_layout,residual_layout,param_layout,grad_layout", ADD_LAYER_NORM_CASES,
                         ids=["-".join(case) for case in ADD_LAYER_NORM_CASES])
def test_add_layer_norm_layouts(x_layout, residual_layout, param_layout, grad_layout):
    # x, residual, weight, bias and both output gradients (of the norm and of the sum) of any layout.
    n = LAYOUT_SHAPE[-1]
    layouts = [_row_layout(x_layout, LAYOUT_SHAPE), _row_layout(residual_layout, LAYOUT_SHAPE),
               _param_layout(param_layout, n), _param_layout(param_layout, n)]
    grads = [_row_layout(grad_layout, LAYOUT_SHAPE), _row_layout(grad_layout, LAYOUT_SHAPE)]
    _check_layouts(add_layer_norm, _torch_add_layer_norm, layouts, grads,
                   (f"x {x_layout}, residual {residual_layout}, weight/bias {param_layout}, grads {grad_layout}",))


@pytest.mark.parametrize("bias_layout", PARAM_LAYOUTS)
@pytest.mark.parametrize("x_layout", ROW_LAYOUTS)
def test_bias_gelu_layouts(x_layout, bias_layout):
    # x, bias and the incoming gradient (laid out as x) of any layout.
    n = LAYOUT_SHAPE[-1]
    layouts = [_row_layout(x_layout, LAYOUT_SHAPE), _param_layout(bias_layout, n)]
    _check_layouts(bias_gelu, lambda x, b: F.gelu(x + b), layouts, [_row_layout(x_layout, LAYOUT_SHAPE)],
                   (f"x {x_layout}, bias {bias_layout}",))


def test_strided_arguments_under_torch_compile():
    # The custom ops (what torch.compile sees) get the same views, and their fake implementations must promise the
    # layouts the real kernels return: a transposed x, stride-2 / stride-0 parameters and an offset residual.
    n = LAYOUT_SHAPE[-1]
    layouts = [_row_layout("transposed", LAYOUT_SHAPE), _row_layout("offset", LAYOUT_SHAPE),
               _param_layout("stride2", n), _param_layout("stride0", n)]

    def chain(x, residual, w, b):
        y, h = add_layer_norm(layer_norm(x, w, b), residual, w, b)
        return bias_gelu(y, b) * 1.5, h  # ops around the kernels, for the compiler to fuse

    def reference(x, residual, w, b):
        y, h = _torch_add_layer_norm(_torch_layer_norm(x, w, b), residual, w, b)
        return F.gelu(y + b) * 1.5, h

    compiled = torch.compile(chain, backend="aot_eager", fullgraph=True)
    grads = [_row_layout("expanded_rows", LAYOUT_SHAPE), _row_layout("transposed", LAYOUT_SHAPE)]
    _check_layouts(compiled, reference, layouts, grads, ("torch.compile",))


def test_custom_ops_pass_opcheck_on_strided_arguments():
    # Fake (meta) implementations agree with the kernels on the strides of every output, forward and backward,
    # when the inputs are views.
    n = LAYOUT_SHAPE[-1]
    (xs, xv), (rs, rv) = _row_layout("transposed", LAYOUT_SHAPE), _row_layout("batch_transposed", LAYOUT_SHAPE)
    (ws, wv), (bs, bv) = _param_layout("stride2", n), _param_layout("stride0", n)
    x, r, dy = xv(_fresh(xs, 1)), rv(_fresh(rs, 2)), xv(_fresh(xs, 3))
    w, b = wv(_fresh(ws, 4, offset=1.0)), bv(_fresh(bs, 5))
    rows = LAYOUT_SHAPE[:-1]
    rstd = (0.5 + torch.rand(rows[::-1], generator=torch.Generator().manual_seed(6))).to(DEVICE).t()  # strided
    ops = torch.ops.flashlite
    for op, args in [
        (ops.layer_norm.default, (x.requires_grad_(), w.requires_grad_(), b.requires_grad_(), 1e-5, None)),
        (ops.add_layer_norm.default, (x, r, w, b, 1e-5, None)),
        (ops.bias_gelu.default, (x, b, None)),
        (ops.layer_norm_backward.default, (dy, x.detach(), w.detach(), rstd, None)),
        (ops.layer_norm_backward.default, (dy, x.detach(), w.detach(), rstd, r)),
        (ops.bias_gelu_backward.default, (dy, x.detach(), b.detach())),
    ]:
        torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------------------ bad input


def test_bad_inputs_name_the_problem():
    x = _rows((2, 8), torch.float32)
    w, b = _affine(8, torch.float32)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        layer_norm(x, w[:7], b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        layer_norm(x, w, b[:4])
    with pytest.raises(TypeError, match="float64"):
        layer_norm(x.double(), w, b)
    with pytest.raises(ValueError, match="eps must be a positive finite number"):
        layer_norm(x, w, b, eps=0.0)
    with pytest.raises(ValueError, match="non-empty last dimension"):
        layer_norm(x[:, :0], None, None)
    with pytest.raises(ValueError, match=f"limit of {MAX_ROW_LENGTH}"):
        layer_norm(torch.zeros(1, MAX_ROW_LENGTH + 1, device=DEVICE), None, None)
    with pytest.raises(TypeError, match="out_dtype"):
        layer_norm(x, w, b, out_dtype=torch.int32)
    with pytest.raises(ValueError, match="residual has shape"):
        add_layer_norm(x, x[:1], w, b)
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        bias_gelu(x, b[:3])


@pytest.mark.parametrize("out_dtype", ["float16", "torch.bfloat16", np.float32, 16])
def test_an_out_dtype_that_is_not_a_torch_dtype_is_named_as_such(out_dtype):
    # A dtype's name was refused with "out_dtype float16 is not supported; use float32, float16 or bfloat16":
    # it named the very dtype it refused. The error now says what kind of value is accepted, and what came.
    x = _rows((2, 8), torch.float32)
    w, b = _affine(8, torch.float32)
    message = (r"out_dtype must be None or a torch\.dtype \(torch\.float32, torch\.float16 or "
               rf"torch\.bfloat16\), got {type(out_dtype).__name__}")
    for op, call in (("layer_norm", lambda: layer_norm(x, w, b, out_dtype=out_dtype)),
                     ("add_layer_norm", lambda: add_layer_norm(x, x.flip(0), w, b, out_dtype=out_dtype)),
                     ("bias_gelu", lambda: bias_gelu(x, b, out_dtype=out_dtype))):
        with pytest.raises(TypeError, match=rf"flashlite\.{op}: {message}"):
            call()


BAD_EPS = [("1e-5", TypeError), (True, TypeError), (None, TypeError), (torch.tensor(1e-5), TypeError),
           (float("nan"), ValueError), (float("inf"), ValueError), (-1e-5, ValueError), (np.float32(-1.0), ValueError)]


@pytest.mark.parametrize("eps,error", BAD_EPS, ids=[repr(e) for e, _ in BAD_EPS])
def test_bad_eps_is_refused_by_name(eps, error):
    # Not a Python comparison error from inside the check, and no silent True -> 1.0 or inf -> output = bias.
    x = _rows((2, 8), torch.float32)
    w, b = _affine(8, torch.float32)
    for op, call in (("layer_norm", lambda: layer_norm(x, w, b, eps)),
                     ("add_layer_norm", lambda: add_layer_norm(x, x.flip(0), w, b, eps=eps))):
        with pytest.raises(error, match=rf"flashlite\.{op}: eps must be a positive finite number \(a Python or "
                                        rf"NumPy int or float\), got "):
            call()


@pytest.mark.parametrize("eps", [np.float32(1e-2), np.float64(1e-2), np.int64(1), 1, 1e-2],
                         ids=["np.float32", "np.float64", "np.int64", "int", "float"])
def test_eps_of_any_real_number_type_is_used(eps):
    x = _rows((3, 37), torch.float32, scale=0.1)
    w, b = _affine(37, torch.float32)
    expected = _torch_layer_norm(x.double(), w.double(), b.double(), eps=float(eps))
    assert_close(layer_norm(x, w, b, eps), expected)
    y, h = add_layer_norm(x, x.flip(0), w, b, eps)
    assert_close(y, _torch_layer_norm(h.double(), w.double(), b.double(), eps=float(eps)))


# ------------------------------------------------------------------------------------------------ GPU compilation

_COMPILE_FOR_HOPPER = r'''
import os
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import flashlite.kernels.layer_norm as k

cases = [
    (k._layer_norm_fwd_kernel,
     {"X": "*fp32", "RESIDUAL": "*bf16", "SUM_OUT": "*fp32", "W": "*fp32", "B": "*fp32", "Y": "*bf16",
      "RSTD": "*fp32", "stride_x": "i32", "stride_r": "i32", "stride_s": "i32", "stride_y": "i32",
      "stride_w": "i32", "stride_b": "i32", "M": "i32", "N": "i32", "eps": "fp32"},
     {"HAS_RESIDUAL": True, "BLOCK_M": 4, "BLOCK_N": 256, "EMULATE_RTNE": False}),
    (k._layer_norm_bwd_kernel,
     {"X": "*fp32", "W": "*fp32", "DY": "*bf16", "DSUM": "*fp32", "DX": "*fp32", "DW_PARTIAL": "*fp32",
      "DB_PARTIAL": "*fp32", "RSTD": "*fp32", "stride_x": "i32", "stride_dy": "i32", "stride_ds": "i32",
      "stride_dx": "i32", "stride_w": "i32", "M": "i32", "N": "i32", "rows_per_program": "i32"},
     {"HAS_DSUM": True, "BLOCK_M": 1, "BLOCK_N": 1024, "EMULATE_RTNE": False}),
    (k._bias_gelu_fwd_kernel,
     {"X": "*bf16", "BIAS": "*fp32", "Y": "*bf16", "stride_bias": "i32", "numel": "i32", "N": "i32"},
     {"BLOCK": 1024, "EMULATE_RTNE": False}),
    (k._bias_gelu_bwd_kernel,
     {"X": "*bf16", "BIAS": "*fp32", "DY": "*bf16", "DX": "*bf16", "stride_bias": "i32", "numel": "i32",
      "N": "i32"},
     {"BLOCK": 1024, "EMULATE_RTNE": False}),
]
for fn, signature, constants in cases:
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "cubin" in compiled.asm, fn.__name__
print("compiled", len(cases))
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU every test above compiles the kernels for real")
def test_kernels_compile_for_hopper_without_a_gpu():
    # The interpreter accepts code that the compiler rejects (e.g. a plain Python float global inside a kernel):
    # compile every kernel for sm_90 ahead of time, in a fresh process with the interpreter off.
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    done = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled 4" in done.stdout


def test_eager_path_and_custom_op_agree_in_values_and_gradients():
    # Eager calls bypass the torch.library dispatcher through an autograd.Function running the same launchers;
    # the registered op (what torch.compile sees) must give the same outputs and gradients.
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 40, generator=gen) * 3 + 5).to(DEVICE)
    r = torch.randn(6, 40, generator=gen).to(DEVICE)
    w, b = torch.rand(40, generator=gen).to(DEVICE), torch.randn(40, generator=gen).to(DEVICE)
    dy = torch.randn(6, 40, generator=gen).to(DEVICE)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (x, r, w, b)]
        out = fn(*leaves)
        out.backward(dy)
        return [out.detach()] + [t.grad for t in leaves]

    ops = torch.ops.flashlite
    cases = {
        "layer_norm": (lambda x, r, w, b: norm.layer_norm(x, w, b) + 0 * r.sum(),
                       lambda x, r, w, b: ops.layer_norm(x, w, b, 1e-5, None)[0] + 0 * r.sum()),
        "add_layer_norm": (lambda x, r, w, b: sum(norm.add_layer_norm(x, r, w, b)),
                           lambda x, r, w, b: sum(ops.add_layer_norm(x, r, w, b, 1e-5, None)[:2])),
        "bias_gelu": (lambda x, r, w, b: norm.bias_gelu(x, b) + 0 * (r.sum() + w.sum()),
                      lambda x, r, w, b: ops.bias_gelu(x, b, None) + 0 * (r.sum() + w.sum())),
    }
    for name, (eager, via_op) in cases.items():
        for got, expected in zip(grads(eager), grads(via_op)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)


def test_eager_calls_do_not_go_through_the_dispatcher(monkeypatch):
    def refuse(*args):
        raise AssertionError("an eager call went through the custom op")

    for name in ("_layer_norm_op", "_add_layer_norm_op", "_bias_gelu_op"):
        monkeypatch.setattr(norm, name, refuse)
    x = torch.randn(3, 16, device=DEVICE, requires_grad=True)
    w, b = torch.ones(16, device=DEVICE), torch.zeros(16, device=DEVICE)
    norm.layer_norm(x, w, b).sum().backward()
    norm.add_layer_norm(x, x.detach(), w, b)[0].sum().backward()
    with torch.no_grad():
        norm.bias_gelu(x, b)
    assert x.grad is not None and torch.isfinite(x.grad).all()
