"""Our fused kernels installed on a built BasicsTransformerLM, from outside.

`apply_fused_kernels(model)` makes each module an instance of a fused subclass of its class (`FusedRMSNorm`, ...;
the same parameters and buffers): every `RMSNorm` runs the Triton RMSNorm (a block's two norms
store autocast's dtype, which their products would cast to anyway) and of every `SwiGLU`
to `w2(gate(w1 x, w3 x))` with the fused gate; with `rope=True` also every `RotaryEmbedding` to the fused RoPE (the
leaderboard's default with its fused kernels; each attention rotates its Q and K in one launch, `rope_pair`), and
every attention module then takes its token positions from one
cached `arange` per length and device: the model made a new one in every layer and step, and RoPE's on-device range
check (four small kernels) ran for each, where one cached tensor is checked once (`kernels.rope._check_positions`).

With `residual_norm` (the default) every `TransformerBlock` becomes a `FusedTransformerBlock`, whose mid-block
residual add runs inside its second norm (`kernels.rmsnorm.add_rmsnorm`): the sum and its norm written by one pass,
the norm's input gradient joined with the residual path's by one pass (0.7-1.2 % of a GPU-bound step on an H100,
notes/model_sizes.md). The block's other add stays where it is: fusing it into the next block's first norm would
change what a block takes and returns, which checkpointing policies and compiled blocks rely on.

Every `Linear` runs as `F.linear` (the same product as its einsum): autograd then computes the weight's gradient in
the weight's own layout, where the einsum's comes out transposed and AccumulateGrad copies every weight gradient of
every step into place (7 per block; 46 ms of the 8B step, notes/leaderboard.md).

With `merge_projections` (the default) each attention's Q, K and V projections are one product
(`merged_projection`), as PyTorch's own Transformers hold one Wqkv, and each SwiGLU's w1 and w3 are one product
whose output the gate reads as two halves (`merged_product`, `kernels.swiglu.silu_mul_packed`). The weights are
moved, once, into one buffer per group (each stays its own Parameter, a row block of it), so the product reads them
as one matrix without a copy. A small model's step is host-bound: this is 14 kernels fewer per block and step for
Q/K/V (two products and four autocast casts in the forward; four products, three casts and two adds of the input's
gradient in the backward, for one concatenation) and about 7 for w1/w3 (one product and two casts in the forward;
two products, two casts and an add in the backward, which takes the gate's gradient whole).

Parameter names and the state dict are untouched, and the function computed is the same up to rounding (both keep
the norm in fp32 and return the input dtype), so checkpoints, checkpointing policies and FSDP compose with it (a
merged product steps aside where FSDP has taken over a Linear's forward to gather its shards). Apply it before
`apply_checkpointing` (the ffn/attn policies wrap the forward a part has at that moment), before FSDP and before
making the optimizer (which must see the parameters' final storage).

Attention is chosen separately (`cs336_systems.attention.use_attention`); the LM head and loss
by the caller (`kernels.cross_entropy.lm_head_cross_entropy`).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor

from cs336_basics.model import CausalMultiHeadSelfAttention, Linear, RMSNorm, RotaryEmbedding, SwiGLU, TransformerBlock
from cs336_systems.kernels.rmsnorm import add_rmsnorm, rmsnorm
from cs336_systems.kernels.rope import rope as fused_rope
from cs336_systems.kernels.rope import rope_pair as fused_rope_pair
from cs336_systems.kernels.swiglu import silu_mul, silu_mul_packed

# CS336_FP32_WEIGHT_GRADIENTS=0: a 16-bit weight gradient product, then its cast (for A/B runs; read at import)
FP32_WEIGHT_GRADIENTS_FROM_THE_PRODUCT = os.environ.get("CS336_FP32_WEIGHT_GRADIENTS", "1") != "0"


def _fused_rmsnorm_forward(self, x):
    return rmsnorm(x, self.weight, self.eps)


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _fused_block_norm_forward(self, x):
    # A block's two norms feed products only (Q/K/V, w1/w3), which autocast casts to its dtype: the kernel stores
    # that dtype itself (the same values, one rounding of the fp32 result), with no fp32 output and cast kernel
    # going forward nor the gradient's cast back.
    return rmsnorm(x, self.weight, self.eps, out_dtype=_autocast_dtype(x))


def _fused_block_forward(self, x):
    # The residual add before the second norm is fused into it (`add_rmsnorm`): one pass writes the sum and its norm
    # going forward, one pass the norm's gradient joined with the residual path's going backward. A second norm
    # with hooks (FSDP's exact mode records its input and output gradient; SavedTensorLog labels by module) is
    # called as its module instead, so they see it.
    delta = self.attn(self.ln1(x))
    if type(self.ln2) is not FusedBlockRMSNorm or self.ln2._forward_hooks or self.ln2._forward_pre_hooks:
        h = x + delta
        return h + self.ffn(self.ln2(h))
    h, normed = add_rmsnorm(x, delta, self.ln2.weight, self.ln2.eps, out_dtype=_autocast_dtype(x))
    return h + self.ffn(normed)


def _fused_swiglu_forward(self, x):
    # The w1 and w3 products are this forward's own temporaries, read later by the gate alone: its backward may
    # write their gradients over them (two (tokens, d_ff) tensors less at the block's backward peak).
    return self.w2(silu_mul(self.w1(x), self.w3(x), backward_in_place=True))


def _linear_forward(self, x):
    copy = _copy_under_autocast(getattr(self, "weight_copy", None), x)
    if copy is not None:
        return MergedProjection.apply(x, False, False, copy, self.weight)
    return F.linear(x, self.weight)


def _copy_under_autocast(copy: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor | None:
    """A weight copy (`weight_copies`) where autocast to its dtype is on for x's device, else None: the product
    then reads the weight itself."""
    device = x.device.type
    if copy is None or not torch.is_autocast_enabled(device) or torch.get_autocast_dtype(device) != copy.dtype:
        return None
    return copy


def forward_taken_over(linear: nn.Module) -> None:
    """Mark a Linear whose forward a wrapper has replaced (our FSDP gathers the sharded weight there): the merged
    products that include it step aside for it, eagerly and under torch.compile."""
    linear._forward_taken_over = True


def _project_themselves(*linears) -> bool:
    """Whether each Linear still runs the product `apply_fused_kernels` gave it, on its own whole weight. Eagerly,
    a wrapper that replaced a Linear's forward shows in the forward's identity; under torch.compile only the mark of
    `forward_taken_over` is read: dynamo (torch 2.11) did not resolve that identity, and the merge was silently off
    in every compiled graph (21 products a block where 12 are needed). A wrapper that replaces a Linear's forward
    under torch.compile must call `forward_taken_over`."""
    if any(linear._forward_taken_over for linear in linears):
        return False
    if torch.compiler.is_compiling():
        return True
    return all(getattr(linear.forward, "__func__", None) is _linear_forward for linear in linears)


def _merged_swiglu_forward(self, x):
    # One product with w1 and w3 stacked; the gate reads its two halves, and its backward writes their gradient over
    # it, whole, for one product each of dx and dW.
    if not _project_themselves(self.w1, self.w3):
        return _fused_swiglu_forward(self, x)
    copy = _copy_under_autocast(getattr(self, "merged_weight_copy", None), x)
    return self.w2(silu_mul_packed(merged_product(x, self.w1.weight, self.w3.weight, copy=copy),
                                   backward_in_place=True))


def _consecutive_rows(weights: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The weights as one (sum of rows, d_in) matrix, a view, where each starts where the one before ends in one
    storage (as `_make_consecutive` leaves them); else None."""
    first = weights[0]
    if isinstance(first, FakeTensor) or first.device.type == "meta" or not all(
            w.dim() == 2 and w.is_contiguous() and w.shape[1] == first.shape[1] and w.dtype == first.dtype
            and w.device == first.device for w in weights):
        return None
    address = first.data_ptr()
    for w in weights:
        if w.data_ptr() != address or w.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        address += w.numel() * w.element_size()
    return first.as_strided((sum(w.shape[0] for w in weights), first.shape[1]), (first.shape[1], 1))


