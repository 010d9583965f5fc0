"""flashlite._casts.cast_together: the layer's grouped weight cast, against per-tensor ``.to`` (CPU)."""
from __future__ import annotations

import pytest
import torch

from flashlite._casts import cast_together
from flashlite.layer import TransformerLayer


def _sources(seed: int) -> list[torch.Tensor]:
    # Odd sizes, a transposed (non-contiguous) weight and a 1-element tensor; values spread over several binades,
    # so rounding to bf16 differs from truncation.
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(37, 11, generator=g) * 100, torch.randn(29, generator=g),
            torch.randn(13, 7, generator=g).t(), torch.randn(1, generator=g) * 1e-3]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_values_and_layouts_equal_per_tensor_casts(dtype):
    sources = _sources(0)
    before = [t.clone() for t in sources]
    got = cast_together(sources, dtype)
    for g, s, b in zip(got, sources, before):
        want = s.to(dtype)
        assert g.dtype == dtype and g.shape == s.shape and g.stride() == s.stride()
        assert torch.equal(g, want)
        assert torch.equal(s, b)  # the sources are not modified


def test_strided_expanded_and_offset_sources():
    # Layouts empty_like does not copy (stride 0, a step of 3, a storage offset) take the per-pair path of the same
    # call; values and shapes still equal per-tensor casts.
    base = torch.randn(40, 9)
    sources = [torch.randn(7, 1).expand(7, 5), base[2:, ::3], base[5:11, 4], torch.randn(6, 4).t()[1:]]
    for got, s in zip(cast_together(sources, torch.bfloat16), sources):
        assert got.shape == s.shape and torch.equal(got, s.to(torch.bfloat16))


def test_tensors_already_in_the_dtype_are_returned_as_they_are():
    half, full = torch.randn(5, dtype=torch.bfloat16), torch.randn(3, 4)
    got = cast_together([half, full], torch.bfloat16)
    assert got[0] is half
    assert torch.equal(got[1], full.to(torch.bfloat16))
    same = cast_together([half], torch.bfloat16)
    assert same[0] is half


def test_mixed_source_dtypes_are_cast_correctly():
    sources = [torch.randn(6, 5), torch.randn(7, dtype=torch.float64), torch.randn(3, dtype=torch.float16)]
    for g, s in zip(cast_together(sources, torch.bfloat16), sources):
        assert torch.equal(g, s.to(torch.bfloat16))


def test_gradients_reach_each_source_in_its_dtype():
    # With grad mode on and sources that require grad, the casts are autograd's own (per tensor).
    sources = [t.detach().double().requires_grad_(True) if i == 1 else t.detach().requires_grad_(True)
               for i, t in enumerate(_sources(1))]
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in sources]
    cast = cast_together(sources, torch.bfloat16)
    # The last output is left out of the loss: its source gets no gradient, as with per-tensor casts.
    loss = sum((c.double() * w).sum() for c, w in zip(cast[:-1], weights[:-1]))
    loss.backward()
    for s, w in zip(sources[:-1], weights[:-1]):
        assert s.grad.dtype == s.dtype
        # d(loss)/d(source) is the bf16-rounded gradient of the cast output, cast back to the source's dtype.
        assert torch.equal(s.grad, w.to(torch.bfloat16).to(s.dtype))
    assert sources[-1].grad is None


def _foreach_copies(fn) -> int:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events()].count("aten::_foreach_copy_")


def test_one_grouped_copy_without_autograd_and_none_with_it():
    sources = _sources(5)
    assert _foreach_copies(lambda: cast_together(sources, torch.bfloat16)) == 1
    needing_grad = [t.detach().requires_grad_(True) for t in sources]
    with torch.no_grad():
        assert _foreach_copies(lambda: cast_together(needing_grad, torch.bfloat16)) == 1
    assert _foreach_copies(lambda: cast_together(needing_grad, torch.bfloat16)) == 0


@pytest.mark.parametrize("grad", [False, True])
def test_under_torch_compile_matches_eager(grad):
    # The casts are the compiled function's outputs, so they are materialized in bf16 (Inductor may skip an
    # intermediate rounding that feeds its own fused arithmetic, but not one it hands back).
    sources = [t.detach().requires_grad_(grad) for t in _sources(3)]
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(t.shape, generator=g).to(torch.bfloat16) for t in sources]

    def run(fn):
        for s in sources:
            s.grad = None
        cast = fn(*sources)
        if grad:
            sum((c * w).float().sum() for c, w in zip(cast, weights)).backward()
        return [c.detach() for c in cast] + ([s.grad.clone() for s in sources] if grad else [])

    def fn(*ts):
        return cast_together(ts, torch.bfloat16)

    eager = run(fn)
    torch._dynamo.reset()
    compiled = run(torch.compile(fn, fullgraph=True))
    torch._dynamo.reset()
    assert len(compiled) == len(eager) == len(sources) * (2 if grad else 1)
    for got, want in zip(compiled, eager):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_mixed_layer_inference_casts_its_weights_with_one_grouped_cast_per_forward():
    # The eight projection tensors (four weights, four biases) of a "mixed" layer are cast in one
    # _foreach_copy_ call, and no per-tensor cast of a parameter-sized tensor remains.
    layer = TransformerLayer(24, 3, 40, precision="mixed", fusions=frozenset(), attention_backend="sdpa")
    x = torch.randn(2, 5, 24)
    with torch.no_grad(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 record_shapes=True) as prof:
        layer(x)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_foreach_copy_") == 1
    parameter_shapes = {tuple(p.shape) for p in layer.parameters()}
    per_tensor = [e for e in prof.events() if e.name == "aten::_to_copy" and e.input_shapes
                  and tuple(e.input_shapes[0]) in parameter_shapes]
    assert per_tensor == []
