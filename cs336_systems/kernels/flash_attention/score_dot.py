"""The fp32-accurate backward's products over the head dimension (S = Q K^T and dP = dO V^T), in short chains.

An IEEE fp32 `tl.dot` is one FMA chain over its inner dimension: each score rounds its running sum d times. At
d 96 (padded to 128) that chain alone put dV of fuzz case 8 at about 3e-7 from fp64 in a CPU emulation, where
chains of 32 summed pairwise left 1.6e-7 (twelve random inputs of the case's shape; notes/flash_attention.md),
about what cuBLAS's fp32 GEMM reaches for PyTorch's own reference. `head_dim_dot` splits the inner dimension into
halves (d >= 64) or quarters (d >= 128), one dot each, and adds the partial products in a fixed pairwise order, so
the row statistics' S and the dK/dV pass's S^T stay bitwise alike (every chain has the same order whichever
operand is transposed). 16-bit and "tf32"/"tf32x3" dots are unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _column_halves(a):
    """(M, K) -> its columns [0, K / 2) and [K / 2, K)."""
    return tl.split(tl.permute(tl.reshape(a, (a.shape[0], 2, a.shape[1] // 2)), (0, 2, 1)))


@triton.jit
def _row_halves(b):
    """(K, N) -> its rows [0, K / 2) and [K / 2, K)."""
    return tl.split(tl.permute(tl.reshape(b, (2, b.shape[0] // 2, b.shape[1])), (1, 2, 0)))


@triton.jit
def _added(x, y):
    """x + y, out of reach of Triton's dot-add combine (which rewrites `x + tl.dot(a, b)` as `tl.dot(a, b, x)` and so
    would chain one chunk's products onto the other's): the two stacked and summed, one rounding either way."""
    return tl.sum(tl.join(x, y), 2)


@triton.jit
def head_dim_dot(a, b, PRECISION: tl.constexpr):
    """a @ b over the head dimension: with PRECISION "ieee" and an inner dimension of 64 or more, in chains of half
    (64 <= K < 128) or a quarter of it, added pairwise; otherwise one `tl.dot`."""
    if PRECISION != "ieee" or a.shape[1] < 64:
        return tl.dot(a, b, input_precision=PRECISION)
    a0, a1 = _column_halves(a)
    b0, b1 = _row_halves(b)
    if a.shape[1] < 128:
        return _added(tl.dot(a0, b0, input_precision=PRECISION), tl.dot(a1, b1, input_precision=PRECISION))
    a00, a01 = _column_halves(a0)
    a10, a11 = _column_halves(a1)
    b00, b01 = _row_halves(b0)
    b10, b11 = _row_halves(b1)
    first = _added(tl.dot(a00, b00, input_precision=PRECISION), tl.dot(a01, b01, input_precision=PRECISION))
    second = _added(tl.dot(a10, b10, input_precision=PRECISION), tl.dot(a11, b11, input_precision=PRECISION))
    return _added(first, second)
