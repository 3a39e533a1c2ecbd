"""Compile the model path's pointwise Triton kernels (RoPE, RMSNorm forward and backward) for a GPU architecture on
this machine, no GPU needed: does each launch the model makes build, and does any of it use local memory (register
spills)? A check to run after changing one of them when no GPU is at hand; their tests under the interpreter say
whether they compute right, this says whether ptxas takes them. It cannot say how fast they run.

As `gluon_jit_ptx.py` does for the attention passes, the launch path itself builds the arguments: our launchers
(`rope._rotate`, `rmsnorm._forward` / `_backward`, plain and with the residual add) run their CUDA path on CPU
tensors of each preset's shapes (batch 4, context 512; Q and K as column blocks of the merged Q/K/V product, as the
fused model has them) with a `launch`
that binds the arguments through Triton's JIT binder for the target and compiles, instead of launching. So the
signature is the one a real launch specialises, not one written down here.

    python scripts/pointwise_sass_check.py                 # sm_90, bf16, every preset's head dim and width
    python scripts/pointwise_sass_check.py --arch 80 --dtype fp16
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even where the tests set the interpreter

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.compiler import compile as triton_compile  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from cs336_systems.config import PRESETS  # noqa: E402
from cs336_systems.kernels import rmsnorm, rope  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BATCH, CONTEXT = 4, 512


def compiling_launch(target: GPUTarget, compiled: list):
    """A `launch` for our launchers: the kernel's arguments bound as `JITFunction.run` binds them for `target`,
    compiled, appended to `compiled` as (kernel name, num_warps, PTX); nothing runs."""
    backend = make_backend(target)

    def launch(kernel, grid, *args, **kwargs):
        kwargs = dict(kwargs, debug=False, instrumentation_mode="")
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization,
                                                                  options)
        ptx = triton_compile(ASTSource(kernel, signature, constexprs, attrs), target=target,
                             options=options.__dict__).asm["ptx"]
        compiled.append((kernel.__name__, options.num_warps, ptx))

    return launch


def launches(dtype: torch.dtype, launch) -> list[str]:
    """Run each preset's RoPE (Q and K in one launch, and one tensor) and RMSNorm (forward, backward) launchers once
    with `launch`; one description per launch, in order."""
    names = []
    for d_model, heads in sorted({(cfg.d_model, cfg.num_heads) for cfg in PRESETS.values()}):
        d_head = d_model // heads
        qkv = torch.zeros(BATCH, CONTEXT, 3 * d_model, dtype=dtype)
        q, k = (qkv[..., i * d_model:(i + 1) * d_model].view(BATCH, CONTEXT, heads, d_head).transpose(1, 2)
                for i in range(2))
        cache = torch.zeros(2, CONTEXT, d_head // 2)
        pos = rope._checked_positions("rope", (q, k), torch.arange(CONTEXT), cache)
        rope._rotate((q, k), pos, cache, 1.0, launch=launch)
        rope._rotate((q,), pos, cache, 1.0, launch=launch)
        names += [f"rope d {d_head}, {heads} heads, Q and K", f"rope d {d_head}, {heads} heads, one tensor"]
        x = torch.zeros(BATCH * CONTEXT, d_model, dtype=dtype)
        weight = torch.ones(d_model, dtype=dtype)
        _, _, rstd = rmsnorm._forward(x, weight, 1e-5, launch=launch)
        rmsnorm._backward(x, x, weight, rstd, launch=launch)
        # the block's residual add fused into its second norm, as under autocast: an fp32 stream, a 16-bit delta
        stream = x.float()
        rmsnorm._forward(stream, weight, 1e-5, launch=launch, out_dtype=dtype, delta2d=x)
        rmsnorm._backward(x, stream, weight, rstd, launch=launch, grad_h2d=stream, second_dtype=dtype)
        names += [f"rmsnorm forward width {d_model}", f"rmsnorm backward width {d_model}",
                  f"add_rmsnorm forward width {d_model}", f"add_rmsnorm backward width {d_model}"]
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the activations' dtype")
    args = parser.parse_args(argv)
    # The launchers' CUDA path on CPU tensors (as scripts/operator_host_overhead.py takes it).
    rope.runs_kernel = rmsnorm.runs_kernel = lambda tensor: True
    compiled: list = []
    try:
        names = launches(DTYPES[args.dtype], compiling_launch(GPUTarget("cuda", args.arch, 32), compiled))
    except Exception as error:  # noqa: BLE001 (a kernel that does not build: say which, then fail)
        print(f"{len(compiled)} launches built, then: does not compile ({type(error).__name__}: "
              f"{(str(error).splitlines() or [''])[0]})")
        return 1
    spilled = 0
    for name, (kernel, warps, ptx) in zip(names, compiled, strict=True):
        spills = "ld.local" in ptx
        spilled += spills
        print(f"{name}: {kernel} builds for sm_{args.arch}, {warps} warps, "
              f"{'local memory used (spills)' if spills else 'no local memory'}")
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
