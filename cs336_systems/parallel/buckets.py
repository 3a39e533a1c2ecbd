"""Assigning gradients to communication buckets: a pure function, testable without processes.

Buckets are filled in reverse `parameters()` order (the order backward produces gradients),
closing a bucket when the next tensor would push it past `bucket_size_mb`; a tensor larger
than a bucket gets a bucket of its own. `bucket_size_mb=None` means one unbounded bucket.
Tensors of different dtypes never share a bucket (a bucket is one flat buffer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    index: int
    dtype: torch.dtype
    params: list[torch.nn.Parameter] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # element offset of each param in the flat buffer
    numel: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def assign_buckets(params: list[torch.nn.Parameter], bucket_size_mb: float | None) -> list[Bucket]:
    """params in `parameters()` order (trainable, deduplicated) -> buckets, first-ready first."""
    if bucket_size_mb is not None and bucket_size_mb <= 0:
        raise ValueError(f"assign_buckets: bucket_size_mb must be positive or None, got {bucket_size_mb}")
    limit = float("inf") if bucket_size_mb is None else bucket_size_mb * 2**20
    buckets: list[Bucket] = []
    open_by_dtype: dict[torch.dtype, Bucket] = {}
    for p in reversed(params):
        size = p.numel() * p.element_size()
        bucket = open_by_dtype.get(p.dtype)
        if bucket is not None and bucket.numel and bucket.nbytes + size > limit:
            bucket = None  # full: close it
        if bucket is None:
            bucket = Bucket(index=len(buckets), dtype=p.dtype)
            buckets.append(bucket)
            open_by_dtype[p.dtype] = bucket
        bucket.params.append(p)
        bucket.offsets.append(bucket.numel)
        bucket.numel += p.numel()
    return buckets


def trainable_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """requires_grad parameters in `parameters()` order; a tied parameter appears once."""
    return [p for p in module.parameters() if p.requires_grad]
