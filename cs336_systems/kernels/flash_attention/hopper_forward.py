"""FlashAttention-2 forward on Hopper, in Gluon: forward.py's kernel with the softmax of one key tile
overlapping the P V product of the tile before it (FA3's intra-warpgroup pipelining).

Why a second version: Triton 3.6's `tl.dot` pipeliner waits for each product whose result the loop
reads (`scripts/flash_ptx_schedule.py`: `W8|0 e66 W8|0` per step at d 128), so within a warpgroup the
exponentials and the tensor cores take turns. Each step here, with P_{j-1} carried in registers:

    issue S_j = Q K_j^T                           tensor cores busy
    issue O += P_{j-1} V_{j-1}                    queued behind S_j
    wait until one is left                        S_j is ready; O's product still runs
    m, P_j, l from S_j (exp2, scale folded in)    the exponentials overlap P_{j-1} V_{j-1}
    wait for O; O *= exp2(m_old - m)

The first key tile is scored before the loop and the last P V product is issued after it. K and V
tiles stream through two rings of STAGES shared-memory buffers filled by TMA and signalled by
mbarriers: K_j's slot is refilled once S_j has retired in every warp, V's one step later. The masked
tiles (causal diagonal, ragged end) keep forward.py's semantics: -1e6 added to masked scores, keys
past n_keys excluded; fully masked tiles are never visited.

Scope: as hopper_backward.py (`eligible`): Hopper, fp16/bf16, head dim 64 or 128, TMA-eligible
strides, any lengths. The rest takes forward.py's kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from cs336_systems.kernels._triton_utils import cdiv
from cs336_systems.kernels.flash_attention import gluon_common
from cs336_systems.kernels.flash_attention.launches import GluonPass, sm_count

MASK_VALUE_LOG2: gl.constexpr = gl.constexpr(-1e6 * gluon_common.LOG2E.value)  # forward.py's -1e6, log2 units

# (BLOCK_M, BLOCK_N, warps, stages) and RESCALE_EARLY per head dim: 16 query rows per warp (a warpgroup per 64
# rows). The best of `cs336-bench attention-tune` (kernels forward-gluon, forward-gluon-late; H200, bf16 causal,
# results/attention-tune.jsonl): 10.36 ms at 4x32x16384x64 against 10.55 for forward.py's best on descriptors
# (a31dbf12a106); 15.36 against 15.58 ms for forward.py as shipped at 1x32x32768x128 (60230c299994, after
# `_refill` took one CTA barrier out of each step).
FORWARD_CONFIG = {64: (64, 128, 4, 2), 128: (128, 128, 8, 3)}
FORWARD_RESCALE_EARLY = {64: False, 128: True}
# Head dims where the default forward is this kernel (`dispatch.forward_launch`): where it measured faster
# than forward.py's (above); forward.py's elsewhere.
GLUON_HEAD_DIMS: tuple[int, ...] = (64, 128)
# Of those, the head dims where it is the warp-specialised kernel (`flash_forward_ws_kernel`, below), and its
# config: attention-tune kernel forward-gluon-ws, commit fa2324a949c3, bf16 causal, same run: 14.13 ms against
# 16.16 for the shipped forward and 15.05 for cuDNN at 1x32x32768x128; 10.29 against 10.35 (cuDNN 9.88) at
# 4x32x16384x64. Not d 64: in the train sweep (f3400e79f873) it took 0.826 ms at 4x32x4096x64, against 0.722 for
# the in-warpgroup kernel (e8ccc0eab717), and 10.10 against 10.01 ms at 4x32x16384x64.
WARP_SPECIALISED_HEAD_DIMS: tuple[int, ...] = (128,)
WS_FORWARD_CONFIG = (128, 128, 4, 3)
# At d 64, by length (attention-tune at 9b214716a97a, H100, `device_run.sh session37`, bf16 causal, ms): the
# warp-specialised kernel on 128 x 128 tiles, 2 stages, is ahead where the rows are long and its programs fill the
# GPU (9.86 against 10.45 for the best in-warpgroup tile at 4x32x16384x64; 1.214 against 1.250 at 1x1x65536x64),
# behind where they are short (0.811 against 0.724 at 4x32x4096x64) or few (1x1x16384x64: 128 programs, 0.150
# against 0.138). Keys of at most SHORT_KEYS take 64 x 64 tiles (0.724 against 0.754 for FORWARD_CONFIG's).
WS_LONG_KEYS = {64: 16384}
WS_LONG_CONFIG = {64: (128, 128, 4, 2)}
SHORT_KEYS = 4096
SHORT_FORWARD_CONFIG = {64: (64, 64, 4, 2)}


@gluon.jit
def _fill_tile(bars, smem, desc, b, h, tile, end_tile, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               HOST: gl.constexpr):
    """Start copying key tile `tile` of one matrix (K or V) into its ring slot (nothing past end_tile)."""
    slot = tile % STAGES
    pred = tile < end_tile
    mbarrier.expect(bars.index(slot), desc.block_type.nbytes, pred=pred)
    gluon_common.copy_rows_in(desc, b, h, tile * BLOCK_N, bars.index(slot), smem.index(slot), pred, HOST)


@gluon.jit
def _refill(k_bars, k_smem, k_desc, v_bars, v_smem, v_desc, b, h, k_tile, v_tile, end_tile, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, HOST: gl.constexpr):
    """_fill_tile for a K tile and a V tile, both barriers armed before either copy starts: the compiler puts a
    CTA barrier between arming a barrier and a copy that signals it, so this takes one where two fills take two."""
    k_slot = k_tile % STAGES
    v_slot = v_tile % STAGES
    k_pred = k_tile < end_tile
    v_pred = v_tile < end_tile
    mbarrier.expect(k_bars.index(k_slot), k_desc.block_type.nbytes, pred=k_pred)
    mbarrier.expect(v_bars.index(v_slot), v_desc.block_type.nbytes, pred=v_pred)
    gluon_common.copy_rows_in(k_desc, b, h, k_tile * BLOCK_N, k_bars.index(k_slot), k_smem.index(k_slot), k_pred,
                              HOST)
    gluon_common.copy_rows_in(v_desc, b, h, v_tile * BLOCK_N, v_bars.index(v_slot), v_smem.index(v_slot), v_pred,
                              HOST)


@gluon.jit
def _wait_tile(bars, tile, STAGES: gl.constexpr):
    mbarrier.wait(bars.index(tile % STAGES), (tile // STAGES) & 1)


@gluon.jit
def _key_tile_range(m0, n_keys, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr):
    """(end of the unmasked key tiles, end of all visited ones) for the query tile at row m0. Causal stops
    after the diagonal (the early exit); tiles before m0 are seen in full by every query of the tile. The
    unmasked run starts at tile 1 (tile 0 is taken before the loop), so its end is at least 1."""
    n_key_tiles = gl.cdiv(n_keys, BLOCK_N)
    full_tiles_end = n_keys // BLOCK_N
    if IS_CAUSAL:
        last_tile = gl.minimum(gl.cdiv(m0 + BLOCK_M, BLOCK_N), n_key_tiles)
        unmasked_end = gl.minimum(m0 // BLOCK_N, full_tiles_end)
    else:
        last_tile = n_key_tiles
        unmasked_end = full_tiles_end
    return gl.maximum(unmasked_end, 1), last_tile


@gluon.jit
def _softmax_step(s, m_i, l_i, offs_m, tile, n_keys, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """(P, alpha, m, l) of raw scores S for one key tile: m the running row max in log2 units, alpha the
    factor that rescales what was accumulated under the old max. Unmasked tiles fold the scale into the
    exponent's FMA."""
    if MASKED:
        s = s * qk_scale
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        if IS_CAUSAL:
            s = s + gl.where(offs_n[None, :] <= offs_m[:, None], 0.0, MASK_VALUE_LOG2)
        s = gl.where(offs_n[None, :] < n_keys, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        p = gl.exp2(s - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i


@gluon.jit
def _rescale(acc, alpha):
    return acc * gl.convert_layout(alpha, gl.SliceLayout(1, acc.type.layout))[:, None]


@gluon.jit
def _key_tiles(acc, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, b, h, offs_m,
               start_tile, end_tile, last_tile, n_keys, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
               STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr, RESCALE_EARLY: gl.constexpr,
               HOST: gl.constexpr):
    """Fold key tiles [start_tile, end_tile) into (acc, m_i, l_i). (p, alpha) come from the previous tile's
    softmax. RESCALE_EARLY: each step rescales acc by alpha and casts P while its own S runs (p is fp32, as
    the softmax left it); else it does both after waiting for P V (p is already the product's operand)."""
    BLOCK_M: gl.constexpr = q_smem.shape[0]
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = k_desc.dtype
    for tile in range(start_tile, end_tile):
        _wait_tile(k_bars, tile, STAGES)
        s = warpgroup_mma(q_smem, k_smem.index(tile % STAGES).permute((1, 0)),
                          gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        if RESCALE_EARLY:
            acc = _rescale(acc, alpha)
            p_op = gl.convert_layout(p.to(dtype), op_layout)
        else:
            p_op = p
        _wait_tile(v_bars, tile - 1, STAGES)
        acc = warpgroup_mma(p_op, v_smem.index((tile - 1) % STAGES), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        # Every warp is past S_j (K_j's slot is free) and past the P V product of the step before
        # (V_{j-2}'s slot is free): refill both.
        gl.thread_barrier()
        _refill(k_bars, k_smem, k_desc, v_bars, v_smem, v_desc, b, h, tile + STAGES, tile + STAGES - 2, last_tile,
                BLOCK_N, STAGES, HOST)
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, tile, n_keys, qk_scale, MASKED, IS_CAUSAL, BLOCK_N,
                                           s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))[0]
        if not RESCALE_EARLY:
            acc = _rescale(acc, alpha)
            p = gl.convert_layout(p.to(dtype), op_layout)
    return acc, m_i, l_i, p, alpha


@gluon.jit
def flash_forward_gluon_kernel(Q, K, V, O, L,
                               q_strides, k_strides, v_strides, o_strides,
                               n_heads, n_queries, n_keys, qk_scale,
                               IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, RESCALE_EARLY: gl.constexpr = True,
                               HOST_DESCRIPTORS: gl.constexpr = False):
    """One program per (query tile, batch x head): O and L of BLOCK_M queries. qk_scale is
    log2(e) / sqrt(d): scores in log2 units. RESCALE_EARLY: see `_key_tiles` (False keeps fewer registers
    live, 165 against 215 at d 64 on 64 x 128 tiles, ptxas). HOST_DESCRIPTORS: Q, K, V and O are the host's 4D
    descriptors (`gluon_common.host_row_tiles`, their strides unused) instead of pointers from which each program
    makes its own."""
    gl.static_assert(STAGES >= 2, "the V ring is refilled one step behind the K ring")
    NUM_WARPS: gl.constexpr = gl.num_warps()
    s_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, BLOCK_N)
    acc_layout: gl.constexpr = gluon_common.wgmma_layout(NUM_WARPS, HEAD_DIM)
    op_layout: gl.constexpr = gluon_common.operand_layout(acc_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    m0, batch_head, b, h = gluon_common.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    q_desc = gluon_common.head_row_tiles(Q, b, h, q_strides, n_queries, BLOCK_M, HEAD_DIM, HOST_DESCRIPTORS)
    k_desc = gluon_common.head_row_tiles(K, b, h, k_strides, n_keys, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    v_desc = gluon_common.head_row_tiles(V, b, h, v_strides, n_keys, BLOCK_N, HEAD_DIM, HOST_DESCRIPTORS)
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, HEAD_DIM], gluon_common.tile_layout(dtype.primitive_bitwidth))
    k_smem, v_smem, q_bar, k_bars, v_bars, _, _ = gluon_common.key_value_rings(k_desc, v_desc, STAGES, 0)

    unmasked_end, last_tile = _key_tile_range(m0, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    gluon_common.copy_rows_in(q_desc, b, h, m0, q_bar, q_smem, True, HOST_DESCRIPTORS)
    for ahead in gl.static_range(STAGES):
        _fill_tile(k_bars, k_smem, k_desc, b, h, ahead, last_tile, BLOCK_N, STAGES, HOST_DESCRIPTORS)
    for ahead in gl.static_range(STAGES - 2):
        _fill_tile(v_bars, v_smem, v_desc, b, h, ahead, last_tile, BLOCK_N, STAGES, HOST_DESCRIPTORS)

    offs_m = m0 + gl.arange(0, BLOCK_M, layout=row_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([BLOCK_M], gl.float32, row_layout)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)  # a plain tensor: the loop waits for it each step

    # Key tile 0, before the loop: scored and exponentiated (masked, which is exact where nothing is).
    mbarrier.wait(q_bar, 0)
    _wait_tile(k_bars, 0, STAGES)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout),
                      use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    gl.thread_barrier()
    _refill(k_bars, k_smem, k_desc, v_bars, v_smem, v_desc, b, h, STAGES, STAGES - 2, last_tile, BLOCK_N, STAGES,
            HOST_DESCRIPTORS)
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, 0, n_keys, qk_scale, True, IS_CAUSAL, BLOCK_N, s_layout)
    if not RESCALE_EARLY:
        p = gl.convert_layout(p.to(dtype), op_layout)

    # Tiles every query of the tile sees in full (no index comparisons), then the diagonal and ragged ones.
    acc, m_i, l_i, p, alpha = _key_tiles(acc, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc,
                                         v_desc, b, h, offs_m, 1, unmasked_end, last_tile, n_keys, qk_scale, False,
                                         IS_CAUSAL, STAGES, s_layout, op_layout, RESCALE_EARLY, HOST_DESCRIPTORS)
    acc, m_i, l_i, p, alpha = _key_tiles(acc, m_i, l_i, p, alpha, q_smem, k_smem, v_smem, k_bars, v_bars, k_desc,
                                         v_desc, b, h, offs_m, unmasked_end, last_tile, last_tile, n_keys, qk_scale,
                                         True, IS_CAUSAL, STAGES, s_layout, op_layout, RESCALE_EARLY, HOST_DESCRIPTORS)
    # The last tile's P V product.
    if RESCALE_EARLY:
        acc = _rescale(acc, alpha)
        p = gl.convert_layout(p.to(dtype), op_layout)
    _wait_tile(v_bars, last_tile - 1, STAGES)
    acc = warpgroup_mma(p, v_smem.index((last_tile - 1) % STAGES), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))

    mbarrier.invalidate(q_bar)
    for slot in gl.static_range(STAGES):
        mbarrier.invalidate(k_bars.index(slot))
        mbarrier.invalidate(v_bars.index(slot))
    # Q's buffer takes O on its way out (TMA clips rows past n_queries).
    l_acc = gl.convert_layout(l_i, gl.SliceLayout(1, acc_layout))
    gl.thread_barrier()
    o_desc = gluon_common.head_row_tiles(O, b, h, o_strides, n_queries, BLOCK_M, HEAD_DIM, HOST_DESCRIPTORS)
    q_smem.store((acc / l_acc[:, None]).to(dtype))
    gl.thread_barrier()
    fence_async_shared()
    gluon_common.copy_rows_out(o_desc, b, h, m0, q_smem, HOST_DESCRIPTORS)
    lse = (m_i + gl.log2(l_i)) / gluon_common.LOG2E  # natural log, as the backward reads it
    gl.store(L + batch_head.to(gl.int64) * n_queries + offs_m, lse, mask=offs_m < n_queries)
    tma.store_wait(pendings=0)


