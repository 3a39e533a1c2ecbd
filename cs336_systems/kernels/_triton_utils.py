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


def configs_for_precision(configs: list, ieee_tiles: tuple, precision: str) -> list:
    """The autotune candidates of one dot precision: `ieee_tiles` ((BLOCK_M, BLOCK_N, warps, stages) rows) are
    the IEEE fp32 family, the rest the tensor-core one. IEEE fp32 dots run on CUDA cores (FMA): each thread
    holds its rows of both operands across the whole reduction, so tensor-core tiles spill there and the FMA
    tiles spread the same work over more warps. Where a family is empty (the interpreter's single config),
    every config stays."""
    def in_ieee_family(config) -> bool:
        tile = (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
        return tile in ieee_tiles

    family = [c for c in configs if in_ieee_family(c) == (precision == "ieee")]
    return family or list(configs)
