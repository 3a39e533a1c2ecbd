"""Small helpers shared by our Triton launchers."""

from __future__ import annotations

import importlib.util
import os

import torch

# What to run where Triton is missing. CUDA builds of torch on Linux bring their matching Triton; the CPU
# build does not, and the toolkit's base install does not ask for it (see README, "Set-up").
TRITON_INSTALL = "pip install 'triton>=3.6,<3.7'  (or: pip install -e '.[triton]')"


# Host-side integer helpers for launch code. Triton 3.6's `triton.cdiv` and `triton.next_power_of_2` are
# ConstexprFunction objects: about 2 us a call on the host, against a few tens of ns for this arithmetic, and a
# launch path calls them several times per operator call (measured on this CPU with `timeit`).
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative a and positive b."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), as `triton.next_power_of_2` for n >= 1."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def triton_installed() -> bool:
    """Whether `import triton` would find a package (checked without importing it)."""
    return importlib.util.find_spec("triton") is not None


def missing_triton_message(what: str) -> str:
    """One line: `what` needs Triton, and how to install it."""
    return f"{what} needs Triton, which is not installed here; install it with: {TRITON_INSTALL}"


@torch.compiler.assume_constant_result  # read once per trace: dynamo neither traces nor guards os.environ
def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_kernel_device(name: str, *tensors: torch.Tensor) -> None:
    """Kernels with no CPU maths run on CUDA tensors, or on CPU tensors under the interpreter; say so otherwise."""
    check_operator_device(name, *tensors)
    if not runs_kernel(tensors[0]):
        raise ValueError(f"{name}: the Triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 for CPU tensors), "
                         f"got {tensors[0].device}")


def check_operator_device(name: str, *tensors: torch.Tensor) -> None:
    """Our model operators run on one CUDA or CPU device: the Triton kernel on CUDA (and on CPU under the
    interpreter), their reference maths in torch on the CPU otherwise; say so for anything else."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{name}: all inputs must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"{name}: inputs must be on a CUDA or CPU device, got {device}")


def runs_kernel(t: torch.Tensor) -> bool:
    """Whether an operator runs its Triton kernel on `t` (CUDA, or CPU under TRITON_INTERPRET=1) rather than
    its reference maths in torch (CPU): so users without a GPU, and CI, run the same model graph."""
    return t.device.type == "cuda" or (t.device.type == "cpu" and interpreting())


def compiling() -> bool:
    """True while torch.compile traces. Our public functions call their registered operator then, so the graph
    holds one opaque op with its fake and autograd rules (no graph break, dynamic shapes); eager calls take the
    autograd Function and launcher directly, because an operator's eager dispatch costs about 15 us of host time
    per call (measured on CPU), as much as a small kernel's launch. (Under a torch dispatch mode, such as selective
    checkpointing, the Function path stays: its saved tensors then match between forward and recompute.)"""
    return torch.compiler.is_compiling()


_TRITON_AT_IMPORT = triton_installed()  # (where the triton_op forms exist; a constant, which torch.compile reads)


@torch.compiler.assume_constant_result  # (a compiled graph keeps the form it was traced with)
def triton_ops_enabled() -> bool:
    """Under torch.compile, RMSNorm, the SwiGLU gates and RoPE trace as `torch.library.triton_op`s (their kernels
    launched through `wrap_triton`), so inductor launches each kernel from its own generated code instead of calling
    our operator's Python implementation (dispatch, launcher and Triton's launch path: about 180-270 us of CPU self
    time a call under torch.profiler on the H100's host, 12 calls a block and step). Measured (H100, small/512,
    compiled per block): a step's host time 58.8 -> 36.0 ms, and the compiled step at medium/large/xl 1.60/2.11/1.42x
    the baseline -> 1.47/1.35/1.03x (notes/model_sizes.md). CS336_TRITON_OPS=0 takes the custom operators instead.
    Not under TRITON_INTERPRET=1, whose kernels would run on torch.compile's fake tensors."""
    return os.environ.get("CS336_TRITON_OPS", "1") != "0" and not interpreting() and _TRITON_AT_IMPORT


def launch_wrapped(kernel, grid: tuple, *args, **kwargs) -> None:
    """`kernel[grid](*args, **kwargs)` as a `triton_op` launches it: through `wrap_triton`, which torch.compile
    traces into the graph (the launchers' `launch=` argument, in place of `launch_plan.launch`)."""
    torch.library.wrap_triton(kernel)[grid](*args, **kwargs)


def autotune_enabled() -> bool:
    """CS336_AUTOTUNE=0 takes the first fitting config instead of timing them all (fast cold
    starts for tests); the default tunes, over deliberately small spaces."""
    return os.environ.get("CS336_AUTOTUNE", "1") != "0"


def tile_family(precision: str, element_size: int) -> str:
    """The autotune family of a launch: "ieee" (IEEE fp32 dots: FMA on CUDA cores, where each thread holds its
    rows of both operands across the whole reduction, so tensor-core tiles spill and these spread the work over
    more warps), "fp32-tensor-core" (fp32 operands on tensor cores, "tf32" or "tf32x3": twice the shared memory
    of a 16-bit tile, and tf32x3 holds each operand split in two in registers) or "tensor-core" (16-bit)."""
    if precision == "ieee":
        return "ieee"
    return "fp32-tensor-core" if element_size == 4 else "tensor-core"


def configs_from_families(families: dict[str, tuple]) -> list:
    """One triton.Config per tile of every family, in listed order and once each (`configs_for_family` picks a
    launch's share). Under the interpreter a single small config: it runs anything, and tuning means nothing
    there. The spaces are small on purpose: a cold cache compiles one family in seconds per (head dim, dtype,
    causal)."""
    import triton

    if interpreting():
        return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16}, num_warps=1, num_stages=1)]
    tiles = dict.fromkeys(tile for family in families.values() for tile in family)
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s) for bm, bn, w, s in tiles]


def config_tile(config) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) of a triton.Config."""
    return config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps, config.num_stages


def configs_for_family(configs: list, families: dict[str, tuple], family: str) -> list:
    """The autotune candidates of one family (`tile_family`), best-first: the configs of `families[family]`'s
    tiles ((BLOCK_M, BLOCK_N, warps, stages) rows) in its listed order. Where that leaves nothing (the
    interpreter's single config), every config stays."""
    by_tile = {config_tile(c): c for c in configs}
    chosen = [by_tile[tile] for tile in families[family] if tile in by_tile]
    return chosen or list(configs)
