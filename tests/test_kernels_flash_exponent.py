"""The fp32-accurate kernels' exp2 (`flash_attention/exponent.py`) against fp64 (CUDA, or CPU under the interpreter)."""

import pytest
import torch

from tests._support import kernel_device

triton = pytest.importorskip("triton")
tl = triton.language

from cs336_systems.kernels.flash_attention.exponent import exp2_polynomial, softmax_exp2  # noqa: E402


@triton.jit
def _exp2_kernel(X, Polynomial, Chosen, N: tl.constexpr, PRECISION: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(X + offsets)
    tl.store(Polynomial + offsets, exp2_polynomial(x))
    tl.store(Chosen + offsets, softmax_exp2(x, PRECISION))


def _run(x: torch.Tensor, precision: str) -> tuple[torch.Tensor, torch.Tensor]:
    polynomial, chosen = torch.empty_like(x), torch.empty_like(x)
    _exp2_kernel[(1,)](x, polynomial, chosen, x.numel(), precision)
    return polynomial, chosen


def test_exp2_polynomial_is_within_one_unit_of_fp64_over_the_softmax_range():
    torch.manual_seed(0)
    x = -torch.rand(4096, dtype=torch.float32, device=kernel_device()) * 40  # P's exponents: (-40, 0]
    polynomial, chosen = _run(x, "ieee")
    exact = torch.exp2(x.double())
    relative = (polynomial.double() - exact).abs() / exact
    assert relative.max().item() <= torch.finfo(torch.float32).eps, relative.max().item()
    assert torch.equal(chosen, polynomial)  # the fp32-accurate precisions take the polynomial


def test_exp2_polynomial_is_exact_at_integers_and_zero_below_the_normal_range():
    x = torch.tensor([0.0, -1.0, -2.0, -17.0, -126.0, -126.5, -200.0, float("-inf"), 3.0] + [0.0] * 7,
                     device=kernel_device())
    polynomial, _ = _run(x, "ieee")
    want = torch.tensor([1.0, 0.5, 0.25, 2.0 ** -17, 2.0 ** -126, 0.0, 0.0, 0.0, 8.0] + [1.0] * 7)
    assert torch.equal(polynomial.cpu(), want)


def test_softmax_exp2_keeps_the_instruction_for_tensor_core_precision():
    x = -torch.rand(64, dtype=torch.float32, device=kernel_device()) * 10
    _, chosen = _run(x, "tf32")
    torch.testing.assert_close(chosen.double(), torch.exp2(x.double()), rtol=1e-6, atol=0)


def test_exp2_polynomial_keeps_nan():
    x = torch.tensor([float("nan"), -1.0] + [0.0] * 14, device=kernel_device())
    polynomial, chosen = _run(x, "ieee")
    assert torch.isnan(polynomial[0]) and torch.isnan(chosen[0]) and polynomial[1].item() == 0.5
