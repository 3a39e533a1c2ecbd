"""The Python-side host time of our fused operators, per call, with their Triton launches stubbed out.

On a GPU a small model's step is host-bound (notes/model_sizes.md): the time between kernels is our operators'
Python (validation, the autograd Function, allocation, launch arguments) plus Triton's launcher. This times the
first part on any machine, CPU included: each operator's kernels are replaced by a launcher that does nothing, and
`runs_kernel` reports True, so the CUDA code path runs its Python on small CPU tensors. Beside each, the torch
expression the baseline runs (its real CPU maths, so an upper bound on its host time).

    python scripts/operator_host_overhead.py                 # median us per call of 7 x 5000 calls
    python scripts/operator_host_overhead.py --calls 2000 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import cs336_systems.kernels.rmsnorm as rmsnorm_module
import cs336_systems.kernels.swiglu as swiglu_module


class _NoLaunch:
    """Stands for a Triton kernel: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _stub_launches() -> None:
    for module in (rmsnorm_module, swiglu_module):
        module._kernels = lambda: (_NoLaunch(), _NoLaunch())
        module.runs_kernel = lambda tensor: True


def _per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(min(calls, 300)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000, help="calls per timing (default 5000)")
    parser.add_argument("--repeats", type=int, default=7, help="timings; the median is printed (default 7)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error(f"--calls and --repeats must be >= 1, got {args.calls} and {args.repeats}")
    torch.set_num_threads(1)
    _stub_launches()
    x = torch.randn(4, 8, 64, requires_grad=True)
    weight = torch.ones(64, requires_grad=True)
    a, b = torch.randn(4, 8, 64, requires_grad=True), torch.randn(4, 8, 64, requires_grad=True)
    cases = [
        ("rmsnorm forward (ours, launch stubbed)", lambda: rmsnorm_module.rmsnorm(x, weight, 1e-5)),
        ("F.rms_norm forward (torch, CPU maths)", lambda: F.rms_norm(x, (64,), weight, 1e-5)),
        ("silu_mul forward (ours, launch stubbed)", lambda: swiglu_module.silu_mul(a, b)),
        ("silu(a) * b forward (torch, CPU maths)", lambda: F.silu(a) * b),
    ]
    print(f"median us per call, {args.repeats} x {args.calls} calls, torch {torch.__version__}")
    for name, fn in cases:
        print(f"{name:42} {_per_call_us(fn, args.calls, args.repeats):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
