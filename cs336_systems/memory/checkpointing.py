"""Activation-checkpointing policies, applied to a built model from outside.

The model knows nothing of them: `apply_checkpointing(model, CheckpointPolicy.parse("every-k:4"))` (policy.py;
a string is parsed the same way) replaces the
forward of the model's block list (`model.layers`) by a checkpointed schedule. All use
torch.utils.checkpoint in its non-reentrant form (it composes with torch.compile, with our
FlashAttention Function and with our FSDP, whose recomputed layers are gathered once).

Policies, for N blocks with activations A per block and boundary tensors b per block:
* none: keep everything (N x A).
* every-block: checkpoint each block: N boundaries are kept, one block is recomputed at a time
  (N x b + A), one extra forward.
* every-k:K: groups of K blocks (N/K boundaries + K x A), one extra forward.
* sqrt: K = round(sqrt(N)), the classic balance of the two terms.
* nested: recursive halving: checkpoint the first half, recurse into the second; recomputing a
  half re-applies the same scheme. O(log N) live boundaries and O(N log N) block forwards.
* ffn: only each block's SwiGLU is checkpointed (attention activations kept).
* attn: only each block's attention is checkpointed (FFN activations kept).
* partial:M: checkpoint the first M blocks one by one and keep the other N - M whole
  (M x b + (N - M) x A + A), M extra block forwards: the least recompute that fits when memory
  is short of `none` but far from needing `every-block` (the leaderboard's choice).

Suffix `+keep-attn` (on every-block, every-k:K, sqrt, partial:M): selective checkpointing that keeps
the attention outputs (O and the row log-sum-exp L: d + h/2 elements per token in bf16) of every
checkpointed block, so the recompute runs the projections, norms and SwiGLU again but not the
attention (at 32k context the most expensive part of a block's forward). It works at the dispatcher
(torch.utils.checkpoint's selective contexts): the ops it keeps are our `cs336::flash_attention_forward`
and SDPA's flash / cuDNN / efficient kernels; any other attention is recomputed as usual.

`selective`, and the suffix `+selective` on partial:M (after any +keep-attn): the blocks that would be
kept whole are checkpointed selectively instead, keeping the outputs of their weight products (q, k, v,
output projection, w1, w3) and of the attention, and recomputing only the pointwise ops (norms, RoPE, the
SwiGLU gate, residual adds: a few ms of memory traffic per block at 32k tokens, no matmul). That keeps
about two thirds of a block for almost no recompute, so `partial:M+keep-attn+selective` fits with fewer
fully recomputed blocks than `partial:M+keep-attn`. w2's output is not kept: the recompute stops as soon
as the last saved tensor (w2's input) is regenerated (torch.utils.checkpoint's early stop), so w2 never
runs again. Products are recognised by a block's parameter storages at forward time, so this is for
unsharded blocks (DDP, one GPU), not for FSDP, whose gathered weights live in fresh storage.
"""

from __future__ import annotations

import functools
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy as SaveOrRecompute  # (torch's per-op decision)
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from cs336_systems.memory.policy import CheckpointPolicy


def _run(blocks, x):
    for block in blocks:
        x = type(block).forward(block, x)  # the block's own forward (its instance forward may be replaced)
    return x


def _checkpointed(fn, *args, keep_attention: bool = False, context_fn=None):
    if context_fn is None:
        context_fn = _keep_attention_contexts if keep_attention else noop_context_fn
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


@functools.cache
def _attention_ops() -> frozenset:
    import cs336_systems.kernels.flash_attention.function  # noqa: F401  (registers cs336::flash_attention_forward)

    aten = torch.ops.aten
    return frozenset({torch.ops.cs336.flash_attention_forward.default,
                      aten._scaled_dot_product_flash_attention.default,
                      aten._scaled_dot_product_cudnn_attention.default,
                      aten._scaled_dot_product_efficient_attention.default})


def _save_attention_outputs(ctx, op, *args, **kwargs):
    return SaveOrRecompute.MUST_SAVE if op in _attention_ops() else SaveOrRecompute.PREFER_RECOMPUTE


def _keep_attention_contexts():
    return create_selective_checkpoint_contexts(_save_attention_outputs)


@functools.cache
def _product_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default})  # linear and einsum lower to these


def _save_products_and_attention(weight_storages: frozenset, ctx, op, *args, **kwargs):
    if op in _attention_ops():
        return SaveOrRecompute.MUST_SAVE
    if op in _product_ops() and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in weight_storages
                                    for a in args):
        return SaveOrRecompute.MUST_SAVE
    return SaveOrRecompute.PREFER_RECOMPUTE


def _kept_product_weights(block: nn.Module) -> frozenset:
    """Storages of the block's weights whose products are kept: all but the SwiGLU's w2 (early stop ends
    the recompute before it runs, so its output is never needed)."""
    ffn = getattr(block, "ffn", None)
    skip = {id(p) for p in ffn.w2.parameters()} if ffn is not None and hasattr(ffn, "w2") else set()
    return frozenset(p.untyped_storage().data_ptr() for p in block.parameters() if id(p) not in skip)


def _selective_forward(own_forward):
    def forward(self, x):
        policy = functools.partial(_save_products_and_attention, _kept_product_weights(self))
        return _checkpointed(own_forward, self, x,
                             context_fn=lambda: create_selective_checkpoint_contexts(policy))
    return forward


def _nested(blocks, x):
    if len(blocks) <= 1:
        return _run(blocks, x)
    mid = len(blocks) // 2
    x = _checkpointed(_nested, blocks[:mid], x)
    return _nested(blocks[mid:], x)


def _checkpointed_forward(own_forward, keep_attention: bool = False):
    def forward(self, x):
        return _checkpointed(own_forward, self, x, keep_attention=keep_attention)
    return forward


def _passthrough(x):
    return x


def apply_checkpointing(model: nn.Module, policy: CheckpointPolicy | str) -> nn.Module:
    """Install `policy` (a CheckpointPolicy, or its string) on `model.layers` (an nn.ModuleList of blocks);
    returns the model.

    The model's own loop still calls every block in order: the first block of each group runs
    the whole group under one checkpoint, the others pass their input through. Names, state
    dict and parameters are untouched.
    """
    policy = CheckpointPolicy.of(policy)
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"apply_checkpointing: model needs an nn.ModuleList `layers`, got {type(blocks).__name__}")
    blocks = list(blocks)
    keep = policy.keep_attention
    if policy.scheme == "none":
        return model
    if policy.scheme in ("ffn", "attn"):
        for block in blocks:
            part = block.ffn if policy.scheme == "ffn" else block.attn
            # The part's current forward (our fused SwiGLU, if installed first), recomputed in backward.
            part.forward = lambda x, own=part.forward: _checkpointed(own, x)
        return model
    if policy.scheme == "partial":
        m = policy.checkpointed_blocks(len(blocks))
        for block in blocks[:m]:
            block.forward = types.MethodType(_checkpointed_forward(type(block).forward, keep), block)
        if policy.selective_rest:
            for block in blocks[m:]:
                block.forward = types.MethodType(_selective_forward(type(block).forward), block)
        return model
    if policy.scheme == "nested":
        groups = [blocks]
        runner = _nested
    else:
        k = policy.group_size(len(blocks))
        groups = [blocks[i:i + k] for i in range(0, len(blocks), k)]
        runner = lambda group, x: _checkpointed(_run, group, x, keep_attention=keep)  # noqa: E731
    for group in groups:
        group[0].forward = lambda x, group=group: runner(group, x)
        for block in group[1:]:
            block.forward = _passthrough
    return model
