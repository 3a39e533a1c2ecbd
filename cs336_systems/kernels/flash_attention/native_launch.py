"""Native launch plans: a repeat attention call with no Python between `flash_attention` and the kernels.

Launch plans (`kernels/launch_plan.py`) take Triton's per-call work out of a repeat call, yet a short call stays
host-bound: a Python autograd.Function costs about as much host time as SDPA's whole forward and backward
(`scripts/attention_host_overhead.py`'s control), and on autograd's device thread our Python backward ran
about twice as slow as on the main thread. This module replays the same plans from C++
(`native_launch.cpp`): a C++ autograd node whose forward and backward allocate the outputs and call
cuLaunchKernelEx on the CUfunctions Triton compiled, packing the parameters exactly as Triton's generated
launcher does. Python only makes a plan, once per input signature, by running the Python path once (which
captures the launches) and handing the result to C++.

The default launcher (`CS336_FLASH_NATIVE=0` or `use_native(False)` turns it off; `flash_attention(...,
launcher="python")` per call). On the H200 it made a short call GPU-bound (notes/flash_attention.md, Versions 12
and 13). A process's first backward through it once crashed where autograd's device thread had no CUDA
context yet; `ensure_context` in the C++ binds the device's primary context there. The
extension is compiled on first use (about 30 s on a 2-core machine) and cached by content, not by checkout
(`kernels/native_build.py`: no lock that an interrupted build can leave behind). Where it
cannot be built or a signature cannot be planned (aliased inputs, a parameter type the packer does not
take), calls take the Python path, with one warning for a build failure.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import torch

from cs336_systems.kernels import launch_plan, native_build
from cs336_systems.kernels.flash_attention import buffers, dispatch

# Names of the tensor slots and parameter kinds, in native_launch.cpp's enum order.
SLOTS = ("q", "k", "v", "out", "lse", "grad_out", "delta", "dk", "dv", "dq", "dq_accum", "row_max", "row_inv_sum")
ARG_KINDS = ("tensor", "null", "i1", "i8", "i16", "i32", "i64", "u8", "u16", "u32", "u64", "fp32", "fp64",
             "tensormap")
# Triton's scalar parameter types -> our kinds, as its launcher stores them (driver.py's ty_to_cpp: "u1", a
# Python bool, is a uint8_t)
_INTEGER_KINDS = {"i1": "i1", "i8": "i8", "i16": "i16", "i32": "i32", "i64": "i64", "u1": "u8", "u8": "u8",
                  "u16": "u16", "u32": "u32", "u64": "u64"}
_REAL_KINDS = {"fp32": "fp32", "f32": "fp32", "fp64": "fp64"}
# backward name -> the code its native plans are registered under: its place in dispatch.BACKWARD_OPTIONS, the one
# table of the backwards `flash_attention` offers ("compile" is not planned).
BACKWARD_CODES = {name: code for code, name in enumerate(dispatch.BACKWARD_OPTIONS)}
ACCUM_CODES = {None: 0, "gluon": 1, "tl": 2}

_enabled = os.environ.get("CS336_FLASH_NATIVE", "1") != "0"
# Native plans are never dropped (autograd nodes hold raw pointers to them), so their number is capped; past it,
# new signatures take the Python path, whose plans are dropped oldest first (launch_plan.MAX_PLANS).
MAX_NATIVE_PLANS = 1024
_module = None
_build_failed = False
_refused: set[tuple] = set()  # signatures that cannot be planned (Python path from then on)


def native_enabled() -> bool:
    return _enabled


def use_native(enabled: bool) -> None:
    """Turn native launch plans on or off for this process."""
    global _enabled
    _enabled = bool(enabled)


def triton_cuda_include() -> str:
    """Triton's bundled CUDA driver headers (cuda.h): the extension needs no CUDA toolkit to build."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "include")


def load_module():
    """The compiled extension (built on first use), or None where it cannot be built."""
    global _module, _build_failed
    if _module is not None or _build_failed:
        return _module
    import triton

    source = Path(__file__).with_name("native_launch.cpp")
    try:
        _module = native_build.load_extension("cs336_flash_native", [source], extra_cflags=["-O2"],
                                              extra_ldflags=["-ldl"], extra_include_paths=[triton_cuda_include()],
                                              key_parts=[f"triton {triton.__version__}"])
    except Exception as error:  # no compiler, no headers: the Python path still works
        _build_failed = True
        warnings.warn(f"cs336 native attention: the extension did not build ({type(error).__name__}: "
                      f"{str(error)[:300]}); using the Python launch path", stacklevel=2)
        return None
    if torch.cuda.is_available():  # launches must reach torch's current stream: check once
        try:
            same = _module.current_stream(torch.cuda.current_device()) == torch.cuda.current_stream().cuda_stream
        except RuntimeError as error:
            same, why = False, str(error)[:200]
        else:
            why = "it reads another stream than torch's current one"
        if not same:
            _module, _build_failed = None, True
            warnings.warn(f"cs336 native attention: {why}; using the Python launch path", stacklevel=2)
    return _module


