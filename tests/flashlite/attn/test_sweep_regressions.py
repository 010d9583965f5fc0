"""Defects the property sweep of attention calls found (test_properties_attention.py), each shrunk to one explicit
case against the float64 reference written there, so each stays fixed.
"""
from __future__ import annotations

import pytest
import torch

import flashlite
from tests.flashlite.attn.test_properties_attention import DEVICE, reference


def _random(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# The create_graph=True backward once took torch.autograd.grad against q, k and v as given: a tensor passed as two or
# three of them got the sum of its gradients in each place, so autograd counted it twice or three times.
@pytest.mark.parametrize("aliases", ["k_is_v", "q_is_k_is_v"])
def test_triton_second_order_gradients_of_aliased_inputs_count_each_use_once(aliases):
    # Self-attention on one tensor (q is k is v), or one tensor for keys and values: first gradients taken with
    # create_graph=True (a gradient penalty's first step) must equal the float64 reference's, as they do without it.
    x = _random(1, 1, 5, 16, seed=0).float().to(DEVICE).requires_grad_()
    q = x if aliases == "q_is_k_is_v" else _random(1, 1, 5, 16, seed=1).float().to(DEVICE)
    weight = _random(1, 1, 5, 16, seed=2).to(DEVICE)
    out = flashlite.attention(q, x, x, backend="triton", precision="ieee")
    (first,) = torch.autograd.grad((out.double() * weight).sum(), x, create_graph=True)
    x64 = x.detach().double().requires_grad_()
    expected_out = reference(x64 if aliases == "q_is_k_is_v" else q.double(), x64, x64)
    (expected,) = torch.autograd.grad((expected_out * weight).sum(), x64)
    plain_out = flashlite.attention(q, x, x, backend="triton", precision="ieee")
    (plain,) = torch.autograd.grad((plain_out.double() * weight).sum(), x)
    torch.testing.assert_close(plain.double(), expected, rtol=1e-5, atol=1e-5)  # without create_graph: right
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-5)
    # The gradient penalty's own gradient, second order through the aliased tensor.
    (second,) = torch.autograd.grad(first.double().pow(2).sum(), x)
    (expected_first,) = torch.autograd.grad((reference(x64 if aliases == "q_is_k_is_v" else q.double(), x64, x64)
                                             * weight).sum(), x64, create_graph=True)
    (expected_second,) = torch.autograd.grad(expected_first.pow(2).sum(), x64)
    torch.testing.assert_close(second.double(), expected_second, rtol=1e-4, atol=1e-4)


# attention_varlen's create_graph=True backward shares that recompute, and once doubled the same way.
def test_varlen_second_order_gradients_of_one_tensor_for_keys_and_values_count_each_use_once():
    q = _random(7, 1, 16, seed=3).float().to(DEVICE)
    x = _random(7, 1, 16, seed=4).float().to(DEVICE).requires_grad_()
    cu = torch.tensor([0, 3, 7], dtype=torch.int32, device=DEVICE)
    weight = _random(7, 1, 16, seed=5).to(DEVICE)
    out = flashlite.attention_varlen(q, x, x, cu, cu, 4, 4, backend="triton", precision="ieee")
    (first,) = torch.autograd.grad((out.double() * weight).sum(), x, create_graph=True)
    x64 = x.detach().double().requires_grad_()
    expected_out = torch.cat([reference(q.double()[a:b].transpose(0, 1)[None], x64[a:b].transpose(0, 1)[None],
                                        x64[a:b].transpose(0, 1)[None])[0].transpose(0, 1) for a, b in ((0, 3), (3, 7))])
    (expected,) = torch.autograd.grad((expected_out * weight).sum(), x64)
    torch.testing.assert_close(first.double(), expected, rtol=1e-5, atol=1e-5)
