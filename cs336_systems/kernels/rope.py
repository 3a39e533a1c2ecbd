"""Fused rotary position embedding in Triton, on interleaved pairs as cs336_basics' RotaryEmbedding:
(x[2i], x[2i+1]) -> (cos t x[2i] - sin t x[2i+1], sin t x[2i] + cos t x[2i+1]), t = pos * theta^(-2i/dim).

Reference: `rope_reference(x, pos_ids, cache)`, the eager maths of RotaryEmbedding.forward.

Why a kernel: eagerly RoPE is about eight kernels per call (two strided slices, four multiplies,
an add, a subtract, a stack and a cast) on each of Q and K; this is one read and one write.
Backward is the inverse rotation (by -t) of the incoming gradient, the same kernel with the sign
of sin flipped; only the positions and the cos/sin cache are kept for it.

Layout: rows = every leading index of x (batch, heads, seq), one position id per row; a program
handles BLOCK_R rows x all dim/2 pairs, fp32 in registers, output in x's dtype.
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests.
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.kernels._triton_utils import check_kernel_device

BLOCK_R = 16


def rope_reference(x: torch.Tensor, pos_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x (..., seq, dim), pos_ids broadcastable to (..., seq), cache (2, context, dim/2) of cos, sin."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cache[:, pos_ids]
    return torch.stack((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1).flatten(-2).to(x.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(x_ptr, pos_ptr, cache_ptr, out_ptr, n_rows, half, context, SIGN: tl.constexpr,
                    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        mask = (rows[:, None] < n_rows) & (cols[None, :] < half)
        pos = tl.load(pos_ptr + rows, mask=rows < n_rows, other=0)
        angle = pos[:, None] * half + cols[None, :]
        cos = tl.load(cache_ptr + angle, mask=mask, other=0.0).to(tl.float32)
        sin = SIGN * tl.load(cache_ptr + context * half + angle, mask=mask, other=0.0).to(tl.float32)
        pair = rows[:, None] * (2 * half) + 2 * cols[None, :]
        x1 = tl.load(x_ptr + pair, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + pair + 1, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + pair, (cos * x1 - sin * x2).to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + pair + 1, (sin * x1 + cos * x2).to(out_ptr.dtype.element_ty), mask=mask)

    return rope_kernel


def _rotate(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, sign: float) -> torch.Tensor:
    import triton

    x = x.contiguous()
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    n_rows = pos.numel()
    if n_rows:
        _kernel()[(triton.cdiv(n_rows, BLOCK_R),)](x, pos, cache, out, n_rows, half, cache.shape[1], SIGN=sign,
                                                 BLOCK_R=BLOCK_R, BLOCK_H=triton.next_power_of_2(half))
    return out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pos, cache):
        ctx.save_for_backward(pos, cache)
        return _rotate(x, pos, cache, 1.0)

    @staticmethod
    def backward(ctx, grad_out):
        pos, cache = ctx.saved_tensors
        return _rotate(grad_out, pos, cache, -1.0), None, None


def rope(x: torch.Tensor, pos_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Fused RoPE. x (..., seq, dim) with dim even; pos_ids integer, broadcastable to (..., seq);
    cache (2, context, dim/2): cos and sin, as RotaryEmbedding's `_freq_cis_cache`."""
    if x.shape[-1] % 2 or cache.dim() != 3 or cache.shape[0] != 2 or cache.shape[2] != x.shape[-1] // 2:
        raise ValueError(f"rope: cache must be (2, context, {x.shape[-1] // 2}) for x of last dim {x.shape[-1]} "
                         f"(even), got {tuple(cache.shape)}")
    if pos_ids.dtype.is_floating_point:
        raise TypeError(f"rope: pos_ids must be integers, got {pos_ids.dtype}")
    check_kernel_device("rope", x, pos_ids, cache)
    pos = torch.broadcast_to(pos_ids, x.shape[:-1]).reshape(-1).to(torch.int64)  # one position per row
    if pos_ids.numel():
        # Checked on the device (no host sync that would stall eager launch pipelining); the eager path
        # would raise an index error instead of reading past the cache.
        torch._assert_async(((pos_ids >= 0) & (pos_ids < cache.shape[1])).all(),
                            f"rope: positions must be in [0, {cache.shape[1]})")
    return RoPEFunction.apply(x, pos, cache.contiguous())
