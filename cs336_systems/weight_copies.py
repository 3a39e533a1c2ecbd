"""Copies of a model's Linear weights in the compute dtype, written by FusedAdamW as it updates the weights.

Why: a model kept in fp32 and run under bf16 autocast casts every Linear weight to bf16 in every forward (compiled,
inductor often casts again in the backward rather than keep the cast) and casts every weight gradient, which the
bf16 product gives in bf16, back to fp32. At xl (ctx 512, H100) such casts are about 13 ms of the step's 120 ms of
kernel time (notes/model_sizes.md). With copies, FusedAdamW writes each weight's bf16 copy in the pass that updates
the weight (2 bytes more written per element, where a cast reads 4 and writes 2), the products read the copy, and
the weight's gradient leaves the product in fp32 (`fused_model.MergedProjection`).

`attach_weight_copies(model, dtype)` (after `fused_model.apply_fused_kernels`, before the optimizer is made) gives
every Linear a `weight_copy` buffer, non-persistent (the state dict is unchanged); a merged group's copies (Q/K/V,
w1/w3) are row blocks of one buffer, held by the attention or SwiGLU module as `merged_weight_copy`, so the merged
product reads them as one matrix. Each weight knows its copy as `weight.compute_copy` (what FusedAdamW looks for).
The products read a copy only under autocast to its dtype; otherwise the weight itself.

A copy is current while its weight is written only by FusedAdamW (its kernel writes both, and leaves the version
counter alone) or through ops the version counter sees (`load_state_dict`, `with torch.no_grad(): w.copy_(...)`,
cs336_basics' and torch's optimizers): a forward pre-hook on the model re-copies, outside any compiled code, each
weight whose version moved (with another optimizer that is a copy of every weight each step: correct, and no
faster than autocast's casts). Writes through `.data` are invisible to it: after them call
`refresh_weight_copies(model)`.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_basics.model import Linear
from cs336_systems.fused_model import product_weight_groups

COPY_DTYPES = (torch.bfloat16, torch.float16)


def attach_weight_copies(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Give every Linear of `model` a copy of its weight in `dtype` (see the module docstring); returns `model`."""
    if dtype not in COPY_DTYPES:
        raise ValueError(f"attach_weight_copies: dtype must be bfloat16 or float16, got {dtype}")
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, Linear)}
    if not linears:
        raise ValueError(f"attach_weight_copies: {type(model).__name__} has no Linear modules")
    pairs = []
    for owner, weights in product_weight_groups(model):
        if any(w.dtype != torch.float32 for w in weights):
            raise ValueError(f"attach_weight_copies: the weights must be float32 (autocast's masters), got "
                             f"{weights[0].dtype}")
        with torch.no_grad():
            buffer = torch.cat([w.detach() for w in weights]).to(dtype)
        if owner is not None:
            owner.register_buffer("merged_weight_copy", buffer, persistent=False)
        for weight, copy in zip(weights, buffer.split([w.shape[0] for w in weights])):
            linears[id(weight)].register_buffer("weight_copy", copy, persistent=False)
            weight.compute_copy = copy
            pairs.append((weight, copy))
    model._weight_copy_pairs = pairs
    model._weight_copy_versions = [(w._version, w.data_ptr()) for w, _ in pairs]
    model.register_forward_pre_hook(keep_copies_current)
    return model


@torch.no_grad()
def refresh_weight_copies(model: nn.Module, *, force: bool = False) -> int:
    """Re-copy each weight whose version counter or storage moved since its copy was written (every one with
    `force`); returns how many were copied."""
    pairs, versions = model._weight_copy_pairs, model._weight_copy_versions
    copied = 0
    for i, (weight, copy) in enumerate(pairs):
        now = (weight._version, weight.data_ptr())
        if force or now != versions[i]:
            copy.copy_(weight)
            versions[i] = now
            copied += 1
    return copied


@torch.compiler.disable
def keep_copies_current(model: nn.Module, args=()) -> None:
    """Re-copy each weight that moved: the model's forward pre-hook, and what a caller that runs the model's parts
    without its forward calls itself (the recipe's `hidden_states`). Never traced: version counters are not something
    a graph can read; under a whole-model torch.compile this is a graph break at the forward's start."""
    refresh_weight_copies(model)
