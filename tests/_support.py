"""Shared helpers for our own tests (named so the official suites' files never overwrite it)."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere counts as infinite error."""
    out64, ref64 = out.detach().double(), ref.detach().double()
    if torch.isnan(out64).any():
        return float("inf")
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64).clamp_min(1e-30)).item()


def kernel_device() -> str:
    """Where Triton kernels run in this test session: cuda, or cpu under the interpreter; skip otherwise."""
    import os

    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        try:
            import triton  # noqa: F401
        except ImportError:
            pytest.skip("triton is not installed")
        return "cpu"
    pytest.skip("needs CUDA or TRITON_INTERPRET=1")


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    if torch.isnan(out).any():
        return float("inf")
    return (out.double() - ref.double()).abs().max().item()


def assert_within_budget(name: str, out: torch.Tensor, ref: torch.Tensor, torch_low_precision: torch.Tensor,
                         factor: float = 2.0) -> None:
    """Our error against the high-precision reference may be at most `factor` x PyTorch's own error at the same
    low precision (Tri Dao's test idiom), plus `factor` rounding units of the output dtype at the reference's
    scale (machine epsilon x max(1, |ref|)): where PyTorch lands within an ulp (or a gradient is exactly zero),
    `factor` x its error is no budget at all."""
    ours = max_abs_error(out, ref)
    floor = factor * torch.finfo(out.dtype).eps * max(1.0, ref.double().abs().max().item())
    budget = factor * max_abs_error(torch_low_precision, ref) + floor
    assert ours <= budget, f"{name}: max error {ours:.3e} > budget {budget:.3e}"
