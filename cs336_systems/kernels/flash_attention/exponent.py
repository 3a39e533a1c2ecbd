"""The softmax's exponential in the FlashAttention kernels: exp2 of log2-domain scores.

`tl.math.exp2` lowers to the GPU's approximate `ex2.approx.f32` (`scripts/exp2_accuracy.py` measures how far it is
from fp64), where PyTorch's fp32 softmax uses an accurate `expf`. The fp32-accurate backward (PRECISION other than
"tf32": the row statistics and the dK/dV and dQ passes, which recompute P) takes `exp2_polynomial` instead, within
one unit of fp32's epsilon: about ten FMAs an element beside the d FMAs of each score's IEEE dot, and no spill at
the shipped tiles (`scripts/flash_ptx_schedule.py --dtype fp32`: 128 registers, 0 B, as before). Fuzz case 8 (65 x
129 keys, d 96) had dV at 2.4x PyTorch's own error against fp64 (notes/flash_attention.md). The forward keeps the
instruction: there the polynomial pushed the fp32 64 x 64 tile from 94 registers to 128 and a spill, and the
backward does not read the forward's P. 16-bit inputs keep it everywhere (their P is rounded to 16 bits).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def exp2_polynomial(x):
    """2^x within one unit of fp32's epsilon: 2^n * 2^f with n = round(x) and f = x - n in [-0.5, 0.5] (exact),
    2^f = e^(f ln 2) by its degree-7 Taylor polynomial (truncation below 6e-9), 2^n from its exponent bits; 0 for x
    below -126 (and -inf), where the GPU's own exp2 flushes to zero too."""
    clamped = tl.maximum(x, -127.0, propagate_nan=tl.PropagateNan.ALL)  # (-inf stays finite; NaN stays NaN)
    n = tl.floor(clamped + 0.5)
    t = (clamped - n) * 0.6931471805599453
    p = 1.0 / 5040.0
    p = p * t + 1.0 / 720.0
    p = p * t + 1.0 / 120.0
    p = p * t + 1.0 / 24.0
    p = p * t + 1.0 / 6.0
    p = p * t + 0.5
    p = p * t + 1.0
    p = p * t + 1.0
    scale = ((tl.maximum(n, -126.0).to(tl.int32) + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(x < -126.0, 0.0, p * scale)


@triton.jit
def softmax_exp2(x, PRECISION: tl.constexpr):
    """exp2(x): the polynomial for fp32-accurate kernels (PRECISION "ieee" or "tf32x3"), else the instruction."""
    if PRECISION != "tf32":
        return exp2_polynomial(x)
    else:
        return tl.math.exp2(x)