def _flattened(type_, value):
    """(type, value) of each scalar a tuple parameter holds, depth first, its constexpr elements (a stride of 1 the
    JIT specialised) left out: the order in which Triton's generated launcher passes them to the kernel."""
    if isinstance(type_, tuple):
        for element_type, element in zip(type_, value):
            yield from _flattened(element_type, element)
    elif type_ != "constexpr":
        yield type_, value


def tensor_map_entries(descriptor, slot: str, meta: dict) -> list[int] | None:
    """A host tensor descriptor over a slot's tensor as native_launch.cpp's TensorMapSpec takes it: [slot, data
    type, swizzle, fill, rank, dims, byte strides, box], innermost dimension first, as Triton's fill_tma_descriptor
    encodes it from the kernel's `tensordesc_meta` (backends/nvidia/driver.py, make_tensordesc_arg). None for
    fp4-padded descriptors (not ours)."""
    from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

    if meta.get("fp4_padded"):
        return None
    rank, element_size = len(descriptor.shape), int(meta["elem_size"])
    dims = [int(size) for size in reversed(descriptor.shape)]
    byte_strides = [int(stride) * element_size for stride in reversed(descriptor.strides[:-1])]
    box = [int(size) for size in reversed(meta["block_size"])]
    fill = 1 if descriptor.padding == "nan" else 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NAN_REQUEST_ZERO_FMA or NONE
    return [SLOTS.index(slot), TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], int(meta["swizzle"]), fill, rank, *dims,
            *byte_strides, *box]


def kernel_spec(captured: launch_plan.CapturedLaunch) -> tuple | None:
    """(function, config, kinds, integers, reals, tensor maps) for native_launch.cpp, from a captured launch; None
    where a parameter has a type the packer does not take or the kernel needs profile scratch. Tuple parameters (a
    tensor's strides) are flattened as Triton's launcher flattens them (`_flattened`); a host tensor descriptor over
    a slot's tensor becomes its CUtensorMap (encoded per call), then its shape as i32 and strides as i64, as
    Triton's launcher expands it."""
    compiled = captured.compiled
    metadata = compiled.metadata
    if getattr(metadata, "profile_scratch_size", 0):  # (instrumentation only)
        return None
    types = list(compiled.src.signature.values())
    if len(types) != len(captured.values):
        return None
    slots, descriptor_slots = dict(captured.slots), dict(captured.descriptor_slots)
    descriptor_meta = list(getattr(metadata, "tensordesc_meta", None) or [])
    kinds, integers, reals, maps = [], [], [], []
    for position, (type_, value) in enumerate(zip(types, captured.values)):
        if type_ == "constexpr":
            continue
        if isinstance(type_, str) and type_.startswith("tensordesc"):
            meta = descriptor_meta.pop(0) if descriptor_meta else None
            entries = (tensor_map_entries(value, descriptor_slots[position], meta)
                       if meta is not None and position in descriptor_slots else None)
            if entries is None:
                return None  # lowered without a CUtensorMap, or over no slot's tensor
            kinds.append(ARG_KINDS.index("tensormap"))
            integers.append(len(maps))
            reals.append(0.0)
            maps.append(entries)
            for kind, sizes in (("i32", value.shape), ("i64", value.strides)):
                kinds.extend([ARG_KINDS.index(kind)] * len(sizes))
                integers.extend(int(size) for size in sizes)
                reals.extend([0.0] * len(sizes))
            continue
        if isinstance(type_, tuple):  # a tensor's strides: its scalars, in order, as Triton's launcher packs them
            for element_type, element in _flattened(type_, value):
                if element_type in _INTEGER_KINDS:
                    kinds.append(ARG_KINDS.index(_INTEGER_KINDS[element_type]))
                    integers.append(int(element))
                    reals.append(0.0)
                else:
                    return None  # pointers or reals inside a tuple: none of our kernels takes them
            continue
        if not isinstance(type_, str):
            return None  # (no other parameter kinds)
        if type_.startswith("*"):
            if position in slots:
                kinds.append(ARG_KINDS.index("tensor"))
                integers.append(SLOTS.index(slots[position]))
            elif value is None:
                kinds.append(ARG_KINDS.index("null"))
                integers.append(0)
            else:
                return None
            reals.append(0.0)
        elif type_ in _INTEGER_KINDS:
            kinds.append(ARG_KINDS.index(_INTEGER_KINDS[type_]))
            integers.append(int(value))
            reals.append(0.0)
        elif type_ in _REAL_KINDS:
            kinds.append(ARG_KINDS.index(_REAL_KINDS[type_]))
            integers.append(0)
            reals.append(float(value))
        else:
            return None  # fp16/bf16 scalars
    num_warps, num_ctas, shared = compiled.packed_metadata[:3]
    config = [*captured.grid, num_warps, num_ctas, shared, int(bool(metadata.launch_cooperative_grid)),
              int(bool(metadata.launch_pdl)), int(getattr(metadata, "global_scratch_size", 0))]
    compiled._init_handles()
    return int(compiled.function), config, kinds, integers, reals, maps


