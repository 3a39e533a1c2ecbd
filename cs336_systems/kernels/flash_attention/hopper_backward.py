"""FlashAttention-2 backward on Hopper, in Gluon: the same two passes as backward.py, with the
tensor-core products issued asynchronously so that the exponentials overlap a product.

Why a second version: Triton 3.6's `tl.dot` pipeliner waits for every product whose result the loop
body reads (`wgmma.wait_group 0` after S and after dP), so inside a warpgroup the exponentials and the
tensor cores take turns (`scripts/flash_ptx_schedule.py`; notes/flash_attention.md, version 5).
Gluon, Triton's lower-level language, exposes the same wgmma with explicit waits. Each inner step
here (dK/dV pass; the dQ pass is the same with rows and columns swapped):

    issue S^T = K Q^T and dP^T = V dO^T         two products in flight
    wait until one is left                       S^T is ready; dP^T (and nothing older) still runs
    P^T = exp2(S^T * scale - L)                  the exponentials overlap dP^T
    issue dV += P^T dO
    wait until one is left                       dP^T is ready; dV still runs
    dS^T = P^T * (dP^T - D)                      overlaps dV
    issue dK += dS^T Q                           runs into the next step's first products

The Q/dO (K/V) tiles stream through a ring of STAGES shared-memory buffers filled by TMA (the copy
engine) and signalled by mbarriers; a buffer is refilled once the wait above has retired the
previous step's products that read it. L and D for the next step are loaded one step ahead.

Scope: Hopper (sm_90), fp16/bf16, head dim 64 or 128, unit stride along d and 16-byte aligned
strides; any sequence lengths (TMA reads rows past the end as zeros and clips stores; L = +inf there
makes P = 0) and n_queries != n_keys. `eligible` says which inputs qualify; the rest take the
`tl` kernels in backward.py.
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from cs336_systems.kernels._triton_utils import cdiv, interpreting
from cs336_systems.kernels.flash_attention import gluon_common
from cs336_systems.kernels.flash_attention.launches import GluonPass

HEAD_DIMS = (64, 128)

# (BLOCK_M, BLOCK_N, warps, stages) per pass and head dim: 16 rows of the outer tile per warp (one
# warpgroup per 64). The best of `cs336-bench attention-tune` on the H200 (results/attention-tune.jsonl,
# commit 29d5a4864034, bf16 causal 1x32x32768x128 and 4x32x16384x64). At d 128 the dK/dV pass on 64 x 128 tiles
# and 8 warps timed faster alone (fa2324a949c3: 29.71 against 30.90 ms) but slower as the whole backward
# (attention-train, f3400e79f873: 49.11 ms, 1.21x cuDNN's, against 1.19x at e8ccc0eab717): 64 x 64 stays.
DKDV_CONFIG = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
DQ_CONFIG = {64: (64, 64, 4, 2), 128: (64, 64, 4, 2)}
# The one-pass backward (the dK/dV kernel with DQ_SPLIT > 0): config and dQ column blocks per head dim
# (attention-tune, kernels fused-gluon-s1/-s2, commit 77d6a5936264).
FUSED_CONFIG = {64: (64, 64, 4, 2), 128: (64, 128, 8, 2)}
FUSED_DQ_SPLIT = {64: 1, 128: 2}
# KV_REGS of the dK/dV pass: 0 reads K and V from shared memory in S^T = K Q^T and dP^T = V dO^T, 1 holds K in
# registers, 2 both (the products then read only Q^T / dO^T from shared memory, half the bytes per FLOP).
# At d 64 both (attention-tune, dkdv-gluon-kv, a31dbf12a106: 16.42 against 17.29 ms at 4x32x16384x64); at d 128
# neither (K and V in registers spill there: 44.2 against 29.4 ms at 1x32x32768x128).
DKDV_KV_REGS = {64: 2, 128: 0}
# QDO_REGS of the dQ pass, the same choice for Q and dO in S = Q K^T and dP = dO V^T: neither, as measured
# (attention-tune, 60230c299994, 1x32x32768x128: 19.03 ms in shared memory, 19.85 with Q, 20.50 with both).
DQ_QDO_REGS = {64: 0, 128: 0}
# The passes the default backward runs in Gluon: those measured faster than their `tl` twins (notes/flash_attention.md;
# with the L/D ring, commit d89950878c24: both, 49.1 against 53.3 ms at 1x32x32768x128).
GLUON_PASSES = ("dkdv", "dq")
# Where the default backward is one pass instead (dQ reduced with TMA reduce-add: fp32 sums in arrival order, so not
# bit-reproducible run to run); `backward="two-pass"` keeps two passes. The warp-specialised kernel of
# hopper_one_pass.py, at these head dims, where its programs (128 keys each) at least fill the GPU and the keys are
# at least ONE_PASS_MIN_KEYS:
# - d 128: attention-tune, 9cc04fa79ec1, 1x32x32768x128: 41.40 ms against 47.69 for the two Gluon passes (the
#   lockstep one-pass kernel here 62.74).
# - d 64 (the consumers taking turns at dQ), H100, `device_run.sh session37` at 9b214716a97a: 24.16 against 26.58 ms
#   at 4x32x16384x64, 1.92 against 2.04 at 4x32x4096x64, 0.744 / 2.884 against 0.882 / 3.315 at 1x1x32768x64 /
#   1x1x65536x64.
# - Programs: at 1x1x8192 / 1x1x16384 the one pass has 64 / 128 programs, fewer than the SMs, and the dK/dV pass 128 /
#   256 (64 keys each). Backward ms, one pass against two (`session38`, 96d22451f868, H200): d 64 0.160 / 0.347
#   against 0.160 / 0.345 (H100: 0.193 / 0.370 against 0.158 / 0.347); d 128 0.329 / 0.634 against 0.225 / 0.536.
# - Keys: at 4x12x512x64 (the model's small sizes) the kernels take the same GPU time either way (0.0566 against
#   0.0573 ms fwd+bwd) and the one pass's extra launches (its fp32 dQ rows zeroed, then cast) cost host time (0.217
#   against 0.139 ms a call); at 4x12x2048x64, 0.347 against 0.351.
ONE_PASS_HEAD_DIMS: tuple[int, ...] = (64, 128)
ONE_PASS_MIN_KEYS = 4096
ONE_PASS_KEYS_PER_PROGRAM = 128  # hopper_one_pass.CONFIG's BLOCK_N


def one_pass_by_default(batch: int, heads: int, n_keys: int, head_dim: int, sms: int) -> bool:
    """Whether the default backward of (batch, heads, n_keys keys, head_dim) inputs on a GPU of `sms` SMs is one
    pass (the rule above); the caller checks that the inputs can take it (`one_pass_eligible`, TMA strides)."""
    return (head_dim in ONE_PASS_HEAD_DIMS and n_keys >= ONE_PASS_MIN_KEYS
            and batch * heads * cdiv(n_keys, ONE_PASS_KEYS_PER_PROGRAM) >= sms)


def eligible(q: torch.Tensor) -> bool:
    """Whether inputs like q (device, dtype, head dim) can take the Gluon passes; the caller also checks
    TMA strides (`dispatch.tma_eligible`). CS336_FLASH_GLUON=0 turns them off (the `tl` passes then run
    everywhere)."""
    if os.environ.get("CS336_FLASH_GLUON", "1") == "0" or interpreting():
        return False
    if q.device.type != "cuda" or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False  # wgmma is Hopper's; Blackwell has other tensor-core instructions
    return q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] in HEAD_DIMS


@gluon.jit
def _fill(bars, a_smem, b_smem, a_desc, b_desc, b, h, tile, slot, end_tile, BLOCK: gl.constexpr, HOST: gl.constexpr):
    """Start copying row tile `tile` of two matrices of batch b, head h into ring slot `slot` (nothing past
    end_tile); HOST: through the host's 4D descriptors (`gluon_common.copy_rows_in`)."""
    pred = tile < end_tile
    bar = bars.index(slot)
    mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=pred)
    gluon_common.copy_rows_in(a_desc, b, h, tile * BLOCK, bar, a_smem.index(slot), pred, HOST)
    gluon_common.copy_rows_in(b_desc, b, h, tile * BLOCK, bar, b_smem.index(slot), pred, HOST)


