"""Our training stack, assembled in one place: every suite that runs "ours" builds it here.

A `Recipe` says which of our pieces a run uses; `build_model` applies them to a fresh model in one order, and
`build_optimizer` / `attention_context` / `wrap_data_parallel` give the rest. The order, and why:

1. parameters in their dtype (bf16 for the leaderboard), created on the device: billions of parameters
   initialised on the CPU first take minutes;
2. fused kernels (RMSNorm, SwiGLU gate, RoPE) replace module forwards, so what comes later wraps them; the
   weights' compute-dtype copies after them (they follow the merged products' layout), before the optimizer;
3. attention is chosen by name at run time (`attention_context(recipe)`, a context that swaps the model's attention
   function): it is a module global, not a module, so it composes with every step here;
4. activation checkpointing wraps the (fused) block forwards: the recompute then runs our kernels too;
5. torch.compile last among the model's own changes, so it traces the forwards as they will run;
6. data parallelism (`wrap_data_parallel`) after all of them: its hooks sit on the final parameters.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.nn as nn

from cs336_basics.optimizer import AdamW
from cs336_systems.attention import attention_names, use_attention
from cs336_systems.config import ModelConfig
from cs336_systems.memory.checkpointing import apply_checkpointing
from cs336_systems.memory.policy import NO_CHECKPOINTING, CheckpointPolicy

COMPILE_SCOPES = ("off", "model", "block")
COMPILE_MODES = ("default", "reduce-overhead")
OPTIMIZERS = ("cs336", "fused")


@dataclass(frozen=True)
class Recipe:
    """Which of our pieces a run uses (the defaults: the plain cs336_basics model and AdamW)."""

    attention: str = "reference"  # a name from attention.attention_names()
    fused: bool = False  # our Triton RMSNorm and SwiGLU gate
    fused_rope: bool = False  # our Triton RoPE too (needs `fused`)
    # the training loss by our fused LM head + cross-entropy (kernels.cross_entropy) on the hidden states, the
    # (tokens, vocab) logits never held: `hidden_forward_of` and `lm_head_loss`
    fused_loss: bool = False
    merge_projections: bool = True  # with `fused`: one Q/K/V product and one w1/w3 product per block
    residual_norm: bool = True  # with `fused`: each block's mid-block residual add fused into its second norm
    checkpoint: CheckpointPolicy = NO_CHECKPOINTING
    compile: str = "off"  # off, model (torch.compile of the whole model) or block (each block, in place)
    compile_mode: str = "default"  # torch.compile's mode: default, or reduce-overhead (replayed as CUDA graphs)
    param_dtype: torch.dtype | None = None  # None: the model's default, fp32
    optimizer: str = "cs336"  # cs336 (cs336_basics' AdamW) or fused (our FusedAdamW)
    optimizer_maths: str = "cs336"  # FusedAdamW's update: cs336 (as cs336_basics) or torch (as torch.optim)
    state_dtype: torch.dtype = torch.float32  # FusedAdamW's moment dtype
    # bf16/fp16 copies of the fp32 Linear weights, written by FusedAdamW, read by the products under autocast to that
    # dtype instead of casting the weights each step (cs336_systems.weight_copies; needs fused and the fused optimizer)
    weight_copy_dtype: torch.dtype | None = None
    lr: float = 1e-4

    def __post_init__(self):
        if self.compile not in COMPILE_SCOPES:
            raise ValueError(f"Recipe: compile must be one of {', '.join(COMPILE_SCOPES)}, got {self.compile!r}")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(f"Recipe: compile_mode must be one of {', '.join(COMPILE_MODES)}, "
                             f"got {self.compile_mode!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"Recipe: optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.attention not in attention_names():
            raise ValueError(f"Recipe: attention must be one of {', '.join(attention_names())}, got {self.attention!r}")
        if self.fused_rope and not self.fused:
            raise ValueError("Recipe: fused_rope needs fused")
        if self.weight_copy_dtype is not None and (
                self.weight_copy_dtype not in (torch.bfloat16, torch.float16) or not self.fused
                or self.optimizer != "fused" or self.param_dtype not in (None, torch.float32)):
            raise ValueError(f"Recipe: weight_copy_dtype must be bfloat16 or float16, with fused, the fused optimizer "
                             f"(it writes the copies) and float32 parameters; got weight_copy_dtype="
                             f"{self.weight_copy_dtype}, fused={self.fused}, optimizer={self.optimizer!r}, "
                             f"param_dtype={self.param_dtype}")
        if not isinstance(self.checkpoint, CheckpointPolicy):
            raise TypeError(f"Recipe: checkpoint must be a CheckpointPolicy (CheckpointPolicy.parse(text)), got "
                            f"{type(self.checkpoint).__name__}")


def build_model(cfg: ModelConfig, recipe: Recipe, device: torch.device | str, seed: int = 0) -> nn.Module:
    """A fresh model of `cfg` with the recipe's pieces applied, in the order the module docstring gives (compile
    "block" compiles each block in place here; compile "model" is `forward_of`'s, which wraps the whole model)."""
    torch.manual_seed(seed)
    model = cfg.build(device=device, dtype=recipe.param_dtype)
    if recipe.fused:
        from cs336_systems.fused_model import apply_fused_kernels  # (imports Triton)

        apply_fused_kernels(model, rope=recipe.fused_rope, merge_projections=recipe.merge_projections,
                            residual_norm=recipe.residual_norm)
        if recipe.weight_copy_dtype is not None:
            from cs336_systems.weight_copies import attach_weight_copies

            attach_weight_copies(model, recipe.weight_copy_dtype)
    apply_checkpointing(model, recipe.checkpoint)
    if recipe.compile == "block":
        for block in model.layers:
            block.compile(options=compile_options(recipe))  # in place; identical blocks share one compiled graph
    return model


