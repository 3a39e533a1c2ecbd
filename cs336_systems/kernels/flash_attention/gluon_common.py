"""What the Gluon (Hopper) attention kernels share: TMA tile descriptors, the program-to-tile map, P^T from S^T,
the TMA reduce-add that Gluon does not expose, and the host-side argument lists.

The kernels themselves are in hopper_forward.py (the forward), hopper_backward.py (the two backward passes) and
hopper_one_pass.py (the warp-specialised one-pass backward); each imports from here (and its launch record,
`GluonPass`, from launches.py) and from no other.
"""

from __future__ import annotations

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import tma

from cs336_systems.kernels.flash_attention.forward import LOG2E


@triton.constexpr_function
def tile_layout(element_bits):
    # Rows of 64 or 128 elements of 16 bits are >= 128 bytes: the widest swizzle.
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=element_bits, rank=2)


@triton.constexpr_function
def wgmma_layout(warps, columns):
    """The register layout of a wgmma result `columns` wide, its rows spread over `warps` warps (16 rows each)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, columns, 16])


@triton.constexpr_function
def operand_layout(result_layout):
    """A 16-bit A operand held in registers for a wgmma whose result has `result_layout`."""
    return gl.DotOperandLayout(operand_index=0, parent=result_layout, k_width=2)


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[tile at coord] += shared src, by the copy engine (cp.reduce.async.bulk.tensor, Hopper). Triton
    3.6 builds the op (create_async_tma_reduce) but Gluon does not expose it; as `tma.async_copy_shared_to_global`,
    it is waited for with `tma.store_wait`."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def row_tiles(base, n_rows, stride_row, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr):
    """A TMA descriptor over one (batch, head)'s (n_rows, HEAD_DIM) matrix, in BLOCK_ROWS-row tiles."""
    return tma.make_tensor_descriptor(base, shape=[n_rows, HEAD_DIM], strides=[stride_row, 1],
                                      block_shape=[BLOCK_ROWS, HEAD_DIM],
                                      layout=tile_layout(base.dtype.element_ty.primitive_bitwidth))


@gluon.jit
def query_tile_of_program(n_queries, n_heads, BLOCK_M: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(first query row, batch x head, batch, head) of this program in a (query tiles, batch x heads) grid.
    Causal: the longest rows first, so the grid's tail is short."""
    n_query_tiles = gl.cdiv(n_queries, BLOCK_M)
    query_tile = n_query_tiles - 1 - gl.program_id(0) if IS_CAUSAL else gl.program_id(0)
    batch_head = gl.program_id(1)
    b = (batch_head // n_heads).to(gl.int64)
    h = (batch_head % n_heads).to(gl.int64)
    return query_tile * BLOCK_M, batch_head, b, h


@gluon.jit
def probabilities_t(sT, lse2, offs_n, tile, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                    BLOCK_M: gl.constexpr, s_layout: gl.constexpr):
    """P^T of one (keys offs_n, query tile `tile`) block from S^T and L (log2 units): exp2 with the scale folded
    in; MASKED and causal: zero where the query comes before the key."""
    pT = gl.exp2(sT * qk_scale - lse2[None, :])
    if MASKED and IS_CAUSAL:
        offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        pT = gl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
    return pT


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)  # (batch, head, row); d is unit-stride (`eligible`)


def input_args(q4, k4, v4, do4, sm_scale: float) -> tuple[tuple, tuple]:
    """(row strides of Q, K, V, dO; sizes and scales) in the kernels' argument order."""
    strides = (*row_strides(q4), *row_strides(k4), *row_strides(v4), *row_strides(do4))
    sizes = (q4.shape[1], q4.shape[2], k4.shape[2], sm_scale * LOG2E.value, sm_scale)
    return strides, sizes


def one_pass_rows(n_queries: int) -> int:
    """Rows of the one-pass dQ accumulator per (batch, head): n_queries rounded up to whole 128-row tiles."""
    return triton.cdiv(n_queries, 128) * 128
