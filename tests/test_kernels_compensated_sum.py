"""add_compensated, the fp32 backward's accumulation (kernels/flash_attention/backward.py), against fp64 sums
(CUDA, or CPU under the interpreter)."""

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.flash_attention.backward import add_compensated
from tests._support import kernel_device


@triton.jit
def _running_sums(X, PLAIN, COMPENSATED, n_tiles, BLOCK: tl.constexpr):
    """Sum n_tiles rows of X (n_tiles, BLOCK) column by column, plainly and compensated."""
    offs = tl.arange(0, BLOCK)
    plain = tl.zeros((BLOCK,), dtype=tl.float32)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    error = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(n_tiles):
        x = tl.load(X + i * BLOCK + offs)
        plain += x
        total, error = add_compensated(total, error, x)
    tl.store(PLAIN + offs, plain)
    tl.store(COMPENSATED + offs, total - error)


def test_compensated_sum_does_not_grow_its_rounding_with_the_tile_count():
    """4096 positive fp32 terms per column: a plain running sum rounds at the size of the sum each step, so its
    error grows with the count; the compensated sum stays within an ulp or two of the exact one."""
    device = kernel_device()
    torch.manual_seed(0)
    n_tiles, block = 4096, 32
    x = torch.rand(n_tiles, block, device=device) + 0.5
    plain, compensated = (torch.empty(block, device=device) for _ in range(2))
    _running_sums[(1,)](x, plain, compensated, n_tiles, BLOCK=block)
    exact = x.double().sum(0)
    ulp = torch.finfo(torch.float32).eps * exact
    compensated_error = ((compensated.double() - exact).abs() / ulp).max().item()
    plain_error = ((plain.double() - exact).abs() / ulp).max().item()
    assert compensated_error <= 2, f"compensated: {compensated_error:.2f} ulps"
    assert plain_error > 4 * max(compensated_error, 0.5), (plain_error, compensated_error)
