"""AdamW with decoupled weight decay (the staff maths) and the cosine learning-rate schedule."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch


class AdamW(torch.optim.Optimizer):
    """AdamW as in Loshchilov & Hutter, in the order the staff package applies it.

    Per step t (1-based): decoupled decay `p -= lr*wd*p`, then
    `m = b1*m + (1-b1)*g`, `v = b2*v + (1-b2)*g^2`,
    `p -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps)`.
    State per parameter: `m`, `v` (like the parameter) and `t` (steps taken, int).
    """

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01):
        if not lr >= 0:  # (also refuses nan)
            raise ValueError(f"AdamW: lr must be a number >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must lie in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"AdamW: eps must be > 0, got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"AdamW: weight_decay must be >= 0, got {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p)
                    state["v"] = torch.zeros_like(p)
                    state["t"] = 0
                state["t"] += 1
                t = state["t"]
                m, v, grad = state["m"], state["v"], p.grad
                p.mul_(1 - lr * wd)
                m.mul_(beta1).add_(grad, alpha=1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
                p.addcdiv_(m, v.sqrt().add_(eps), value=-step_size)
        return loss


def get_cosine_lr(it: int, max_learning_rate: float, min_learning_rate: float, warmup_iters: int,
                  cosine_cycle_iters: int) -> float:
    """Linear warm-up to `max_learning_rate`, cosine decay to `min_learning_rate`, then flat."""
    if it < warmup_iters:
        return it / warmup_iters * max_learning_rate
    if it > cosine_cycle_iters:
        return min_learning_rate
    progress = (it - warmup_iters) / (cosine_cycle_iters - warmup_iters)
    return min_learning_rate + 0.5 * (1 + math.cos(math.pi * progress)) * (max_learning_rate - min_learning_rate)
