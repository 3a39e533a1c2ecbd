"""Activation-checkpointing policies, applied to a built model from outside.

The model knows nothing of them: `apply_checkpointing(model, "every-k:4")` replaces the
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
import math
import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

POLICIES = ("none", "every-block", "every-k:K", "partial:M", "sqrt", "nested", "ffn", "attn", "selective")
KEEP_ATTENTION = "+keep-attn"
KEEP_ATTENTION_BASES = ("every-block", "every-k", "partial", "sqrt")
SELECTIVE = "+selective"


def keeps_attention(policy: str) -> bool:
    """True for the `+keep-attn` variants (validated)."""
    parse_policy(policy)
    return policy.removesuffix(SELECTIVE).endswith(KEEP_ATTENTION)


def selective_rest(policy: str) -> bool:
    """True for `selective` and the `partial:M...+selective` variants (validated): the blocks not fully
    checkpointed keep their products and attention outputs and recompute their pointwise ops."""
    parse_policy(policy)
    return policy == "selective" or policy.endswith(SELECTIVE)


def parse_policy(policy: str) -> tuple[str, int | None]:
    """'every-k:4' -> ('every-k', 4); validates the name and K. A `+keep-attn` suffix is accepted on the
    single-level policies (see `keeps_attention`) and does not change the result; `selective` is
    ('partial', 0) and a `+selective` suffix (partial only, see `selective_rest`) does not change it either."""
    if policy == "selective":
        return "partial", 0
    if policy.endswith(SELECTIVE):
        name, arg = parse_policy(policy.removesuffix(SELECTIVE))
        if name != "partial" or policy.removesuffix(SELECTIVE) == "selective":
            raise ValueError(f"checkpoint policy {policy!r}: {SELECTIVE} applies to partial:M "
                             f"(optionally partial:M{KEEP_ATTENTION}{SELECTIVE}); got it on {name!r}")
        return name, arg
    if policy.endswith(KEEP_ATTENTION):
        if policy.removesuffix(KEEP_ATTENTION).endswith(SELECTIVE) or policy == "selective" + KEEP_ATTENTION:
            raise ValueError(f"checkpoint policy {policy!r}: write {KEEP_ATTENTION} before {SELECTIVE}, "
                             f"e.g. partial:10{KEEP_ATTENTION}{SELECTIVE}")
        name, arg = parse_policy(policy.removesuffix(KEEP_ATTENTION))
        if name not in KEEP_ATTENTION_BASES:
            raise ValueError(f"checkpoint policy {policy!r}: {KEEP_ATTENTION} applies to "
                             f"{', '.join(KEEP_ATTENTION_BASES)}; got it on {name!r}")
        return name, arg
    name, _, arg = policy.partition(":")
    if name == "every-k":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"checkpoint policy every-k needs a positive group size, e.g. every-k:4; got {policy!r}")
        return name, int(arg)
    if name == "partial":
        if not arg.isdigit():
            raise ValueError(f"checkpoint policy partial needs a block count M >= 0, e.g. partial:20; got {policy!r}")
        return name, int(arg)
    if name not in {p.partition(":")[0] for p in POLICIES} or arg:
        raise ValueError(f"unknown checkpoint policy {policy!r}; valid: {', '.join(POLICIES)}")
    return name, None


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
    return CheckpointPolicy.MUST_SAVE if op in _attention_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_contexts():
    return create_selective_checkpoint_contexts(_save_attention_outputs)


@functools.cache
def _product_ops() -> frozenset:
    aten = torch.ops.aten
    return frozenset({aten.mm.default, aten.bmm.default, aten.addmm.default})  # linear and einsum lower to these


def _save_products_and_attention(weight_storages: frozenset, ctx, op, *args, **kwargs):
    if op in _attention_ops():
        return CheckpointPolicy.MUST_SAVE
    if op in _product_ops() and any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in weight_storages
                                    for a in args):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


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


def group_size(policy: str, num_blocks: int) -> int | None:
    """Blocks per checkpointed group for the single-level policies (None otherwise)."""
    name, k = parse_policy(policy)
    if name == "every-block":
        return 1
    if name == "every-k":
        return min(k, num_blocks)
    if name == "sqrt":
        return max(1, round(math.sqrt(num_blocks)))
    return None


def _checkpointed_forward(own_forward, keep_attention: bool = False):
    def forward(self, x):
        return _checkpointed(own_forward, self, x, keep_attention=keep_attention)
    return forward


def _passthrough(x):
    return x


def apply_checkpointing(model: nn.Module, policy: str) -> nn.Module:
    """Install `policy` on `model.layers` (an nn.ModuleList of blocks); returns the model.

    The model's own loop still calls every block in order: the first block of each group runs
    the whole group under one checkpoint, the others pass their input through. Names, state
    dict and parameters are untouched.
    """
    name, _ = parse_policy(policy)
    keep = keeps_attention(policy)
    blocks = getattr(model, "layers", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"apply_checkpointing: model needs an nn.ModuleList `layers`, got {type(blocks).__name__}")
    blocks = list(blocks)
    if name == "none":
        return model
    if name in ("ffn", "attn"):
        for block in blocks:
            part = block.ffn if name == "ffn" else block.attn
            # The part's current forward (our fused SwiGLU, if installed first), recomputed in backward.
            part.forward = lambda x, own=part.forward: _checkpointed(own, x)
        return model
    if name == "partial":
        m = min(parse_policy(policy)[1], len(blocks))
        for block in blocks[:m]:
            block.forward = types.MethodType(_checkpointed_forward(type(block).forward, keep), block)
        if selective_rest(policy):
            for block in blocks[m:]:
                block.forward = types.MethodType(_selective_forward(type(block).forward), block)
        return model
    if name == "nested":
        groups = [blocks]
        runner = _nested
    else:
        k = group_size(policy, len(blocks))
        groups = [blocks[i:i + k] for i in range(0, len(blocks), k)]
        runner = lambda group, x: _checkpointed(_run, group, x, keep_attention=keep)  # noqa: E731
    for group in groups:
        group[0].forward = lambda x, group=group: runner(group, x)
        for block in group[1:]:
            block.forward = _passthrough
    return model
