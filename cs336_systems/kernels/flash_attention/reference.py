"""Attention references: naive (materialised scores) and a tiled pure-PyTorch FlashAttention-2.

Shapes: q (..., n_queries, d), k and v (..., n_keys, d), any leading dims (batch, or batch
and heads). L is the row log-sum-exp of the scaled (and masked) scores, (..., n_queries).
Causal masking follows the suites: key index > query index is masked by adding -1e6.
"""

from __future__ import annotations

import math

import torch

MASK_VALUE = -1e6  # added to masked scores (not -inf), as the assignment specifies


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, where: str) -> None:
    """What every attention here refuses, named in its message (`where`): q, k, v of other than 3 or 4 dims or of
    mismatched dims, lengths, head dims or dtypes; an empty sequence; a head dim of 0."""
    if q.dim() not in (3, 4):
        raise ValueError(f"{where}: q must be 3-D (batch, seq, d) or 4-D (batch, heads, seq, d), "
                         f"got shape {tuple(q.shape)}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"{where}: q, k, v must have the same number of dims, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[:-2] != k.shape[:-2] or k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"{where}: batch/head dims must match and k, v must have the same length, got "
                         f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"{where}: q, k, v must share the head dim, got {q.shape[-1]}, {k.shape[-1]}, "
                         f"{v.shape[-1]}")
    if q.shape[-1] == 0:
        raise ValueError(f"{where}: the head dim must be at least 1, got 0")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"{where}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError(f"{where}: sequences must be non-empty")


def causal_mask(n_queries: int, n_keys: int, device, query_start: int = 0, key_start: int = 0) -> torch.Tensor:
    """(n_queries, n_keys) bool, True where the key is visible (key index <= query index);
    the starts place a tile inside the full matrix."""
    keys = torch.arange(key_start, key_start + n_keys, device=device)
    queries = torch.arange(query_start, query_start + n_queries, device=device)
    return keys[None, :] <= queries[:, None]


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False, *,
                    upcast: bool = True, return_lse: bool = False):
    """softmax(q k^T / sqrt(d)) v with every score materialised.

    upcast: compute in fp32 (softmax in fp32 either way) and return the input dtype; without
    it, the matmuls run in the input dtype, as a plain low-precision PyTorch program would.
    """
    in_dtype, acc_dtype = q.dtype, _accumulator_dtype(q)
    if upcast:
        q, k, v = q.to(acc_dtype), k.to(acc_dtype), v.to(acc_dtype)
    scores = (q @ k.transpose(-1, -2)).to(acc_dtype) / math.sqrt(q.shape[-1])  # (..., n_queries, n_keys)
    if is_causal:
        scores = scores + torch.where(causal_mask(q.shape[-2], k.shape[-2], q.device), 0.0, MASK_VALUE)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = (probs.to(v.dtype) @ v).to(in_dtype)
    return (out, lse) if return_lse else out


