"""FlashAttention-2 backward: two Triton passes without atomics, and a torch.compile'd variant.

With P = exp(S - L) recomputed from the saved row log-sum-exp L and D = rowsum(O * dO):
    dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dQ = dS K * scale,   dK = dS^T Q * scale.

* `preprocess`: D, one program per (query tile, batch x head). fp32 with fp32-accurate dots ("ieee", "tf32x3")
  runs `flash_row_stats_kernel` instead: each row's max m and inverse sum 1 / l, and D = rowsum(P dP), with which
  the passes recompute P = exp2(s - m) / l (its docstring says why). exp2 is the GPU's ex2.approx.f32 throughout:
  a polynomial within one fp32 unit (`scripts/exp2_accuracy.py`) left 2 of the fp32 GPU fuzz's 200 cases over
  budget on an H100 against 1 with the instruction (notes/flash_attention.md), and cost ten FMAs an element.
* dK/dV pass: one program per key tile walks the query tiles that see it (causal: from the
  diagonal down), accumulating dK and dV in fp32 registers; it works on transposed tiles
  (S^T = K Q^T) so every product is a plain tl.dot.
* dQ pass: one program per query tile walks the key tiles it sees, accumulating dQ.
Each pass owns its output tile, so nothing is accumulated across programs (no atomics,
deterministic).

The one-pass variant (`backward="fused"`) runs the dK/dV kernel with DQ_REDUCE set: each inner step
also forms its share of dQ (dS K, one more product) and adds it into an fp32 (batch x heads,
n_queries, BLOCK_D) buffer, on Hopper through a TMA descriptor (one bulk reduce-add per tile, done by
the copy engine in L2), elsewhere through pointer atomics. It skips the dQ pass's recomputation of S
and dP (5 products instead of 7) at the price of a summation order that varies run to run (dQ is
not bitwise reproducible; dK and dV are). Loops are split as in the forward: an unmasked loop that never compares
indices, and a masked loop for the diagonal and the ragged edge.

The tile sizes each pass tunes over are in backward_tiles.py; the handout's first version, the same maths in
PyTorch under torch.compile, is `reference.compiled_backward`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cs336_systems.kernels._triton_utils import configs_from_families
from cs336_systems.kernels.flash_attention import tiles
from cs336_systems.kernels.flash_attention.backward_tiles import (
    BACKWARD_TUNING_KEY,
    DKDV_TILE_FAMILIES,
    DQ_TILE_FAMILIES,
    FUSED_TILE_FAMILIES,
    SPLIT_KEY_TILES,
    prune_backward,
    prune_split,
)
from cs336_systems.kernels.flash_attention.forward import LOG2E, scaled_scores

# Which key gradients a dK/dV pass forms (KEY_GRADS): both (0, the parameters' default), or one of them, for the
# split passes of wide heads (`flash_key_grad_kernel`, dispatch's "dkdv-split").
DV_ONLY = tl.constexpr(1)
DK_ONLY = tl.constexpr(2)


@triton.jit
def flash_preprocess_kernel(O, dO, Delta, DQ_accum, o_strides, do_strides, stride_accum_bh, n_heads, n_queries,
                            head_dim,
                            BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, ZERO_DQ: tl.constexpr = False,
                            WRITE_DELTA: tl.constexpr = True):
    """D = rowsum(O * dO) per query row (unless WRITE_DELTA is off: fp32-accurate dots take D from
    `flash_row_stats_kernel`); with ZERO_DQ, also zeroes the one-pass backward's fp32 dQ accumulator (rows of
    BLOCK_D values, `stride_accum_bh` apart per (batch, head)) in those rows, which saves a launch of its own."""
    batch_head = tl.program_id(1)
    b, h = batch_head // n_heads, batch_head % n_heads
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    if WRITE_DELTA:
        o_block = tiles.head_tile(O, b, h, o_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D)
        do_block = tiles.head_tile(dO, b, h, do_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D)
        o = tl.load(o_block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        do = tl.load(do_block, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        tl.store(Delta + batch_head.to(tl.int64) * n_queries + offs_m, tl.sum(o * do, axis=1),
                 mask=offs_m < n_queries)
    if ZERO_DQ:
        offs_d = tl.arange(0, BLOCK_D)
        rows = DQ_accum + batch_head.to(tl.int64) * stride_accum_bh + offs_m[:, None] * BLOCK_D + offs_d[None, :]
        tl.store(rows, tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32), mask=offs_m[:, None] < n_queries)


@triton.jit
def add_compensated(total, error, part):
    """total + part by Kahan's compensated summation; `error` carries what the rounding dropped (the sum is
    total - error). For the fp32 ("ieee") gradient accumulators: `tl.dot(a, b, acc)` chains every product of a
    whole loop through one FMA sequence (and Triton rewrites `acc + tl.dot(a, b)` into that form), so over
    2048 causal queries dK's rounding grew to 3x PyTorch's (notes/flash_attention.md, Version 14). Adding each
    tile's own dot here leaves a chain of one tile's length, and no rounding growth across tiles. "tf32x3"
    (fp32 accuracy from tensor cores) accumulates the same way, so it is compensated too."""
    corrected = part - error
    new_total = total + corrected
    return new_total, (new_total - total) - corrected


@triton.jit
def _row_scores(q, kT, offs_m, tile_start, n_keys, qk_scale, IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
                PRECISION: tl.constexpr):
    """One tile of log2-domain scores, -inf where a key is past n_keys or (causal) right of the query."""
    s = scaled_scores(q, kT, qk_scale, PRECISION)
    offs_n = tile_start + tl.arange(0, BLOCK_N)
    keep = offs_n[None, :] < n_keys
    if IS_CAUSAL:
        keep = keep & (offs_n[None, :] <= offs_m[:, None])
    return tl.where(keep, s, float("-inf"))


@triton.jit
def flash_row_stats_kernel(Q, K, V, dO, RowMax, RowInvSum, Delta, q_strides, k_strides, v_strides, do_strides,
                           n_heads, n_queries, n_keys, head_dim, qk_scale, n_queries_bucket, n_keys_bucket,
                           IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The fp32-accurate backward's row statistics (PRECISION "ieee" or "tf32x3"), one query tile per program, in
    one sweep over the keys: the row max m of the log2-domain scores, the row sum l of exp2(s - m) and
    D = rowsum(P * dP) with P = exp2(s - m) / l, as PyTorch's softmax backward forms D (its sum rescaled online as
    l is; a second sweep with the final m and l, tried, was no closer to fp64 over the fuzz's 200 shapes). The
    passes then recompute P from (m, 1 / l) instead of from L = (m + log2 l) / log2(e), whose rounding grows with
    |L| (a few fp32 units of P where PyTorch's own softmax is within one or two), and use this D instead of
    rowsum(O * dO). This is what holds fp32 to 2x PyTorch's own error (`tests/test_kernels_flash_fuzz.py`); it
    costs the fp32 backward two more products per tile pair (S and dP), and 16-bit inputs never run it."""
    query_tile, batch_head, b, h = tiles.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    m0 = query_tile * BLOCK_M
    q = tl.load(tiles.head_tile(Q, b, h, q_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D),
                boundary_check=(0, 1), padding_option="zero")
    do = tl.load(tiles.head_tile(dO, b, h, do_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D),
                 boundary_check=(0, 1), padding_option="zero")
    kT_tiles = tiles.operand_tiles(tiles.head_base(K, b, h, k_strides), n_keys, head_dim, k_strides, BLOCK_N,
                                   BLOCK_D, True, False)
    vT_tiles = tiles.operand_tiles(tiles.head_base(V, b, h, v_strides), n_keys, head_dim, v_strides, BLOCK_N,
                                   BLOCK_D, True, False)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    keys_end = tl.minimum(m0 + BLOCK_M, n_keys) if IS_CAUSAL else n_keys  # (key 0 is in every row: m is finite)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    weighted = tl.zeros((BLOCK_M,), dtype=tl.float32)  # rowsum(exp2(s - m) * dP), rescaled as row_sum is
    for tile_start in range(0, keys_end, BLOCK_N):
        kT = tl.load(tl.advance(kT_tiles, (0, tile_start)), boundary_check=(0, 1), padding_option="zero")
        vT = tl.load(tl.advance(vT_tiles, (0, tile_start)), boundary_check=(0, 1), padding_option="zero")
        s = _row_scores(q, kT, offs_m, tile_start, n_keys, qk_scale, IS_CAUSAL, BLOCK_N, PRECISION)
        new_max = tl.maximum(row_max, tl.max(s, 1))
        alpha = tl.math.exp2(row_max - new_max)
        p = tl.math.exp2(s - new_max[:, None])
        row_sum = row_sum * alpha + tl.sum(p, 1)
        weighted = weighted * alpha + tl.sum(p * tl.dot(do, vT, input_precision=PRECISION), 1)
        row_max = new_max
    inv_sum = tl.math.div_rn(1.0, row_sum)  # IEEE-rounded: Triton's `/` is div.full.f32, up to 2 units off
    delta = weighted * inv_sum
    rows = batch_head.to(tl.int64) * n_queries + offs_m
    in_range = offs_m < n_queries
    tl.store(RowMax + rows, row_max, mask=in_range)
    tl.store(RowInvSum + rows, inv_sum, mask=in_range)
    tl.store(Delta + rows, delta, mask=in_range)