@gluon.jit
def _fill_stats(lse_smem, delta_smem, lse_row, delta_row, tile, slot, n_rows, BLOCK: gl.constexpr):
    """Start copying L and D of row tile `tile` into ring slot `slot` (cp.async, one commit group). Rows
    past n_rows read as zeros: their Q and dO rows are zeros too, so they add nothing to dK or dV."""
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[1], threads_per_warp=[32],
                                            warps_per_cta=[gl.num_warps()], order=[0])
    offs = tile * BLOCK + gl.arange(0, BLOCK, layout=layout)
    inside = offs < n_rows
    async_copy.async_copy_global_to_shared(lse_smem.index(slot), lse_row + offs, mask=inside)
    async_copy.async_copy_global_to_shared(delta_smem.index(slot), delta_row + offs, mask=inside)
    async_copy.commit_group()


@gluon.jit
def _row_stats(lse_row, delta_row, tile, n_rows, BLOCK: gl.constexpr, layout: gl.constexpr):
    """L (in log2 units) and D of row tile `tile`; rows past n_rows get L = +inf (P = 0) and D = 0."""
    offs = tile * BLOCK + gl.arange(0, BLOCK, layout=layout)
    inside = offs < n_rows
    lse = gl.load(lse_row + offs, mask=inside, other=float("inf"))
    delta = gl.load(delta_row + offs, mask=inside, other=0.0)
    return lse * gluon_common.LOG2E, delta


