"""Where an fp32 fuzz case's dV error comes from on the GPU (issue 33, case 8): the kernels' own row statistics and
dV against fp64, and dV rebuilt from fp64 with one of the kernel's ingredients at a time.

The backward runs its launches one by one (`dispatch._backward_launches`), so the row statistics the passes read
(m and 1 / l of the log2-domain scores) can be compared with fp64's. Then dV = P^T dO is formed in fp64 from
  stats  P from fp64 scores with the kernel's m and 1 / l  (the row statistics' share of the error);
  round  the exact P rounded to fp32                     (storing P in fp32 at all);
  scores P from fp32 scores (torch on this GPU, IEEE), exact exponent, the kernel's m and 1 / l;
and the kernel's dV pass is rerun with each listed tile config (`--configs`). Printed: each dV's max error, PyTorch's
own (the fuzz budget's base), where ours peaks (key, column, |dV| there) and the error per 32-key block.

    python scripts/flash_dv_probe.py --case 8
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' fuzz cases
from tests._support import error_and_budget  # noqa: E402
from tests.test_kernels_flash_fuzz import CASES, fuzz_inputs  # noqa: E402


def _config(text: str) -> tuple[int, int, int, int]:
    try:
        block_m, block_n, warps, stages = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--configs: {text!r} is not MxNxWARPSxSTAGES, e.g. 32x32x16x2") from None
    return block_m, block_n, warps, stages


def _synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", type=int, default=8, help=f"fuzz case, 0-{len(CASES) - 1} (default 8)")
    parser.add_argument("--configs", type=lambda s: [_config(c) for c in s.split(",")],
                        default=[_config(c) for c in "32x32x16x2,32x32x4x2,16x32x8x2,32x64x8x2,64x64x16x2".split(",")],
                        help="dK/dV tile configs to rerun, MxNxWARPSxSTAGES comma-separated")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (with TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if not 0 <= args.case < len(CASES):
        parser.error(f"--case: {args.case} is outside 0-{len(CASES) - 1}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no GPU here (use --device cpu with TRITON_INTERPRET=1)")
    from cs336_systems.kernels.flash_attention import dispatch
    from cs336_systems.kernels.flash_attention.reference import naive_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    (batch, heads, n_queries, n_keys, d), causal = CASES[args.case]
    q, k, v, grad_out = (t.detach() for t in fuzz_inputs(args.case, torch.float32, args.device))

    out, lse = dispatch.flash_forward(q, k, v, causal)
    choice = dispatch.choose_backward(q, k, v, grad_out, dispatch.BackwardOptions())
    launches, buffers = dispatch._backward_launches(q, k, v, out, lse, grad_out, causal, choice)
    for launch in launches:
        if launch is not None:
            launch()
    _synchronize(args.device)
    print(f"case {args.case}: shape {(batch, heads, n_queries, n_keys, d)} causal {causal}; kernels {choice.kernels}")
    if "row_max" not in buffers:
        print("this dtype / precision has no row statistics pass (P from L): nothing to probe")
        return 0

    q64, k64, v64, do64 = (t.double() for t in (q, k, v, grad_out))
    exact_in = [t.clone().requires_grad_() for t in (q64, k64, v64)]
    dv_exact = torch.autograd.grad(naive_attention(*exact_in, causal), exact_in[2], do64)[0]
    low_in = [t.clone().requires_grad_() for t in (q, k, v)]
    dv_torch = torch.autograd.grad(naive_attention(*low_in, causal, upcast=False), low_in[2], grad_out)[0]

    scale = math.log2(math.e) / math.sqrt(d)  # log2-domain scores, as the kernels form them
    s64 = q64 @ k64.transpose(-1, -2) * scale
    if causal:
        s64 = s64.masked_fill(torch.ones_like(s64, dtype=torch.bool).triu(1), float("-inf"))
    m64 = s64.amax(-1)
    e64 = torch.exp2(s64 - m64[..., None])
    l64 = e64.sum(-1)
    p64 = e64 / l64[..., None]
    row_max = buffers["row_max"].view(m64.shape).double()
    inv_sum = buffers["row_inv_sum"].view(m64.shape).double()
    eps = torch.finfo(torch.float32).eps
    print(f"row max m: max |m - m64| {(row_max - m64).abs().max().item():.3e} (log2 units; m64 up to "
          f"{m64.abs().max().item():.2f})")
    print(f"1 / l: max relative error {((inv_sum * l64) - 1).abs().max().item() / eps:.2f} eps, mean "
          f"{((inv_sum * l64) - 1).abs().mean().item() / eps:.2f} eps")

    s32 = (q @ k.transpose(-1, -2)).double() * torch.tensor(scale, dtype=torch.float32).item()  # fp32 dot, fp32 scale
    s32 = s32.float().double()  # the product with the scale rounded to fp32, as the kernel's
    if causal:
        s32 = s32.masked_fill(torch.isinf(s64), float("-inf"))
    candidates = {
        "ours": buffers["dv"].double(),
        "torch": dv_torch.double(),
        "stats": (torch.exp2(s64 - row_max[..., None]) * inv_sum[..., None]).transpose(-1, -2) @ do64,
        "round": p64.float().double().transpose(-1, -2) @ do64,
        "scores": (torch.exp2((s32 - row_max[..., None]).float().double()) * inv_sum[..., None]
                   ).float().double().transpose(-1, -2) @ do64,
    }
    torch_error = (dv_torch.double() - dv_exact).abs().max().item()
    for name, dv in candidates.items():
        error = (dv - dv_exact).abs()
        print(f"dV {name:<7} max error {error.max().item():.3e}  ({error.max().item() / torch_error:.2f}x PyTorch's)")
    ours, budget = error_and_budget(buffers["dv"], dv_exact, dv_torch)
    print(f"budget {budget:.3e}: ours / budget {ours / budget:.2f}")
    error = (buffers["dv"].double() - dv_exact).abs().reshape(-1, n_keys, d)
    flat = int(error.argmax())
    key, column = divmod(flat % (n_keys * d), d)
    print(f"ours peaks at key {key}, column {column}: |dV| there {dv_exact.reshape(-1, n_keys, d).flatten()[flat]:.3f}"
          f", |dV| max {dv_exact.abs().max().item():.3f}")
    per_block = [f"{error[:, start:start + 32].max().item():.2e}" for start in range(0, n_keys, 32)]
    print("error per 32-key block:", " ".join(per_block))

    dkdv = launches[1]
    for config in args.configs:
        if not hasattr(dkdv, "with_config"):
            break
        buffers["dv"].zero_()
        try:
            dkdv.with_config(*config)()
            _synchronize(args.device)
        except Exception as failure:  # a config that does not fit this head dim is a row, not the end
            print(f"config {'x'.join(map(str, config))}: {type(failure).__name__}: {str(failure)[:120]}")
            continue
        config_error = (buffers["dv"].double() - dv_exact).abs().max().item()
        print(f"config {'x'.join(map(str, config)):<12} dV max error {config_error:.3e} "
              f"({config_error / budget:.2f} of the budget)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
