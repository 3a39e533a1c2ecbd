"""Which dot precision our FlashAttention kernels use for fp32 inputs.

bf16 / fp16 dots always run on tensor cores. fp32 has three choices (Triton's `input_precision`):

* "ieee": fp32 products on CUDA cores (FMA), the scores S = Q K^T summed in fp64 on the fp64 tensor cores and
  rounded once (`forward.scaled_scores`). torch.matmul's arithmetic, and our default. The fp64 sum is fast where
  fp64 is (A100, H100/H200: fp64 tensor cores); GPUs with 1/64-rate fp64 (most GeForce cards) pay for it in S,
  and "tf32x3" is their fast fp32-accurate choice.
* "tf32x3": each operand split into a TF32 high part and a TF32 low part, three tensor-core products
  (the low x low one dropped): close to fp32 accuracy at tensor-core speed. This is the arithmetic of SDPA's
  efficient (CUTLASS) backend for fp32 on sm_80 and later (`OpMultiplyAddFastF32`), so it is the like-for-like
  comparison with that baseline.
* "tf32": one TF32 product (10-bit mantissas), as torch does for fp32 under
  `torch.backends.cuda.matmul.allow_tf32 = True`.

Left unset, fp32 follows `allow_tf32` ("tf32" when set, else "ieee"), as torch's own matmuls do. Set it for
the process with `set_fp32_dot_precision` or the environment variable CS336_FLASH_FP32, or for a block with
`fp32_dot_precision(...)`; `flash_attention(..., fp32_precision=...)` sets it for one call. The autograd
Function records the precision its forward ran with and its backward uses the same.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

FP32_DOT_PRECISIONS = ("ieee", "tf32x3", "tf32")
ENV_VAR = "CS336_FLASH_FP32"


def checked(precision: str | None, where: str) -> str | None:
    """`precision` if it is one of FP32_DOT_PRECISIONS or None, else a ValueError naming `where`."""
    if precision is not None and precision not in FP32_DOT_PRECISIONS:
        raise ValueError(f"{where}: got {precision!r}; allowed: {', '.join(FP32_DOT_PRECISIONS)} "
                         "(or unset: follow torch.backends.cuda.matmul.allow_tf32)")
    return precision


_override: str | None = checked(os.environ.get(ENV_VAR) or None, ENV_VAR)


def set_fp32_dot_precision(precision: str | None) -> None:
    """The fp32 dot precision from now on (None: follow `allow_tf32`)."""
    global _override
    _override = checked(precision, "fp32 dot precision")


def fp32_dot_precision_override() -> str | None:
    """The precision set for fp32 (None where it follows `allow_tf32`)."""
    return _override


@contextmanager
def fp32_dot_precision(precision: str | None) -> Iterator[None]:
    """The fp32 dot precision inside the block (None: leave it as it is)."""
    global _override
    previous = _override
    if precision is not None:
        set_fp32_dot_precision(precision)
    try:
        yield
    finally:
        _override = previous


def dot_precision(dtype: torch.dtype) -> str:
    """The kernels' PRECISION for inputs of `dtype` (16-bit dots ignore it: "tf32" stands for tensor cores)."""
    if dtype != torch.float32:
        return "tf32"
    if _override is not None:
        return _override
    return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