@gluon.jit
def _dkdv_query_tiles(dk, dv, k_smem, v_smem, q_smem, do_smem, bars, q_desc, do_desc, lse_smem, delta_smem,
                      lse_row, delta_row, offs_n, start_tile, end_tile, first_tile, last_tile, n_queries,
                      qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                      STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr,
                      k_tile, ds_smem, dq_target, sm_scale, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr,
                      DQ_BUFFERS: gl.constexpr, b, h, HOST: gl.constexpr):
    """Add query tiles [start_tile, end_tile) to one key tile's dK and dV; with DQ_SPLIT > 0 also add
    each query tile's share of dQ, dS K, into fp32 rows (dq_target: see `_dk_and_dq_share`; the one-pass
    backward)."""
    dtype: gl.constexpr = q_desc.dtype
    HEAD_DIM: gl.constexpr = q_smem.shape[2]
    for tile in range(start_tile, end_tile):
        step, slot, q_tile, do_tile = gluon_common.ring_step(bars, q_smem, do_smem, tile, first_tile, STAGES)
        sT, dpT = gluon_common.score_products(k_smem, q_tile, v_smem, do_tile, s_layout)
        async_copy.wait_group(STAGES - 2)  # this thread's copies of this tile's L and D have landed
        sT = warpgroup_mma_wait(num_outstanding=1, deps=(sT,))
        if DQ_SPLIT > 0 and DQ_TMA:
            # The dQ reductions issued DQ_BUFFERS - 1 steps ago have read the staging buffers this step fills.
            tma.store_wait(pendings=(DQ_BUFFERS - 1) * DQ_SPLIT)
        # The previous step's dV and dK products have retired too: every warp is past them, so their
        # slot can take the tile STAGES - 1 ahead (and every thread's L and D copies are visible).
        gl.thread_barrier()
        lse2 = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout)) * gluon_common.LOG2E
        ahead_slot = (step + STAGES - 1) % STAGES
        _fill(bars, q_smem, do_smem, q_desc, do_desc, b, h, tile + STAGES - 1, ahead_slot, last_tile, BLOCK_M, HOST)
        _fill_stats(lse_smem, delta_smem, lse_row, delta_row, tile + STAGES - 1, ahead_slot, n_queries, BLOCK_M)
        pT = gluon_common.probabilities_t(sT, lse2, offs_n, tile, qk_scale, MASKED, IS_CAUSAL, BLOCK_M, s_layout)
        dv = warpgroup_mma(gl.convert_layout(pT.to(dtype), op_layout), do_tile, dv, is_async=True)
        dpT = warpgroup_mma_wait(num_outstanding=1, deps=(dpT,))
        delta = delta_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        dsT = gluon_common.zero_first_row_t(pT * (dpT - delta[None, :]), tile, MASKED, IS_CAUSAL, BLOCK_M, s_layout)
        if DQ_SPLIT > 0:
            dk = _dk_and_dq_share(dk, dsT.to(dtype), ds_smem, q_tile, k_tile, dq_target, tile,
                                  (step % DQ_BUFFERS) * DQ_SPLIT, n_queries, sm_scale, MASKED, BLOCK_M, HEAD_DIM,
                                  DQ_SPLIT, DQ_TMA)
        else:
            dk = warpgroup_mma(gl.convert_layout(dsT.to(dtype), op_layout), q_tile, dk, is_async=True)
    return dk, dv


