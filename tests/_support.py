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
