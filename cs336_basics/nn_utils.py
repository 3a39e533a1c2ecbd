"""Numerically stable softmax, log-softmax and cross-entropy, and global-norm gradient clipping."""

from __future__ import annotations

from collections.abc import Iterable

import torch


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Softmax along `dim`, max-subtracted so large logits do not overflow."""
    shifted = x - torch.amax(x, dim=dim, keepdim=True)
    exp = torch.exp(shifted)
    return exp / torch.sum(exp, dim=dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Log-softmax along `dim`, max-subtracted before the log-sum-exp."""
    shifted = x - torch.amax(x, dim=dim, keepdim=True)
    return shifted - torch.logsumexp(shifted, dim=dim, keepdim=True)


def cross_entropy(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood.

    inputs: (..., vocab) unnormalised logits; targets: (...) integer class ids.
    The mean runs over every leading element.
    """
    if inputs.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: targets must have the logits' leading shape {tuple(inputs.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise TypeError(f"cross_entropy: targets must be integer class ids, got dtype {targets.dtype}")
    log_probs = log_softmax(inputs, dim=-1)
    picked = torch.gather(log_probs, -1, targets.long().unsqueeze(-1)).squeeze(-1)
    return -picked.mean()


@torch.no_grad()
def clip_gradient(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale all gradients in place so their global L2 norm is at most `max_norm`.

    Returns the norm before clipping. eps = 1e-6 as in the staff package.
    """
    if max_norm <= 0:
        raise ValueError(f"clip_gradient: max_norm must be positive, got {max_norm}")
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm = torch.sqrt(sum((g.detach().float() ** 2).sum() for g in grads))
    scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(scale.to(g.dtype))
    return norm