@triton.jit
def _dkdv_query_tiles(dk, dv, k, v, qT_block, do_block, lse_row, delta_row, inv_sum_row, offs_n, start_m, end_m,
                      n_queries, qk_scale, dq_target, batch_head, MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr,
                      EVEN_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                      DQ_REDUCE: tl.constexpr, USE_TMA: tl.constexpr = False, KEY_GRADS: tl.constexpr = 0):
    """Add the contributions of query tiles [start_m, end_m) to one key tile's dK and dV (KEY_GRADS: both, or
    only dV or only dK, whose pass skips the other's products); with DQ_REDUCE, also add this key tile's share
    of dQ (dS K) into the fp32 accumulator `dq_target`: through a TMA descriptor (DQ_REDUCE == 2, one bulk
    reduce-add per tile) or pointer atomics (DQ_REDUCE == 1). qT_block and do_block come from
    `tiles.operand_tiles` (Q transposed; dO as is, or transposed with fp32-accurate dots). With fp32-accurate dots
    (PRECISION other than "tf32"), `lse_row` points at the row max m and `inv_sum_row` at 1 / l
    (`flash_row_stats_kernel`); else `lse_row` at L (inv_sum_row unread)."""
    EXACT_ROWS: tl.constexpr = PRECISION != "tf32"
    if not USE_TMA:
        qT_block = tl.advance(qT_block, (0, start_m))
        do_block = tl.advance(do_block, (0, start_m) if EXACT_ROWS else (start_m, 0))
    dk_error = tl.zeros_like(dk)  # (fp32-accurate dots only: add_compensated)
    dv_error = tl.zeros_like(dv)
    for tile_start in range(start_m, end_m, BLOCK_M):
        offs_m = tile_start + tl.arange(0, BLOCK_M)
        qT = tiles.load_tile(qT_block, tile_start, MASKED or not EVEN_D, True, USE_TMA)  # (BLOCK_D, BLOCK_M)
        if EXACT_ROWS:
            # dP^T = V dO^T from dO^T as loaded, as the row statistics' dP = dO V^T is formed: D = rowsum(P dP) and
            # dP - D cancel only if both products round alike (Triton's interpreter rounds a dot of a transposed
            # view differently: numpy's sgemm of an F-ordered operand).
            do = tl.trans(tiles.load_tile(do_block, tile_start, MASKED or not EVEN_D, True, USE_TMA))
        else:
            do = tiles.load_tile(do_block, tile_start, MASKED or not EVEN_D, False, USE_TMA)  # (BLOCK_M, BLOCK_D)
        if MASKED:
            # Rows past n_queries get L (or m) = +inf, so their P is exactly 0.
            lse = tl.load(lse_row + offs_m, mask=offs_m < n_queries, other=float("inf"))
            delta = tl.load(delta_row + offs_m, mask=offs_m < n_queries, other=0.0)
        else:
            lse = tl.load(lse_row + offs_m)
            delta = tl.load(delta_row + offs_m)
        sT = scaled_scores(k, qT, qk_scale, PRECISION)  # (BLOCK_N, BLOCK_M), log2 units
        if PRECISION != "tf32":
            inv_sum = tl.load(inv_sum_row + offs_m, mask=offs_m < n_queries, other=0.0)
            pT = tl.math.exp2(sT - lse[None, :]) * inv_sum[None, :]
        else:
            pT = tl.math.exp2(sT - lse[None, :] * LOG2E)
        if MASKED and IS_CAUSAL:
            pT = tl.where(offs_m[None, :] >= offs_n[:, None], pT, 0.0)
        if KEY_GRADS != DV_ONLY:
            dpT = tl.dot(v, tl.trans(do), input_precision=PRECISION)  # (BLOCK_N, BLOCK_M)
            dsT = pT * (dpT - delta[None, :])
            if MASKED and IS_CAUSAL:
                dsT = tl.where(offs_m[None, :] == 0, 0.0, dsT)  # the first row sees one key: dS is exactly 0
        if PRECISION != "tf32":  # fp32-accurate dots ("ieee", "tf32x3"): compensated
            if KEY_GRADS != DK_ONLY:
                dv, dv_error = add_compensated(dv, dv_error, tl.dot(pT, do, input_precision=PRECISION))
            if KEY_GRADS != DV_ONLY:
                dk, dk_error = add_compensated(dk, dk_error, tl.dot(dsT, tl.trans(qT), input_precision=PRECISION))
        else:
            if KEY_GRADS != DK_ONLY:
                dv = tl.dot(pT.to(do.dtype), do, dv, input_precision=PRECISION)
            if KEY_GRADS != DV_ONLY:
                dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk, input_precision=PRECISION)
        if DQ_REDUCE != 0:
            dq_part = tl.dot(tl.trans(dsT.to(k.dtype)), k, input_precision=PRECISION)  # (BLOCK_M, BLOCK_D)
            if DQ_REDUCE == 2:  # rows past n_queries fall outside the descriptor and are dropped
                dq_target.atomic_add([batch_head, tile_start, 0], dq_part.reshape(1, BLOCK_M, BLOCK_D))
            else:
                rows = dq_target + offs_m[:, None] * BLOCK_D + tl.arange(0, BLOCK_D)[None, :]
                tl.atomic_add(rows, dq_part, mask=offs_m[:, None] < n_queries, sem="relaxed")
        if not USE_TMA:
            qT_block = tl.advance(qT_block, (0, BLOCK_M))
            do_block = tl.advance(do_block, (0, BLOCK_M) if EXACT_ROWS else (BLOCK_M, 0))
    if PRECISION != "tf32":
        dk, dv = dk - dk_error, dv - dv_error
    return dk, dv


