"""What the Gluon (Hopper) attention kernels share: TMA tile descriptors, the program-to-tile map, P^T from S^T,
the TMA reduce-add that Gluon does not expose, and the host-side argument lists.

The kernels themselves are in hopper_forward.py (the forward), hopper_backward.py (the two backward passes) and
hopper_one_pass.py (the warp-specialised one-pass backward); each imports from here (and its launch record,
`GluonPass`, from launches.py) and from no other.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import triton
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from cs336_systems.kernels._triton_utils import cdiv
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


@triton.constexpr_function
def tile_rows(block_shape):
    """The rows of a descriptor's tile: (rows, d) in the kernels' own, (1, 1, rows, d) in the host's 4D ones."""
    return block_shape[len(block_shape) - 2]


@gluon.jit
def copy_rows_in(desc, b, h, row, bar, smem, pred, HOST: gl.constexpr):
    """Start the copy engine on one tile of batch b, head h's rows from `row` on, into smem (rows, d), signalling
    bar: through a descriptor of that head made in the kernel (`head_row_tiles`), or (HOST) the host's 4D
    descriptor over (batch, heads, rows, d), made once per launch (`host_row_tiles`)."""
    if HOST:
        tma.async_copy_global_to_shared(desc, [b.to(gl.int32), h.to(gl.int32), row, 0], bar,
                                        smem.reshape([1, 1, smem.shape[0], smem.shape[1]]), pred=pred)
    else:
        tma.async_copy_global_to_shared(desc, [row, 0], bar, smem, pred=pred)


@gluon.jit
def copy_rows_out(desc, b, h, row, smem, HOST: gl.constexpr):
    """`copy_rows_in`'s way back: smem (rows, d) to batch b, head h's rows from `row` on (rows past the end clipped)."""
    if HOST:
        tma.async_copy_shared_to_global(desc, [b.to(gl.int32), h.to(gl.int32), row, 0],
                                        smem.reshape([1, 1, smem.shape[0], smem.shape[1]]))
    else:
        tma.async_copy_shared_to_global(desc, [row, 0], smem)


@gluon.jit
def head_row_tiles(ptr, b, h, strides, n_rows, BLOCK_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                   HOST: gl.constexpr = False):
    """`row_tiles` of batch b, head h's matrix; `strides`: the tensor's (batch, head, row) strides, one tuple
    argument (`row_strides`). HOST: `ptr` is already the host's 4D descriptor (`host_row_tiles`), taken as it is
    (`copy_rows_in` addresses its tiles by batch and head)."""
    if HOST:
        tiles = ptr
    else:
        tiles = row_tiles(ptr + b * strides[0] + h * strides[1], n_rows, strides[2], BLOCK_ROWS, HEAD_DIM)
    return tiles


@gluon.jit
def backward_input_tiles(Q, K, V, dO, b, h, input_strides, n_queries, n_keys,
                         BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                         HOST: gl.constexpr = False):
    """The backward's input descriptors of batch b, head h: (Q, dO) in BLOCK_M-row tiles, (K, V) in BLOCK_N.
    `input_strides`: the row strides of Q, K, V and dO, one tuple argument (`input_args`). HOST: the four are the
    host's descriptors already (`head_row_tiles`)."""
    q_desc = head_row_tiles(Q, b, h, input_strides[0], n_queries, BLOCK_M, HEAD_DIM, HOST)
    do_desc = head_row_tiles(dO, b, h, input_strides[3], n_queries, BLOCK_M, HEAD_DIM, HOST)
    k_desc = head_row_tiles(K, b, h, input_strides[1], n_keys, BLOCK_N, HEAD_DIM, HOST)
    v_desc = head_row_tiles(V, b, h, input_strides[2], n_keys, BLOCK_N, HEAD_DIM, HOST)
    return q_desc, do_desc, k_desc, v_desc


@gluon.jit
def key_tile_buffers(q_desc, do_desc, k_desc, v_desc, STAGES: gl.constexpr):
    """Shared memory of a program that owns one key tile: K and V once, and rings of STAGES slots for the query
    side's Q, dO (TMA) and L, D (cp.async) tiles. (k, v, q ring, dO ring, L ring, D ring)."""
    BLOCK_M: gl.constexpr = tile_rows(q_desc.block_type.shape)  # (the kernels' 2D descriptors or the host's 4D)
    BLOCK_N: gl.constexpr = tile_rows(k_desc.block_type.shape)
    HEAD_DIM: gl.constexpr = q_desc.block_type.shape[len(q_desc.block_type.shape) - 1]
    dtype: gl.constexpr = q_desc.dtype
    layout: gl.constexpr = tile_layout(dtype.primitive_bitwidth)
    k_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, HEAD_DIM], layout)
    q_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, HEAD_DIM], layout)
    stats_layout: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    delta_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], stats_layout)
    return k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem


