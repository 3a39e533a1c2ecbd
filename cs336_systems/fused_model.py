"""Our fused kernels installed on a built BasicsTransformerLM, from outside.

`apply_fused_kernels(model)` re-points the forward of every `RMSNorm` to the Triton RMSNorm and
of every `SwiGLU` to `w2(silu_mul(w1 x, w3 x))` with the fused gate; with `rope=True` also every
`RotaryEmbedding` to the fused RoPE (the leaderboard's default with its fused kernels), and every attention
module then takes its token positions from one cached `arange` per length and device: the model made a new one
in every layer and step, and RoPE's on-device range check (four small kernels) ran for each, where one cached
tensor is checked once (`kernels.rope._check_positions`). Every `Linear` runs
as `F.linear` (the same product as its einsum): autograd then computes the weight's gradient in the
weight's own layout, where the einsum's comes out transposed and AccumulateGrad copies every weight
gradient of every step into place (7 per block; 46 ms of the 8B step, notes/leaderboard.md). Parameters, names and the
state dict are untouched, and the function computed is the same up to rounding (both keep the
norm in fp32 and return the input dtype), so checkpoints, checkpointing policies and FSDP
compose with it. Apply it before `apply_checkpointing`: the ffn/attn policies wrap the
forward a part has at that moment.

Attention is chosen separately (`cs336_systems.attention.use_attention`); the LM head and loss
by the caller (`kernels.cross_entropy.lm_head_cross_entropy`).
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_basics.model import CausalMultiHeadSelfAttention, Linear, RMSNorm, RotaryEmbedding, SwiGLU
from cs336_systems.kernels.rmsnorm import rmsnorm
from cs336_systems.kernels.rope import rope as fused_rope
from cs336_systems.kernels.swiglu import silu_mul


def _fused_rmsnorm_forward(self, x):
    return rmsnorm(x, self.weight, self.eps)


def _fused_swiglu_forward(self, x):
    # The w1 and w3 products are this forward's own temporaries, read later by the gate alone: its backward may
    # write their gradients over them (two (tokens, d_ff) tensors less at the block's backward peak).
    return self.w2(silu_mul(self.w1(x), self.w3(x), backward_in_place=True))


def _linear_forward(self, x):
    return F.linear(x, self.weight)


def _fused_rope_forward(self, x, pos_ids):
    return fused_rope(x, pos_ids, self._freq_cis_cache)


@functools.lru_cache(maxsize=16)
def _cached_positions(length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device)


def _attention_with_cached_positions(self, x, token_positions=None):
    # (under torch.compile the arange is made in the graph, as the model makes it, and checked there)
    if token_positions is None and not torch.compiler.is_compiling():
        token_positions = _cached_positions(x.shape[-2], x.device)
    return CausalMultiHeadSelfAttention.forward(self, x, token_positions)


def apply_fused_kernels(model: nn.Module, *, rope: bool = False) -> nn.Module:
    """Install the fused RMSNorm and SwiGLU gate (and, with `rope`, RoPE) on every such module of
    `model`, and the layout-keeping product on every Linear; returns `model`."""
    patched = 0
    for module in model.modules():
        if rope and isinstance(module, RotaryEmbedding):
            module.forward = types.MethodType(_fused_rope_forward, module)
            continue
        if rope and isinstance(module, CausalMultiHeadSelfAttention) and module.positional_encoder is not None:
            module.forward = types.MethodType(_attention_with_cached_positions, module)
        if isinstance(module, RMSNorm):
            module.forward = types.MethodType(_fused_rmsnorm_forward, module)
            patched += 1
        elif isinstance(module, SwiGLU):
            module.forward = types.MethodType(_fused_swiglu_forward, module)
            patched += 1
        elif isinstance(module, Linear):
            module.forward = types.MethodType(_linear_forward, module)
    if not patched:
        raise ValueError(f"apply_fused_kernels: {type(model).__name__} has no RMSNorm or SwiGLU modules")
    return model
