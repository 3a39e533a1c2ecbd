"""Bytes a forward pass leaves alive for backward, measured on any device (CPU included).

`retained_bytes(fn)` runs `fn()` under a TorchDispatchMode that keeps a weak reference to the
storage of every tensor an op produces; after the call (and a garbage collection) it adds up
the storages still alive, leaving out what existed before (parameters, inputs) and the
returned tensor. That is exactly what autograd (saved tensors, checkpoint boundaries) holds.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class _StorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        # storage -> weak references to every tensor seen on it (views and aliases included): the
        # storage is alive while any of them is (storage objects themselves are re-created per access).
        self.storages: dict[int, list[weakref.ref]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.storages.setdefault(t.untyped_storage().data_ptr(), []).append(weakref.ref(t))
        return out


def retained_bytes(fn: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, int]:
    """(fn's output, bytes of tensors created inside fn that are still alive afterwards, output excluded)."""
    tracker = _StorageTracker()
    with tracker:
        out = fn()
    gc.collect()
    skip = {t.untyped_storage().data_ptr() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
    alive = {}
    for ptr, refs in tracker.storages.items():
        living = next((t for t in (r() for r in refs) if t is not None), None)
        if living is not None and ptr not in skip:
            alive[ptr] = living.untyped_storage().nbytes()
    return out, sum(alive.values())
