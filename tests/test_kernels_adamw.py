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


def test_multi_tensor_launch_matches_per_tensor_launches_exactly():
    device = kernel_device()
    kw = dict(lr=1e-2, weight_decay=0.1, maths="torch")
    multi, opt = _run(lambda ps: FusedAdamW(ps, **kw), device)
    single, _ = _run(lambda ps: FusedAdamW(ps, multi_tensor=False, **kw), device)
    for a, b in zip(multi, single):
        assert torch.equal(a, b)
    assert len(opt._tables_cache) == 1  # the tensors never change: one cached set of launch tables


def test_multi_tensor_with_mixed_dtypes_and_missing_gradients():
    device = kernel_device()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, device=device)),
              torch.nn.Parameter(torch.randn(70, device=device).to(torch.bfloat16)),
              torch.nn.Parameter(torch.randn(5, device=device))]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdamW(params, lr=1e-2, maths="torch")
    ref = FusedAdamW(copies, lr=1e-2, maths="torch", multi_tensor=False)
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, copies)):
            has_grad = not (i == 2 and step == 1)  # one parameter skips a step: its t falls behind
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(device, p.dtype)
            p.grad, q.grad = (g.clone(), g.clone()) if has_grad else (None, None)
        ours.step()
        ref.step()
    assert ours.state[params[2]]["t"] == 2 and ours.state[params[0]]["t"] == 3
    for p, q in zip(params, copies):
        assert torch.equal(p, q)


def test_gradient_table_is_copied_to_the_device_only_for_new_addresses(monkeypatch):
    """Steps whose gradients sit at the addresses of an earlier step reuse its table (no host-to-device copy);
    gradients at new addresses get a new table, and the update follows them."""
    import cs336_systems.kernels.adamw as adamw

    device = kernel_device()
    built = []
    real = adamw._addresses
    monkeypatch.setattr(adamw, "_addresses", lambda tensors, dev: built.append(len(tensors)) or real(tensors, dev))
    starts = [torch.randn(n, device=device) for n in (3, 1500)]
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = FusedAdamW(params, lr=0.1)
    grads = [torch.ones_like(p) for p in params]
    for _ in range(3):  # the same gradient tensors each step
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    assert len(built) == 3 + 1  # p, m, v tables once, and one gradient table
    for p in params:
        p.grad = -torch.ones_like(p)  # new tensors, new addresses: a new table, and the step uses them
    optimizer.step()
    assert len(built) == 5
    # the same four steps without a table: per tensor, the addresses passed fresh each launch
    monkeypatch.setattr(FusedAdamW, "_gradient_table", lambda self, ps: real([p.grad for p in ps], ps[0].device))
    fresh = [torch.nn.Parameter(p0) for p0 in starts]
    plain = FusedAdamW(fresh, lr=0.1)
    for sign in (1, 1, 1, -1):
        for p in fresh:
            p.grad = sign * torch.ones_like(p)
        plain.step()
    for ours, expected in zip(params, fresh):
        assert torch.equal(ours.detach(), expected.detach())
