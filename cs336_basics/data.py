"""Random language-modelling batches from a flat token array."""

from __future__ import annotations

import operator

import numpy as np
import numpy.typing as npt
import torch


def _positive_int(value, name: str) -> int:
    try:
        value = operator.index(value)  # ints and numpy integers; not floats or bools' look-alikes
    except TypeError:
        raise ValueError(f"get_batch: {name} must be a positive integer, got {value!r}") from None
    if value < 1:
        raise ValueError(f"get_batch: {name} must be a positive integer, got {value}")
    return value


def get_batch(dataset: npt.NDArray, batch_size: int, context_length: int, device: str
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `batch_size` windows; returns (x, y), both (batch_size, context_length) int64, y = x shifted by one."""
    try:
        device = torch.device(device)
    except RuntimeError:
        raise ValueError(
            f"get_batch: device must be a torch device such as 'cpu', 'cuda' or 'cuda:0', got {device!r}") from None
    batch_size = _positive_int(batch_size, "batch_size")
    context_length = _positive_int(context_length, "context_length")
    if dataset.ndim != 1:
        raise ValueError(f"get_batch: dataset must be a 1-D token array, got shape {dataset.shape}")
    if not np.issubdtype(dataset.dtype, np.integer):
        raise TypeError(f"get_batch: dataset must hold integer token ids, got dtype {dataset.dtype}")
    if len(dataset) <= context_length:
        raise ValueError(
            f"get_batch: dataset has {len(dataset)} tokens, needs more than context_length={context_length}"
        )
    starts = torch.randint(len(dataset) - context_length, (batch_size,)).numpy()
    window = np.arange(context_length + 1)
    tokens = torch.from_numpy(np.asarray(dataset[starts[:, None] + window]).astype(np.int64))
    x, y = tokens[:, :-1], tokens[:, 1:]
    if str(device).startswith("cuda"):
        return (x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True))
    return x.contiguous().to(device), y.contiguous().to(device)