def _accumulator_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 accumulators for fp32 and lower precisions; fp64 stays fp64 (for tight references)."""
    return torch.promote_types(x.dtype, torch.float32)


def _tiles(n: int, tile: int):
    for start in range(0, n, tile):
        yield start, min(start + tile, n)


def flash_forward_tiled(q, k, v, is_causal: bool, q_tile: int, k_tile: int):
    """Online-softmax forward over (q_tile x k_tile) tiles; fp32 accumulators. Returns (O, L)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    acc_dtype = _accumulator_dtype(q)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=acc_dtype)
    for q0, q1 in _tiles(n_queries, q_tile):
        q_blk = q[..., q0:q1, :].to(acc_dtype)  # (..., bq, d)
        acc = torch.zeros_like(q_blk)
        row_max = torch.full(q_blk.shape[:-1], -math.inf, device=q.device, dtype=acc_dtype)
        row_sum = torch.zeros(q_blk.shape[:-1], device=q.device, dtype=acc_dtype)
        for k0, k1 in _tiles(n_keys, k_tile):
            if is_causal and k0 > q1 - 1:
                break  # every later key tile is fully masked for this query tile
            s = q_blk @ k[..., k0:k1, :].to(acc_dtype).transpose(-1, -2) * scale  # (..., bq, bk)
            if is_causal:
                s = s + torch.where(causal_mask(q1 - q0, k1 - k0, q.device, q0, k0), 0.0, MASK_VALUE)
            new_max = torch.maximum(row_max, s.amax(-1))
            p = torch.exp(s - new_max[..., None])
            correction = torch.exp(row_max - new_max)
            row_sum = row_sum * correction + p.sum(-1)
            # P is rounded to V's dtype before the PV product, as the kernel does.
            acc = acc * correction[..., None] + p.to(v.dtype).to(acc_dtype) @ v[..., k0:k1, :].to(acc_dtype)
            row_max = new_max
        out[..., q0:q1, :] = (acc / row_sum[..., None]).to(q.dtype)
        lse[..., q0:q1] = row_max + torch.log(row_sum)
    return out, lse


def _tile_probabilities(q_blk, k_blk, lse_blk, is_causal: bool, q0: int, k0: int, scale: float) -> torch.Tensor:
    """P of the query tile starting at row q0 against the key tile starting at k0 (tiles in the accumulator
    dtype; lse_blk: the tile's saved L, (..., rows, 1)), recomputed from the saved L."""
    s = q_blk @ k_blk.transpose(-1, -2) * scale
    if is_causal:
        s = s + torch.where(causal_mask(q_blk.shape[-2], k_blk.shape[-2], q_blk.device, q0, k0), 0.0, MASK_VALUE)
    return torch.exp(s - lse_blk)


