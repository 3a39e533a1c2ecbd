"""The worked example: y = (weight * x).sum(-1), forward and backward in Triton.

Read this before the FlashAttention kernels: it has every layer they have, small.

* Shapes. x: (..., D) flattened to (rows, D); weight: (D,); y: (...).
* Forward. Each program owns ROWS_TILE rows and walks across D in D_TILE columns with
  block pointers (`tl.make_block_ptr` + `tl.advance`), which handle the ragged last tile
  through `boundary_check` and zero padding. The running sum is fp32 in registers.
* Backward. dx = dy[:, None] * weight[None, :] is elementwise, tile by tile. dweight =
  sum_rows dy[:, None] * x needs a reduction over rows, which crosses programs: each program
  writes its partial sum for its rows into a (programs, D) buffer and torch sums that buffer
  (no atomics, so the result is deterministic).
* Tiles. ROWS_TILE=16 rows x D_TILE (next power of two of D, at most 128): a register tile
  of at most 2k elements per program; plenty for an op that is memory-bound anyway.
"""

from __future__ import annotations

import torch

from cs336_systems.kernels._triton_utils import cdiv, check_kernel_device


def weighted_sum_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x: (..., D), weight: (D,) -> (...)."""
    return (weight * x).sum(-1)


def _jit():
    """Build the kernels on first use (Triton is imported only when a kernel runs)."""
    import triton
    import triton.language as tl

    @triton.jit
    def weighted_sum_fwd(x_ptr, weight_ptr, y_ptr, x_stride_row, x_stride_dim, weight_stride, y_stride,
                         ROWS, D, ROWS_TILE: tl.constexpr, D_TILE: tl.constexpr):
        row_tile = tl.program_id(0)
        x_block = tl.make_block_ptr(x_ptr, shape=(ROWS, D), strides=(x_stride_row, x_stride_dim),
                                    offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE), order=(1, 0))
        w_block = tl.make_block_ptr(weight_ptr, shape=(D,), strides=(weight_stride,), offsets=(0,),
                                    block_shape=(D_TILE,), order=(0,))
        y_block = tl.make_block_ptr(y_ptr, shape=(ROWS,), strides=(y_stride,), offsets=(row_tile * ROWS_TILE,),
                                    block_shape=(ROWS_TILE,), order=(0,))
        acc = tl.zeros((ROWS_TILE,), dtype=tl.float32)
        for _ in range(0, D, D_TILE):
            x = tl.load(x_block, boundary_check=(0, 1), padding_option="zero")  # (ROWS_TILE, D_TILE)
            w = tl.load(w_block, boundary_check=(0,), padding_option="zero")  # (D_TILE,)
            acc += tl.sum(x.to(tl.float32) * w.to(tl.float32)[None, :], axis=1)
            x_block = tl.advance(x_block, (0, D_TILE))
            w_block = tl.advance(w_block, (D_TILE,))
        tl.store(y_block, acc.to(y_block.dtype.element_ty), boundary_check=(0,))

    @triton.jit
    def weighted_sum_bwd(x_ptr, weight_ptr, dy_ptr, dx_ptr, dweight_partial_ptr, x_stride_row, x_stride_dim,
                         weight_stride, dy_stride, dx_stride_row, dx_stride_dim, partial_stride_row,
                         partial_stride_dim, ROWS, D, ROWS_TILE: tl.constexpr, D_TILE: tl.constexpr):
        row_tile = tl.program_id(0)
        n_row_tiles = tl.num_programs(0)
        x_block = tl.make_block_ptr(x_ptr, shape=(ROWS, D), strides=(x_stride_row, x_stride_dim),
                                    offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE), order=(1, 0))
        w_block = tl.make_block_ptr(weight_ptr, shape=(D,), strides=(weight_stride,), offsets=(0,),
                                    block_shape=(D_TILE,), order=(0,))
        dy_block = tl.make_block_ptr(dy_ptr, shape=(ROWS,), strides=(dy_stride,), offsets=(row_tile * ROWS_TILE,),
                                     block_shape=(ROWS_TILE,), order=(0,))
        dx_block = tl.make_block_ptr(dx_ptr, shape=(ROWS, D), strides=(dx_stride_row, dx_stride_dim),
                                     offsets=(row_tile * ROWS_TILE, 0), block_shape=(ROWS_TILE, D_TILE),
                                     order=(1, 0))
        partial_block = tl.make_block_ptr(dweight_partial_ptr, shape=(n_row_tiles, D),
                                          strides=(partial_stride_row, partial_stride_dim), offsets=(row_tile, 0),
                                          block_shape=(1, D_TILE), order=(1, 0))
        dy = tl.load(dy_block, boundary_check=(0,), padding_option="zero").to(tl.float32)  # (ROWS_TILE,)
        for _ in range(0, D, D_TILE):
            x = tl.load(x_block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
            w = tl.load(w_block, boundary_check=(0,), padding_option="zero").to(tl.float32)
            tl.store(dx_block, (dy[:, None] * w[None, :]).to(dx_block.dtype.element_ty), boundary_check=(0, 1))
            # Padded rows hold x = 0, so they add nothing to the partial sum.
            tl.store(partial_block, tl.sum(dy[:, None] * x, axis=0, keep_dims=True), boundary_check=(0, 1))
            x_block = tl.advance(x_block, (0, D_TILE))
            w_block = tl.advance(w_block, (D_TILE,))
            dx_block = tl.advance(dx_block, (0, D_TILE))
            partial_block = tl.advance(partial_block, (0, D_TILE))

    return weighted_sum_fwd, weighted_sum_bwd


_KERNELS = None


def _kernels():
    global _KERNELS
    if _KERNELS is None:
        _KERNELS = _jit()
    return _KERNELS


ROWS_TILE = 16


def _d_tile(d: int) -> int:
    return min(128, max(16, 1 << (d - 1).bit_length()))


class WeightedSumFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() != 1 or x.shape[-1] != weight.shape[0]:
            raise ValueError(f"weighted_sum: weight must be (D,) with D = x.shape[-1] = {x.shape[-1]}, "
                             f"got weight of shape {tuple(weight.shape)}")
        check_kernel_device("weighted_sum", x, weight)
        d = x.shape[-1]
        x2d = x.reshape(-1, d)  # (rows, D); a view when x is contiguous
        rows = x2d.shape[0]
        y = torch.empty(rows, device=x.device, dtype=x.dtype)
        forward_kernel, _ = _kernels()
        forward_kernel[(cdiv(rows, ROWS_TILE),)](
            x2d, weight, y, x2d.stride(0), x2d.stride(1), weight.stride(0), y.stride(0), rows, d,
            ROWS_TILE=ROWS_TILE, D_TILE=_d_tile(d))
        ctx.save_for_backward(x2d, weight)
        ctx.leading_shape = x.shape[:-1]
        return y.view(x.shape[:-1])

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x2d, weight = ctx.saved_tensors
        rows, d = x2d.shape
        dy = grad_y.reshape(-1).contiguous()  # (rows,)
        dx = torch.empty_like(x2d)
        n_tiles = cdiv(rows, ROWS_TILE)
        partial = torch.empty(n_tiles, d, device=x2d.device, dtype=torch.float32)
        _, backward_kernel = _kernels()
        backward_kernel[(n_tiles,)](
            x2d, weight, dy, dx, partial, x2d.stride(0), x2d.stride(1), weight.stride(0), dy.stride(0),
            dx.stride(0), dx.stride(1), partial.stride(0), partial.stride(1), rows, d,
            ROWS_TILE=ROWS_TILE, D_TILE=_d_tile(d))
        return dx.view(*ctx.leading_shape, d), partial.sum(0).to(weight.dtype)


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(weight * x).sum(-1) with Triton kernels; x: (..., D), weight: (D,) -> (...)."""
    return WeightedSumFunction.apply(x, weight)
