"""The FlashAttention adapters, exercised the way the official suites call them."""

import pytest
import torch

from tests import adapters
from tests._support import kernel_device


def _suite_inputs(device):
    torch.manual_seed(0)
    return [torch.randn(4, 128, 64, device=device, requires_grad=True) for _ in range(3)]


def _plain_attention(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / 8.0
    if causal:
        s = s + torch.triu(torch.full((128, 128), -1e6, device=q.device), diagonal=1)
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def _check(cls, device, causal):
    assert isinstance(cls, type) and issubclass(cls, torch.autograd.Function)
    q, k, v = _suite_inputs(device)
    out = cls.apply(q, k, v, causal)
    ref, lse = _plain_attention(q, k, v, causal)
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)
    lse_saved = [t for t in out.grad_fn.saved_tensors if t.shape == (4, 128)]
    assert len(lse_saved) == 1
    torch.testing.assert_close(lse_saved[0], lse, rtol=1e-2, atol=1e-2)
    grad = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), grad)
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_pytorch_adapter_on_cpu(causal):
    _check(adapters.get_flashattention_autograd_function_pytorch(), "cpu", causal)


def test_pytorch_adapter_default_is_not_causal():
    q, k, v = _suite_inputs("cpu")
    out = adapters.get_flashattention_autograd_function_pytorch().apply(q, k, v)
    assert out.grad_fn.is_causal is False


@pytest.mark.parametrize("causal", [False, True])
def test_triton_adapter(causal):
    _check(adapters.get_flashattention_autograd_function_triton(), kernel_device(), causal)
