"""Small helpers shared by our Triton launchers."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_kernel_device(name: str, *tensors: torch.Tensor) -> None:
    """Kernels run on CUDA tensors, or on CPU tensors under the interpreter; say so otherwise."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not (device.type == "cpu" and interpreting()):
        raise ValueError(
            f"{name}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), got {device}"
        )


def autotune_enabled() -> bool:
    """CS336_AUTOTUNE=0 takes the first fitting config instead of timing them all (fast cold
    starts for tests); the default tunes, over deliberately small spaces."""
    return os.environ.get("CS336_AUTOTUNE", "1") != "0"
