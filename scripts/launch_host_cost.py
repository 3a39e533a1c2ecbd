"""Host time of one small-kernel launch's bookkeeping, on any machine: Triton's binder and cache key (what
`JITFunction.run` does before every launch) against a launch plan's replay (`kernels/launch_plan.launch`: its key,
lookup and address substitution), for the RMSNorm forward's arguments. Neither launches anything (a machine
without a GPU has no launcher), so both leave out the driver call they share.

    python scripts/launch_host_cost.py [--calls 20000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics

import torch
from operator_host_overhead import NoLaunch, per_call_us  # (this folder: the script's own)
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import compute_cache_key, create_function_from_signature

import cs336_systems.kernels.rmsnorm as rmsnorm_module
from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import interpreting


class _Captured:
    """The RMSNorm forward kernel as `launch_plan.launch` sees it, handing back a compiled kernel that launches
    nothing on its first launch."""

    def __init__(self, kernel):
        self.fn = kernel.fn

    def run(self, *args, grid, warmup, **kwargs):
        return NoLaunch()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000, help="calls per timing (default 20000)")
    parser.add_argument("--repeats", type=int, default=5, help="timings; median and range printed (default 5)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error(f"--calls and --repeats must be >= 1, got {args.calls} and {args.repeats}")
    if interpreting():
        parser.error("TRITON_INTERPRET=1 replaces the JIT (and its binder) by the interpreter: unset it")
    kernel, _ = rmsnorm_module._kernels()
    rows, d, block_d = 2048, 768, 1024
    x, weight, y, rstd = torch.randn(rows, d), torch.ones(d), torch.empty(rows, d), torch.empty(rows)
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    options = dict(ADD=False, BLOCK_D=block_d, num_warps=4, debug=False, instrumentation_mode="")

    def bind():
        _, specialization, bound_options = binder(x, x, weight, x, y, rstd, d, 1e-5, **options)
        compute_cache_key({}, specialization, bound_options)

    launch_plan._plans_device = lambda tensor: True  # plan CPU tensors too (this process only)
    captured = _Captured(kernel)

    def replay():
        launch_plan.launch(captured, (rows,), x, x, weight, x, y, rstd, d, 1e-5, ADD=False, BLOCK_D=block_d,
                           num_warps=4)

    print(f"us per launch, median (min-max) of {args.repeats} x {args.calls} calls, torch {torch.__version__}")
    for name, fn in (("Triton binder + cache key", bind), ("launch plan replay", replay)):
        times = per_call_us(fn, args.calls, args.repeats)
        print(f"{name:28} {statistics.median(times):6.2f} ({min(times):.2f}-{max(times):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
