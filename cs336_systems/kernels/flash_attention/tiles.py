"""How the FlashAttention kernels' inner loops read (rows, head_dim) tiles of one (batch, head).

Two ways, chosen by the USE_TMA constexpr, behind one pair of helpers so the three kernels
(forward, dK/dV pass, dQ pass) spell it once:
* a block pointer at row 0, over the (rows, head_dim) matrix or, TRANSPOSED, over its
  (head_dim, rows) view (loads give (BLOCK_D, BLOCK_ROWS) tiles, the B operand of S = Q K^T);
  the loop advances it, and loads bound-check where MASKED or head_dim < BLOCK_D;
* a tensor descriptor (Hopper's copy engine), addressed by row: rows past the end and columns
  past head_dim read as zeros; the host checks unit stride along d and 16-byte alignment
  (`dispatch.tma_eligible`). A TRANSPOSED load transposes the (BLOCK_ROWS, BLOCK_D) tile.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def head_base(ptr, b, h, strides):
    """Where the matrix of batch b, head h starts (64-bit offsets: a tensor can pass 2^31 elements). `strides`:
    the tensor's (batch, head, row, d) strides, one tuple argument (the JIT specialises each element, so a unit
    stride along d is a constant)."""
    return ptr + b.to(tl.int64) * strides[0] + h.to(tl.int64) * strides[1]


@triton.jit
def row_block(base, n_rows, head_dim, strides, row0, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A block pointer to the (BLOCK_ROWS, BLOCK_D) tile at row `row0` of a (n_rows, head_dim) matrix."""
    return tl.make_block_ptr(base, shape=(n_rows, head_dim), strides=(strides[2], strides[3]), offsets=(row0, 0),
                             block_shape=(BLOCK_ROWS, BLOCK_D), order=(1, 0))


@triton.jit
def head_tile(ptr, b, h, strides, n_rows, head_dim, row0, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """`row_block` of batch b, head h's matrix."""
    return row_block(head_base(ptr, b, h, strides), n_rows, head_dim, strides, row0, BLOCK_ROWS, BLOCK_D)


@triton.jit
def operand_tiles(base, n_rows, head_dim, strides, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                  TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr):
    """The tiles of a (n_rows, head_dim) matrix at `base` that a loop walks BLOCK_ROWS rows at a time."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, head_dim], strides=[strides[2], 1],
                                         block_shape=[BLOCK_ROWS, BLOCK_D])
    elif TRANSPOSED:
        return tl.make_block_ptr(base, shape=(head_dim, n_rows), strides=(strides[3], strides[2]), offsets=(0, 0),
                                 block_shape=(BLOCK_D, BLOCK_ROWS), order=(0, 1))
    else:
        return row_block(base, n_rows, head_dim, strides, 0, BLOCK_ROWS, BLOCK_D)


@triton.jit
def load_tile(tiles, row, CHECKED: tl.constexpr, TRANSPOSED: tl.constexpr, USE_TMA: tl.constexpr):
    """The tile at `row` (descriptors; a block pointer is already there): (BLOCK_ROWS, BLOCK_D), or
    (BLOCK_D, BLOCK_ROWS) when TRANSPOSED. CHECKED: zero-fill past the matrix (block pointers)."""
    if USE_TMA:
        tile = tiles.load([row, 0])
        if TRANSPOSED:
            tile = tl.trans(tile)
    elif CHECKED:
        tile = tl.load(tiles, boundary_check=(0, 1), padding_option="zero")
    else:
        tile = tl.load(tiles)
    return tile


@triton.jit
def key_tile_ends(m0, n_keys, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """For the query tile at row m0: (where the key tiles it reads without a mask end, where its keys end).
    Whole key tiles below the diagonal need no mask; causal, the tiles on the diagonal (and a ragged last tile)
    do, and none past the tile's last query is read."""
    full_key_tiles_end = (n_keys // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        unmasked_end = tl.minimum(m0, full_key_tiles_end)
        masked_end = tl.minimum(m0 + BLOCK_M, n_keys)
    else:
        unmasked_end = full_key_tiles_end
        masked_end = n_keys
    return unmasked_end, masked_end


@triton.jit
def query_tile_of_program(n_queries, n_heads, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """(query tile, batch x head, batch, head) of this program in a (query tiles, batch x heads) grid.
    Causal: the last query tiles see the most keys, so they start first and the grid's tail is short."""
    n_query_tiles = tl.cdiv(n_queries, BLOCK_M)
    query_tile = n_query_tiles - 1 - tl.program_id(0) if IS_CAUSAL else tl.program_id(0)
    batch_head = tl.program_id(1)
    b, h = batch_head // n_heads, batch_head % n_heads
    return query_tile, batch_head, b, h