@triton.jit
def _dq_key_tiles(dq, q, do, lse, inv_sum, delta, kT_block, vT_block, offs_m, start_n, end_n, n_keys, qk_scale,
                  MASKED: tl.constexpr, IS_CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, BLOCK_N: tl.constexpr,
                  PRECISION: tl.constexpr, USE_TMA: tl.constexpr = False):
    """Add the contributions of key tiles [start_n, end_n) to one query tile's dQ. kT_block and vT_block
    come from `tiles.operand_tiles` (K and V transposed). With fp32-accurate dots (PRECISION other than "tf32"),
    `lse` holds the row max m and `inv_sum` 1 / l (`flash_row_stats_kernel`); else `lse` is L (inv_sum unread)."""
    if not USE_TMA:
        kT_block = tl.advance(kT_block, (0, start_n))
        vT_block = tl.advance(vT_block, (0, start_n))
    dq_error = tl.zeros_like(dq)  # (fp32-accurate dots only: add_compensated)
    for tile_start in range(start_n, end_n, BLOCK_N):
        kT = tiles.load_tile(kT_block, tile_start, MASKED or not EVEN_D, True, USE_TMA)  # (BLOCK_D, BLOCK_N)
        vT = tiles.load_tile(vT_block, tile_start, MASKED or not EVEN_D, True, USE_TMA)
        s = scaled_scores(q, kT, qk_scale, PRECISION)  # (BLOCK_M, BLOCK_N)
        if PRECISION != "tf32":
            p = tl.math.exp2(s - lse[:, None]) * inv_sum[:, None]
        else:
            p = tl.math.exp2(s - lse[:, None] * LOG2E)
        if MASKED:
            offs_n = tile_start + tl.arange(0, BLOCK_N)
            keep = offs_n[None, :] < n_keys
            if IS_CAUSAL:
                keep = keep & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(keep, p, 0.0)
        dp = tl.dot(do, vT, input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        if MASKED and IS_CAUSAL:
            ds = tl.where(offs_m[:, None] == 0, 0.0, ds)  # the first row sees one key: dS is exactly 0
        if PRECISION != "tf32":
            dq, dq_error = add_compensated(dq, dq_error, tl.dot(ds, tl.trans(kT), input_precision=PRECISION))
        else:
            dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq, input_precision=PRECISION)
        if not USE_TMA:
            kT_block = tl.advance(kT_block, (0, BLOCK_N))
            vT_block = tl.advance(vT_block, (0, BLOCK_N))
    if PRECISION != "tf32":
        dq = dq - dq_error
    return dq




