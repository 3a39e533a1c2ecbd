"""The launch records every attention kernel runs through, and the device facts a launch depends on.

A launch record holds one kernel's arguments, compile-time flags and grid, so that the same launch can be run
as chosen (`__call__`), with one explicit tile config (`with_config`: what `cs336-bench attention-tune` times),
or once more to capture a launch plan (`launch_for_plan`: kernels/launch_plan.py). Three kinds, and a sequence of them:
- `KernelLaunch`: an autotuned `tl` kernel (forward.py, backward.py);
- `FixedLaunch`: a bare kernel on a fixed grid (the backward's D preprocess);
- `GluonPass`: a Gluon kernel with its one measured config (hopper_*.py);
- `LaunchSequence`: launches run in turn in one slot (the split dV and dK passes of wide heads).

Device facts: `has_tma` (Hopper's copy engine), `tma_eligible` (strides a tensor descriptor takes) and
`install_descriptor_allocator` (the scratch memory kernels need to make descriptors).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from cs336_systems.kernels.launch_plan import bound_values


@dataclass
class KernelLaunch:
    """An autotuned kernel's arguments, compile-time flags and grid (a function of the chosen tile sizes)."""

    kernel: object  # a triton Autotuner; `.fn` is the bare JITFunction
    args: tuple
    flags: dict
    grid: object  # meta -> grid tuple

    def __call__(self):
        self.kernel[self.grid](*self.args, **self.flags)

    def with_config(self, block_m: int, block_n: int, num_warps: int, num_stages: int):
        """The bare kernel launched with one explicit config (no autotuning)."""
        def launch():
            self.kernel.fn[self.grid](*self.args, **self.flags, BLOCK_M=block_m, BLOCK_N=block_n,
                                      num_warps=num_warps, num_stages=num_stages)
        return launch

    def launch_for_plan(self):
        """Launch through the autotuner (which tunes on a key's first call); (compiled kernel, grid, every
        parameter's value) for `launch_plan`."""
        compiled = self.kernel.run(*self.args, grid=self.grid, warmup=False, **self.flags)
        params = {**self.flags, **self.kernel.best_config.all_kwargs()}
        return compiled, self.grid(params), bound_values(self.kernel.fn, self.args, params)


@dataclass
class LaunchSequence:
    """Launches that run one after another in one slot of a backward (the split dV and dK passes of wide heads):
    `parts` are captured into launch plans one by one."""

    parts: tuple

    def __call__(self):
        for part in self.parts:
            part()

    def with_config(self, block_m: int, block_n: int, num_warps: int, num_stages: int):
        launches = [part.with_config(block_m, block_n, num_warps, num_stages) for part in self.parts]

        def launch():
            for part in launches:
                part()
        return launch


@dataclass
class FixedLaunch:
    """A bare kernel on a fixed grid (the backward's D preprocess)."""

    kernel: object  # a JITFunction
    args: tuple
    flags: dict
    grid: tuple

    def __call__(self):
        self.kernel[self.grid](*self.args, **self.flags)

    def launch_for_plan(self):
        compiled = self.kernel.run(*self.args, grid=self.grid, warmup=False, **self.flags)
        return compiled, self.grid, bound_values(self.kernel, self.args, self.flags)


@dataclass
class GluonPass:
    """One Gluon kernel's arguments and default config (BLOCK_M, BLOCK_N, warps, stages): the backward passes
    of hopper_backward.py and hopper_one_pass.py, and hopper_forward.py's forward."""

    kernel: object
    args: tuple
    flags: dict
    config: tuple[int, int, int, int]
    grid: Callable[[int, int], tuple[int, int]]  # (BLOCK_M, BLOCK_N) -> grid
    # (BLOCK_M, BLOCK_N) -> the arguments, where they depend on the tiles (the host's tensor descriptors); else args
    args_for: Callable[[int, int], tuple] | None = None

    def __call__(self):
        self.with_config(*self.config)()

    def _args(self, block_m: int, block_n: int) -> tuple:
        return self.args if self.args_for is None else self.args_for(block_m, block_n)

    def with_config(self, block_m: int, block_n: int, num_warps: int, num_stages: int):
        def launch():
            self.kernel[self.grid(block_m, block_n)](*self._args(block_m, block_n), **self.flags, BLOCK_M=block_m,
                                                     BLOCK_N=block_n, STAGES=num_stages, num_warps=num_warps)
        return launch

    def launch_for_plan(self):
        """Launch with the default config; (compiled kernel, grid, every parameter's value) for `launch_plan`."""
        block_m, block_n, num_warps, num_stages = self.config
        params = dict(self.flags, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=num_stages)
        grid = self.grid(block_m, block_n)
        args = self._args(block_m, block_n)
        compiled = self.kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps, **params)
        return compiled, grid, bound_values(self.kernel, args, params)


@functools.cache
def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors: a grid with fewer programs leaves some idle."""
    return torch.cuda.get_device_properties(device).multi_processor_count


def has_tma(device: torch.device) -> bool:
    """Hopper or later: the copy engine behind tensor descriptors (the interpreter's CPU tensors: never)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def tma_eligible(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors (the copy engine) need unit stride along d and 16-byte aligned bases and row,
    batch and head strides; any 4-D view of ours that meets that qualifies."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(stride * t.element_size() % 16 for stride in t.stride()[:-1]):
            return False
    return True


def descriptor_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8, device="cuda")


def interpreter_scratch(size: int, alignment: int, stream) -> torch.Tensor:
    return torch.empty(size, dtype=torch.int8)


def install_descriptor_allocator(device: torch.device | str = "cuda"):
    """Descriptors made inside a kernel need global scratch (128 bytes per program); torch provides it.
    Triton keeps the allocator in a ContextVar, so it is set in every thread that launches (autograd runs
    backward in its own thread); an allocator the caller set is left alone."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(descriptor_scratch if torch.device(device).type == "cuda" else interpreter_scratch)
