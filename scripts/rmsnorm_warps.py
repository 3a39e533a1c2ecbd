"""How fast our RMSNorm kernels move bytes at the model's row widths, by warps per program (GPU only).

The model suite's profiles put RMSNorm at about 60 % of the HBM bandwidth at large/2048 (notes/model_sizes.md), the
SwiGLU gate near it. This times the forward and backward, plain and with the residual add fused
(`kernels.rmsnorm.add_rmsnorm`, an fp32 stream and a bf16 delta as under autocast), at each width the presets use
and 8192 rows (batch 4 x context 2048), for each warp count, and prints the achieved GB/s (bytes the kernel must
read and write / median time, `triton.testing.do_bench`) beside the launcher's own choice. A measurement to pick the
warp rule from, not a test. Then the fused backward by its number of programs (`DW_PROGRAMS`).

    python scripts/rmsnorm_warps.py                       # widths 1024, 1280, 2560; warps 2..16
    python scripts/rmsnorm_warps.py --rows 2048 --widths 768 --warps 4,8
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from cs336_systems.kernels import rmsnorm


def _bytes(kind: str, rows: int, d: int) -> int:
    """What the pass must move: fp32 stream (4 B), bf16 norm output and delta (2 B), fp32 rstd per row."""
    per_element = {"forward": 4 + 2, "backward": 4 + 2 + 4, "add forward": 4 + 2 + 4 + 2,
                   "add backward": 4 + 2 + 4 + 4 + 2}[kind]
    return rows * d * per_element + rows * 4


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=8192, help="rows (tokens) per call (default 8192)")
    parser.add_argument("--widths", default="1024,1280,2560",
                        help="comma-separated row widths (default 1024,1280,2560)")
    parser.add_argument("--warps", default="2,4,8,16", help="comma-separated warps per program (default 2,4,8,16)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    widths = [int(w) for w in args.widths.split(",")]
    warps = [int(w) for w in args.warps.split(",")]
    if args.rows < 1 or not all(w > 0 for w in widths) or not all(w in (1, 2, 4, 8, 16, 32) for w in warps):
        parser.error(f"--rows must be >= 1, --widths positive, --warps powers of two up to 32; got {args.rows}, "
                     f"{args.widths}, {args.warps}")
    from triton.testing import do_bench

    default_rule = rmsnorm._num_warps
    print(f"{torch.cuda.get_device_name()}, {args.rows} rows; GB/s by warps (* the launcher's choice)")
    for d in widths:
        x = torch.randn(args.rows, d, device="cuda")
        delta = torch.randn(args.rows, d, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(d, device="cuda") + 0.5
        dy = torch.randn(args.rows, d, device="cuda", dtype=torch.bfloat16)
        rstd = rmsnorm._forward(x, w, 1e-5)[2]
        calls = {
            "forward": partial(rmsnorm._forward, x, w, 1e-5, out_dtype=torch.bfloat16),
            "backward": partial(rmsnorm._backward, dy, x, w, rstd),
            "add forward": partial(rmsnorm._forward, x, w, 1e-5, out_dtype=torch.bfloat16, delta2d=delta),
            "add backward": partial(rmsnorm._backward, dy, x, w, rstd, grad_h2d=x, second_dtype=torch.bfloat16),
        }
        chosen = default_rule(rmsnorm._block_d(d))
        for kind, call in calls.items():
            cells = []
            for n in warps:
                rmsnorm._num_warps = lambda block_d, n=n: n
                try:
                    ms = do_bench(call, warmup=25, rep=200, return_mode="median")
                finally:
                    rmsnorm._num_warps = default_rule
                cells.append(f"{n}{'*' if n == chosen else ''}: {_bytes(kind, args.rows, d) / ms / 1e6:6.0f}")
            print(f"width {d:5d} {kind:12s} " + "  ".join(cells))
        # the backward's programs (each a strided set of rows and one partial dW row), at the launcher's warps
        cells = []
        for programs in (132, 256, 528, 1056):
            default_programs, rmsnorm.DW_PROGRAMS = rmsnorm.DW_PROGRAMS, programs
            try:
                ms = do_bench(calls["add backward"], warmup=25, rep=200, return_mode="median")
            finally:
                rmsnorm.DW_PROGRAMS = default_programs
            mark = "*" if programs == default_programs else ""
            cells.append(f"{programs}{mark}: {_bytes('add backward', args.rows, d) / ms / 1e6:6.0f}")
        print(f"width {d:5d} add backward by programs " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
