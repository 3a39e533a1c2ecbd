"""FlashAttention-2 backward in one pass on Hopper, warp-specialised (FA3's design), in Gluon.

Why: the two passes of hopper_backward.py execute 7 tensor-core products per (query tile, key tile) pair,
because the dQ pass recomputes S and dP; one pass executes 5 and adds each key tile's share of dQ into fp32
rows that the programs of other key tiles add to as well. hopper_backward's one-pass kernel (DQ_SPLIT > 0)
does that with 8 warps in lockstep and spills at d 128 (notes/flash_attention.md, versions 7 and 9). Here a
program owns 128 keys, and it is split into three partitions:

    producer (1 warp)          K and V once; then per query tile Q and dO by TMA and L and D by cp.async,
                               into a ring of STAGES slots, each signalled by one mbarrier
    consumer h = 0, 1          keys n0 + 64 h .. + 63: S^T, dP^T, P^T, dS^T, dV += P^T dO, dK += dS^T Q;
    (a warpgroup each,         dS^T into its half of a shared (128 keys, 64 queries) buffer; once both halves
     240 registers)            are in (an mbarrier of count 2), 64 of dQ's columns over all 128 keys:
                               dS K[:, cols], staged in shared memory and added into fp32 rows by TMA
                               reduce-add. At d 128 consumer h takes columns 64 h .. + 63 every step; at
                               d 64 (one block of 64 columns) the consumers take turns, h on steps of
                               parity h, so each waits for the whole dS only on its own steps

The consumers share no CTA barrier, so they drift apart: one forms P and dS while the other's products run.
Register reallocation (`setmaxnreg`) gives the consumers what the producer does not need.

Scope: Hopper, fp16/bf16, head dim 64 or 128 (dQ's products are 64 columns wide, the 128-byte swizzle's
width), `hopper_backward.eligible` inputs with TMA strides, more than one query row
(`hopper_backward.one_pass_eligible`), any lengths. It is `backward="fused"` at those head dims
(`dispatch.backward_launches`), the default backward where `hopper_backward.one_pass_by_default` says, and
attention-tune's kernel `fused-gluon-ws`.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.kernels._triton_utils import cdiv
from cs336_systems.kernels.flash_attention import gluon_common
from cs336_systems.kernels.flash_attention.launches import GluonPass

HEAD_DIMS = (64, 128)
KEYS_PER_CONSUMER = gl.constexpr(64)
DQ_COLUMNS = gl.constexpr(64)  # the width of one dQ product: half of d 128, all of d 64
# (BLOCK_M query rows per step, BLOCK_N keys per program = 2 consumers x 64, warps of the first consumer, STAGES)
# per head dim
CONFIG = {64: (64, 128, 4, 2), 128: (64, 128, 4, 2)}


@gluon.jit
def _producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar,
              ready, empty, lse_row, delta_row, n0, first_tile, last_tile, n_queries, STAGES: gl.constexpr):
    BLOCK_M: gl.constexpr = q_desc.block_type.shape[0]
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [n0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [n0, 0], kv_bar, v_smem)
    rows_layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[BLOCK_M // 32], threads_per_warp=[32],
                                                 warps_per_cta=[1], order=[0])
    for tile in range(first_tile, last_tile):
        step = tile - first_tile
        slot = step % STAGES
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)  # a fresh barrier passes the first round
        # L and D by cp.async (rows past n_queries read as zeros: their Q and dO rows are zeros too, so they add
        # nothing). Each thread's arrive is counted before the expect below completes the phase.
        offs = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=rows_layout)
        inside = offs < n_queries
        async_copy.async_copy_global_to_shared(lse_smem.index(slot), lse_row + offs, mask=inside)
        async_copy.async_copy_global_to_shared(delta_smem.index(slot), delta_row + offs, mask=inside)
        async_copy.mbarrier_arrive(ready.index(slot))
        mbarrier.expect(ready.index(slot), 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [tile * BLOCK_M, 0], ready.index(slot), q_smem.index(slot))
        tma.async_copy_global_to_shared(do_desc, [tile * BLOCK_M, 0], ready.index(slot), do_smem.index(slot))


@gluon.jit
def _add_dq_share(dk, dv, ds_tile, k_columns, stage, dq_desc, ds_full, phase, slot_empty, row, column, sm_scale,
                  share_layout: gl.constexpr):
    """Once both halves of dS are in `ds_tile` (`ds_full` at `phase`): dQ[row:, column:] += sm_scale * dS (queries
    x 128 keys) K[:, columns], staged in `stage` and added by TMA reduce-add. Waits for this step's dK and dV
    products too, and releases the query slot. (dk, dv)"""
    BLOCK_M: gl.constexpr = ds_tile.shape[1]
    mbarrier.wait(ds_full, phase)
    share = warpgroup_mma(ds_tile.permute((1, 0)), k_columns,
                          gl.zeros([BLOCK_M, DQ_COLUMNS], gl.float32, share_layout), use_acc=False, is_async=True)
    share, dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(share, dk, dv))
    mbarrier.arrive(slot_empty)  # every product that read this slot has retired
    stage.store(share * sm_scale)
    fence_async_shared()
    gl.thread_barrier()
    gluon_common.tma_reduce_add(dq_desc, [row, column], stage)
    return dk, dv


@gluon.jit
def _query_tiles(dk, dv, half: gl.constexpr, k_half, v_half, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
                 dq_stage, dq_desc, ready, empty, ds_ready, offs_n, start_tile, end_tile, first_tile, qk_scale,
                 sm_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr,
                 DQ_BUFFERS: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
                 share_layout: gl.constexpr):
    """Add query tiles [start_tile, end_tile) to this consumer's dK and dV, and their dQ columns to the fp32 rows."""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    TAKE_TURNS: gl.constexpr = HEAD_DIM == DQ_COLUMNS  # d 64: one dQ product a step, by the consumers in turn
    dtype: gl.constexpr = q_smem.dtype
    for tile in range(start_tile, end_tile):
        step, slot, q_tile, do_tile = gluon_common.ring_step(ready, q_smem, do_smem, tile, first_tile, STAGES)
        sT, dpT = gluon_common.score_products(k_half, q_tile, v_half, do_tile, s_layout)
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
        lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * gluon_common.LOG2E
        pT = gluon_common.probabilities_t(sT, lse2, offs_n, tile, qk_scale, MASKED, IS_CAUSAL, BLOCK_M, s_layout)
        pT_low = gl.convert_layout(pT.to(dtype), op_layout)
        dv = warpgroup_mma(pT_low, do_tile, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        dsT = gluon_common.zero_first_row_t(pT * (dpT - delta[None, :]), tile, MASKED, IS_CAUSAL, BLOCK_M,
                                            s_layout).to(dtype)
        # This consumer's half of dS^T into the shared buffer of this step's parity. That buffer's readers two steps
        # ago (at d 128 both consumers, at d 64 the one whose turn it was) retired those products before they
        # signalled last step's buffer, which last step's reader waited for: at d 128 this consumer; at d 64 this
        # one too, unless it read the buffer two steps ago itself. This consumer's own reduction from DQ_BUFFERS
        # of its dQ products ago must have read its stage.
        tma.store_wait(pendings=DQ_BUFFERS - 1)
        ds_tile = ds_smem.index(step % 2)
        ds_tile.slice(half * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER, dim=0).store(dsT)
        fence_async_shared()
        gl.thread_barrier()  # (this partition's warps) every row is stored, and every stage is free
        mbarrier.arrive(ds_ready.index(step % 2))
        dk = warpgroup_mma(gl.convert_layout(dsT, op_layout), q_tile, dk, is_async=True)
        if TAKE_TURNS:
            # (new names: dk and dv are products in flight here, tensors once waited for in either branch)
            if step % 2 == half:  # each consumer waits only on the buffer of its own parity, every phase of it
                stage = dq_stage.index(half * DQ_BUFFERS + (step // 2) % DQ_BUFFERS)
                dk_done, dv_done = _add_dq_share(dk, dv, ds_tile, k_smem, stage, dq_desc, ds_ready.index(step % 2),
                                                 (step // 2) & 1, empty.index(slot), tile * BLOCK_M, 0, sm_scale,
                                                 share_layout)
            else:
                dk_done, dv_done = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
                mbarrier.arrive(empty.index(slot))  # every product that read this slot has retired
            dk, dv = dk_done, dv_done
        else:  # d 128: this consumer's columns, every step
            dk, dv = _add_dq_share(dk, dv, ds_tile, k_smem.slice(half * DQ_COLUMNS, DQ_COLUMNS, dim=1),
                                   dq_stage.index(half * DQ_BUFFERS + step % DQ_BUFFERS), dq_desc,
                                   ds_ready.index(step % 2), (step // 2) & 1, empty.index(slot), tile * BLOCK_M,
                                   half * DQ_COLUMNS, sm_scale, share_layout)
    return dk, dv


@gluon.jit
def _consumer(half: gl.constexpr, dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
              dq_stage, dq_desc, kv_bar, ready, empty, ds_ready, kv_done, n0, first_tile, last_tile, n_queries,
              qk_scale, sm_scale, IS_CAUSAL: gl.constexpr, STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr):
    """One consumer warpgroup: dK and dV of keys n0 + 64 * half onwards, and its share of dQ."""
    BLOCK_M: gl.constexpr = q_smem.shape[1]
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    s_layout: gl.constexpr = gluon_common.wgmma_layout(4, BLOCK_M)
    acc_layout: gl.constexpr = gluon_common.wgmma_layout(4, HEAD_DIM)
    share_layout: gl.constexpr = gluon_common.wgmma_layout(4, DQ_COLUMNS)
    op_layout: gl.constexpr = gluon_common.operand_layout(acc_layout)
    keys0 = n0 + half * KEYS_PER_CONSUMER
    k_half = k_smem.slice(half * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER, dim=0)
    v_half = v_smem.slice(half * KEYS_PER_CONSUMER, KEYS_PER_CONSUMER, dim=0)
    offs_n = keys0 + gl.arange(0, KEYS_PER_CONSUMER, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, acc_layout)  # each step waits for its products
    dv = gl.zeros([KEYS_PER_CONSUMER, HEAD_DIM], gl.float32, acc_layout)
    mbarrier.wait(kv_bar, 0)

    # The loops of hopper_backward.flash_dkdv_gluon_kernel: the diagonal tiles (masked), the tiles every key
    # sees in full, then the ragged last tile (masked).
    full_tiles_end = n_queries // BLOCK_M
    if IS_CAUSAL:
        diagonal_end = gl.minimum((n0 + 2 * KEYS_PER_CONSUMER) // BLOCK_M, last_tile)
        dk, dv = _query_tiles(dk, dv, half, k_half, v_half, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
                              dq_stage, dq_desc, ready, empty, ds_ready, offs_n, first_tile, diagonal_end, first_tile,
                              qk_scale, sm_scale, True, IS_CAUSAL, STAGES, DQ_BUFFERS, s_layout, op_layout,
                              share_layout)
        unmasked_start = diagonal_end
    else:
        unmasked_start = 0
    dk, dv = _query_tiles(dk, dv, half, k_half, v_half, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
                          dq_stage, dq_desc, ready, empty, ds_ready, offs_n, unmasked_start, full_tiles_end,
                          first_tile, qk_scale, sm_scale, False, IS_CAUSAL, STAGES, DQ_BUFFERS, s_layout,
                          op_layout, share_layout)
    dk, dv = _query_tiles(dk, dv, half, k_half, v_half, k_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem,
                          dq_stage, dq_desc, ready, empty, ds_ready, offs_n,
                          gl.maximum(unmasked_start, full_tiles_end), last_tile, first_tile, qk_scale, sm_scale,
                          True, IS_CAUSAL, STAGES, DQ_BUFFERS, s_layout, op_layout, share_layout)
    tma.store_wait(pendings=0)
    # K's buffer takes dK, V's dV on the way out (TMA clips rows past n_keys); the other consumer's dQ products
    # read all of K, so both must be done first.
    mbarrier.arrive(kv_done)
    mbarrier.wait(kv_done, 0)
    gluon_common.store_key_gradients(dk, dv, sm_scale, k_half, v_half, dk_desc, dv_desc, keys0)


@gluon.jit
def flash_bwd_one_pass_ws_kernel(Q, K, V, dO, L, Delta, dK, dV, DQ_ACCUM, input_strides, key_grad_strides,
                                 n_heads, n_queries, n_keys, qk_scale, sm_scale, dq_rows,
                                 IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                                 BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DQ_BUFFERS: gl.constexpr = 1,
                                 CONSUMER_REGS: gl.constexpr = 240):
    """One program per (128 keys, batch x head), launched with num_warps=4 (the first consumer): dK and dV written,
    sm_scale * dQ added into DQ_ACCUM, fp32 (batch x heads, dq_rows, HEAD_DIM), zeroed by the caller, dq_rows >=
    n_queries in whole tiles. DQ_BUFFERS: staging buffers of the dQ share per consumer (2 would let a step's
    reduction overlap the next step, but does not fit in shared memory beside 2 stages at d 128). CONSUMER_REGS:
    registers of the second consumer after reallocation (the producer keeps 24; the first consumer gets 256)."""
    gl.static_assert(BLOCK_N == 2 * KEYS_PER_CONSUMER, "two consumer warpgroups of 64 keys")
    gl.static_assert((HEAD_DIM == 64) | (HEAD_DIM == 128), "dQ's products 64 columns wide: the 128-byte swizzle")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    n0, batch_head, b, h = gluon_common.key_tile_of_program(n_heads, BLOCK_N)
    q_desc, do_desc, k_desc, v_desc = gluon_common.backward_input_tiles(
        Q, K, V, dO, b, h, input_strides, n_queries, n_keys, BLOCK_M, BLOCK_N, HEAD_DIM)
    dk_desc = gluon_common.head_row_tiles(dK, b, h, key_grad_strides[0], n_keys, KEYS_PER_CONSUMER, HEAD_DIM)
    dv_desc = gluon_common.head_row_tiles(dV, b, h, key_grad_strides[1], n_keys, KEYS_PER_CONSUMER, HEAD_DIM)
    dq_row = DQ_ACCUM + batch_head.to(gl.int64) * dq_rows * HEAD_DIM
    dq_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    dq_desc = tma.make_tensor_descriptor(dq_row, shape=[dq_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                         block_shape=[BLOCK_M, DQ_COLUMNS], layout=dq_layout)
    dtype: gl.constexpr = q_desc.dtype
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = gluon_common.key_tile_buffers(q_desc, do_desc, k_desc,
                                                                                          v_desc, STAGES)
    ds_layout: gl.constexpr = gluon_common.tile_layout(dtype.primitive_bitwidth)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    dq_stage = gl.allocate_shared_memory(gl.float32, [2 * DQ_BUFFERS, BLOCK_M, DQ_COLUMNS], dq_layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    kv_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    mbarrier.init(kv_done, count=2)
    for slot in gl.static_range(STAGES):
        mbarrier.init(ready.index(slot), count=1)
        mbarrier.init(empty.index(slot), count=2)  # one arrive per consumer warpgroup
    for parity in gl.static_range(2):
        mbarrier.init(ds_ready.index(parity), count=2)

    # Causal: the queries before this key tile see none of it (the early exit).
    first_tile = n0 // BLOCK_M if IS_CAUSAL else 0
    last_tile = gl.cdiv(n_queries, BLOCK_M)
    lse_row = L + batch_head.to(gl.int64) * n_queries
    delta_row = Delta + batch_head.to(gl.int64) * n_queries
    gl.warp_specialize([
        (_consumer, (0, dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_stage,
                     dq_desc, kv_bar, ready, empty, ds_ready, kv_done, n0, first_tile, last_tile, n_queries, qk_scale,
                     sm_scale, IS_CAUSAL, STAGES, DQ_BUFFERS)),
        (_consumer, (1, dk_desc, dv_desc, k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem, ds_smem, dq_stage,
                     dq_desc, kv_bar, ready, empty, ds_ready, kv_done, n0, first_tile, last_tile, n_queries, qk_scale,
                     sm_scale, IS_CAUSAL, STAGES, DQ_BUFFERS)),
        (_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, lse_smem, delta_smem, kv_bar,
                     ready, empty, lse_row, delta_row, n0, first_tile, last_tile, n_queries, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])


def one_pass(q4, k4, v4, do4, lse, delta, dq_accum, dk4, dv4, is_causal: bool, sm_scale: float) -> GluonPass:
    """`hopper_backward.fused_pass`'s contract on `flash_bwd_one_pass_ws_kernel` (head dim 64 or 128)."""
    batch, heads, n_queries, head_dim = q4.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim: got {head_dim}; the warp-specialised one-pass backward takes {HEAD_DIMS}")
    n_keys = k4.shape[2]
    dq_rows = gluon_common.check_dq_accum(dq_accum, q4)
    input_strides, sizes = gluon_common.input_args(q4, k4, v4, do4, sm_scale)
    return GluonPass(flash_bwd_one_pass_ws_kernel,
                     (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_accum, input_strides,
                      gluon_common.key_grad_strides(dk4, dv4), *sizes, dq_rows),
                     dict(IS_CAUSAL=bool(is_causal), HEAD_DIM=head_dim), CONFIG[head_dim],
                     lambda block_m, block_n: (cdiv(n_keys, block_n), batch * heads))
