"""How far Triton's `tl.math.exp2` (ex2.approx.f32 on NVIDIA GPUs) and our polynomial exp2
(`flash_attention/exponent.py`) are from fp64, in units of fp32's epsilon relative to the result, over 65536
scores in [-30, 0] (the range P's exponent takes in FlashAttention). Diagnoses the fp32 backward's dV error
(notes/flash_attention.md, fuzz case 8).

    python scripts/exp2_accuracy.py            # on the GPU
    TRITON_INTERPRET=1 python scripts/exp2_accuracy.py --device cpu
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.flash_attention.exponent import exp2_polynomial


@triton.jit
def _both_kernel(X, Approx, Polynomial, N: tl.constexpr):
    offsets = tl.arange(0, N)
    x = tl.load(X + offsets)
    tl.store(Approx + offsets, tl.math.exp2(x))
    tl.store(Polynomial + offsets, exp2_polynomial(x))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    n = 1 << 16
    torch.manual_seed(0)
    x = (-torch.rand(n, dtype=torch.float32) * 30).to(args.device)
    approx, polynomial = torch.empty_like(x), torch.empty_like(x)
    _both_kernel[(1,)](x, approx, polynomial, n)
    exact = torch.exp2(x.double())
    eps = torch.finfo(torch.float32).eps
    for name, values in (("tl.math.exp2", approx), ("polynomial", polynomial), ("torch.exp2", torch.exp2(x))):
        error = ((values.double() - exact).abs() / (eps * exact)).cpu()
        print(f"{name:<18} max {error.max().item():.3f} eps, mean {error.mean().item():.3f} eps")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
