"""cs336_basics.nn_utils against torch.nn.functional and torch.nn.utils."""

import pytest
import torch
import torch.nn.functional as F

from cs336_basics.nn_utils import clip_gradient, cross_entropy, log_softmax, softmax


@pytest.mark.parametrize("dim", [0, -1, 1])
def test_softmax_and_log_softmax_match_torch(dim):
    torch.manual_seed(0)
    x = torch.randn(4, 7, 5) * 10
    torch.testing.assert_close(softmax(x, dim), F.softmax(x, dim))
    torch.testing.assert_close(log_softmax(x, dim), F.log_softmax(x, dim))


def test_softmax_is_stable_for_huge_logits():
    x = torch.tensor([[1000.0, 1000.0, -1000.0]])
    torch.testing.assert_close(softmax(x), torch.tensor([[0.5, 0.5, 0.0]]))
    assert torch.isfinite(log_softmax(x)[0, :2]).all()


def test_cross_entropy_matches_torch_over_leading_dims():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11) * 5
    targets = torch.randint(0, 11, (3, 5))
    torch.testing.assert_close(cross_entropy(logits, targets), F.cross_entropy(logits.view(-1, 11), targets.view(-1)))
    big = logits * 1000
    assert torch.isfinite(cross_entropy(big, targets))


def test_cross_entropy_bad_input():
    with pytest.raises(ValueError, match="leading shape"):
        cross_entropy(torch.randn(4, 10), torch.zeros(5, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        cross_entropy(torch.randn(4, 10), torch.zeros(4))


def test_clip_gradient_matches_clip_grad_norm():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        g = torch.randn_like(p) * 10
        p.grad, t.grad = g.clone(), g.clone()
    frozen = torch.nn.Parameter(torch.randn(2), requires_grad=False)  # grad None: skipped
    clip_gradient(params + [frozen], max_norm=1.0)
    torch.nn.utils.clip_grad_norm_(twins, max_norm=1.0)  # also max_norm / (norm + 1e-6)
    for p, t in zip(params, twins):
        torch.testing.assert_close(p.grad, t.grad, rtol=1e-5, atol=1e-6)
    norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
    assert norm <= 1.0 + 1e-5


def test_clip_gradient_leaves_small_gradients():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 0.1)
    clip_gradient([p], max_norm=5.0)
    torch.testing.assert_close(p.grad, torch.full((4,), 0.1))
    with pytest.raises(ValueError, match="max_norm"):
        clip_gradient([p], 0.0)
