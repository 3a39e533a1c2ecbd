"""The PTX of the Gluon backward passes as Triton's own JIT would build it from our launchers' arguments, on a
machine without a GPU.

`flash_ptx_schedule.py` writes each kernel's signature by hand; this instead runs the launch path itself:
`hopper_backward.backward_passes` / `fused_pass` and `hopper_one_pass.one_pass` build their `GluonPass` from CPU
tensors of the given shape, Triton's binder (the function `JITFunction.run` calls, made for an sm_90 target)
specialises the arguments (tuples, nested or not, element by element), and the kernel is compiled from that
signature. Dump before and after a change to how a kernel takes its arguments, and diff: identical PTX means
the change reaches the GPU as the same kernel with the same values.

    python scripts/gluon_jit_ptx.py --out DIR [--shape 2,3,300,128] [--causal on]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import compile as triton_compile
from triton.compiler import make_backend
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import create_function_from_signature

from cs336_systems.kernels.flash_attention import gluon_common, hopper_backward, hopper_one_pass

TARGET = GPUTarget("cuda", 90, 32)


def _ptx(gluon_pass) -> str:
    """Bind `gluon_pass`'s launch as `JITFunction.run` does, then compile for sm_90 (no launch, no driver)."""
    kernel = gluon_pass.kernel
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    block_m, block_n, num_warps, num_stages = gluon_pass.config
    kwargs = dict(gluon_pass.flags, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=num_stages, num_warps=num_warps,
                  debug=False, instrumentation_mode="")
    bound_args, specialization, options = binder(*gluon_pass.args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    source = GluonASTSource(kernel, signature, constexprs, attrs)
    return triton_compile(source, target=TARGET, options=options.__dict__).asm["ptx"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, required=True, help="folder for one PTX file per pass")
    parser.add_argument("--shape", default="2,3,300,128", help="batch,heads,seq,d (default 2,3,300,128)")
    parser.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    parser.add_argument("--causal", choices=("on", "off"), default="on")
    args = parser.parse_args(argv)
    try:
        batch, heads, seq, head_dim = (int(v) for v in args.shape.split(","))
    except ValueError:
        parser.error(f"--shape: expected four integers batch,heads,seq,d, got {args.shape!r}")
    if min(batch, heads, seq) < 1 or head_dim not in hopper_backward.HEAD_DIMS:
        parser.error(f"--shape: batch, heads and seq must be >= 1 and d one of {hopper_backward.HEAD_DIMS} (the Gluon "
                     f"passes' head dims), got {args.shape!r}")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    q, k, v, do, dq, dk, dv = (torch.zeros(batch, heads, seq, head_dim, dtype=dtype) for _ in range(7))
    lse = torch.zeros(batch * heads, seq)
    delta = torch.zeros(batch * heads, seq)
    dq_accum = torch.zeros(batch * heads, gluon_common.one_pass_rows(seq), head_dim)
    causal = args.causal == "on"
    dkdv, dq_pass = hopper_backward.backward_passes(q, k, v, do, lse, delta, dq, dk, dv, causal, 0.125)
    passes = {"dkdv": dkdv, "dq": dq_pass,
              "fused": hopper_backward.fused_pass(q, k, v, do, lse, delta, dq_accum, dk, dv, causal, 0.125)}
    if head_dim in hopper_one_pass.HEAD_DIMS:
        passes["one-pass-ws"] = hopper_one_pass.one_pass(q, k, v, do, lse, delta, dq_accum, dk, dv, causal, 0.125)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, gluon_pass in passes.items():
        ptx = _ptx(gluon_pass)
        (args.out / f"{name}.ptx").write_text(ptx)
        print(f"{name}: {len(ptx.splitlines())} PTX lines")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
