"""FlashAttention-2 forward in Triton.

Grid: (query tiles, batch x heads). Each program holds one BLOCK_M x head_dim tile of Q
and walks the key tiles once, keeping the online-softmax state (row max m, row sum l,
output accumulator) in fp32 registers. P is cast to V's dtype for the PV product, as in
FA2. Scores are kept in log2 units (scale * log2(e) folded into one multiply) so the
exponentials are exp2. L = m + log(l) (natural log) is stored for the backward pass.

Key tiles come in two loops (Triton tutorial 06's structure):
* an unmasked loop over tiles that every query of the tile sees in full (causal: keys left
  of the diagonal tile; both: tiles inside n_keys), which never compares indices;
* a masked loop over the diagonal tile(s) and the ragged last tile, which applies the causal
  mask (-1e6 added, as the assignment specifies) and the n_keys bound.
Fully masked tiles (right of the diagonal) are never visited: the causal early exit.
Causal query tiles are scheduled heaviest first so the tail of the grid is short.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cs336_systems.kernels._triton_utils import (
    autotune_enabled,
    configs_for_family,
    configs_from_families,
    tile_family,
)
from cs336_systems.kernels.flash_attention import tiles

LOG2E = tl.constexpr(1.4426950408889634)  # log2(e); kernels read it, so a constexpr (host code: .value)
MASK_VALUE_LOG2 = tl.constexpr(-1e6 * LOG2E.value)  # the assignment's -1e6, in log2 units (constexpr: read in kernels)


@triton.jit
def scaled_scores(a, b, qk_scale, PRECISION: tl.constexpr):
    """a @ b * qk_scale, the scores in log2 units. IEEE fp32 sums the products in fp64 (on Hopper's fp64 tensor
    cores) and rounds once: one fp32 FMA chain over the head dim put the fp32 fuzz's worst case at 2.4x PyTorch's
    own error, where the fp64 sum leaves every case within 2x (notes/flash_attention.md)."""
    if PRECISION == "ieee":
        s = (tl.dot(a.to(tl.float64), b.to(tl.float64)) * qk_scale).to(tl.float32)
    else:
        s = tl.dot(a, b, input_precision=PRECISION) * qk_scale
    return s


@triton.jit
def _attend_key_tiles(acc, m_i, l_i, q, kT_block, v_block, offs_m, start_n, end_n, n_keys, qk_scale,
                      MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
                      BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False):
    """Fold key tiles [start_n, end_n) into the running (acc, m_i, l_i) of one query tile. kT_block and
    v_block come from `tiles.operand_tiles` (K transposed, V as is)."""
    if not USE_TMA:
        kT_block = tl.advance(kT_block, (0, start_n))
        v_block = tl.advance(v_block, (start_n, 0))
    for tile_start in range(start_n, end_n, BLOCK_N):
        kT = tiles.load_tile(kT_block, tile_start, MASKED or not EVEN_D, True, USE_TMA)  # (BLOCK_D, BLOCK_N)
        v = tiles.load_tile(v_block, tile_start, MASKED or not EVEN_D, False, USE_TMA)  # (BLOCK_N, BLOCK_D)
        s = scaled_scores(q, kT, qk_scale, PRECISION)  # (BLOCK_M, BLOCK_N), log2 units
        if MASKED:
            offs_n = tile_start + tl.arange(0, BLOCK_N)
            if IS_CAUSAL:
                s += tl.where(offs_n[None, :] <= offs_m[:, None], 0.0, MASK_VALUE_LOG2)
            s = tl.where(offs_n[None, :] < n_keys, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
        if not USE_TMA:
            kT_block = tl.advance(kT_block, (0, BLOCK_N))
            v_block = tl.advance(v_block, (BLOCK_N, 0))
    return acc, m_i, l_i


# IEEE fp32 (fp32 inputs without allow_tf32): FMA dots for P V and S in fp64 (`scaled_scores`). FMA dots spill on
# the tensor-core tiles at d >= 64 (ptxas, sm_90: 128 x 128 on 8 warps 7 KB at d 64; 64 x 64 on 4 warps 53 KB at
# d 128; at seq 2048 the forward ran 18x (d 64) and 41x (d 128) slower than naive fp32); with S in fp64, 64 x 64 on
# 8 warps spills nothing at d 128 (190 registers) where 16 warps spill 468 B
# (`python scripts/flash_ptx_schedule.py --kernel forward --dtype fp32 --d 128 --config 64x64x8x2`).
IEEE_FP32_TILES = ((64, 64, 8, 2), (64, 32, 8, 2), (64, 64, 16, 2), (32, 32, 4, 2), (32, 16, 8, 2))
# fp32 on tensor cores (tf32x3, tf32): fp32 tiles take twice a 16-bit tile's shared memory (64 x 64 in 3 stages
# is 256 KiB at d 128, past the H200's 227), and tf32x3 splits each operand in registers. ptxas (sm_90,
# tf32x3) spills at most 44 B on these at d 64, and at d 128 (the wide-head rule leaves the last four) at most
# 652 B, in at most 192 KiB: `python scripts/flash_ptx_schedule.py --kernel forward --dtype fp32
# --precision tf32x3 --d 128 --config 128x32x8x2`.
FP32_TENSOR_CORE_TILES = ((128, 64, 8, 2), (128, 32, 8, 2), (64, 64, 4, 2), (64, 32, 4, 3), (32, 32, 4, 2))
# 16-bit: the first two won `cs336-bench attention-tune` on the H200 at d 128 and d 64 (bf16, causal,
# results/attention-tune.jsonl); the smaller tiles fit wide heads.
TENSOR_CORE_TILES = ((128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4),
                     (64, 32, 4, 2))
TILE_FAMILIES = {"tensor-core": TENSOR_CORE_TILES, "ieee": IEEE_FP32_TILES, "fp32-tensor-core": FP32_TENSOR_CORE_TILES}


def _prune_forward_configs(configs, named_args, **kwargs):
    """Keep the launch's tile family (`tile_family`: IEEE fp32, fp32 on tensor cores, 16-bit) and the configs
    that fit: fp32 tiles and wide heads need smaller blocks (shared memory)."""
    family = tile_family(kwargs.get("PRECISION"), named_args["Q"].element_size())
    configs = configs_for_family(configs, TILE_FAMILIES, family)
    head_dim = kwargs.get("BLOCK_D", named_args.get("BLOCK_D"))
    wide = head_dim >= 256 or named_args["Q"].element_size() == 4 and head_dim >= 128
    n_queries = named_args["n_queries"]
    kept = [c for c in configs
            if c.kwargs["BLOCK_M"] % c.kwargs["BLOCK_N"] == 0
            and (not wide or c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= 64 * 64)
            and (c.kwargs["BLOCK_M"] <= 64 or n_queries > 64)]
    kept = kept or configs[-1:]
    return kept if autotune_enabled() else kept[:1]  # configs are listed best-first


@triton.autotune(configs=configs_from_families(TILE_FAMILIES),
                 key=["n_queries_bucket", "n_keys_bucket", "BLOCK_D", "IS_CAUSAL", "PRECISION"],
                 prune_configs_by={"early_config_prune": _prune_forward_configs})
@triton.jit
def flash_forward_kernel(Q, K, V, O, L,
                         q_strides, k_strides, v_strides, o_strides,
                         n_heads, n_queries, n_keys, head_dim, qk_scale, n_queries_bucket, n_keys_bucket,
                         IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                         PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         USE_TMA: tl.constexpr = False):
    query_tile, batch_head, b, h = tiles.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    q_base = tiles.head_base(Q, b, h, q_strides)
    k_base = tiles.head_base(K, b, h, k_strides)
    v_base = tiles.head_base(V, b, h, v_strides)
    o_base = tiles.head_base(O, b, h, o_strides)
    m0 = query_tile * BLOCK_M

    kT_block = tiles.operand_tiles(k_base, n_keys, head_dim, k_strides, BLOCK_N, BLOCK_D, True, USE_TMA)
    v_block = tiles.operand_tiles(v_base, n_keys, head_dim, v_strides, BLOCK_N, BLOCK_D, False, USE_TMA)
    q_tiles = tiles.operand_tiles(q_base, n_queries, head_dim, q_strides, BLOCK_M, BLOCK_D, False, USE_TMA)
    if not USE_TMA:
        q_tiles = tl.advance(q_tiles, (m0, 0))
    q = tiles.load_tile(q_tiles, m0, True, False, USE_TMA)  # (BLOCK_M, BLOCK_D)
    offs_m = m0 + tl.arange(0, BLOCK_M)

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    unmasked_end, masked_end = tiles.key_tile_ends(m0, n_keys, IS_CAUSAL, BLOCK_M, BLOCK_N)
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, kT_block, v_block, offs_m, 0, unmasked_end, n_keys,
                                      qk_scale, False, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, USE_TMA)
    acc, m_i, l_i = _attend_key_tiles(acc, m_i, l_i, q, kT_block, v_block, offs_m, unmasked_end, masked_end,
                                      n_keys, qk_scale, True, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, USE_TMA)

    if O.dtype.element_ty == tl.float32:  # `/` is div.full.f32 (2 units); fp32 outputs get IEEE rounding
        out = tl.math.div_rn(acc, l_i[:, None])
    else:
        out = acc / l_i[:, None]
    if USE_TMA:
        tl.make_tensor_descriptor(o_base, shape=[n_queries, head_dim], strides=[o_strides[2], 1],
                                  block_shape=[BLOCK_M, BLOCK_D]).store([m0, 0], out.to(O.dtype.element_ty))
    else:
        o_block = tiles.row_block(o_base, n_queries, head_dim, o_strides, m0, BLOCK_M, BLOCK_D)
        tl.store(o_block, out.to(O.dtype.element_ty), boundary_check=(0, 1))
    lse = (m_i + tl.math.log2(l_i)) / LOG2E  # back to natural log
    tl.store(L + batch_head.to(tl.int64) * n_queries + offs_m, lse, mask=offs_m < n_queries)
