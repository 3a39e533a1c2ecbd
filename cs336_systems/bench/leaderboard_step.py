"""The leaderboard's training step, ours and the PyTorch-native baseline's, as the `leaderboard` suite times them:
the model built (ours through the recipe), the optimizer, the forward to the hidden states, the chunked or
fused loss, and a plain version of the same step for `--verify`'s comparison."""

from __future__ import annotations

import contextlib

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.attention import use_attention
from cs336_systems.memory.policy import NO_CHECKPOINTING
from cs336_systems.parallel import comm
from cs336_systems.recipe import Recipe, build_model, build_optimizer, hidden_states, lm_head_loss, wrap_data_parallel


def training_step(optimizer, forward, loss_fn, phase, ddp=None):
    def step():
        optimizer.zero_grad(set_to_none=True)
        if ddp is not None:
            ddp.on_train_batch_start()
        with phase("forward"):
            h = forward()
        with phase("loss"):
            loss = loss_fn(h)
        with phase("backward"):
            loss.backward()
        if ddp is not None:
            with phase("sync"):  # what is left of the all-reduces once backward is done
                ddp.finish_gradient_synchronization()
        with phase("optimizer"):
            optimizer.step()
        return loss
    return step


def timed_and_plain(optimizer, forward, loss_fn, ddp=None):
    """build(phase) -> (the step with phase ranges, the same step without): what _measure times."""
    def build(phase):
        return (training_step(optimizer, forward, loss_fn, phase, ddp),
                training_step(optimizer, forward, loss_fn, lambda name: contextlib.nullcontext(), ddp))
    return build


def verify(cfg, device, dtype, attention, policy, chunk_tokens, fused, fused_rope=False) -> dict[str, float]:
    """Relative errors (vs an fp64 plain step) of our step and of the plain step at `dtype`."""
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), device=device,
                           generator=torch.Generator(device).manual_seed(3))
    targets = torch.roll(tokens, -1, dims=1)

    def grads_of(run_dtype, ours: bool):
        model = build_model(cfg, Recipe(param_dtype=run_dtype, fused=fused and ours, fused_rope=fused_rope and ours,
                                        checkpoint=policy if ours else NO_CHECKPOINTING), device)
        with use_attention(attention if ours else "reference"):
            if ours:
                loss = lm_head_loss(model, hidden_states(model, tokens), targets, chunk_tokens=chunk_tokens)
            else:
                logits = model(tokens)
                loss = cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
            loss.backward()
        return loss.detach().double(), [p.grad.double() for p in model.parameters()]

    exact_loss, exact = grads_of(torch.float64, ours=False)
    out = {}
    for name, ours in (("ours", True), ("plain", False)):
        loss, grads = grads_of(dtype, ours)
        num = sum(((g - e) ** 2).sum() for g, e in zip(grads, exact))
        den = sum((e**2).sum() for e in exact)
        out[f"{name}_grad_rel_error"] = float((num / den).sqrt())
        out[f"{name}_loss_abs_error"] = float((loss - exact_loss).abs())
    return out


def our_step(cfg, args, device, tokens, targets, recipe: Recipe):
    model = build_model(cfg, recipe, device)
    ddp = wrap_data_parallel(model, args.ddp)  # several ranks: our DDP (hooks on the parameters; no wrapper call)
    optimizer = build_optimizer(model, recipe)

    def loss_fn(h):
        return lm_head_loss(model, h, targets, chunk_tokens=args.chunk_tokens)

    return timed_and_plain(optimizer, lambda: hidden_states(model, tokens), loss_fn, ddp)


class _HiddenStates(torch.nn.Module):
    """The baseline LM's forward up to the hidden states, as a module torch's DDP can wrap (its reducer
    is armed in forward); the LM head is used by the chunked loss after it."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm.hidden(tokens)


def baseline_step(cfg, args, device, tokens, targets, recipe: Recipe):
    from cs336_systems.bench.baseline_lm import BaselineLM, baseline_optimizer, chunked_cross_entropy

    torch.manual_seed(0)
    with torch.device(device):
        model = BaselineLM(cfg, checkpoint_blocks=True)
    model.to(dtype=recipe.param_dtype)  # the baseline's parameters in our step's dtype
    optimizer = baseline_optimizer(model, device)
    forward = lambda: model.hidden(tokens)  # noqa: E731
    if comm.world_size() > 1:  # a baseline: torch's own DDP
        wrapped = torch.nn.parallel.DistributedDataParallel(_HiddenStates(model), gradient_as_bucket_view=True)
        forward = lambda: wrapped(tokens)  # noqa: E731

    def loss_fn(h):
        return chunked_cross_entropy(model, h, targets, args.chunk_tokens)

    return timed_and_plain(optimizer, forward, loss_fn)
