"""Launch plans: repeat kernel launches that skip Triton's per-call launch work.

A small model's step is host-bound: the GPU finishes a kernel before the host has issued the next. Triton's
`JITFunction.run` binds and specialises every argument and hashes them on every launch (its binder and cache key
alone: 11.6 us a launch of the RMSNorm kernel on a 2-core CPU, against 5.0 us for a plan's replay bookkeeping:
`scripts/launch_host_cost.py`), the autotuner adds its own lookup, and our attention launchers redo their
eligibility checks (TMA strides, Gluon head dims, device capability) on top; together about 85 us for our
attention forward against 17-19 us for SDPA's (`scripts/attention_host_overhead.py` on the H200's host,
c10185dc0fc8).

A plan is made once per signature, by running the normal launch path once and capturing, for each kernel it
launched, the compiled kernel, its grid and every argument's value. Later calls with that signature call the
compiled kernels directly, substituting only the tensors' addresses. Two users:
- the attention (`flash_attention/dispatch.py`): a plan per input signature, holding every kernel of the forward
  or the backward; its signature is everything the launch path decided on and the compiler specialised on:
  shapes, strides, dtypes, devices, 16-byte alignment of every tensor, the flags (causal, which backward) and the
  fp32 dot precision (`precision.py`); arguments are matched to tensors by address when the plan is made, and
  inputs that share an address (self-attention on one tensor) make no plan, since their roles could not be told
  apart;
- one plain (not autotuned) kernel launch, `launch(kernel, grid, *args, **kwargs)` (RMSNorm, the SwiGLU gate,
  RoPE, the cross-entropy rows): keyed by the kernel, grid, keyword arguments, every tensor argument's shape,
  strides, dtype, device and alignment and every other argument's value; tensors are slotted by position.

Limits: environment switches (CS336_FLASH_GLUON, CS336_FLASH_HOST_DESCRIPTORS, CS336_AUTOTUNE) are read when a
plan is made; `clear_plans()` drops them. Plans are kept only on CUDA (the interpreter has no compiled kernels) and
at most `MAX_PLANS` of them (oldest dropped first). `CS336_FLASH_LAUNCH_PLANS=0`, or `use_plans(False)`, runs every
call through the normal path.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

MAX_PLANS = 256
_enabled = os.environ.get("CS336_FLASH_LAUNCH_PLANS", "1") != "0"
_plans: OrderedDict[tuple, object] = OrderedDict()


def plans_enabled() -> bool:
    return _enabled


def use_plans(enabled: bool) -> None:
    """Turn launch plans on or off for this process (off: every call takes the normal launch path)."""
    global _enabled
    _enabled = bool(enabled)


def clear_plans() -> None:
    _plans.clear()


def plan_count() -> int:
    return len(_plans)


def lookup(key: tuple):
    return _plans.get(key)


def store(key: tuple, plan) -> None:
    _plans[key] = plan
    while len(_plans) > MAX_PLANS:
        _plans.popitem(last=False)


def _tensor_key(t: torch.Tensor) -> tuple:
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0


def tensor_signature(*tensors: torch.Tensor) -> tuple:
    """What a compiled launch depends on per tensor: shape, strides, dtype, device and whether its address
    is 16-byte aligned (Triton specialises pointers on that; our TMA eligibility checks it)."""
    return tuple(_tensor_key(t) for t in tensors)


def bound_values(jit_function, args: tuple, kwargs: dict) -> list:
    """Every parameter of a Triton/Gluon kernel in declaration order (constexprs and defaults included), as
    a compiled kernel's launcher takes them; kwargs that are not parameters (num_warps, ...) are dropped."""
    signature = inspect.signature(jit_function.fn)  # the Python function under the decorator
    params = {name: value for name, value in kwargs.items() if name in signature.parameters}
    bound = signature.bind(*args, **params)
    bound.apply_defaults()
    return list(bound.arguments.values())


@dataclass(frozen=True)
class DeviceAddress:
    """A tensor's address and dtype, all a host tensor descriptor reads of its base (Triton's launcher encodes the
    descriptor from `base.data_ptr()`): a replayed descriptor over a slot's new tensor, with no tensor held."""

    address: int
    dtype: torch.dtype

    def data_ptr(self) -> int:
        return self.address