@gluon.jit
def key_value_rings(k_desc, v_desc, STAGES: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr):
    """Shared memory of a program that owns one query tile and streams the key tiles: rings of STAGES slots for K
    and V, a barrier for its Q tile, and a ready barrier per slot of each ring, initialised; with EMPTY_ARRIVALS > 0
    also an empty barrier per slot (released by that many arrivals: the warp-specialised forward's consumers),
    else the ready barriers stand in for them unused. Allocated right after the caller's Q buffer, in this order.
    (k ring, v ring, q barrier, k ready, v ready, k empty, v empty)"""
    BLOCK_N: gl.constexpr = tile_rows(k_desc.block_type.shape)  # (the kernels' 2D descriptors or the host's 4D)
    HEAD_DIM: gl.constexpr = k_desc.block_type.shape[len(k_desc.block_type.shape) - 1]
    layout: gl.constexpr = tile_layout(k_desc.dtype.primitive_bitwidth)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if EMPTY_ARRIVALS > 0:
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    else:
        k_empty, v_empty = k_ready, v_ready
    mbarrier.init(q_bar, count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(slot), count=1)
        mbarrier.init(v_ready.index(slot), count=1)
        if EMPTY_ARRIVALS > 0:
            mbarrier.init(k_empty.index(slot), count=EMPTY_ARRIVALS)
            mbarrier.init(v_empty.index(slot), count=EMPTY_ARRIVALS)
    return k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty


