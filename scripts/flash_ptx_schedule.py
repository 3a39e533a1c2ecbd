"""How the FlashAttention kernels' inner loops are scheduled on Hopper, read from the PTX (no GPU needed).

Compiles the forward, dK/dV and dQ kernels for sm_90 ahead of time, with the specialisation the JIT gives
real launches: unit strides along d become constants, and pointers, sizes and other strides are marked
divisible by 16. Without that, no load is pipelined. For each config it prints:
  * shared memory, and the pipelined loads: cp.async (block pointers) or cp.async.bulk (TMA);
  * the schedule of the unrolled loop bodies. Wn is a group of n wgmma instructions, |k a
    `wgmma.wait_group k` (k = 0: wait for everything in flight), en a run of n ex2 instructions.
For example `W8|0e32W12|0W4|0` is the dK/dV step at d 128, 64 x 64 tiles: S^T is waited for, then the
exponentials run, then dV and dP^T are issued together and waited for, then dK is issued and waited for.

    python scripts/flash_ptx_schedule.py                      # the shipped first configs, d 128, bf16, causal
    python scripts/flash_ptx_schedule.py --kernel dq --config 128x64x8x3,64x64x4x3 --d 64

A config that does not compile prints "does not compile (ErrorType)"; PTX_SCHEDULE_TRACEBACK=1 raises the error
instead, with the compiler's message.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for real, even where the tests set the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from cs336_systems.kernels._triton_utils import config_tile  # noqa: E402
from cs336_systems.kernels.flash_attention import (  # noqa: E402
    backward,
    forward,
    hopper_backward,
    hopper_forward,
    hopper_one_pass,
)

DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}  # fp32: the tl kernels only
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SCALARS = ("qk_scale", "sm_scale")
NOT_ALIGNED = ("n_heads",)  # a count, not a size in elements


TL_AUTOTUNERS = {"forward": forward.flash_forward_kernel, "dkdv": backward.flash_dkdv_kernel,
                 "fused": backward.flash_bwd_fused_kernel, "dq": backward.flash_dq_kernel,
                 "dv-split": backward.flash_key_grad_kernel, "dk-split": backward.flash_key_grad_kernel,
                 "row-stats": backward.flash_row_stats_kernel}
ROW_STATS = ("RowMax", "RowInvSum")  # the fp32-accurate backward's row statistics (None in other launches)


def first_tl_config(name: str, dtype: str, precision: str, head_dim: int) -> tuple[int, int, int, int]:
    """The first config a `tl` kernel's autotuner keeps for a long sequence at this dtype, dot precision and
    head dim (its pruning, as a launch runs it): what CS336_AUTOTUNE=0 launches."""
    tuner = TL_AUTOTUNERS[name]
    named = {"Q": torch.empty(0, dtype=TORCH_DTYPES[dtype]), "n_queries": 4096}
    first = tuner.early_config_prune(tuner.configs, named, BLOCK_D=head_dim, PRECISION=precision)[0]
    return config_tile(first)


def kernels(dtype: str) -> dict:
    """name -> (JITFunction, pointer types, extra constexprs, shipped first config)."""
    t = DTYPES[dtype]
    dkdv_pointers = {n: t for n in ("Q", "K", "V", "dO", "dK", "dV")} | {"L": "*fp32", "Delta": "*fp32",
                                                                        "DQ_ACCUM": "*fp32"}
    return {
        # The tl kernels: shipped config None, the first their autotuner keeps for the launch (`first_tl_config`).
        "forward": (forward.flash_forward_kernel.fn, {n: t for n in ("Q", "K", "V", "O")} | {"L": "*fp32"}, {},
                    None),
        "dkdv": (backward._dkdv_kernel, dkdv_pointers, {"DQ_REDUCE": 0, "KEY_GRADS": 0}, None),
        "fused": (backward._dkdv_kernel, dkdv_pointers, {"DQ_REDUCE": 1, "KEY_GRADS": 0}, None),  # the one pass
        # The split key passes of wide heads (`backward.flash_key_grad_kernel`): dV alone, then dK alone.
        "dv-split": (backward._dkdv_kernel, dkdv_pointers, {"DQ_REDUCE": 0, "KEY_GRADS": 1}, None),
        "dk-split": (backward._dkdv_kernel, dkdv_pointers, {"DQ_REDUCE": 0, "KEY_GRADS": 2}, None),
        "dq": (backward.flash_dq_kernel.fn, {n: t for n in ("Q", "K", "V", "dO", "dQ")}
               | {"L": "*fp32", "Delta": "*fp32"}, {}, None),
        # The fp32-accurate backward's first pass (fp32 with "ieee" or "tf32x3" only).
        "row-stats": (backward.flash_row_stats_kernel.fn, {n: t for n in ("Q", "K", "V", "dO")}
                      | {"Delta": "*fp32"}, {}, None),
        # The Gluon passes (hopper_backward.py): shipped configs at d 128.
        "dkdv-gluon": (hopper_backward.flash_dkdv_gluon_kernel, {n: t for n in ("Q", "K", "V", "dO", "dK", "dV")}
                       | {"L": "*fp32", "Delta": "*fp32"}, {"KV_REGS": 0, "DQ_ACCUM": None, "DQ_SPLIT": 0,
                                                            "DQ_TMA": 1, "DQ_BUFFERS": 2},
                       hopper_backward.DKDV_CONFIG[128]),
        "fused-gluon": (hopper_backward.flash_dkdv_gluon_kernel, {n: t for n in ("Q", "K", "V", "dO", "dK", "dV")}
                        | {"L": "*fp32", "Delta": "*fp32", "DQ_ACCUM": "*fp32"},
                        {"KV_REGS": 0, "DQ_SPLIT": hopper_backward.FUSED_DQ_SPLIT[128], "DQ_TMA": 1, "DQ_BUFFERS": 2},
                        hopper_backward.FUSED_CONFIG[128]),
        "fused-gluon-ws": (hopper_one_pass.flash_bwd_one_pass_ws_kernel,
                           {n: t for n in ("Q", "K", "V", "dO", "dK", "dV")}
                           | {"L": "*fp32", "Delta": "*fp32", "DQ_ACCUM": "*fp32"},
                           {"DQ_BUFFERS": 1, "CONSUMER_REGS": 240}, hopper_one_pass.CONFIG[128]),
        "forward-gluon": (hopper_forward.flash_forward_gluon_kernel, {n: t for n in ("Q", "K", "V", "O")}
                          | {"L": "*fp32"}, {"RESCALE_EARLY": True}, hopper_forward.FORWARD_CONFIG[128]),
        "forward-gluon-ws": (hopper_forward.flash_forward_ws_kernel, {n: t for n in ("Q", "K", "V", "O")}
                             | {"L": "*fp32"}, {"CONSUMER_REGS": 240}, hopper_forward.WS_FORWARD_CONFIG),
        "forward-gluon-late": (hopper_forward.flash_forward_gluon_kernel, {n: t for n in ("Q", "K", "V", "O")}
                               | {"L": "*fp32"}, {"RESCALE_EARLY": False}, hopper_forward.FORWARD_CONFIG[128]),
        # On the host's 4D descriptors: their types carry the config's tiles (`host_descriptor_types`).
        "forward-gluon-late-host": (hopper_forward.flash_forward_gluon_kernel, {"L": "*fp32"},
                                    {"RESCALE_EARLY": False, "HOST_DESCRIPTORS": True},
                                    hopper_forward.FORWARD_CONFIG[128]),
        "dkdv-gluon-host": (hopper_backward.flash_dkdv_gluon_kernel,
                            {"L": "*fp32", "Delta": "*fp32", "DQ_ACCUM": "*fp32"},
                            {"KV_REGS": 0, "HOST_DESCRIPTORS": True}, hopper_backward.DKDV_CONFIG[128]),
        "dq-gluon-host": (hopper_backward.flash_dq_gluon_kernel, {"L": "*fp32", "Delta": "*fp32"},
                          {"QDO_REGS": 0, "HOST_DESCRIPTORS": True}, hopper_backward.DQ_CONFIG[128]),
        "dq-gluon": (hopper_backward.flash_dq_gluon_kernel, {n: t for n in ("Q", "K", "V", "dO", "dQ")}
                     | {"L": "*fp32", "Delta": "*fp32"}, {"QDO_REGS": 0}, hopper_backward.DQ_CONFIG[128]),
    }

# Tuple-of-tuples stride arguments of the Gluon backward kernels: name -> how many tensors' strides.
NESTED_STRIDES = {"input_strides": 4, "key_grad_strides": 2}


def host_descriptor_types(dtype: str, block_m: int, block_n: int, head_dim: int) -> dict:
    """The attention tensors as the host's 4D tensor descriptors (`gluon_common.host_row_tiles`) of one config's
    tiles (those a kernel does not take are left out by `source`)."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    element = DTYPES[dtype].lstrip("*")
    rows = {"Q": block_m, "O": block_m, "dO": block_m, "dQ": block_m, "K": block_n, "V": block_n, "dK": block_n,
            "dV": block_n}
    return {name: f"tensordesc<{element}[1,1,{n},{head_dim}],{layout}>" for name, n in rows.items()}


