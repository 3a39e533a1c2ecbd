"""Fused AdamW against cs336_basics' AdamW and torch's AdamW, 10 steps (CUDA, or CPU under the interpreter)."""

import pytest
import torch

from cs336_basics.optimizer import AdamW
from cs336_systems.kernels.adamw import FusedAdamW
from tests._support import kernel_device


def _run(make_opt, device, steps=10):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in ((37,), (5, 300), (2049,))]
    opt = make_opt(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
    return params, opt


@pytest.mark.parametrize("maths,reference", [("cs336", AdamW), ("torch", torch.optim.AdamW)])
def test_fused_adamw_matches_reference_for_ten_steps(maths, reference):
    device = kernel_device()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, opt = _run(lambda ps: FusedAdamW(ps, maths=maths, **kw), device)
    ref, _ = _run(lambda ps: reference(ps, **kw), device)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    assert opt.state[ours[0]]["t"] == 10 and set(opt.state[ours[0]]) == {"m", "v", "t"}


def test_bf16_state_stays_close_to_fp32_state():
    device = kernel_device()
    kw = dict(lr=1e-3, weight_decay=0.01)
    fp32, _ = _run(lambda ps: FusedAdamW(ps, **kw), device)
    bf16, opt = _run(lambda ps: FusedAdamW(ps, state_dtype=torch.bfloat16, **kw), device)
    assert opt.state[bf16[0]]["m"].dtype == torch.bfloat16
    for a, b in zip(fp32, bf16):
        # Each Adam step moves a weight by about lr; bf16 m and v (8 mantissa bits) perturb that move by
        # under 2%, so after 10 steps the two runs differ by at most 2% of 10 x lr.
        assert 0 < (a - b).abs().max() <= 0.02 * 10 * 1e-3


def test_bad_options():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="maths must be one of cs336, torch"):
        FusedAdamW(p, maths="adam")
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdamW(p, state_dtype=torch.float16)
