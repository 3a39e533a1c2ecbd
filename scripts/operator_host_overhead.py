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
import cs336_systems.kernels.rope as rope_module
import cs336_systems.kernels.swiglu as swiglu_module
from cs336_basics.model import RotaryEmbedding


class NoLaunch:
    """Stands for a Triton kernel, or a compiled one: `kernel[grid](...)` does nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _NoAttention(torch.autograd.Function):
    """Stands for our attention's C++ autograd node (`native_launch`, the GPU's default launcher): O and the
    gradients allocated, nothing computed or launched."""

    @staticmethod
    def forward(ctx, q, k, v):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, grad_out):
        return tuple(torch.empty_like(t) for t in ctx.saved_tensors)


def stub_launches() -> None:
    """Every launch of our fused operators (RMSNorm, SwiGLU gates, RoPE, fused AdamW) does nothing, and they take
    their CUDA path on CPU tensors (`runs_kernel`); our attention allocates its outputs only (`_NoAttention`).
    For the whole process: call it before building a model."""
    import cs336_systems.attention as attention_module
    import cs336_systems.kernels.adamw as adamw_module
    import cs336_systems.kernels.flash_attention.function as flash_function

    for module in (rmsnorm_module, swiglu_module):
        module._kernels = lambda: (NoLaunch(), NoLaunch())
        module.runs_kernel = lambda tensor: True
    swiglu_module._packed_kernel = lambda: NoLaunch()  # (the gate over the merged w1/w3 product)
    rope_module._kernel = lambda: NoLaunch()
    rope_module.runs_kernel = lambda tensor: True
    adamw_module._kernel = lambda: NoLaunch()
    adamw_module.runs_kernel = lambda tensor: True
    flash_function.flash_attention = lambda q, k, v, is_causal=False, **options: _NoAttention.apply(q, k, v)
    attention_module._triton.cache_clear()  # (it bound flash_attention when first asked)


def _torch_rope(x, cos, sin):
    """The baseline LM's RoPE (bench/baseline_lm.py): even and odd halves, rotated, interleaved back."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def _forward_backward(forward):
    """forward() and a backward of its (first) output with ones."""
    def step():
        out = forward()
        out.backward(torch.ones_like(out))
    return step


def per_call_us(fn, calls: int, repeats: int) -> list[float]:
    """us per call of `fn`, `repeats` timings of `calls` calls each, after a warm-up."""
    for _ in range(min(calls, 300)):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5000, help="calls per timing (default 5000)")
    parser.add_argument("--repeats", type=int, default=7, help="timings; the median is printed (default 7)")
    args = parser.parse_args(argv)
    if args.calls < 1 or args.repeats < 1:
        parser.error(f"--calls and --repeats must be >= 1, got {args.calls} and {args.repeats}")
    torch.set_num_threads(1)
    stub_launches()
    x = torch.randn(4, 8, 64, requires_grad=True)
    weight = torch.ones(64, requires_grad=True)
    a, b = torch.randn(4, 8, 64, requires_grad=True), torch.randn(4, 8, 64, requires_grad=True)
    # RoPE on the model's head view (batch, heads, seq, d_head), positions shared by the heads.
    heads = torch.randn(4, 8, 2, 32).transpose(1, 2).requires_grad_()
    q_heads, k_heads = (t.transpose(1, 2) for t in torch.randn(4, 8, 4, 32, requires_grad=True).split(2, dim=2))
    cache = RotaryEmbedding(context_length=16, dim=32)._freq_cis_cache
    positions = torch.arange(8)[None]
    cos, sin = cache[0, :8], cache[1, :8]
    cases = [
        ("rmsnorm forward (ours, launch stubbed)", lambda: rmsnorm_module.rmsnorm(x, weight, 1e-5)),
        ("F.rms_norm forward (torch, CPU maths)", lambda: F.rms_norm(x, (64,), weight, 1e-5)),
        ("silu_mul forward (ours, launch stubbed)", lambda: swiglu_module.silu_mul(a, b)),
        ("silu(a) * b forward (torch, CPU maths)", lambda: F.silu(a) * b),
        ("rope forward (ours, launch stubbed)", lambda: rope_module.rope(heads, positions, cache)),
        ("rope forward (torch, CPU maths)", lambda: _torch_rope(heads, cos, sin)),
        ("rmsnorm fwd+bwd (ours, launch stubbed)", _forward_backward(lambda: rmsnorm_module.rmsnorm(x, weight))),
        ("F.rms_norm fwd+bwd (torch, CPU maths)", _forward_backward(lambda: F.rms_norm(x, (64,), weight, 1e-5))),
        ("silu_mul fwd+bwd (ours, launch stubbed)", _forward_backward(lambda: swiglu_module.silu_mul(a, b))),
        ("silu(a) * b fwd+bwd (torch, CPU maths)", _forward_backward(lambda: F.silu(a) * b)),
        ("rope fwd+bwd (ours, launch stubbed)", _forward_backward(lambda: rope_module.rope(heads, positions, cache))),
        ("rope fwd+bwd (torch, CPU maths)", _forward_backward(lambda: _torch_rope(heads, cos, sin))),
        ("rope of Q and K fwd+bwd: two calls (ours)", _forward_backward(
            lambda: rope_module.rope(q_heads, positions, cache) + rope_module.rope(k_heads, positions, cache))),
        ("rope of Q and K fwd+bwd: rope_pair (ours)", _forward_backward(
            lambda: sum(rope_module.rope_pair(q_heads, k_heads, positions, cache)))),
    ]
    print(f"median us per call, {args.repeats} x {args.calls} calls, torch {torch.__version__}")
    for name, fn in cases:
        print(f"{name:44} {statistics.median(per_call_us(fn, args.calls, args.repeats)):8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
