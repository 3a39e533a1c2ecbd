"""The tensors an attention launch writes (O and L; D, dK, dV and dQ or its fp32 accumulator), allocated the same
way by a first call (`dispatch`) and by a replayed launch plan, and the backward's result read back from them."""

from __future__ import annotations

import math

import torch

from cs336_systems.kernels._triton_utils import next_power_of_2
from cs336_systems.kernels.flash_attention import gluon_common


def forward_buffers(q) -> tuple[torch.Tensor, torch.Tensor]:
    """O and L as the forward writes them."""
    # O in q's layout: for the model's head view of (batch, seq, heads, d), merging the heads back afterwards is
    # a view, not a copy.
    return torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)


def backward_buffers(k, v, lse, exact_rows: bool = False) -> dict[str, torch.Tensor]:
    """D and the backward's dK, dV, named as launch plans know them; with exact_rows (`dispatch.exact_row_stats`),
    also each query row's max and inverse sum (`backward.flash_row_stats_kernel`)."""
    # Gradients in their inputs' layouts: the model's strided head views get theirs back without copies.
    buffers = dict(delta=torch.empty_like(lse), dk=torch.empty_like(k), dv=torch.empty_like(v))
    if exact_rows:
        buffers |= dict(row_max=torch.empty_like(lse), row_inv_sum=torch.empty_like(lse))
    return buffers


def dq_accum_shape(q, accum: str) -> tuple[int, int]:
    """(rows, columns) per (batch, head) of the one-pass fp32 dQ accumulator: "gluon" (the Gluon one-pass
    kernels: whole 128-row tiles of head_dim) or "tl" (backward.py's one-pass kernel: n_queries rows of BLOCK_D)."""
    if accum == "gluon":
        return gluon_common.one_pass_rows(q.shape[-2]), q.shape[-1]
    return q.shape[-2], max(16, next_power_of_2(q.shape[-1]))


def dq_buffer(q, accum: str | None) -> dict[str, torch.Tensor]:
    """Where dQ goes: dq (accum None: two passes write it) or the one-pass accumulator (`dq_accum_shape`),
    which the preprocess launch zeroes."""
    if accum is None:
        return dict(dq=torch.empty_like(q))
    rows, cols = dq_accum_shape(q, accum)
    return dict(dq_accum=torch.empty(math.prod(q.shape[:-2]), rows, cols, device=q.device, dtype=torch.float32))


def backward_result(q, buffers: dict[str, torch.Tensor], accum: str | None):
    """(dq, dk, dv) once the launches have run: dq is cast from the one-pass accumulator where there is one
    (the `tl` kernel adds dS K unscaled; the Gluon ones add it scaled)."""
    if accum is None:
        dq = buffers["dq"]
    else:
        rows = buffers["dq_accum"][:, :q.shape[-2], :q.shape[-1]]
        if accum == "tl":
            rows = rows.mul_(1.0 / math.sqrt(q.shape[-1]))
        dq = torch.empty_like(q)  # in q's layout, as the other gradients
        dq.copy_(rows.view(q.shape))  # (batch*heads, ..) -> q's dims
    if buffers["dk"].shape[-2] == 1:  # one key: P = 1 whatever Q and K, so their gradients are exactly zero
        dq.zero_()
        buffers["dk"].zero_()
    return dq, buffers["dk"], buffers["dv"]