def make_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, backward: str) -> bool:
    """Run the Python launch path once on inputs like these (its plans capture the launches) and register the
    result natively. False where it cannot be planned."""
    module = load_module()
    if module is None or module.plan_count() >= MAX_NATIVE_PLANS:
        return False
    if k.shape[-2] == 1:
        return False  # one key: the Python path zeroes dQ and dK exactly (`buffers.backward_result`)
    options = dispatch.BACKWARD_OPTIONS[backward]
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        out, lse = dispatch.flash_forward(q, k, v, is_causal)  # each makes its Python plan, or finds it
        # In O's layout, as the C++ backward hands its plan one. Zeros, not random: making a plan must leave the
        # caller's random stream alone (a test's next torch.randn would otherwise differ with the launcher).
        grad_out = torch.zeros_like(out)
        dispatch.flash_backward(q, k, v, out, lse, grad_out, is_causal, options)
        forward = launch_plan.lookup(dispatch.forward_plan_key(q, k, v, is_causal))
        backward_plan = launch_plan.lookup(dispatch.backward_plan_key(q, k, v, out, lse, grad_out, is_causal,
                                                                      options))
    if forward is None or backward_plan is None:
        return False
    specs = [kernel_spec(forward.launch)], [kernel_spec(c) for c in backward_plan.launches]
    if any(spec is None for spec in (*specs[0], *specs[1])):
        return False
    accum = backward_plan.accum
    rows, cols = buffers.dq_accum_shape(q, accum) if accum is not None else (0, 0)
    scale = 1.0 / math.sqrt(q.shape[-1]) if accum == "tl" else 1.0  # as `buffers.backward_result` applies it
    module.register_plan(q, k, v, bool(is_causal), BACKWARD_CODES[backward], specs[0], specs[1],
                         ACCUM_CODES[accum], scale, rows, cols, backward_plan.exact_rows)
    return True


def _through_plan(replay, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, backward: str):
    """`replay(module, code)`, code the backward's (None where the module has no plan for these inputs), a plan made
    on the first miss of a signature; None where there is no plan to be had: take the Python path. With launch plans off
    (`launch_plan.use_plans(False)`) no native plan is used or made either: they are made from the Python plans,
    and "off" means every call takes the normal launch path."""
    if not launch_plan.plans_enabled():
        return None
    module = load_module()
    code = BACKWARD_CODES.get(backward)
    if module is None or code is None:
        return None
    result = replay(module, code)
    if result is not None:
        return result
    key = (bool(is_causal), backward, launch_plan.tensor_signature(q, k, v))
    if key in _refused:
        return None
    dispatch.validate_attention_inputs(q, k, v)  # a plan skips validation from then on: its signature passed it
    if not make_plan(q, k, v, is_causal, backward):
        _refused.add(key)
        return None
    return replay(module, code)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, backward: str):
    """O through a native plan, with the C++ autograd node, or None: take the Python path."""
    return _through_plan(lambda module, code: module.attention(q, k, v, bool(is_causal), code), q, k, v, is_causal,
                         backward)


def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, backward: str):
    """(O, L) through a native plan's forward, or None: `cs336::flash_attention_forward`'s CUDA implementation
    (what torch.compile's graphs call) without the Python launch path's host time."""
    return _through_plan(lambda module, code: module.forward(q, k, v, bool(is_causal), code), q, k, v, is_causal,
                         backward)


def backward(q, k, v, out, lse, grad_out, is_causal: bool, backward: str):
    """(dQ, dK, dV) through a native plan's backward, or None: `cs336::flash_attention_backward`'s."""
    return _through_plan(lambda module, code: module.backward(q, k, v, out, lse, grad_out, bool(is_causal), code),
                         q, k, v, is_causal, backward)