def source(fn, pointers: dict, constexprs: dict, gluon: bool = False) -> ASTSource:
    # Compile-time flags not given take their defaults, as a launch that leaves them out does.
    constexprs = {param.name: param.default for param in fn.params if param.is_constexpr and param.has_default} | {
        name: value for name, value in constexprs.items() if name in fn.arg_names}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in NESTED_STRIDES:
            # Several tensors' row strides, one tuple of (batch, head, row) tuples (the Gluon backward's
            # `input_strides`, `key_grad_strides`), each element specialised as the JIT does: divisible by 16.
            signature[name] = (("i32",) * 3,) * NESTED_STRIDES[name]
            attrs |= {(i, t, j): [["tt.divisibility", 16]] for t in range(NESTED_STRIDES[name]) for j in range(3)}
        elif name.endswith("_strides"):
            # A tensor's strides, one tuple argument, specialised element by element as the JIT does: (batch,
            # head, row) strides divisible by 16, and in the tl kernels a unit stride along d, a constant.
            count = 3 if gluon else 4
            signature[name] = ("i32",) * 3 + ("constexpr",) * (count - 3)
            attrs |= {(i, j): [["tt.divisibility", 16]] for j in range(3)}
            if count == 4:
                constexprs[(i, 3)] = 1
        elif name in constexprs:
            signature[name] = "constexpr"
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in SCALARS:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name not in NOT_ALIGNED:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return (GluonASTSource if gluon else ASTSource)(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def schedule(ptx: str) -> str:
    events = []
    for line in ptx.splitlines():
        if "wgmma.mma_async" in line:
            events.append("W")
        elif "ex2.approx" in line:
            events.append("e")
        elif "wgmma.wait_group" in line:
            events.append("|" + line.split()[-1].rstrip(";"))
    text = "".join(events)
    text = re.sub(r"W+", lambda m: f"W{len(m.group(0))}", text)
    return re.sub(r"e+", lambda m: f"e{len(m.group(0))}", text)


def registers_and_spills(ptx: str, arch: int) -> str:
    """ptxas -v's registers per thread and spill stores (bytes) for the kernel, from the ptxas Triton itself uses:
    its bundled one, or TRITON_PTXAS_PATH's (the GPU image's Triton writes PTX for its CUDA 13 ptxas, which the
    bundled CUDA 12.8 one refuses)."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as scratch:
        source_file = Path(scratch) / "kernel.ptx"
        source_file.write_text(ptx)
        arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        report = subprocess.run([str(ptxas), "-v", f"--gpu-name={arch_name}", str(source_file),
                                 "-o", str(Path(scratch) / "kernel.cubin")], capture_output=True, text=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    if not registers:
        return f"ptxas: no report ({(report.strip().splitlines() or ['no output'])[0][:120]})"
    return f"{registers.group(1)} regs, {spills.group(1) if spills else '?'} B spilled"


def parse_config(text: str) -> tuple[int, int, int, int]:
    try:
        config = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        config = ()
    if len(config) != 4:
        raise argparse.ArgumentTypeError(f"--config: got {text!r}; expected BLOCK_MxBLOCK_NxWARPSxSTAGES")
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--kernel", default="forward,forward-gluon,dkdv,dq,dkdv-gluon,dq-gluon,fused-gluon",
                        help="comma-separated from: " + ", ".join(kernels("bf16")))
    parser.add_argument("--config", type=lambda s: [parse_config(c) for c in s.split(",")], default=None,
                        help="comma-separated BLOCK_MxBLOCK_NxWARPSxSTAGES (default: each kernel's first)")
    parser.add_argument("--d", type=int, default=128, choices=(16, 32, 64, 128, 256), help="head dim")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--precision", choices=("ieee", "tf32x3", "tf32"), default=None,
                        help="fp32 dot precision (default ieee, as function.py's default for fp32)")
    parser.add_argument("--causal", choices=("on", "off"), default="on")
    parser.add_argument("--tma", action="store_true", help="the tensor-descriptor variants")
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90, Hopper)")
    parser.add_argument("--ptx-dir", type=Path, default=None,
                        help="also write each kernel's PTX here (KERNEL_BMxBN_wW_sS_dD_DTYPE.ptx): diff two dumps to "
                             "check that a change leaves the compiled kernels as they were")
    args = parser.parse_args()
    if args.precision is not None and args.dtype != "fp32":
        parser.error(f"--precision: got {args.precision} with --dtype {args.dtype}; it applies to fp32 only")
    table = kernels(args.dtype)
    names = [k.strip() for k in args.kernel.split(",")]
    unknown = [n for n in names if n not in table]
    if unknown:
        parser.error(f"--kernel: got {', '.join(unknown)}; allowed: {', '.join(table)}")
    target = GPUTarget("cuda", args.arch, 32)
    precision = (args.precision or "ieee") if args.dtype == "fp32" else "tf32"  # as function.py's default
    for name in names:
        fn, pointers, extra, shipped = table[name]
        if shipped is None:
            shipped = first_tl_config(name, args.dtype, precision, args.d)
        for bm, bn, warps, stages in args.config or [shipped]:
            gluon = "-gluon" in name
            if gluon and args.dtype == "fp32":
                parser.error(f"--kernel {name}: the Gluon kernels take bf16/fp16 only")
            if gluon:  # pipelining is written out in the kernel: STAGES is its ring of buffers
                constexprs = dict(IS_CAUSAL=args.causal == "on", HEAD_DIM=args.d, BLOCK_M=bm, BLOCK_N=bn, STAGES=stages,
                                  **extra)
            else:
                constexprs = dict(IS_CAUSAL=args.causal == "on", BLOCK_D=args.d, EVEN_D=True, PRECISION=precision,
                                  BLOCK_M=bm, BLOCK_N=bn, USE_TMA=args.tma, **extra)
                if precision == "tf32":  # the row statistics are read by fp32-accurate launches only (None here)
                    if name == "row-stats":
                        parser.error("--kernel row-stats: runs for fp32 with --precision ieee or tf32x3 only")
                    constexprs |= {n: None for n in ROW_STATS}
                else:
                    pointers = pointers | {n: "*fp32" for n in ROW_STATS}
            if extra.get("HOST_DESCRIPTORS"):
                pointers = pointers | host_descriptor_types(args.dtype, bm, bn, args.d)
            try:
                compiled = triton.compile(source(fn, pointers, constexprs, gluon), target=target,
                                          options=dict(num_warps=warps, num_stages=1 if gluon else stages))
            except Exception as error:  # e.g. out of shared memory
                print(f"{name:10} {bm}x{bn} w{warps} s{stages}: does not compile ({type(error).__name__})")
                if os.environ.get("PTX_SCHEDULE_TRACEBACK"):
                    raise
                continue
            ptx = compiled.asm["ptx"]
            if args.ptx_dir is not None:
                args.ptx_dir.mkdir(parents=True, exist_ok=True)
                (args.ptx_dir / f"{name}_{bm}x{bn}_w{warps}_s{stages}_d{args.d}_{args.dtype}.ptx").write_text(ptx)
            print(f"{name:10} {bm}x{bn} w{warps} s{stages}: shared {compiled.metadata.shared // 1024} KiB, "
                  f"cp.async {len(re.findall(r'cp[.]async[.]c[ag]', ptx))}, "
                  f"TMA {len(re.findall(r'cp[.]async[.]bulk', ptx))}, "
                  f"descriptors made {len(re.findall(r'tensormap[.]cp_fenceproxy', ptx))}, "
                  f"{registers_and_spills(ptx, args.arch)}; "
                  f"{schedule(ptx)[:160]}")


if __name__ == "__main__":
    main()
