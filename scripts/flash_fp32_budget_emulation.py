"""How far FA2's fp32 rounding sits from PyTorch's, emulated in torch (fp32, CPU) over the fuzz test's 200 shapes.

Four designs of the fp32 attention, each output and gradient against fp64, counted where it exceeds the fuzz's
budget (2x PyTorch's own fp32 error plus its floor; `tests/test_kernels_flash_fuzz.py`):
- from-l: the kernels before the row statistics pass: an online-softmax forward over key tiles saving L, P
  recomputed as exp2(s c - L log2 e), D = rowsum(O dO);
- dpd: the same with D = rowsum(P dP) (what the PyTorch FA2 class does in fp32);
- rows: the kernels' fp32-accurate backward (`backward.flash_row_stats_kernel`): the same forward; a backward pass of
  its own forms each row's max m and sum l online over key tiles, P = exp2(s c - m) / l, and D = rowsum(P dP);
- split: an exact statistics sweep (row max m2 and log2 l of the log2-domain scores), P = exp2((s c - m2) - log2 l)
  in the forward's second sweep and in the backward, D = rowsum(P dP).
Rows of one key (dQ, dK exactly zero) are left out: the kernels zero them explicitly. An emulation, not the kernels:
its products are torch's CPU matmuls of whole rows, where the kernels' are tiles (under Triton's interpreter,
numpy's sgemm of zero-padded tiles, which rounds worse: `tests/test_kernels_flash_fuzz.py` says how much).

    python scripts/flash_fp32_budget_emulation.py
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the fuzz test's shapes and error measure

from cs336_systems.kernels.flash_attention.reference import naive_attention  # noqa: E402
from tests._support import max_abs_error  # noqa: E402
from tests.test_kernels_flash_fuzz import CASES  # noqa: E402

LOG2E = 1.4426950408889634
VARIANTS = ("from-l", "dpd", "rows", "split")


def _online_forward(s2: torch.Tensor, v: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """O and L (natural log) of log2-domain scores by the kernels' online softmax over key tiles."""
    row_max = torch.full(s2.shape[:-1] + (1,), float("-inf"))
    row_sum = torch.zeros_like(row_max)
    acc = torch.zeros(s2.shape[:-1] + (v.shape[-1],))
    for start in range(0, s2.shape[-1], block_n):
        tile = s2[..., start:start + block_n]
        new_max = torch.maximum(row_max, tile.amax(-1, keepdim=True))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        alpha, p = torch.exp2(row_max - safe_max), torch.exp2(tile - safe_max)
        row_sum = row_sum * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ v[..., start:start + block_n, :]
        row_max = new_max
    return acc / row_sum, (row_max + torch.log2(row_sum)) / LOG2E


def _online_statistics(s2: torch.Tensor, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's max and sum of exp2(s2 - max), formed online over key tiles as the row statistics pass forms them."""
    row_max = torch.full(s2.shape[:-1] + (1,), float("-inf"))
    row_sum = torch.zeros_like(row_max)
    for start in range(0, s2.shape[-1], block_n):
        tile = s2[..., start:start + block_n]
        new_max = torch.maximum(row_max, tile.amax(-1, keepdim=True))
        row_sum = row_sum * torch.exp2(row_max - new_max) + torch.exp2(tile - new_max).sum(-1, keepdim=True)
        row_max = new_max
    return row_max, row_sum


def fa2(q, k, v, do, causal: bool, variant: str, block_n: int):
    """(O, dQ, dK, dV) in fp32 by one of VARIANTS (the module docstring)."""
    head_dim = q.shape[-1]
    s2 = (q @ k.transpose(-1, -2)) * torch.tensor(LOG2E / math.sqrt(head_dim))  # log2-domain scores
    if causal:
        keep = torch.arange(q.shape[-2])[:, None] >= torch.arange(k.shape[-2])[None, :]
        s2 = s2.masked_fill(~keep, float("-inf"))
    if variant in ("from-l", "dpd"):
        out, lse = _online_forward(s2, v, block_n)
        p = torch.exp2(s2 - lse * LOG2E)
    elif variant == "rows":
        out, _ = _online_forward(s2, v, block_n)
        row_max, row_sum = _online_statistics(s2, block_n)
        p = torch.exp2(s2 - row_max) * (1.0 / row_sum)
    else:
        row_max = s2.amax(-1, keepdim=True)
        row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
        log2_sum = torch.log2(torch.exp2(s2 - row_max).sum(-1, keepdim=True))
        p = torch.exp2((s2 - row_max) - log2_sum)
        out = p @ v
    dp = do @ v.transpose(-1, -2)
    delta = (out * do if variant == "from-l" else p * dp).sum(-1, keepdim=True)
    ds = p * (dp - delta) / math.sqrt(head_dim)
    return out, ds @ k, ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ do


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--block-n", type=int, default=16, help="key tile of the online forward (default 16)")
    args = parser.parse_args(argv)
    if args.block_n < 1:
        parser.error(f"--block-n must be >= 1, got {args.block_n}")
    for variant in VARIANTS:
        over = []
        for i, ((batch, heads, nq, nk, d), causal) in enumerate(CASES):
            torch.manual_seed(i)
            lead = (batch,) if heads is None else (batch, heads)
            q, k, v = (torch.randn(*lead, n, d) for n in (nq, nk, nk))
            do = torch.randn(*lead, nq, d)
            exact_in = [t.double().requires_grad_() for t in (q, k, v)]
            exact = naive_attention(*exact_in, causal)
            exact_grads = torch.autograd.grad(exact, exact_in, do.double())
            low_in = [t.clone().requires_grad_() for t in (q, k, v)]
            low = naive_attention(*low_in, causal, upcast=False)
            low_grads = torch.autograd.grad(low, low_in, do)
            mine = fa2(q, k, v, do, causal, variant, args.block_n)
            for name, got, want, torch_low in zip(("out", "dq", "dk", "dv"), mine, (exact, *exact_grads),
                                                  (low, *low_grads)):
                floor = 2 * torch.finfo(torch.float32).eps * max(1.0, want.abs().max().item())
                ratio = max_abs_error(got, want) / (2 * max_abs_error(torch_low, want) + floor)
                if ratio > 1 and not (nk == 1 and name in ("dq", "dk")):
                    over.append(f"{i}:{name} {ratio:.2f}")
        print(f"{variant:7} {len(over):3} over budget  {', '.join(over[:12])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