@triton.constexpr_function
def _dq_share_layout(num_warps, columns):
    # dQ's share is (BLOCK_M, columns) whatever BLOCK_N is: the warpgroups split its columns, not its rows.
    groups = num_warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, columns // groups, 16])


@gluon.jit
def _dk_and_dq_share(dk, dsT, ds_smem, q_tile, k_tile, dq_target, tile, first_buffer, n_queries, sm_scale,
                     MASKED: gl.constexpr,
                     BLOCK_M: gl.constexpr, HEAD_DIM: gl.constexpr, DQ_SPLIT: gl.constexpr, DQ_TMA: gl.constexpr):
    """The one-pass step's last products: dK += dS^T Q, and dQ[tile] += sm_scale * dS K over this program's
    keys, reduced into fp32 rows that programs of other key tiles add to as well. dq_target is
    (fp32 rows of this head, their TMA descriptor, staging buffers): DQ_TMA = 1 stages the share in shared
    memory (buffers first_buffer + part) and has the copy engine add it (`gluon_common.tma_reduce_add`) while the next
    steps run; 0 adds it from registers with relaxed atomics.
    dS^T goes through shared memory once and both products read it there (dQ's transposed). dQ's share is
    issued first, in DQ_SPLIT column blocks, so that waiting for it leaves dK in flight."""
    COLUMNS: gl.constexpr = HEAD_DIM // DQ_SPLIT
    share_layout: gl.constexpr = _dq_share_layout(gl.num_warps(), COLUMNS)
    dq_row, dq_desc, dq_stage = dq_target
    # Every warp is past the previous step's products that read ds_smem (their waits come before this
    # step's thread barrier); the fence orders these stores before the tensor cores' reads.
    ds_smem.store(dsT)
    fence_async_shared()
    gl.thread_barrier()
    shares = ()
    for part in gl.static_range(DQ_SPLIT):
        shares = shares + (warpgroup_mma(ds_smem.permute((1, 0)), k_tile.slice(part * COLUMNS, COLUMNS, dim=1),
                                         gl.zeros([BLOCK_M, COLUMNS], gl.float32, share_layout), use_acc=False,
                                         is_async=True),)
    dk = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)
    if DQ_TMA:
        for part in gl.static_range(DQ_SPLIT):
            share = warpgroup_mma_wait(num_outstanding=DQ_SPLIT - part, deps=(shares[part],))
            dq_stage.index(first_buffer + part).store(share * sm_scale)
        fence_async_shared()
        gl.thread_barrier()
        for part in gl.static_range(DQ_SPLIT):
            gluon_common.tma_reduce_add(dq_desc, [tile * BLOCK_M, part * COLUMNS], dq_stage.index(first_buffer + part))
    else:
        offs_m = tile * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, share_layout))
        # 32-bit offsets from one head's base: per thread they differ by constants, which fold into addresses.
        rows = offs_m[:, None] * HEAD_DIM
        for part in gl.static_range(DQ_SPLIT):
            share = warpgroup_mma_wait(num_outstanding=DQ_SPLIT - part, deps=(shares[part],))
            offs_d = part * COLUMNS + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, share_layout))
            if MASKED:
                gl.atomic_add(dq_row + (rows + offs_d[None, :]), share * sm_scale,
                              mask=offs_m[:, None] < n_queries, sem="relaxed")
            else:
                gl.atomic_add(dq_row + (rows + offs_d[None, :]), share * sm_scale, sem="relaxed")
    return dk


