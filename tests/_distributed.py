"""Helpers for our distributed tests: gloo on CPU processes, a free port per run (never in parallel)."""

from __future__ import annotations

import torch
import torch.nn as nn

from cs336_systems.parallel.comm import spawn


def run_on_ranks(fn, world_size: int = 2, *args) -> None:
    """fn(rank, world_size, *args) on `world_size` gloo processes; an assertion on any rank fails the test."""
    spawn(fn, world_size, *args, backend="gloo")


class ToyModel(nn.Module):
    """Linear layers with a frozen parameter, a tied parameter used twice, an unused one and a buffer."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(10, 16)
        self.shared = nn.Parameter(torch.randn(16, 16) * 0.1)  # used twice: a tied parameter
        self.fc2 = nn.Linear(16, 5)
        self.frozen = nn.Linear(10, 16)
        self.frozen.requires_grad_(False)
        self.unused = nn.Linear(3, 3)
        self.register_buffer("scale", torch.randn(16))

    def forward(self, x):
        h = torch.relu(self.fc1(x) + self.frozen(x)) * self.scale
        h = torch.tanh(h @ self.shared) @ self.shared.T
        return self.fc2(h)


def toy_batches(steps: int, batch: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 10, generator=g), torch.randn(batch, 5, generator=g)) for _ in range(steps)]


def local_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank r's contiguous share of the batch, as the suites split it."""
    per = t.shape[0] // world_size
    return t[rank * per:(rank + 1) * per]
