"""Compile the model path's pointwise Triton kernels (RoPE, RMSNorm forward and backward) for a GPU architecture on
this machine, no GPU needed: does each specialisation the model launches build, and does any of it use local memory
(register spills)? A check to run after changing one of them when no GPU is at hand; their tests under the
interpreter say whether they compute right, this says whether ptxas takes them.

    python scripts/pointwise_sass_check.py                 # sm_90, bf16, the head dims and widths of the presets
    python scripts/pointwise_sass_check.py --arch 80 --dtype fp16
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even where the tests set the interpreter

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from cs336_systems.config import PRESETS  # noqa: E402
from cs336_systems.kernels import rmsnorm, rope  # noqa: E402

DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}


def compile_kernel(fn, pointers: dict, constexprs: dict, warps: int, arch: int):
    """fn compiled as a launch specialises it: integer arguments i32, pointers divisible by 16."""
    signature = {name: pointers.get(name, "i32") for name in fn.arg_names} | {name: "constexpr" for name in constexprs}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if signature[name].startswith("*")}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                          target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))


def cases(dtype: str):
    """(name, kernel, pointer types, constexprs, warps) for every specialisation the presets' model launches."""
    t = DTYPES[dtype]
    head_dims = sorted({cfg.d_head for cfg in PRESETS.values()})
    widths = sorted({cfg.d_model for cfg in PRESETS.values()})
    rope_kernel = rope._kernel()
    rope_pointers = {n: t for n in ("x_ptr", "y_ptr", "out_ptr", "out_y_ptr")} | {"pos_ptr": "*i64",
                                                                                   "cache_ptr": "*fp32"}
    for d in head_dims:
        block_d = max(2, triton.next_power_of_2(d))
        for pair in (True, False):
            for share in (True, False):
                yield (f"rope d {d} pair={pair} heads_share_positions={share}", rope_kernel, rope_pointers,
                       dict(SIGN=1.0, HEADS_SHARE_POS=share, PAIR=pair, BLOCK_S=max(1, rope.TILE_ELEMENTS // block_d),
                            BLOCK_D=block_d), 4)
    forward_kernel, backward_kernel = rmsnorm._kernels()
    norm_pointers = {"x_ptr": t, "w_ptr": t, "y_ptr": t, "dy_ptr": t, "dx_ptr": t, "rstd_ptr": "*fp32",
                     "dw_partial_ptr": "*fp32", "eps": "fp32"}
    for width in widths:
        block_d = rmsnorm._block_d(width)
        for direction, kernel in (("forward", forward_kernel), ("backward", backward_kernel)):
            yield (f"rmsnorm {direction} width {width}", kernel, norm_pointers, dict(BLOCK_D=block_d),
                   rmsnorm._num_warps(block_d))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: Hopper)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the activations' dtype")
    args = parser.parse_args(argv)
    failed = 0
    for name, fn, pointers, constexprs, warps in cases(args.dtype):
        try:
            compiled = compile_kernel(fn, pointers, constexprs, warps, args.arch)
        except Exception as error:  # noqa: BLE001 (report every case, then fail)
            print(f"{name}: does not compile ({type(error).__name__}: {str(error).splitlines()[0]})")
            failed += 1
            continue
        spills = "local memory used (spills)" if "ld.local" in compiled.asm["ptx"] else "no local memory"
        failed += "ld.local" in compiled.asm["ptx"]
        print(f"{name}: builds for sm_{args.arch}, {warps} warps, {spills}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