class MergedProjection(torch.autograd.Function):
    """x W_i^T for several weights W_i in one product: returned whole (`split=False`, the W_i's outputs side by side
    along the last dim) or as one output per weight (column blocks of the product). Under autocast, the input and
    the merged weight are cast once, as `F.linear` would cast each. With `copy` (the W_i stacked, in autocast's
    dtype, as `weight_copies` keeps them) the product reads it and nothing is cast but the input. Either way the
    weights' gradients leave the product in the weights' dtype (`_weight_gradient`).

    A column block is a view: while any of them lives, the whole product does. With `copy_last` the last output is a
    copy of its own, so an attention that saves V for its backward keeps V alone, not Q's and K's columns beside it
    (RoPE reads Q and K and keeps neither: the product is freed after it)."""

    @staticmethod
    def forward(ctx, x, split, copy_last, copy, *weights):
        if copy is not None:
            x, weight = x.to(copy.dtype), copy
        else:
            weight = _consecutive_rows(weights)
            if weight is None:  # (the weights were moved apart, e.g. by `.to()` after `apply_fused_kernels`: a copy)
                weight = torch.cat(weights)
            device = x.device.type
            dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
            x, weight = x.to(dtype), weight.to(dtype)
        ctx.save_for_backward(x, weight)
        ctx.rows = [w.shape[0] for w in weights]
        ctx.weight_dtype = weights[0].dtype
        product = F.linear(x, weight)
        return _column_blocks(product, ctx.rows, copy_last) if split else product

    @staticmethod
    def backward(ctx, *grads):
        x, weight = ctx.saved_tensors
        if len(grads) == 1 and grads[0] is not None:  # the whole product's gradient (`split=False`)
            grad = grads[0].to(weight.dtype)
        else:
            # One gradient of the whole product (what PyTorch's split backward forms too), so each of dx and dW is
            # one product; an output nobody used has no gradient (None): zeros there.
            grad = torch.cat([g.to(weight.dtype) if g is not None
                              else x.new_zeros(*x.shape[:-1], rows, dtype=weight.dtype)
                              for g, rows in zip(grads, ctx.rows)], dim=-1)
        grad_x = grad @ weight if ctx.needs_input_grad[0] else None
        if not any(ctx.needs_input_grad[4:]):
            return grad_x, None, None, None, *(None for _ in ctx.rows)
        grad_weight = _weight_gradient(grad.reshape(-1, grad.shape[-1]).T, x.reshape(-1, x.shape[-1]),
                                       ctx.weight_dtype)
        return grad_x, None, None, None, *grad_weight.split(ctx.rows)  # (row blocks: contiguous, as their weights)