@triton.jit
def _dkdv_kernel(Q, K, V, dO, L, Delta, RowMax, RowInvSum, dK, dV, DQ_ACCUM,
                      q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides,
                      n_heads, n_queries, n_keys, head_dim, qk_scale, sm_scale, n_queries_bucket, n_keys_bucket,
                      IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                      PRECISION: tl.constexpr, DQ_REDUCE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, USE_TMA: tl.constexpr = False, KEY_GRADS: tl.constexpr = 0):
    batch_head = tl.program_id(1)
    b, h = batch_head // n_heads, batch_head % n_heads
    n0 = tl.program_id(0) * BLOCK_N
    # dQ accumulator (DQ_REDUCE != 0): fp32, (batch x heads, n_queries, BLOCK_D), zeroed by the host.
    if DQ_REDUCE == 2:
        dq_target = tl.make_tensor_descriptor(DQ_ACCUM, shape=[tl.num_programs(1), n_queries, BLOCK_D],
                                              strides=[n_queries * BLOCK_D, BLOCK_D, 1],
                                              block_shape=[1, BLOCK_M, BLOCK_D])
    elif DQ_REDUCE == 1:
        dq_target = DQ_ACCUM + batch_head.to(tl.int64) * n_queries * BLOCK_D
    else:
        dq_target = DQ_ACCUM  # unused (None)
    k_block = tiles.head_tile(K, b, h, k_strides, n_keys, head_dim, n0, BLOCK_N, BLOCK_D)
    v_block = tiles.head_tile(V, b, h, v_strides, n_keys, head_dim, n0, BLOCK_N, BLOCK_D)
    q_base = tiles.head_base(Q, b, h, q_strides)
    do_base = tiles.head_base(dO, b, h, do_strides)
    qT_block = tiles.operand_tiles(q_base, n_queries, head_dim, q_strides, BLOCK_M, BLOCK_D, True, USE_TMA)
    do_block = tiles.operand_tiles(do_base, n_queries, head_dim, do_strides, BLOCK_M, BLOCK_D, PRECISION != "tf32",
                                   USE_TMA)  # (fp32-accurate dots: transposed, `_dkdv_query_tiles` says why)
    lse_row = L + batch_head.to(tl.int64) * n_queries
    delta_row = Delta + batch_head.to(tl.int64) * n_queries
    if PRECISION != "tf32":  # fp32-accurate: P from `flash_row_stats_kernel`'s (m, 1 / l), not from L
        lse_row = RowMax + batch_head.to(tl.int64) * n_queries
        inv_sum_row = RowInvSum + batch_head.to(tl.int64) * n_queries
    else:
        inv_sum_row = lse_row  # (unread)
    k = tl.load(k_block, boundary_check=(0, 1), padding_option="zero")
    if KEY_GRADS != DV_ONLY:
        v = tl.load(v_block, boundary_check=(0, 1), padding_option="zero")
    else:
        v = k  # (unread: dV = P^T dO needs no V)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)

    full_query_tiles_end = (n_queries // BLOCK_M) * BLOCK_M
    rows = (lse_row, delta_row, inv_sum_row)
    if IS_CAUSAL:
        # Queries [n0, n0 + BLOCK_N) straddle the diagonal: masked. Later ones see the whole key tile.
        diagonal_end = tl.minimum(n0 + BLOCK_N, n_queries)
        dk, dv = _dkdv_query_tiles(dk, dv, k, v, qT_block, do_block, *rows, offs_n, n0, diagonal_end, n_queries,
                                   qk_scale, dq_target, batch_head, True, IS_CAUSAL, EVEN_D, BLOCK_M, BLOCK_D,
                                   PRECISION, DQ_REDUCE, USE_TMA, KEY_GRADS)
        unmasked_start = n0 + BLOCK_N
    else:
        unmasked_start = 0
    unmasked_end = tl.maximum(unmasked_start, full_query_tiles_end)
    dk, dv = _dkdv_query_tiles(dk, dv, k, v, qT_block, do_block, *rows, offs_n, unmasked_start, full_query_tiles_end,
                               n_queries, qk_scale, dq_target, batch_head, False, IS_CAUSAL, EVEN_D, BLOCK_M, BLOCK_D,
                               PRECISION, DQ_REDUCE, USE_TMA, KEY_GRADS)
    dk, dv = _dkdv_query_tiles(dk, dv, k, v, qT_block, do_block, *rows, offs_n, unmasked_end, n_queries, n_queries,
                               qk_scale, dq_target, batch_head, True, IS_CAUSAL, EVEN_D, BLOCK_M, BLOCK_D, PRECISION,
                               DQ_REDUCE, USE_TMA, KEY_GRADS)

    # dK and dV in their own layouts (the host makes them like K and V, so the gradients of the model's
    # strided head views flow back without copies).
    dk_block = tiles.head_tile(dK, b, h, dk_strides, n_keys, head_dim, n0, BLOCK_N, BLOCK_D)
    dv_block = tiles.head_tile(dV, b, h, dv_strides, n_keys, head_dim, n0, BLOCK_N, BLOCK_D)
    if KEY_GRADS != DV_ONLY:
        tl.store(dk_block, (dk * sm_scale).to(dK.dtype.element_ty), boundary_check=(0, 1))
    if KEY_GRADS != DK_ONLY:
        tl.store(dv_block, dv.to(dV.dtype.element_ty), boundary_check=(0, 1))


flash_dkdv_kernel = triton.autotune(
    configs=configs_from_families(DKDV_TILE_FAMILIES), key=BACKWARD_TUNING_KEY,
    prune_configs_by={"early_config_prune": prune_backward("BLOCK_N", "BLOCK_M", DKDV_TILE_FAMILIES)})(_dkdv_kernel)
# The same kernel forming one of dK and dV (KEY_GRADS), for wide heads: its own tiles and tuning cache.
flash_key_grad_kernel = triton.autotune(
    configs=configs_from_families({"wide-split": SPLIT_KEY_TILES}), key=BACKWARD_TUNING_KEY + ["KEY_GRADS"],
    prune_configs_by={"early_config_prune": prune_split})(_dkdv_kernel)
# The same kernel with DQ_REDUCE set: its own tuning cache, and DQ_ACCUM zeroed again after tuning runs.
flash_bwd_fused_kernel = triton.autotune(
    configs=configs_from_families(FUSED_TILE_FAMILIES), key=BACKWARD_TUNING_KEY, reset_to_zero=["DQ_ACCUM"],
    prune_configs_by={"early_config_prune": prune_backward("BLOCK_N", "BLOCK_M", FUSED_TILE_FAMILIES,
                                                              wide_max_tile=16 * 64)})(_dkdv_kernel)


@triton.autotune(configs=configs_from_families(DQ_TILE_FAMILIES), key=BACKWARD_TUNING_KEY,
                 prune_configs_by={"early_config_prune": prune_backward("BLOCK_M", "BLOCK_N", DQ_TILE_FAMILIES)})
@triton.jit
def flash_dq_kernel(Q, K, V, dO, L, Delta, RowMax, RowInvSum, dQ,
                    q_strides, k_strides, v_strides, do_strides, dq_strides,
                    n_heads, n_queries, n_keys, head_dim, qk_scale, sm_scale, n_queries_bucket, n_keys_bucket,
                    IS_CAUSAL: tl.constexpr, BLOCK_D: tl.constexpr, EVEN_D: tl.constexpr,
                    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    USE_TMA: tl.constexpr = False):
    query_tile, batch_head, b, h = tiles.query_tile_of_program(n_queries, n_heads, BLOCK_M, IS_CAUSAL)
    m0 = query_tile * BLOCK_M
    q_block = tiles.head_tile(Q, b, h, q_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D)
    do_block = tiles.head_tile(dO, b, h, do_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D)
    k_base = tiles.head_base(K, b, h, k_strides)
    v_base = tiles.head_base(V, b, h, v_strides)
    kT_block = tiles.operand_tiles(k_base, n_keys, head_dim, k_strides, BLOCK_N, BLOCK_D, True, USE_TMA)
    vT_block = tiles.operand_tiles(v_base, n_keys, head_dim, v_strides, BLOCK_N, BLOCK_D, True, USE_TMA)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = tl.load(q_block, boundary_check=(0, 1), padding_option="zero")
    do = tl.load(do_block, boundary_check=(0, 1), padding_option="zero")
    if PRECISION != "tf32":  # fp32-accurate: P from `flash_row_stats_kernel`'s (m, 1 / l), not from L
        rows = batch_head.to(tl.int64) * n_queries + offs_m
        lse = tl.load(RowMax + rows, mask=offs_m < n_queries, other=float("inf"))
        inv_sum = tl.load(RowInvSum + rows, mask=offs_m < n_queries, other=0.0)
    else:
        lse = tl.load(L + batch_head.to(tl.int64) * n_queries + offs_m, mask=offs_m < n_queries,
                      other=float("inf"))
        inv_sum = lse  # (unread)
    delta = tl.load(Delta + batch_head.to(tl.int64) * n_queries + offs_m, mask=offs_m < n_queries, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)

    unmasked_end, masked_end = tiles.key_tile_ends(m0, n_keys, IS_CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_key_tiles(dq, q, do, lse, inv_sum, delta, kT_block, vT_block, offs_m, 0, unmasked_end, n_keys,
                       qk_scale, False, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, USE_TMA)
    dq = _dq_key_tiles(dq, q, do, lse, inv_sum, delta, kT_block, vT_block, offs_m, unmasked_end, masked_end, n_keys,
                       qk_scale, True, IS_CAUSAL, EVEN_D, BLOCK_N, PRECISION, USE_TMA)
    dq_block = tiles.head_tile(dQ, b, h, dq_strides, n_queries, head_dim, m0, BLOCK_M, BLOCK_D)
    tl.store(dq_block, (dq * sm_scale).to(dQ.dtype.element_ty), boundary_check=(0, 1))


# The row statistics walk the keys of one query tile as the dQ pass does: its tiles and pruning.
flash_row_stats_kernel = triton.autotune(
    configs=configs_from_families(DQ_TILE_FAMILIES), key=BACKWARD_TUNING_KEY,
    prune_configs_by={"early_config_prune": prune_backward("BLOCK_M", "BLOCK_N", DQ_TILE_FAMILIES)})(
        flash_row_stats_kernel)


__all__ = ["LOG2E", "flash_bwd_fused_kernel", "flash_dkdv_kernel", "flash_dq_kernel",
           "flash_key_grad_kernel",
           "flash_preprocess_kernel", "flash_row_stats_kernel"]
