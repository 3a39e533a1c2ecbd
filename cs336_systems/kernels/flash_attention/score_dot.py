"""The fp32-accurate backward's scores S = Q K^T over the head dimension, in two chains.

An IEEE fp32 `tl.dot` is one FMA chain over its inner dimension: each score rounds its running sum d times. On the
H200 that chain put dV of fuzz case 8 (65 queries, 129 keys, d 96 padded to 128) at 3.4x PyTorch's own error
against fp64, over the 2x budget; with S summed in chains of a quarter of the head dim, added pairwise, 1.1x
(`scripts/flash_dv_probe.py`, notes/flash_attention.md). Quarters spill the backward's registers at d 128, halves
do not: `head_dim_dot` forms S as two dots of the same operands, each with the other half's columns of `a` zeroed
(an FMA with a zero product leaves the chain's sum exactly as it was), and adds them. Every pass that recomputes P
(the row statistics, the dK/dV pass, the dQ pass) forms S this way, so the row statistics' S and the dK/dV pass's
S^T stay bitwise alike. dP = dO V^T keeps one chain (dK and dQ were inside their budgets; D = rowsum(P dP) needs
dP formed alike in the row statistics and the passes). 16-bit, "tf32" and "tf32x3" dots are unchanged.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _added(x, y):
    """x + y, out of reach of Triton's dot-add combine (which rewrites `x + tl.dot(a, b)` as `tl.dot(a, b, x)` and so
    would chain one chunk's products onto the other's): the two stacked and summed, one rounding either way."""
    return tl.sum(tl.join(x, y), 2)


@triton.jit
def head_dim_dot(a, b, PRECISION: tl.constexpr):
    """a @ b over the head dimension: with PRECISION "ieee" and an inner dimension of 64 or more, in two chains (the
    first and second half of it, each a dot of `a` with the other half's columns zeroed), added; otherwise one
    `tl.dot`."""
    if PRECISION == "ieee" and a.shape[1] >= 64:
        columns = tl.arange(0, a.shape[1])[None, :]
        low = tl.dot(tl.where(columns < a.shape[1] // 2, a, 0.0), b, input_precision=PRECISION)
        high = tl.dot(tl.where(columns >= a.shape[1] // 2, a, 0.0), b, input_precision=PRECISION)
        result = _added(low, high)
    else:
        result = tl.dot(a, b, input_precision=PRECISION)
    return result