def default_forward(batch: int, heads: int, n_queries: int, n_keys: int, head_dim: int, sms: int):
    """(warp-specialised, config) of the default Gluon forward of such inputs on a GPU of `sms` SMs: the
    warp-specialised kernel at WARP_SPECIALISED_HEAD_DIMS, and at d 64 where the rows are long and its programs
    fill the GPU (the measurements above); else the in-warpgroup kernel, on 64 x 64 tiles at d 64 for short rows."""
    if head_dim in WARP_SPECIALISED_HEAD_DIMS:
        return True, WS_FORWARD_CONFIG
    if (head_dim in WS_LONG_KEYS and n_keys >= WS_LONG_KEYS[head_dim]
            and batch * heads * cdiv(n_queries, WS_LONG_CONFIG[head_dim][0]) >= sms):
        return True, WS_LONG_CONFIG[head_dim]
    if head_dim in SHORT_FORWARD_CONFIG and n_keys <= SHORT_KEYS:
        return False, SHORT_FORWARD_CONFIG[head_dim]
    return False, FORWARD_CONFIG[head_dim]


def forward_pass(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, o4: torch.Tensor, lse: torch.Tensor,
                 is_causal: bool, sm_scale: float, warp_specialised: bool | None = None,
                 host_descriptors: bool = False) -> GluonPass:
    """The forward over (batch, heads, seq, d) tensors that are `hopper_backward.eligible` and TMA-eligible;
    O (o4) and L (lse, fp32 (batch, heads, n_queries) contiguous) are written when it runs.
    warp_specialised: `flash_forward_ws_kernel` (True) or `flash_forward_gluon_kernel` (False); None: as
    `default_forward` chooses (and its tiles). host_descriptors: the in-warpgroup kernel on the host's 4D tensor
    descriptors, made per launch (`HOST_DESCRIPTORS`; attention-tune kernel `forward-gluon-late-host`; `dispatch`
    passes `gluon_common.host_descriptors_default()`); the warp-specialised one makes its own whatever it says."""
    batch, heads, n_queries, head_dim = q4.shape
    default_ws, config = default_forward(batch, heads, n_queries, k4.shape[2], head_dim, sm_count(q4.device))
    if warp_specialised is None:
        warp_specialised = default_ws
    elif warp_specialised != default_ws:  # the other kernel, asked for: its general tiles
        config = WS_FORWARD_CONFIG if warp_specialised else FORWARD_CONFIG[head_dim]
    strides = [gluon_common.row_strides(t) for t in (q4, k4, v4, o4)]  # one tuple argument per tensor
    args = (q4, k4, v4, o4, lse, *strides, heads, n_queries, k4.shape[2], sm_scale * gluon_common.LOG2E.value)
    flags = dict(IS_CAUSAL=bool(is_causal), HEAD_DIM=head_dim)
    grid = lambda block_m, block_n: (cdiv(n_queries, block_m), batch * heads)  # noqa: E731
    if warp_specialised:  # (warps: the first consumer's 4)
        return GluonPass(flash_forward_ws_kernel, args, flags, config, grid)
    own = GluonPass(flash_forward_gluon_kernel, args, flags | dict(RESCALE_EARLY=FORWARD_RESCALE_EARLY[head_dim]),
                    config, grid)
    return gluon_common.on_host_descriptors(own, gluon_common.INPUT_TILES) if host_descriptors else own