@gluon.jit
def flash_dkdv_gluon_kernel(Q, K, V, dO, L, Delta, dK, dV, DQ_ACCUM, input_strides, key_grad_strides,
                            n_heads, n_queries, n_keys, qk_scale, sm_scale, dq_rows,
                            IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, KV_REGS: gl.constexpr = 0,
                            DQ_SPLIT: gl.constexpr = 0, DQ_TMA: gl.constexpr = 1, DQ_BUFFERS: gl.constexpr = 2,
                            HOST_DESCRIPTORS: gl.constexpr = False):
    """One program per (key tile, batch x head): dK and dV of BLOCK_N keys. DQ_SPLIT > 0 makes it the
    one-pass backward: it also adds sm_scale * dS K into DQ_ACCUM, fp32 (batch x heads, dq_rows, HEAD_DIM),
    zeroed by the caller, dq_rows >= n_queries in whole tiles (`_dk_and_dq_share`). HOST_DESCRIPTORS (two passes
    only): Q, K, V, dO, dK and dV are the host's 4D descriptors (`gluon_common.host_row_tiles`; strides unused)."""
    gl.static_assert(not (HOST_DESCRIPTORS and DQ_SPLIT > 0), "host descriptors: the two-pass dK/dV only")
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, BLOCK_M)
    acc_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, HEAD_DIM)
    op_layout: gl.constexpr = gluon_common.operand_layout(acc_layout)
    n0, batch_head, b, h = gluon_common.key_tile_of_program(n_heads, BLOCK_N)
    q_desc, do_desc, k_desc, v_desc = gluon_common.backward_input_tiles(
        Q, K, V, dO, b, h, input_strides, n_queries, n_keys, BLOCK_M, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    dtype: gl.constexpr = q_desc.dtype
    k_smem, v_smem, q_smem, do_smem, lse_smem, delta_smem = gluon_common.key_tile_buffers(q_desc, do_desc, k_desc,
                                                                                          v_desc, STAGES)
    if DQ_SPLIT > 0:
        ds_layout: gl.constexpr = gluon_common.tile_layout(dtype.primitive_bitwidth)
        ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
        dq_row = DQ_ACCUM + batch_head.to(gl.int64) * dq_rows * HEAD_DIM
        DQ_COLUMNS: gl.constexpr = HEAD_DIM // DQ_SPLIT
        dq_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
        # Whole tiles of padding rows: the reduction never relies on TMA clipping at n_queries.
        dq_desc = tma.make_tensor_descriptor(dq_row, shape=[dq_rows, HEAD_DIM], strides=[HEAD_DIM, 1],
                                             block_shape=[BLOCK_M, DQ_COLUMNS], layout=dq_layout)
        dq_stage = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS * DQ_SPLIT if DQ_TMA else 1, BLOCK_M, DQ_COLUMNS],
                                             dq_layout)
        dq_target = (dq_row, dq_desc, dq_stage)
    else:
        ds_smem = k_smem  # unused
        dq_target = (L, L, k_smem)  # unused
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(bars.index(slot), count=1)

    # Causal: the queries before this key tile see none of it (the early exit).
    first_tile = n0 // BLOCK_M if IS_CAUSAL else 0
    last_tile = gl.cdiv(n_queries, BLOCK_M)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    gluon_common.copy_rows_in(k_desc, b, h, n0, kv_bar, k_smem, True, HOST_DESCRIPTORS)
    gluon_common.copy_rows_in(v_desc, b, h, n0, kv_bar, v_smem, True, HOST_DESCRIPTORS)
    lse_row = L + batch_head.to(gl.int64) * n_queries
    delta_row = Delta + batch_head.to(gl.int64) * n_queries
    for ahead in gl.static_range(STAGES - 1):
        _fill(bars, q_smem, do_smem, q_desc, do_desc, b, h, first_tile + ahead, ahead, last_tile, BLOCK_M,
              HOST_DESCRIPTORS)
        _fill_stats(lse_smem, delta_smem, lse_row, delta_row, first_tile + ahead, ahead, n_queries, BLOCK_M)
    offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(kv_bar, 0)
    if KV_REGS == 2:
        k_op = k_smem.load(gluon_common.operand_layout(s_layout))
        v_op = v_smem.load(gluon_common.operand_layout(s_layout))
    elif KV_REGS == 1:
        k_op = k_smem.load(gluon_common.operand_layout(s_layout))
        v_op = v_smem
    else:
        k_op = k_smem
        v_op = v_smem

    # Loops as in backward.py: the diagonal tiles (masked), the tiles every key of the tile sees in
    # full (no index comparisons), then the ragged last tile (masked).
    full_tiles_end = n_queries // BLOCK_M
    if IS_CAUSAL:
        diagonal_end = gl.minimum((n0 + BLOCK_N) // BLOCK_M, last_tile)
        dk, dv = _dkdv_query_tiles(
            dk, dv, k_op, v_op, q_smem, do_smem, bars, q_desc, do_desc, lse_smem, delta_smem, lse_row, delta_row,
            offs_n, first_tile, diagonal_end, first_tile, last_tile, n_queries, qk_scale, True, IS_CAUSAL,
            BLOCK_M, STAGES, s_layout, op_layout, k_smem, ds_smem, dq_target, sm_scale, DQ_SPLIT, DQ_TMA, DQ_BUFFERS,
            b, h, HOST_DESCRIPTORS)
        unmasked_start = diagonal_end
    else:
        unmasked_start = 0
    dk, dv = _dkdv_query_tiles(
        dk, dv, k_op, v_op, q_smem, do_smem, bars, q_desc, do_desc, lse_smem, delta_smem, lse_row, delta_row,
        offs_n, unmasked_start, full_tiles_end, first_tile, last_tile, n_queries, qk_scale, False, IS_CAUSAL,
        BLOCK_M, STAGES, s_layout, op_layout, k_smem, ds_smem, dq_target, sm_scale, DQ_SPLIT, DQ_TMA, DQ_BUFFERS, b, h,
        HOST_DESCRIPTORS)
    dk, dv = _dkdv_query_tiles(
        dk, dv, k_op, v_op, q_smem, do_smem, bars, q_desc, do_desc, lse_smem, delta_smem, lse_row, delta_row,
        offs_n, gl.maximum(unmasked_start, full_tiles_end), last_tile, first_tile, last_tile, n_queries,
        qk_scale, True, IS_CAUSAL, BLOCK_M, STAGES, s_layout, op_layout, k_smem, ds_smem, dq_target, sm_scale,
        DQ_SPLIT, DQ_TMA, DQ_BUFFERS, b, h, HOST_DESCRIPTORS)
    dk, dv = warpgroup_mma_wait(num_outstanding=0, deps=(dk, dv))
    async_copy.wait_group(0)  # the copies issued for tiles past the end (all masked off)

    mbarrier.invalidate(kv_bar)
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(slot))
    # K and V's buffers take dK and dV on their way out (TMA clips rows past n_keys).
    gl.thread_barrier()
    dk_desc = gluon_common.head_row_tiles(dK, b, h, key_grad_strides[0], n_keys, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    dv_desc = gluon_common.head_row_tiles(dV, b, h, key_grad_strides[1], n_keys, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    gluon_common.store_key_gradients(dk, dv, sm_scale, k_smem, v_smem, dk_desc, dv_desc, n0, b, h, HOST_DESCRIPTORS)


@gluon.jit
def _dq_key_tiles(dq, q_op, do_op, k_smem, v_smem, bars, k_desc, v_desc, lse2, delta, offs_m,
                  start_tile, end_tile, first_tile, last_tile, n_keys, qk_scale, MASKED: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  s_layout: gl.constexpr, op_layout: gl.constexpr, b, h, HOST: gl.constexpr):
    """Add key tiles [start_tile, end_tile) to one query tile's dQ. q_op / do_op: Q and dO in shared memory
    or in registers (`flash_dq_gluon_kernel`'s QDO_REGS)."""
    dtype: gl.constexpr = k_desc.dtype
    for tile in range(start_tile, end_tile):
        step, slot, k_tile, v_tile = gluon_common.ring_step(bars, k_smem, v_smem, tile, first_tile, STAGES)
        s, dp = gluon_common.score_products(q_op, k_tile, do_op, v_tile, s_layout)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        gl.thread_barrier()  # the previous step's dQ product has retired in every warp: refill its slot
        _fill(bars, k_smem, v_smem, k_desc, v_desc, b, h, tile + STAGES - 1, (step + STAGES - 1) % STAGES, last_tile,
              BLOCK_N, HOST)
        p = gl.exp2(s * qk_scale - lse2[:, None])
        if MASKED:
            offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
            keep = offs_n[None, :] < n_keys
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = gl.where(keep, p, 0.0)
        dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp,))
        ds = p * (dp - delta[:, None])
        if MASKED and IS_CAUSAL:
            ds = gl.where(offs_m[:, None] == 0, 0.0, ds)  # the first row sees one key: dS is exactly 0
        dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), op_layout), k_tile, dq, is_async=True)
    return dq