@gluon.jit
def key_tile_of_program(n_heads, BLOCK_N: gl.constexpr):
    """(first key row, batch x head, batch, head) of this program in a (key tiles, batch x heads) grid."""
    batch_head = gl.program_id(1)
    b = (batch_head // n_heads).to(gl.int64)
    h = (batch_head % n_heads).to(gl.int64)
    return gl.program_id(0) * BLOCK_N, batch_head, b, h


@gluon.jit
def ring_step(bars, a_ring, b_ring, tile, first_tile, STAGES: gl.constexpr):
    """(step, slot, a tile, b tile) of `tile` in two rings of STAGES buffers filled from `first_tile` on, once the
    slot's copies have landed."""
    step = tile - first_tile
    slot = step % STAGES
    mbarrier.wait(bars.index(slot), (step // STAGES) & 1)
    return step, slot, a_ring.index(slot), b_ring.index(slot)


@gluon.jit
def score_products(a, b_tile, c, d_tile, layout: gl.constexpr):
    """Issue S = a b_tile^T and dP = c d_tile^T (or their transposes, with the roles swapped), fp32 in `layout`;
    both stay in flight, so the caller's exponentials can overlap the second."""
    ROWS: gl.constexpr = a.shape[0]
    COLUMNS: gl.constexpr = b_tile.shape[0]
    zeros = gl.zeros([ROWS, COLUMNS], gl.float32, layout)
    s = warpgroup_mma(a, b_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
    dp = warpgroup_mma(c, d_tile.permute((1, 0)), zeros, use_acc=False, is_async=True)
    return s, dp


@gluon.jit
def store_key_gradients(dk, dv, sm_scale, k_buffer, v_buffer, dk_desc, dv_desc, row0, b=0, h=0,
                        HOST: gl.constexpr = False):
    """dK (scaled here) and dV out through K's and V's shared buffers, which the caller has finished reading
    (TMA clips rows past the end); HOST: through the host's 4D descriptors (`copy_rows_out`)."""
    dtype: gl.constexpr = k_buffer.dtype
    k_buffer.store((dk * sm_scale).to(dtype))
    v_buffer.store(dv.to(dtype))
    gl.thread_barrier()
    fence_async_shared()
    copy_rows_out(dk_desc, b, h, row0, k_buffer, HOST)
    copy_rows_out(dv_desc, b, h, row0, v_buffer, HOST)
    tma.store_wait(pendings=0)


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


@gluon.jit
def zero_first_row_t(dsT, tile, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                     s_layout: gl.constexpr):
    """dS^T with the first query's column zeroed in a masked causal tile: that row sees one key, its P is 1 and
    dS = P (dP - D) is exactly 0 in PyTorch's softmax backward, where D from O and dO would leave a rounding
    residue (as the tl kernels and the PyTorch class do)."""
    if MASKED and IS_CAUSAL:
        offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
        dsT = gl.where(offs_m[None, :] == 0, 0.0, dsT)
    return dsT


def host_descriptors_default() -> bool:
    """Whether the shipped Gluon passes (the in-warpgroup forward, the two-pass backward) take the host's tensor
    descriptors (`host_row_tiles`) instead of making their own per program: yes unless CS336_FLASH_HOST_DESCRIPTORS=0,
    read when a launch plan is made. On an H100 at the d 64 shapes where ours trailed cuDNN, each pass ran 5-23 %
    faster on them at the shipped tiles (notes/flash_attention.md, results/attention-tune.jsonl)."""
    return os.environ.get("CS336_FLASH_HOST_DESCRIPTORS", "1") != "0"


def host_row_tiles(t4: torch.Tensor, rows: int):
    """A host TMA descriptor over a (batch, heads, rows, d) tensor in (1, 1, rows, d) tiles, any strides the copy
    engine takes (`tma_eligible`): the model's head views included. Made once per launch, where `head_row_tiles`
    makes one per program (each a descriptor written to global memory and fenced)."""
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=t4.element_size() * 8, rank=4)
    return TensorDescriptor(t4, list(t4.shape), list(t4.stride()), [1, 1, rows, t4.shape[3]], layout)


def on_host_descriptors(gluon_pass, tiles: dict[int, str]):
    """`gluon_pass` (a `launches.GluonPass`) with HOST_DESCRIPTORS set and the (batch, heads, rows, d) tensors at
    the argument positions `tiles` names passed as the host's descriptors (`host_row_tiles`) in tiles of BLOCK_M
    ("M") or BLOCK_N ("N") rows, made per launch for the config's tiles (`GluonPass.args_for`). An empty batch keeps
    the kernel's own: a descriptor's sizes must be positive, and nothing runs."""
    if gluon_pass.args[0].numel() == 0:
        return gluon_pass

    def args_for(block_m: int, block_n: int) -> tuple:
        rows = {"M": block_m, "N": block_n}
        args = list(gluon_pass.args)
        for position, side in tiles.items():
            args[position] = host_row_tiles(args[position], rows[side])
        return tuple(args)

    return dataclasses.replace(gluon_pass, flags=gluon_pass.flags | dict(HOST_DESCRIPTORS=True), args_for=args_for)


# The argument positions of Q, K, V and dO (O in the forward) in every Gluon pass, by the rows of their tiles.
INPUT_TILES = {0: "M", 1: "N", 2: "N", 3: "M"}


def row_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """A tensor's (batch, head, row) strides, the kernels' tuple argument; d is unit-stride (`eligible`)."""
    return t.stride(0), t.stride(1), t.stride(2)


def input_args(q4, k4, v4, do4, sm_scale: float) -> tuple[tuple, tuple]:
    """(the row strides of Q, K, V, dO: the kernels' `input_strides` argument; sizes and scales, in the kernels'
    argument order)."""
    input_strides = (row_strides(q4), row_strides(k4), row_strides(v4), row_strides(do4))
    sizes = (q4.shape[1], q4.shape[2], k4.shape[2], sm_scale * LOG2E.value, sm_scale)
    return input_strides, sizes


def key_grad_strides(dk4, dv4) -> tuple[tuple, tuple]:
    """The row strides of dK and dV: the key-gradient kernels' `key_grad_strides` argument."""
    return row_strides(dk4), row_strides(dv4)


def check_dq_accum(dq_accum: torch.Tensor, q4: torch.Tensor) -> int:
    """The one-pass kernels' accumulator contract: contiguous fp32 (batch x heads, `one_pass_rows`, d). Returns
    its rows per (batch, head)."""
    batch, heads, n_queries, head_dim = q4.shape
    expected = (batch * heads, one_pass_rows(n_queries), head_dim)
    if tuple(dq_accum.shape) != expected or not dq_accum.is_contiguous() or dq_accum.dtype != torch.float32:
        raise ValueError(f"dq_accum: got {dq_accum.dtype} of shape {tuple(dq_accum.shape)}; expected a contiguous "
                         f"fp32 buffer of shape {expected}")
    return expected[1]


def one_pass_rows(n_queries: int) -> int:
    """Rows of the one-pass dQ accumulator per (batch, head): n_queries rounded up to whole 128-row tiles."""
    return cdiv(n_queries, 128) * 128
