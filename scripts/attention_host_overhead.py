"""Where the host time of one small attention call goes (a diagnostic for the flash sweep's short sequences).

At seq 128 the GPU work of an attention call is a few microseconds, so do_bench measures how fast the host
issues it. This prints, for our Triton FlashAttention (with and without launch plans,
`kernels/launch_plan.py`, and replayed from C++, `native_launch.py`) and SDPA's flash and cuDNN
backends, the wall time per call of
forward (no grad), forward (grad enabled, graph built) and forward+backward, each averaged over many calls
with one synchronisation at the end, and the GPU's kernel time per forward+backward (torch.profiler); then
the backward's parts, Triton's own launch cost as a control, and cProfile's top entries for our forward
and backward.

    python scripts/attention_host_overhead.py [--seq 128] [--d 64] [--calls 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cs336_systems.kernels.flash_attention.dispatch import flash_backward, flash_forward
from cs336_systems.kernels.flash_attention.function import FlashAttentionTriton, flash_attention
from cs336_systems.profiling.timing import kernel_time_ms


def per_call_us(fn, calls: int) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


@triton.jit
def _copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


@triton.jit
def _copy_kernel_many_args(src, dst, n, a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15,
                           a16, a17, a18, a19, a20, a21, a22, a23, a24, a25, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def triton_launch_floor(calls: int) -> dict[str, float]:
    """Triton's own launch cost on this host, as controls: a 3-argument kernel and one with 29 arguments
    (our kernels take about 30), each launched through `JITFunction.run`."""
    src = torch.randn(1024, device="cuda")
    dst = torch.empty_like(src)
    extra = [1024 * (i + 1) for i in range(26)]
    return {"3-arg kernel": per_call_us(lambda: _copy_kernel[(1,)](src, dst, 1024, BLOCK=1024), calls),
            "29-arg kernel": per_call_us(lambda: _copy_kernel_many_args[(1,)](src, dst, 1024, *extra, BLOCK=1024),
                                         calls)}


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


def backward_gaps(q, k, v, grad_out, calls: int) -> dict[str, float]:
    """Where a fresh graph's backward spends its host time: from .backward() to our Function's backward
    starting (autograd engine, its device thread), inside it, and from its end to .backward() returning."""
    marks = {}
    original = FlashAttentionTriton.backward

    def timed_backward(ctx, grad):
        marks["enter"] = time.perf_counter()
        grads = original(ctx, grad)
        marks["exit"] = time.perf_counter()
        return grads

    gaps = {"fwd": 0.0, "engine -> our backward": 0.0, "our backward": 0.0, "our backward -> return": 0.0}
    FlashAttentionTriton.backward = staticmethod(timed_backward)
    try:
        for step in range(calls + 10):
            for t in (q, k, v):
                t.grad = None
            start = time.perf_counter()
            out = flash_attention(q, k, v, True, launcher="python")  # the Function whose backward is timed
            called = time.perf_counter()
            out.backward(grad_out)
            returned = time.perf_counter()
            if step >= 10:
                for key, value in zip(gaps, (called - start, marks["enter"] - called, marks["exit"] - marks["enter"],
                                             returned - marks["exit"])):
                    gaps[key] += value * 1e6 / calls
    finally:
        FlashAttentionTriton.backward = staticmethod(original)
    torch.cuda.synchronize()
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--out", default=None, help="also write the report to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_host_overhead: needs a CUDA device")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cs336_systems.kernels import launch_plan

    q, k, v = (torch.randn(1, 1, args.seq, args.d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    grad_out = torch.randn_like(q)

    def sdpa(backend):
        def attend():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return attend

    attention = {
        "triton, plans off": lambda: flash_attention(q, k, v, True, launcher="python"),
        "triton python": lambda: flash_attention(q, k, v, True, launcher="python"),
        "triton native": lambda: flash_attention(q, k, v, True, launcher="native"),  # (the default)
        "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
    }
    from cs336_systems.kernels.flash_attention import native_launch

    if native_launch.load_module() is None:
        del attention["triton native"]
    lines = [f"seq {args.seq}, d {args.d}, bf16, causal, 1 x 1 heads; microseconds per call, wall (one sync per "
             f"{args.calls} calls) and GPU (kernel time per call, torch.profiler); 'plans off': every call through "
             f"the normal launch path (launch_plan.use_plans(False))"]
    for name, attend in attention.items():
        launch_plan.use_plans(name != "triton, plans off")

        def forward_no_grad(attend=attend):
            with torch.no_grad():
                attend()

        def forward_backward(attend=attend):
            for t in (q, k, v):
                t.grad = None
            attend().backward(grad_out)

        timings = {"fwd no-grad": per_call_us(forward_no_grad, args.calls),
                   "fwd grad": per_call_us(attend, args.calls),
                   "fwd+bwd": per_call_us(forward_backward, args.calls),
                   "GPU fwd+bwd": kernel_time_ms(forward_backward, calls=50) * 1e3}
        lines.append(f"{name:>18}: " + ", ".join(f"{key} {value:7.1f}" for key, value in timings.items()))
    # The backward's parts, timed the same way: the launcher called directly, a backward through a retained
    # graph, and, as a control, a Python autograd Function that does one elementwise op each way.
    out, lse = flash_forward(q.detach(), k.detach(), v.detach(), True)
    retained = flash_attention(q, k, v, True, launcher="python")
    x = torch.randn(16, device="cuda", requires_grad=True)
    parts = {"flash_backward direct": lambda: flash_backward(q, k, v, out, lse, grad_out, True),
             "bwd, retained graph": lambda: retained.backward(grad_out, retain_graph=True),
             "control Function fwd+bwd": lambda: _Scale.apply(x).sum().backward()}
    for plans in (False, True):
        launch_plan.use_plans(plans)
        label = "plans on" if plans else "plans off"
        lines.append(f"{label:>18}: " + ", ".join(f"{key} {per_call_us(fn, args.calls):7.1f}"
                                                   for key, fn in parts.items()))
        lines.append(f"{label:>18}, one fwd+bwd split by timestamps (us, mean): " + ", ".join(
            f"{key} {value:7.1f}" for key, value in backward_gaps(q, k, v, grad_out, args.calls).items()))
    lines.append("           control: " + ", ".join(f"{key} {value:7.1f}" for key, value in
                                                    triton_launch_floor(args.calls).items()))
    # cProfile sees only this thread and autograd runs the backward in its own, so the two halves are
    # profiled as direct calls: the forward with grad enabled, and the backward launcher itself.
    halves = {"forward (autograd Function, grad enabled)": lambda: flash_attention(q, k, v, True, launcher="python"),
              "backward (flash_backward, direct)": parts["flash_backward direct"]}
    for title, half in halves.items():
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.calls):
            half()
        torch.cuda.synchronize()
        profiler.disable()
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(18)
        lines.append(f"\ncProfile (plans on) of {args.calls} calls of the {title}, by own time:\n{stream.getvalue()}")
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(report)


if __name__ == "__main__":
    main()
