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
"""

from __future__ import annotations

import functools
import math
import types

import torch.nn as nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
    noop_context_fn,
)

POLICIES = ("none", "every-block", "every-k:K", "partial:M", "sqrt", "nested", "ffn", "attn")
KEEP_ATTENTION = "+keep-attn"
KEEP_ATTENTION_BASES = ("every-block", "every-k", "partial", "sqrt")


def keeps_attention(policy: str) -> bool:
    """True for the `+keep-attn` variants (validated)."""
    parse_policy(policy)
    return policy.endswith(KEEP_ATTENTION)


def parse_policy(policy: str) -> tuple[str, int | None]:
    """'every-k:4' -> ('every-k', 4); validates the name and K. A `+keep-attn` suffix is accepted on the
    single-level policies (see `keeps_attention`) and does not change the result."""
    if policy.endswith(KEEP_ATTENTION):
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


def _checkpointed(fn, *args, keep_attention: bool = False):
    return checkpoint(fn, *args, use_reentrant=False,
                      context_fn=_keep_attention_contexts if keep_attention else noop_context_fn)


@functools.cache
def _attention_ops() -> frozenset:
    import torch

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
        for block in blocks[:min(parse_policy(policy)[1], len(blocks))]:
            block.forward = types.MethodType(_checkpointed_forward(type(block).forward, keep), block)
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