# ---- The same forward, warp-specialised (FA3's producer / consumer split; default at WARP_SPECIALISED_HEAD_DIMS) ----
# A one-warp producer partition streams Q, K and V through the rings, and two consumer warpgroups each own 64
# query rows of the 128-row tile. A consumer releases a K or V slot to the producer with an mbarrier arrive, so
# the consumers share no CTA barrier and drift apart: one can run its softmax while the other has the tensor
# cores. Registers move from the producer to the consumers (`worker_num_regs`). attention-tune kernel
# `forward-gluon-ws`.
WS_CONSUMER_ROWS = gl.constexpr(64)


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, m0,
                 last_tile, STAGES: gl.constexpr):
    BLOCK_N: gl.constexpr = k_desc.block_type.shape[0]
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    for half in gl.static_range(2):
        tma.async_copy_global_to_shared(q_desc, [m0 + half * WS_CONSUMER_ROWS, 0], q_bar, q_smem.index(half))
    for tile in range(0, last_tile):
        slot = tile % STAGES
        free = ((tile // STAGES) & 1) ^ 1  # a fresh barrier counts as released once: the first round passes
        mbarrier.wait(k_empty.index(slot), free)
        mbarrier.expect(k_ready.index(slot), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [tile * BLOCK_N, 0], k_ready.index(slot), k_smem.index(slot))
        mbarrier.wait(v_empty.index(slot), free)
        mbarrier.expect(v_ready.index(slot), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [tile * BLOCK_N, 0], v_ready.index(slot), v_smem.index(slot))


@gluon.jit
def _ws_key_tiles(acc, m_i, l_i, p, alpha, q_tile, k_smem, v_smem, k_ready, k_empty, v_ready, v_empty, offs_m,
                  start_tile, end_tile, n_keys, qk_scale, MASKED: gl.constexpr, IS_CAUSAL: gl.constexpr,
                  STAGES: gl.constexpr, s_layout: gl.constexpr, op_layout: gl.constexpr):
    """`_key_tiles` (early rescale) for one consumer warpgroup, releasing slots by mbarrier instead of a CTA
    barrier."""
    BLOCK_N: gl.constexpr = k_smem.shape[1]
    dtype: gl.constexpr = k_smem.dtype
    for tile in range(start_tile, end_tile):
        slot = tile % STAGES
        mbarrier.wait(k_ready.index(slot), (tile // STAGES) & 1)
        s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)),
                          gl.zeros([WS_CONSUMER_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
        acc = _rescale(acc, alpha)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        previous = (tile - 1) % STAGES
        mbarrier.wait(v_ready.index(previous), ((tile - 1) // STAGES) & 1)
        acc = warpgroup_mma(p_op, v_smem.index(previous), acc, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
        mbarrier.arrive(k_empty.index(slot))
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, tile, n_keys, qk_scale, MASKED, IS_CAUSAL, BLOCK_N,
                                           s_layout)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))[0]
        mbarrier.arrive(v_empty.index(previous))
    return acc, m_i, l_i, p, alpha


@gluon.jit
def _ws_consumer(half: gl.constexpr, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                 lse_row, m0, last_tile, unmasked_end, n_queries, n_keys, qk_scale, IS_CAUSAL: gl.constexpr,
                 HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer warpgroup: O and L of query rows m0 + 64 * half onwards."""
    s_layout: gl.constexpr = gluon_common.wgmma_layout(4, BLOCK_N)
    acc_layout: gl.constexpr = gluon_common.wgmma_layout(4, HEAD_DIM)
    op_layout: gl.constexpr = gluon_common.operand_layout(acc_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = k_smem.dtype
    rows0 = m0 + half * WS_CONSUMER_ROWS
    q_tile = q_smem.index(half)
    offs_m = rows0 + gl.arange(0, WS_CONSUMER_ROWS, layout=row_layout)
    m_i = gl.full([WS_CONSUMER_ROWS], float("-inf"), gl.float32, row_layout)
    l_i = gl.zeros([WS_CONSUMER_ROWS], gl.float32, row_layout)
    acc = gl.zeros([WS_CONSUMER_ROWS, HEAD_DIM], gl.float32, acc_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(k_ready.index(0), 0)
    s = warpgroup_mma(q_tile, k_smem.index(0).permute((1, 0)),
                      gl.zeros([WS_CONSUMER_ROWS, BLOCK_N], gl.float32, s_layout), use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
    mbarrier.arrive(k_empty.index(0))
    p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, offs_m, 0, n_keys, qk_scale, True, IS_CAUSAL, BLOCK_N, s_layout)
    acc, m_i, l_i, p, alpha = _ws_key_tiles(acc, m_i, l_i, p, alpha, q_tile, k_smem, v_smem, k_ready, k_empty,
                                            v_ready, v_empty, offs_m, 1, unmasked_end, n_keys, qk_scale, False,
                                            IS_CAUSAL, STAGES, s_layout, op_layout)
    acc, m_i, l_i, p, alpha = _ws_key_tiles(acc, m_i, l_i, p, alpha, q_tile, k_smem, v_smem, k_ready, k_empty,
                                            v_ready, v_empty, offs_m, unmasked_end, last_tile, n_keys, qk_scale, True,
                                            IS_CAUSAL, STAGES, s_layout, op_layout)
    acc = _rescale(acc, alpha)
    last = (last_tile - 1) % STAGES
    mbarrier.wait(v_ready.index(last), ((last_tile - 1) // STAGES) & 1)
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), op_layout), v_smem.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    mbarrier.arrive(v_empty.index(last))
    # This warpgroup's Q buffer takes its O rows on the way out (TMA clips rows past n_queries).
    l_acc = gl.convert_layout(l_i, gl.SliceLayout(1, acc_layout))
    q_tile.store((acc / l_acc[:, None]).to(dtype))
    gl.thread_barrier()  # (this partition's warps) every row is written before the copy engine reads the tile
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [rows0, 0], q_tile)
    lse = (m_i + gl.log2(l_i)) / gluon_common.LOG2E
    gl.store(lse_row + offs_m, lse, mask=offs_m < n_queries)
    tma.store_wait(pendings=0)


@gluon.jit
def flash_forward_ws_kernel(Q, K, V, O, L,
                            q_strides, k_strides, v_strides, o_strides,
                            n_heads, n_queries, n_keys, qk_scale,
                            IS_CAUSAL: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr = 240):
    """flash_forward_gluon_kernel's contract, warp-specialised: launched with num_warps=4 (the first consumer);
    the second consumer (4 warps) and the producer (1 warp) are worker partitions. BLOCK_M must be 128.
    CONSUMER_REGS: registers of the second consumer after reallocation; the first gets what the producer's 24 and
    this leave of the 65536 (ptxas at d 128, 128 x 128 tiles: no spills at 240, spills at 232 and at 248)."""
    gl.static_assert(BLOCK_M == 2 * WS_CONSUMER_ROWS, "two consumer warpgroups of 64 rows")
    gl.static_assert(gl.num_warps() == 4, "the default partition is one consumer warpgroup")
    m0, batch_head, b, h = gluon_common.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    q_desc = gluon_common.head_row_tiles(Q, b, h, q_strides, n_queries, WS_CONSUMER_ROWS, HEAD_DIM)
    k_desc = gluon_common.head_row_tiles(K, b, h, k_strides, n_keys, BLOCK_N, HEAD_DIM)
    v_desc = gluon_common.head_row_tiles(V, b, h, v_strides, n_keys, BLOCK_N, HEAD_DIM)
    o_desc = gluon_common.head_row_tiles(O, b, h, o_strides, n_queries, WS_CONSUMER_ROWS, HEAD_DIM)
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, WS_CONSUMER_ROWS, HEAD_DIM], q_desc.layout)
    # Empty barriers released by one arrive per consumer warpgroup.
    k_smem, v_smem, q_bar, k_ready, v_ready, k_empty, v_empty = gluon_common.key_value_rings(k_desc, v_desc, STAGES, 2)

    unmasked_end, last_tile = _key_tile_range(m0, n_keys, BLOCK_M, BLOCK_N, IS_CAUSAL)
    lse_row = L + batch_head.to(gl.int64) * n_queries
    gl.warp_specialize([
        (_ws_consumer, (0, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, lse_row, m0,
                        last_tile, unmasked_end, n_queries, n_keys, qk_scale, IS_CAUSAL, HEAD_DIM, BLOCK_N, STAGES)),
        (_ws_consumer, (1, o_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty, lse_row, m0,
                        last_tile, unmasked_end, n_queries, n_keys, qk_scale, IS_CAUSAL, HEAD_DIM, BLOCK_N, STAGES)),
        (_ws_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, k_ready, k_empty, v_ready, v_empty,
                        m0, last_tile, STAGES)),
    ], [4, 1], [CONSUMER_REGS, 24])