def is_tensor_descriptor(value) -> bool:
    """A host tensor descriptor (Triton's or Gluon's TensorDescriptor: a dataclass over a base tensor)."""
    return dataclasses.is_dataclass(value) and hasattr(value, "base") and hasattr(value, "block_shape")


@dataclass
class CapturedLaunch:
    """One kernel launch with its tensor arguments replaced by named slots."""

    runner: Callable  # the compiled kernel's own launcher for `grid`
    values: list  # every parameter's value; a slot's entry is overwritten per call
    slots: tuple[tuple[int, str], ...]  # (parameter position, tensor name)
    compiled: object  # Triton's CompiledKernel (native_launch.py reads its function and metadata)
    grid: tuple[int, int, int]
    # (parameter position, tensor name) of host tensor descriptors over a slot's tensor: the descriptor (shape,
    # strides, tiles) stays, its base moves to the tensor's address per call
    descriptor_slots: tuple[tuple[int, str], ...] = ()

    def __call__(self, addresses: dict[str, int]) -> None:
        values = self.values.copy()
        for position, name in self.slots:
            values[position] = addresses[name]
        for position, name in self.descriptor_slots:  # (a copy, not dataclasses.replace: its checks passed at capture)
            values[position] = descriptor = copy.copy(values[position])
            descriptor.base = DeviceAddress(addresses[name], descriptor.base.dtype)
        self.runner(*values)


def capture(compiled, grid: tuple, values: list, tensors: dict[str, torch.Tensor]) -> CapturedLaunch | None:
    """A launch that has just run (its compiled kernel, grid and bound values) as a CapturedLaunch whose
    tensor arguments are named by `tensors` (matched by address); None if a tensor argument matches none
    of them or several (aliased inputs)."""
    by_address: dict[int, list[str]] = {}
    for name, tensor in tensors.items():
        by_address.setdefault(tensor.data_ptr(), []).append(name)
    slots, descriptor_slots = [], []
    for position, value in enumerate(values):
        base = value.base if is_tensor_descriptor(value) else value
        if isinstance(base, torch.Tensor):
            names = by_address.get(base.data_ptr(), [])
            if len(names) != 1:
                return None
            (descriptor_slots if base is not value else slots).append((position, names[0]))
    return _captured(compiled, grid, values, tuple(slots), tuple(descriptor_slots))


def _captured(compiled, grid: tuple, values: list, slots: tuple, descriptor_slots: tuple = ()) -> CapturedLaunch:
    """The CapturedLaunch of a launch that has just run, with the slots' tensors taken out of its values (a
    descriptor keeps its base's address only)."""
    values = list(values)
    for position, _ in slots:
        values[position] = None
    for position, _ in descriptor_slots:
        descriptor = values[position]
        values[position] = dataclasses.replace(descriptor, base=DeviceAddress(0, descriptor.base.dtype))
    if hasattr(compiled, "result"):  # Triton's asynchronous compile mode hands back a future
        compiled = compiled.result()
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return CapturedLaunch(compiled[grid], values, slots, compiled, grid, descriptor_slots)


def _argument_key(value) -> object:
    """What a compiled launch depends on in one argument: a tensor's shape, strides, dtype, device and 16-byte
    alignment (Triton specialises pointers on it); any other argument's value (ints are specialised on too)."""
    return _tensor_key(value) if isinstance(value, torch.Tensor) else value


def _plans_device(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda"  # (the interpreter's CPU launches have no compiled kernel to keep)


def launch(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` for a plain `triton.jit` kernel, tensors passed positionally: on CUDA the
    first launch of a signature is captured and later ones replay it (see the module docstring)."""
    if not (_enabled and _plans_device(args[0])):
        kernel[grid](*args, **kwargs)
        return
    key = (kernel, grid, tuple(kwargs.items()), tuple(_argument_key(value) for value in args))
    plan = _plans.get(key)
    if plan is not None:
        plan({position: args[position].data_ptr() for position, _ in plan.slots})
        return
    compiled = kernel.run(*args, grid=grid, warmup=False, **kwargs)
    slots = tuple((position, position) for position, value in enumerate(args) if isinstance(value, torch.Tensor))
    store(key, _captured(compiled, grid, bound_values(kernel, args, kwargs), slots))
