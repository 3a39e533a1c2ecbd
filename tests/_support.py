"""Shared helpers for our own tests (named so the official suites' files never overwrite it)."""

from __future__ import annotations

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
requires_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                                     reason="the Gluon passes run on Hopper (sm_90)")


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
    ours, budget = error_and_budget(out, ref, torch_low_precision, factor)
    assert ours <= budget, f"{name}: max error {ours:.3e} > budget {budget:.3e} ({ours / budget:.2f}x)"


def error_and_budget(out: torch.Tensor, ref: torch.Tensor, torch_low_precision: torch.Tensor,
                     factor: float = 2.0) -> tuple[float, float]:
    """(our max error against `ref`, the budget `assert_within_budget` holds it to)."""
    ours = max_abs_error(out, ref)
    floor = factor * torch.finfo(out.dtype).eps * max(1.0, ref.double().abs().max().item())
    return ours, factor * max_abs_error(torch_low_precision, ref) + floor


def _in_triton_interpreter() -> bool:
    """Whether Triton's CPU interpreter is on the stack (it copies every kernel argument back itself)."""
    import os
    import sys

    frame = sys._getframe()
    while frame is not None:
        if frame.f_code.co_filename.endswith(os.path.join("triton", "runtime", "interpreter.py")):
            return True
        frame = frame.f_back
    return False


class CopyCounter:
    """Context manager recording the tensor copies (aten copy_, clone, _to_copy) run inside it, as
    (op, shape, strides) of the destination or source; the interpreter's own copies are left out."""

    COPIES = ("copy_", "clone", "_to_copy")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        copies = self.copies = []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if func.__name__.split(".")[0] in CopyCounter.COPIES and not _in_triton_interpreter():
                    copies.append((func.__name__, tuple(args[0].shape), args[0].stride()))
                return func(*args, **(kwargs or {}))

        self._mode = Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)

    def of_shape(self, *shapes) -> list:
        """The copies whose tensor has one of `shapes`, or, given an int, any dim of that size."""
        return [c for c in self.copies if any(c[1] == tuple(s) if not isinstance(s, int) else s in c[1]
                                              for s in shapes)]