def _weight_gradient(grad_t: torch.Tensor, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_t @ x in `dtype`. On CUDA a bf16/fp16 product writes its fp32 accumulator as fp32 itself (`mm` with
    `out_dtype`): no rounding to 16 bits and no cast kernel after (a read of 2 and a write of 4 bytes an element of
    every weight gradient, every step)."""
    if grad_t.dtype == dtype:
        return grad_t @ x
    if grad_t.is_cuda and dtype == torch.float32 and FP32_WEIGHT_GRADIENTS_FROM_THE_PRODUCT:
        return torch.mm(grad_t, x, out_dtype=dtype)
    return (grad_t @ x).to(dtype)


def _column_blocks(product: torch.Tensor, rows: list[int], copy_last: bool) -> tuple[torch.Tensor, ...]:
    """The product's column block of each weight (views), the last a copy of its own with `copy_last`."""
    outputs = product.split(rows, dim=-1)
    return (*outputs[:-1], outputs[-1].contiguous()) if copy_last else outputs


def _traced_product(x: torch.Tensor, weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The merged product as torch.compile traces it: the weights concatenated in the graph, where inductor makes the
    concatenation and autocast's cast one kernel (the casts it replaces read and write as much), and autograd's own
    backward of the product and the concatenation (one product each of dx and dW, then row blocks)."""
    return F.linear(x, torch.cat(weights))


def merged_projection(x: torch.Tensor, *weights: torch.Tensor, copy_last: bool = False,
                      copy: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(x W_1^T, x W_2^T, ...) as one product (`MergedProjection`); each W_i (d_out_i, d_in). The outputs are views
    of the product, but for the last with `copy_last`. `copy`: the W_i stacked in autocast's dtype, read instead."""
    if copy is None and torch.compiler.is_compiling():
        return _column_blocks(_traced_product(x, weights), [w.shape[0] for w in weights], copy_last)
    return MergedProjection.apply(x, True, copy_last, copy, *weights)


def merged_product(x: torch.Tensor, *weights: torch.Tensor, copy: torch.Tensor | None = None) -> torch.Tensor:
    """x [W_1; W_2; ...]^T: the products with each W_i (d_out_i, d_in) side by side along the last dim, as one
    product whose backward takes its gradient whole (no concatenation). `copy` as for `merged_projection`."""
    if copy is None and torch.compiler.is_compiling():
        return _traced_product(x, weights)
    return MergedProjection.apply(x, False, False, copy, *weights)


def _make_consecutive(params: list[nn.Parameter]) -> None:
    """Move the parameters' data, once, into one new buffer in this order (each a row block of it), so
    `_consecutive_rows` finds them as one matrix."""
    buffer = torch.cat([p.detach() for p in params])
    for p, rows in zip(params, buffer.split([p.shape[0] for p in params])):
        p.data = rows


def _merged_project_qkv(self, x):
    # Not without RoPE (the attention would then save Q's and K's views, and with them the whole product, for its
    # backward).
    if (self.positional_encoder is None
            or not _project_themselves(self.q_proj, self.k_proj, self.v_proj)):
        return CausalMultiHeadSelfAttention.project_qkv(self, x)
    return merged_projection(x, self.q_proj.weight, self.k_proj.weight, self.v_proj.weight, copy_last=True,
                             copy=_copy_under_autocast(getattr(self, "merged_weight_copy", None), x))


def _fused_rope_forward(self, x, pos_ids):
    return fused_rope(x, pos_ids, self._freq_cis_cache)


def _fused_rotate_qk(self, q, k, positions):
    # Q and K in one launch (a launch fewer per layer each way: most of a small model's RoPE time is its launches).
    return fused_rope_pair(q, k, positions, self.positional_encoder._freq_cis_cache)


@functools.lru_cache(maxsize=16)
def _cached_positions(length: int, device: torch.device) -> torch.Tensor:
    return torch.arange(length, device=device)


def _attention_with_cached_positions(self, x, token_positions=None):
    # (under torch.compile the arange is made in the graph, as the model makes it, and checked there)
    if token_positions is None and not torch.compiler.is_compiling():
        token_positions = _cached_positions(x.shape[-2], x.device)
    return CausalMultiHeadSelfAttention.forward(self, x, token_positions)


def product_weight_groups(model: nn.Module) -> list[tuple[nn.Module | None, list[nn.Parameter]]]:
    """The weights each product of a fused model reads as one matrix: (the attention or SwiGLU module whose merged
    product it is, its weights) for each merged group, then (None, [weight]) for every other Linear."""
    groups, grouped = [], set()
    for module in model.modules():
        if isinstance(module, MergedQKVAttention):
            weights = [module.q_proj.weight, module.k_proj.weight, module.v_proj.weight]
        elif isinstance(module, MergedSwiGLU):
            weights = [module.w1.weight, module.w3.weight]
        else:
            continue
        groups.append((module, weights))
        grouped.update(id(w) for w in weights)
    groups += [(None, [m.weight]) for m in model.modules() if isinstance(m, Linear) and id(m.weight) not in grouped]
    return groups


# The fused forms as subclasses, each module's class swapped in place (`module.__class__ = ...`), rather than bound
# methods set on each instance: torch.compile then guards a module's forward by its type, which it checks anyway,
# where an instance's own `forward` costs guards on the method object, its function's code and its `__self__` (a
# Python lambda guard) for every module, checked on every call of a compiled block (notes/model_sizes.md: 12 checks
# a step at small, about 4x the baseline's cost each).
class FusedRMSNorm(RMSNorm):
    forward = _fused_rmsnorm_forward


class FusedBlockRMSNorm(RMSNorm):
    forward = _fused_block_norm_forward


class FusedSwiGLU(SwiGLU):
    forward = _fused_swiglu_forward


class FusedTransformerBlock(TransformerBlock):
    forward = _fused_block_forward


class MergedSwiGLU(SwiGLU):
    forward = _merged_swiglu_forward


class FusedLinear(Linear):
    forward = _linear_forward


class FusedRotaryEmbedding(RotaryEmbedding):
    forward = _fused_rope_forward


class MergedQKVAttention(CausalMultiHeadSelfAttention):
    project_qkv = _merged_project_qkv


class FusedRoPEAttention(CausalMultiHeadSelfAttention):
    forward = _attention_with_cached_positions
    rotate_qk = _fused_rotate_qk


class MergedQKVFusedRoPEAttention(MergedQKVAttention, FusedRoPEAttention):
    pass


# an attention's fused class by (Q/K/V merged, RoPE fused); neither: the plain class
_ATTENTION_CLASSES = {(True, True): MergedQKVFusedRoPEAttention, (True, False): MergedQKVAttention,
                      (False, True): FusedRoPEAttention, (False, False): CausalMultiHeadSelfAttention}


def apply_fused_kernels(model: nn.Module, *, rope: bool = False, merge_projections: bool = True,
                        residual_norm: bool = True) -> nn.Module:
    """Install the fused RMSNorm and SwiGLU gate (and, with `rope`, RoPE) on every such module of
    `model`, the layout-keeping product on every Linear, (`merge_projections`) one Q/K/V product per attention
    and one w1/w3 product per SwiGLU, and (`residual_norm`) each block's mid-block residual add fused into its second
    norm; returns `model`. Each module becomes an instance of the fused subclass of its
    class (above): parameters, buffers, names and the state dict are untouched."""
    patched = 0
    block_norms = {id(norm) for block in model.modules() if isinstance(block, TransformerBlock)
                   for norm in (block.ln1, block.ln2)}
    for module in model.modules():
        if type(module) is TransformerBlock and residual_norm:
            module.__class__ = FusedTransformerBlock
        elif isinstance(module, CausalMultiHeadSelfAttention):
            if merge_projections:
                _make_consecutive([module.q_proj.weight, module.k_proj.weight, module.v_proj.weight])
            module.__class__ = _ATTENTION_CLASSES[merge_projections, rope and module.positional_encoder is not None]
        elif rope and isinstance(module, RotaryEmbedding):
            module.__class__ = FusedRotaryEmbedding
        elif isinstance(module, RMSNorm):
            module.__class__ = FusedBlockRMSNorm if id(module) in block_norms else FusedRMSNorm
            patched += 1
        elif isinstance(module, SwiGLU):
            if merge_projections:
                _make_consecutive([module.w1.weight, module.w3.weight])
            module.__class__ = MergedSwiGLU if merge_projections else FusedSwiGLU
            patched += 1
        elif isinstance(module, Linear):
            module.__class__ = FusedLinear
            module._forward_taken_over = getattr(module, "_forward_taken_over", False)
    if not patched:
        raise ValueError(f"apply_fused_kernels: {type(model).__name__} has no RMSNorm or SwiGLU modules")
    return model