@gluon.jit
def flash_dq_gluon_kernel(Q, K, V, dO, L, Delta, dQ, input_strides, dq_strides,
                          n_heads, n_queries, n_keys, qk_scale, sm_scale,
                          IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, STAGES: gl.constexpr, QDO_REGS: gl.constexpr = 0,
                          HOST_DESCRIPTORS: gl.constexpr = False):
    """One program per (query tile, batch x head): dQ of BLOCK_M queries. QDO_REGS: 0 reads Q and dO from
    shared memory in S = Q K^T and dP = dO V^T, 1 holds Q in registers, 2 both (the products then read only
    K^T / V^T from shared memory: half the bytes per FLOP; DQ_QDO_REGS). HOST_DESCRIPTORS: Q, K, V, dO and dQ are
    the host's 4D descriptors (`gluon_common.host_row_tiles`; strides unused)."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, BLOCK_N)
    acc_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, HEAD_DIM)
    op_layout: gl.constexpr = gluon_common.operand_layout(acc_layout)
    m0, batch_head, b, h = gluon_common.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    query_tile = m0 // BLOCK_M
    q_desc, do_desc, k_desc, v_desc = gluon_common.backward_input_tiles(
        Q, K, V, dO, b, h, input_strides, n_queries, n_keys, BLOCK_M, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    dtype: gl.constexpr = q_desc.dtype

    layout: gl.constexpr = gluon_common.tile_layout(dtype.primitive_bitwidth)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], layout)
    do_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, HEAD_DIM], layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for slot in gl.static_range(STAGES):
        mbarrier.init(bars.index(slot), count=1)

    n_key_tiles = gl.cdiv(n_keys, BLOCK_N)
    last_tile = gl.minimum(gl.cdiv(m0 + BLOCK_M, BLOCK_N), n_key_tiles) if IS_CAUSAL else n_key_tiles
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    gluon_common.copy_rows_in(q_desc, b, h, m0, q_bar, q_smem, True, HOST_DESCRIPTORS)
    gluon_common.copy_rows_in(do_desc, b, h, m0, q_bar, do_smem, True, HOST_DESCRIPTORS)
    for ahead in gl.static_range(STAGES - 1):
        _fill(bars, k_smem, v_smem, k_desc, v_desc, b, h, ahead, ahead, last_tile, BLOCK_N, HOST_DESCRIPTORS)

    lse2, delta = _row_stats(L + batch_head.to(gl.int64) * n_queries, Delta + batch_head.to(gl.int64) * n_queries,
                             query_tile, n_queries, BLOCK_M, gl.SliceLayout(1, s_layout))
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout))
    mbarrier.wait(q_bar, 0)
    operand: gl.constexpr = gluon_common.operand_layout(s_layout)
    if QDO_REGS == 2:
        q_op = q_smem.load(operand)
        do_op = do_smem.load(operand)
    elif QDO_REGS == 1:
        q_op = q_smem.load(operand)
        do_op = do_smem
    else:
        q_op = q_smem
        do_op = do_smem

    full_tiles_end = n_keys // BLOCK_N
    if IS_CAUSAL:
        unmasked_end = gl.minimum(m0 // BLOCK_N, full_tiles_end)
    else:
        unmasked_end = full_tiles_end
    dq = _dq_key_tiles(dq, q_op, do_op, k_smem, v_smem, bars, k_desc, v_desc, lse2, delta, offs_m, 0,
                       unmasked_end, 0, last_tile, n_keys, qk_scale, False, IS_CAUSAL, BLOCK_M, BLOCK_N, STAGES,
                       s_layout, op_layout, b, h, HOST_DESCRIPTORS)
    dq = _dq_key_tiles(dq, q_op, do_op, k_smem, v_smem, bars, k_desc, v_desc, lse2, delta, offs_m,
                       unmasked_end, last_tile, 0, last_tile, n_keys, qk_scale, True, IS_CAUSAL, BLOCK_M, BLOCK_N,
                       STAGES, s_layout, op_layout, b, h, HOST_DESCRIPTORS)
    dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq,))

    mbarrier.invalidate(q_bar)
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(slot))
    gl.thread_barrier()
    dq_desc = gluon_common.head_row_tiles(dQ, b, h, dq_strides, n_queries, BLOCK_M, HEAD_DIM, HOST_DESCRIPTORS)
    q_smem.store((dq * sm_scale).to(dtype))
    gl.thread_barrier()
    fence_async_shared()
    gluon_common.copy_rows_out(dq_desc, b, h, m0, q_smem, HOST_DESCRIPTORS)
    tma.store_wait(pendings=0)


def backward_passes(q4, k4, v4, do4, lse, delta, dq4, dk4, dv4, is_causal: bool, sm_scale: float,
                    host_descriptors: bool = False):
    """(dK/dV pass, dQ pass) over (batch, heads, seq, d) tensors that are `eligible`; D must be written
    (backward.py's preprocess) before they run. (A warp-specialised dQ pass, split as hopper_forward's
    flash_forward_ws_kernel, was slower: notes/flash_attention.md, version 9, commit 17609933637a.)
    host_descriptors: both passes on the host's 4D tensor descriptors, made per launch (`HOST_DESCRIPTORS`;
    attention-tune kernels `dkdv-gluon-host`, `dq-gluon-host`; `dispatch` passes
    `gluon_common.host_descriptors_default()`)."""
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    input_strides, sizes = gluon_common.input_args(q4, k4, v4, do4, sm_scale)
    flags = dict(IS_CAUSAL=bool(is_causal), HEAD_DIM=head_dim)
    common = (q4, k4, v4, do4, lse, delta)
    dkdv = GluonPass(flash_dkdv_gluon_kernel,
                     (*common, dk4, dv4, None, input_strides, gluon_common.key_grad_strides(dk4, dv4), *sizes, 0),
                     flags | dict(KV_REGS=DKDV_KV_REGS[head_dim]),
                     DKDV_CONFIG[head_dim], lambda block_m, block_n: (cdiv(n_keys, block_n), batch * heads))
    dq = GluonPass(flash_dq_gluon_kernel, (*common, dq4, input_strides, gluon_common.row_strides(dq4), *sizes),
                   flags | dict(QDO_REGS=DQ_QDO_REGS[head_dim]), DQ_CONFIG[head_dim],
                   lambda block_m, block_n: (cdiv(n_queries, block_m), batch * heads))
    if not host_descriptors:
        return dkdv, dq
    inputs = gluon_common.INPUT_TILES  # then dK, dV (positions 6, 7) or dQ (6)
    return (gluon_common.on_host_descriptors(dkdv, inputs | {6: "N", 7: "N"}),
            gluon_common.on_host_descriptors(dq, inputs | {6: "M"}))


def one_pass_eligible(q: torch.Tensor) -> bool:
    """Whether inputs like q (batch, heads, seq, d) can take the one-pass kernel: `eligible`, and more than
    one query row. With one row (the JIT makes n_queries the constant 1) its dQ came out wrong without a
    causal mask on the H200 (commit 4d8209e3db96; 2..65 rows agreed with the two passes exactly), root
    cause not found; such inputs take the `tl` one-pass kernel."""
    return eligible(q) and q.shape[-2] > 1


def fused_pass(q4, k4, v4, do4, lse, delta, dq_accum, dk4, dv4, is_causal: bool, sm_scale: float) -> GluonPass:
    """The one-pass backward over `eligible` (batch, heads, seq, d) tensors: dK and dV written, dQ (scaled)
    added into dq_accum, zeroed fp32 (batch x heads, `one_pass_rows(n_queries)`, d); D must be written first."""
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    dq_rows = gluon_common.check_dq_accum(dq_accum, q4)
    input_strides, sizes = gluon_common.input_args(q4, k4, v4, do4, sm_scale)
    flags = dict(IS_CAUSAL=bool(is_causal), HEAD_DIM=head_dim, KV_REGS=0, DQ_SPLIT=FUSED_DQ_SPLIT[head_dim], DQ_TMA=1)
    return GluonPass(flash_dkdv_gluon_kernel,
                     (q4, k4, v4, do4, lse, delta, dk4, dv4, dq_accum, input_strides,
                      gluon_common.key_grad_strides(dk4, dv4), *sizes, dq_rows),
                     flags, FUSED_CONFIG[head_dim],
                     lambda block_m, block_n: (cdiv(n_keys, block_n), batch * heads))
