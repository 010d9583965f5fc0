import pytest
import torch

def test_matmul_pair(kernel_ab):
    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    kernel_ab.compare(lambda: x @ x, lambda: torch.mm(x, x), name="mm vs torch.mm")

@pytest.mark.memory(5 * 2**30)
def test_marked_past_the_cap():
    torch.empty(5 * 2**30, dtype=torch.uint8, device="cuda")

def test_allocates_past_the_cap():
    torch.empty(6 * 2**30, dtype=torch.uint8, device="cuda")

def test_fits_the_cap():
    torch.empty(2**30, dtype=torch.uint8, device="cuda")
