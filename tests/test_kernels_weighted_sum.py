"""The weighted-sum worked example against its reference (CUDA, or CPU under the interpreter)."""

import pytest
import torch

from cs336_systems.kernels.weighted_sum import weighted_sum, weighted_sum_reference
from tests._support import kernel_device


@pytest.mark.parametrize("shape", [(1, 16), (3, 5, 37), (33, 130), (2, 17, 300)])
def test_weighted_sum_forward_and_backward(shape):
    device = kernel_device()
    torch.manual_seed(0)
    x = torch.randn(*shape, device=device, requires_grad=True)
    w = torch.randn(shape[-1], device=device, requires_grad=True)
    y = weighted_sum(x, w)
    assert y.shape == shape[:-1]
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y64 = weighted_sum_reference(x64, w64)
    torch.testing.assert_close(y.double(), y64, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(y)
    gx, gw = torch.autograd.grad(y, (x, w), grad)
    rx, rw = torch.autograd.grad(y64, (x64, w64), grad.double())
    torch.testing.assert_close(gx.double(), rx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw.double(), rw, rtol=1e-5, atol=1e-4)


def test_weighted_sum_rejects_bad_weight():
    device = kernel_device()
    with pytest.raises(ValueError, match="weight must be"):
        weighted_sum(torch.randn(4, 8, device=device), torch.randn(7, device=device))
