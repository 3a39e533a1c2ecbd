"""cs336_basics.optimizer: AdamW against a textbook re-statement and torch.optim.AdamW; the cosine schedule."""

import math

import pytest
import torch

from cs336_basics.optimizer import AdamW, get_cosine_lr


def _textbook_adamw(p, grads, lr, betas, eps, wd):
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * wd * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        p = p - lr * math.sqrt(1 - betas[1] ** t) / (1 - betas[0] ** t) * m / (v.sqrt() + eps)
    return p, m, v


def test_adamw_matches_textbook_for_ten_steps():
    torch.manual_seed(0)
    init = torch.randn(6, 4, dtype=torch.float64)
    grads = [torch.randn(6, 4, dtype=torch.float64) for _ in range(10)]
    p = torch.nn.Parameter(init.clone())
    opt = AdamW([p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    ref, m, v = _textbook_adamw(init, grads, 0.01, (0.8, 0.95), 1e-6, 0.1)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-12, atol=1e-12)
    state = opt.state[p]
    assert set(state) == {"m", "v", "t"} and state["t"] == 10
    torch.testing.assert_close(state["m"], m)
    torch.testing.assert_close(state["v"], v)


def test_adamw_agrees_with_torch_adamw():
    """torch's AdamW puts eps outside the bias correction; with tiny eps the two agree closely."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    twin = torch.nn.Linear(8, 3)
    twin.load_state_dict(model.state_dict())
    ours = AdamW(model.parameters(), lr=1e-2, weight_decay=0.05, eps=1e-12)
    theirs = torch.optim.AdamW(twin.parameters(), lr=1e-2, weight_decay=0.05, eps=1e-12)
    for _ in range(10):
        x = torch.randn(16, 8)
        for m, opt in ((model, ours), (twin, theirs)):
            opt.zero_grad()
            m(x).pow(2).mean().backward()
            opt.step()
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_adamw_skips_params_without_grad_and_supports_closure():
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = AdamW([a, b], lr=0.1)
    a.grad = torch.ones(2)
    loss = opt.step(closure=lambda: 3.0)
    assert loss == 3.0
    assert not torch.equal(a, torch.ones(2)) and torch.equal(b, torch.ones(2)) and b not in opt.state


@pytest.mark.parametrize("kwargs,name", [(dict(lr=-1), "lr"), (dict(betas=(1.0, 0.9)), "betas"),
                                         (dict(eps=0), "eps"), (dict(weight_decay=-0.1), "weight_decay")])
def test_adamw_rejects_bad_hyperparameters(kwargs, name):
    with pytest.raises(ValueError, match=name):
        AdamW([torch.nn.Parameter(torch.ones(1))], **kwargs)


def test_cosine_schedule_shape():
    kw = dict(max_learning_rate=1.0, min_learning_rate=0.1, warmup_iters=10, cosine_cycle_iters=110)
    assert get_cosine_lr(0, **kw) == 0.0
    assert get_cosine_lr(5, **kw) == pytest.approx(0.5)
    assert get_cosine_lr(10, **kw) == pytest.approx(1.0)
    assert get_cosine_lr(60, **kw) == pytest.approx(0.55)  # half-way: mean of max and min
    assert get_cosine_lr(110, **kw) == pytest.approx(0.1)
    assert get_cosine_lr(500, **kw) == 0.1
    lrs = [get_cosine_lr(i, **kw) for i in range(10, 111)]
    assert all(x >= y for x, y in zip(lrs, lrs[1:]))
