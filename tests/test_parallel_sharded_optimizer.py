"""ZeRO-1 sharding on gloo: identical parameters to the unsharded optimizer, every step."""

import copy

import pytest
import torch

from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer, ZeroReduceScatterOptimizer, communication_volume
from tests._distributed import ToyModel, local_rows, run_on_ranks, toy_batches

pytestmark = pytest.mark.distributed  # spawns gloo ranks


def _matches_unsharded(rank, world_size):
    torch.manual_seed(0)
    model, reference = ToyModel(), ToyModel()
    reference.load_state_dict(model.state_dict())
    params = (p for p in model.parameters())  # a generator, as users pass
    opt = ShardedOptimizer(params, torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
    owners = {opt.owner_of(p) for p in model.parameters()}
    assert owners == set(range(world_size))  # numel-balanced: every rank owns something here
    for x, y in toy_batches(5):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()  # same full batch on every rank
            o.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=0)
    # Optimizer state lives only with the owner.
    for p in model.parameters():
        has_state = opt.inner is not None and p in opt.inner.state and len(opt.inner.state[p]) > 0
        assert has_state == (opt.owner_of(p) == rank and p.grad is not None)  # unused params get no state


def test_sharded_optimizer_matches_unsharded_adamw():
    run_on_ranks(_matches_unsharded, 2)


def _groups_and_late_groups(rank, world_size):
    torch.manual_seed(0)
    a, b, c = (torch.nn.Parameter(torch.randn(n)) for n in (7, 3, 5))
    opt = ShardedOptimizer([{"params": [a], "lr": 0.5}, {"params": [b]}], torch.optim.SGD, lr=0.1)
    # One tiny parameter each: with 3 ranks somebody owns nothing, and must not crash.
    opt.add_param_group({"params": [c], "lr": 0.01})  # later in training
    twins = [p.detach().clone().requires_grad_() for p in (a, b, c)]
    ref = torch.optim.SGD([{"params": [twins[0]], "lr": 0.5}, {"params": [twins[1]]}, {"params": [twins[2]],
                                                                                          "lr": 0.01}], lr=0.1)
    for _ in range(3):
        for group in opt.param_groups + ref.param_groups:  # a scheduler's edit must reach the shards
            group["lr"] *= 0.5
        for ps, o in (((a, b, c), opt), (twins, ref)):
            o.zero_grad()
            sum((p * p * (i + 1)).sum() for i, p in enumerate(ps)).backward()
            o.step()
        for p, q in zip((a, b, c), twins):
            torch.testing.assert_close(p, q, rtol=1e-7, atol=0)


def test_param_groups_added_later_and_a_rank_with_nothing():
    run_on_ranks(_groups_and_late_groups, 3)


def _state_dict_round_trip(rank, world_size):
    torch.manual_seed(0)
    model = ToyModel()
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    x, y = toy_batches(1)[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    saved = copy.deepcopy(opt.state_dict())  # as through torch.save: no tensors shared with the live state
    twin = ToyModel()
    twin.load_state_dict(model.state_dict())
    opt2 = ShardedOptimizer(twin.parameters(), torch.optim.AdamW, lr=0.05)
    opt2.load_state_dict(saved)
    for m, o in ((model, opt), (twin, opt2)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)
    bad = dict(saved, world_size=world_size + 1)
    with pytest.raises(ValueError, match="saved on rank"):
        opt2.load_state_dict(bad)


def test_state_dict_round_trips():
    run_on_ranks(_state_dict_round_trip, 2)


def _reduce_scatter_mode(rank, world_size):
    torch.manual_seed(0)
    model, reference = ToyModel(), ToyModel()
    reference.load_state_dict(model.state_dict())
    opt = ZeroReduceScatterOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=0.05)
    for x, y in toy_batches(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
        opt.step()  # averages gradients itself: no DDP around it
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)


def test_reduce_scatter_zero1_matches_unsharded():
    run_on_ranks(_reduce_scatter_mode, 2)


def test_communication_volume():
    n, w = 1000, 4
    assert communication_volume(n, w, "ddp")["total"] == pytest.approx(1500)
    assert communication_volume(n, w, "zero1-reduce-scatter")["total"] == pytest.approx(1500)
    assert communication_volume(n, w, "sharded-broadcast")["total"] == pytest.approx(2250)
    with pytest.raises(ValueError, match="mode"):
        communication_volume(n, w, "zero3")