def delta_from_products(q, k, v, lse, grad_out, is_causal: bool, q_tile: int, k_tile: int) -> torch.Tensor:
    """D = rowsum(P * dP), tile by tile, (..., n_queries) in fp32 (`flash_backward_tiled`'s fp32 D)."""
    acc_dtype = _accumulator_dtype(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    delta = torch.zeros(q.shape[:-1], device=q.device, dtype=acc_dtype)
    for q0, q1 in _tiles(q.shape[-2], q_tile):
        q_blk, do_blk = q[..., q0:q1, :].to(acc_dtype), grad_out[..., q0:q1, :].to(acc_dtype)
        lse_blk = lse[..., q0:q1, None].to(acc_dtype)
        for k0, k1 in _tiles(k.shape[-2], k_tile):
            if is_causal and q1 - 1 < k0:
                break  # no query in this tile sees these keys or later ones
            k_blk, v_blk = k[..., k0:k1, :].to(acc_dtype), v[..., k0:k1, :].to(acc_dtype)
            p = _tile_probabilities(q_blk, k_blk, lse_blk, is_causal, q0, k0, scale)
            delta[..., q0:q1] += (p * (do_blk @ v_blk.transpose(-1, -2))).sum(-1)
    return delta


def flash_backward_tiled(q, k, v, out, lse, grad_out, is_causal: bool, q_tile: int, k_tile: int):
    """Backward by recomputation, tile by tile. Returns (dq, dk, dv).

    D = rowsum(O * dO) in 16 bits, as the handout's algorithm; in fp32, D = rowsum(P * dP) from one more sweep over
    the tiles (`delta_from_products`): the same value in exact arithmetic, but it rounds with the dP it is
    subtracted from, as PyTorch's softmax backward does, where O's rounding put dS at up to 5x PyTorch's fp32
    error on rows with few keys (tests/test_kernels_flash_fuzz.py).

    A row that sees one key (every row when there is one key; the first row under a causal mask) has P = 1 there,
    so its dS = P (dP - D) is zero; D from O and dO rounds differently from dP, though, which would leave
    1e-7..1e-6 in gradients that are exactly zero (PyTorch's softmax backward gives exact zeros). Those rows' dS
    is set to zero (every kernel does the same: `dispatch` for one key, the kernels' masked tiles for the first
    row)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    n_queries, n_keys = q.shape[-2], k.shape[-2]
    acc_dtype = _accumulator_dtype(q)
    if q.dtype == torch.float32:
        delta = delta_from_products(q, k, v, lse, grad_out, is_causal, q_tile, k_tile)
    else:
        delta = (out.to(acc_dtype) * grad_out.to(acc_dtype)).sum(-1)  # (..., n_queries)
    dq = torch.zeros_like(q, dtype=acc_dtype)
    dk = torch.zeros_like(k, dtype=acc_dtype)
    dv = torch.zeros_like(v, dtype=acc_dtype)
    lse = lse.to(acc_dtype)
    for k0, k1 in _tiles(n_keys, k_tile):
        k_blk, v_blk = k[..., k0:k1, :].to(acc_dtype), v[..., k0:k1, :].to(acc_dtype)
        for q0, q1 in _tiles(n_queries, q_tile):
            if is_causal and q1 - 1 < k0:
                continue  # no query in this tile sees these keys
            q_blk, do_blk = q[..., q0:q1, :].to(acc_dtype), grad_out[..., q0:q1, :].to(acc_dtype)
            p = _tile_probabilities(q_blk, k_blk, lse[..., q0:q1, None], is_causal, q0, k0, scale)  # (..., bq, bk)
            dv[..., k0:k1, :] += p.transpose(-1, -2) @ do_blk
            dp = do_blk @ v_blk.transpose(-1, -2)
            ds = p * (dp - delta[..., q0:q1, None]) * scale
            if is_causal and q0 == 0:
                ds[..., 0, :] = 0.0  # `one_key_rows`: the first row sees one key
            if n_keys == 1:
                ds.zero_()
            dq[..., q0:q1, :] += ds @ k_blk
            dk[..., k0:k1, :] += ds.transpose(-1, -2) @ q_blk
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 in plain PyTorch: tiled online-softmax forward saving (Q, K, V, O, L),
    backward by recomputation. Runs anywhere PyTorch does (the suites call it on CPU).

    Memory is O(tile^2) per leading element beyond inputs and outputs; speed is that of a
    Python loop over tiles, so this is a reference, not a kernel.
    """

    Q_TILE = 16
    K_TILE = 16

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        check_attention_inputs(q, k, v, "FlashAttentionPytorch")
        out, lse = flash_forward_tiled(q, k, v, bool(is_causal), FlashAttentionPytorch.Q_TILE,
                                       FlashAttentionPytorch.K_TILE)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal = bool(is_causal)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        tiles = FlashAttentionPytorch.Q_TILE, FlashAttentionPytorch.K_TILE
        return *flash_backward_tiled(q, k, v, out, lse, grad_out, ctx.is_causal, *tiles), None


def _compiled_backward_math(q, k, v, out, lse, grad_out, is_causal: bool):
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, dof = q.float(), k.float(), v.float(), grad_out.float()
    s = qf @ kf.transpose(-1, -2) * scale
    if is_causal:
        s = s + torch.where(causal_mask(q.shape[-2], k.shape[-2], q.device), 0.0, MASK_VALUE)
    p = torch.exp(s - lse[..., None])
    delta = (out.float() * dof).sum(-1, keepdim=True)
    dv = p.transpose(-1, -2) @ dof
    ds = p * (dof @ vf.transpose(-1, -2) - delta)
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_compiled = None


def compiled_backward(q, k, v, out, lse, grad_out, is_causal: bool):
    """The backward maths in PyTorch under torch.compile, the first version the handout asks for (compiled once per
    shape, causal flag and dtype): whole (n_queries x n_keys) tiles, so P is materialised per call. A correctness
    and speed baseline, not a memory-saving path."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_compiled_backward_math, dynamic=False)
    return _compiled(q, k, v, out, lse, grad_out, is_causal)
