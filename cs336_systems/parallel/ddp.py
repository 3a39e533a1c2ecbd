"""Distributed data parallel: one base class, variants that differ only in gradient synchronisation.

Construction broadcasts every parameter (frozen ones too) and buffer from rank 0, in one
flat broadcast per dtype. `forward` runs the wrapped module. After `loss.backward()`, call
`finish_gradient_synchronization()`; afterwards every trainable parameter's `.grad` is the
average over ranks. `no_sync()` skips synchronisation for gradient accumulation: the next
synchronised backward averages the accumulated sum, as torch's DDP does.

Variants:
* `NaiveDDP`: one blocking all-reduce per parameter after backward.
* `FlatDDP`: all gradients flattened into one buffer, one all-reduce.
* `OverlapDDP`: an async all-reduce per parameter launched from its post-accumulate-grad
  hook, so communication overlaps the rest of backward.
* `BucketedDDP`: parameters grouped into buckets (see buckets.py); each bucket's async
  all-reduce starts when its last gradient lands. After synchronisation the gradients are
  views of the bucket buffers, so a `zero_grad(set_to_none=False)` next step accumulates
  straight into the buckets and the copy in is skipped.

Parameters that get no gradient (unused in this forward) must be unused on every rank; their
`.grad` stays None. A tied parameter is one Parameter: it is communicated once, after both
uses accumulated (the post-accumulate hook fires once per backward).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.parallel import comm
from cs336_systems.parallel.buckets import assign_buckets, trainable_parameters


def broadcast_from_rank0(tensors: list[torch.Tensor]) -> None:
    """Overwrite `tensors` with rank 0's values: one flat broadcast per dtype and device."""
    if comm.world_size() == 1:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    with torch.no_grad():
        for group in groups.values():
            flat = _flatten_dense_tensors([t.detach() for t in group])
            comm.broadcast(flat, src=0)
            for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(value)


def average_coalesced(tensors: list[torch.Tensor]) -> None:
    """In place: each tensor becomes its mean over ranks, with one all-reduce per dtype."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for group in by_dtype.values():
        flat = _flatten_dense_tensors(group)
        comm.all_reduce(flat)
        flat.div_(comm.world_size())
        for t, value in zip(group, _unflatten_dense_tensors(flat, group)):
            t.copy_(value)


class DataParallel(nn.Module, abc.ABC):
    """The shared base: broadcast at construction, forward, no_sync, and the sync protocol."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.world_size = comm.world_size()
        broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._sync_enabled = True
        self._params = trainable_parameters(module)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first synchronised step after it averages the sum."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_gradient_synchronization(self) -> None:
        if self._sync_enabled and self.world_size > 1:
            self._synchronize()

    def on_train_batch_start(self) -> None:
        """Called before zero_grad each step (the bucketed suites do); resets per-step state."""

    @abc.abstractmethod
    def _synchronize(self) -> None:
        """Average `.grad` over ranks: the one thing the variants do differently."""


class NaiveDDP(DataParallel):
    def _synchronize(self) -> None:
        for p in self._params:
            if p.grad is not None:
                comm.all_reduce(p.grad)
                p.grad.div_(self.world_size)


class FlatDDP(DataParallel):
    def _synchronize(self) -> None:
        average_coalesced([p.grad for p in self._params if p.grad is not None])


class OverlapDDP(DataParallel):
    """Async all-reduce per parameter, started by its post-accumulate-grad hook."""

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._handles: list[tuple[torch.nn.Parameter, object]] = []
        for p in self._params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if self._sync_enabled and self.world_size > 1:
            self._handles.append((p, comm.all_reduce(p.grad, async_op=True)))

    def _synchronize(self) -> None:
        for p, handle in self._handles:
            handle.wait()
            p.grad.div_(self.world_size)
        self._handles.clear()

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self._handles.clear()


class BucketedDDP(DataParallel):
    """Async all-reduce per bucket, started when the bucket's last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_size_mb: float | None = 25.0):
        super().__init__(module)
        self.bucket_size_mb = bucket_size_mb
        self.buckets = assign_buckets(self._params, bucket_size_mb)
        device = self._params[0].device if self._params else torch.device("cpu")
        self._buffers = [torch.zeros(b.numel, dtype=b.dtype, device=device) for b in self.buckets]
        self._slot = {}  # id(param) -> (bucket index, offset)
        for b in self.buckets:
            for p, offset in zip(b.params, b.offsets):
                self._slot[id(p)] = (b.index, offset)
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._ready = [0] * len(self.buckets)
        self._handles: dict[int, object] = {}

    def _view(self, p: torch.nn.Parameter) -> torch.Tensor:
        index, offset = self._slot[id(p)]
        return self._buffers[index][offset:offset + p.numel()].view_as(p)

    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        if not (self._sync_enabled and self.world_size > 1):
            return
        view = self._view(p)
        if p.grad.data_ptr() != view.data_ptr():  # not yet a view of the bucket: copy in
            view.copy_(p.grad)
        index, _ = self._slot[id(p)]
        self._ready[index] += 1
        if self._ready[index] == len(self.buckets[index].params):
            self._handles[index] = comm.all_reduce(self._buffers[index], async_op=True)

    def _synchronize(self) -> None:
        for bucket in self.buckets:
            handle = self._handles.get(bucket.index)
            if handle is None:
                if self._ready[bucket.index] == 0:
                    continue  # no gradient in this bucket this step (unused everywhere)
                # Some params of the bucket had no gradient: zeros stand in for them.
                for p in bucket.params:
                    if p.grad is None:
                        self._view(p).zero_()
                handle = comm.all_reduce(self._buffers[bucket.index], async_op=True)
            handle.wait()
            self._buffers[bucket.index].div_(self.world_size)
            for p in bucket.params:
                if p.grad is not None:
                    p.grad = self._view(p)  # gradients become views of the reduced bucket
        self._reset()

    def _reset(self) -> None:
        self._ready = [0] * len(self.buckets)
        self._handles.clear()

    def on_train_batch_start(self) -> None:
        self._reset()

    def finish_gradient_synchronization(self) -> None:
        super().finish_gradient_synchronization()
        self._reset()


VARIANTS = {"naive": NaiveDDP, "flat": FlatDDP, "overlap": OverlapDDP, "bucketed": BucketedDDP}


def make_ddp(module: nn.Module, variant: str = "bucketed", **kwargs) -> DataParallel:
    if variant not in VARIANTS:
        raise ValueError(f"make_ddp: unknown variant {variant!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[variant](module, **kwargs)