def skip_guards_on_our_globals(entries) -> list[bool]:
    """dynamo's guard filter for our compiled code: keep every guard but those on the globals of our own package's
    modules (`cs336_systems`: our kernels' wrappers, their constants and operators, the fused forms' helpers), which
    nothing rebinds once imported. A small model's step is host-bound, and those guards are most of what dynamo
    checks before each call of our compiled block where the baseline's has few (notes/model_sizes.md). Guards on
    torch's and cs336_basics' globals stay: `attention_context` swaps the model's attention function, a
    cs336_basics global, and a block compiled under one attention must not run under another."""
    return [not (entry.is_global and "__import_cs336_systems" in entry.name) for entry in entries]


def compile_options(recipe: Recipe) -> dict:
    """torch.compile's options for the recipe's mode (as `mode=` would set them) and our guard filter."""
    import torch._inductor

    return dict(torch._inductor.list_mode_options(recipe.compile_mode)) | {
        "guard_filter_fn": skip_guards_on_our_globals}


def forward_of(model: nn.Module, recipe: Recipe) -> nn.Module:
    """What to call for the model's forward: torch.compile of the whole model where compile is "model"."""
    return torch.compile(model, options=compile_options(recipe)) if recipe.compile == "model" else model


def hidden_states(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The model's forward up to (not including) the LM head: embeddings, blocks, final norm. (It bypasses the
    model's forward, so it keeps the weights' compute-dtype copies current itself, as that forward's hook does.)"""
    if getattr(model, "_weight_copy_pairs", None) is not None:
        from cs336_systems.weight_copies import keep_copies_current

        keep_copies_current(model)
    h = model.token_embeddings(tokens)
    for layer in model.layers:
        h = layer(h)
    return model.ln_final(h)


def hidden_forward_of(model: nn.Module, recipe: Recipe):
    """tokens -> the hidden states `lm_head_loss` reads (what `forward_of` is for the logits): torch.compile of the
    whole of it where compile is "model"."""
    forward = functools.partial(hidden_states, model)
    return torch.compile(forward, options=compile_options(recipe)) if recipe.compile == "model" else forward


def lm_head_loss(model: nn.Module, hidden: torch.Tensor, targets: torch.Tensor,
                 chunk_tokens: int = 4096) -> torch.Tensor:
    """The mean next-token loss of the model's LM head on `hidden`, by our fused LM head + cross-entropy. Under
    autocast the product runs in autocast's dtype, as the plain head's would: it reads the head's weight copy
    (`weight_copies`) where there is one, else a cast of the weight; the weight's gradient is its own dtype's."""
    from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy  # (imports Triton)

    weight = model.lm_head.weight
    device = hidden.device.type
    if not torch.is_autocast_enabled(device):
        return lm_head_cross_entropy(hidden, weight, targets, chunk_tokens=chunk_tokens)
    dtype = torch.get_autocast_dtype(device)
    product_weight = getattr(model.lm_head, "weight_copy", None)
    if product_weight is None or product_weight.dtype != dtype:
        product_weight = weight.detach().to(dtype)
    with torch.autocast(device, enabled=False):  # (the dtypes are chosen here; the products take them as they are)
        return lm_head_cross_entropy(hidden.to(dtype), weight, targets, chunk_tokens=chunk_tokens,
                                     product_weight=product_weight)


def build_optimizer(model: nn.Module, recipe: Recipe) -> torch.optim.Optimizer:
    if recipe.optimizer == "fused":
        from cs336_systems.kernels.adamw import FusedAdamW  # (imports Triton)

        return FusedAdamW(model.parameters(), lr=recipe.lr, maths=recipe.optimizer_maths,
                          state_dtype=recipe.state_dtype)
    return AdamW(model.parameters(), lr=recipe.lr)


def attention_context(recipe: Recipe) -> contextlib.AbstractContextManager:
    """The context in which the model runs the recipe's attention."""
    return use_attention(recipe.attention)


def wrap_data_parallel(model: nn.Module, variant: str):
    """Our DDP over the default process group where there are several ranks (None at world size 1): its hooks
    sit on the parameters, so the model's forward is called as before."""
    from cs336_systems.parallel import comm
    from cs336_systems.parallel.ddp import make_ddp

    return make_ddp(model, variant) if comm.world_size() > 1 else None
