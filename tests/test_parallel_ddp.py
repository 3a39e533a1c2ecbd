"""DDP variants on gloo against single-process training (toy model with frozen, tied, unused params)."""

import copy

import pytest
import torch
import torch.distributed as dist

from cs336_systems.parallel.buckets import assign_buckets
from cs336_systems.parallel.ddp import VARIANTS, make_ddp
from tests._distributed import ToyModel, local_rows, run_on_ranks, toy_batches

pytestmark = pytest.mark.distributed  # spawns gloo ranks

CASES = [("naive", {}), ("flat", {}), ("overlap", {}), ("bucketed", {"bucket_size_mb": None}),
         ("bucketed", {"bucket_size_mb": 0.0001}), ("bucketed", {"bucket_size_mb": 0.002}),
         ("bucketed", {"bucket_size_mb": 10.0})]


def _train_and_compare(rank, world_size, cases):
    for variant, kwargs in cases:
        torch.manual_seed(rank)  # ranks start different: the constructor must broadcast rank 0's weights
        model = ToyModel()
        ddp = make_ddp(model, variant, **kwargs)
        torch.manual_seed(0)
        reference = ToyModel()
        reference.load_state_dict(ddp.module.state_dict())  # rank 0's weights, on every rank
        frozen_before = model.frozen.weight.detach().clone()
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for step, (x, y) in enumerate(toy_batches(4)):
            ddp.on_train_batch_start()
            opt.zero_grad(set_to_none=step % 2 == 0)  # both zero_grad styles
            loss = torch.nn.functional.mse_loss(ddp(local_rows(x, rank, world_size)), local_rows(y, rank, world_size))
            loss.backward()
            ddp.finish_gradient_synchronization()
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, msg=f"{variant} {kwargs} step {step}: {name}")
        assert torch.equal(model.frozen.weight, frozen_before)
        assert model.unused.weight.grad is None
        assert [n for n, _ in ddp.named_parameters()] == [f"module.{n}" for n, _ in model.named_parameters()]


def test_ddp_variants_match_single_process():
    run_on_ranks(_train_and_compare, 2, CASES)


def _no_sync_accumulates(rank, world_size):
    for variant in VARIANTS:
        torch.manual_seed(0)
        model, reference = ToyModel(), ToyModel()
        reference.load_state_dict(model.state_dict())
        ddp = make_ddp(model, variant)
        x, y = toy_batches(1, batch=16)[0]
        halves = [local_rows(t, rank, world_size) for t in (x, y)]
        with ddp.no_sync():  # micro-batch 1: local only
            torch.nn.functional.mse_loss(ddp(halves[0][:4]), halves[1][:4]).backward()
        torch.nn.functional.mse_loss(ddp(halves[0][4:]), halves[1][4:]).backward()
        ddp.finish_gradient_synchronization()
        # Reference: the sum of the two micro-batch mean losses over every rank's rows, averaged over ranks.
        for r in range(world_size):
            xr, yr = (local_rows(t, r, world_size) for t in (x, y))
            loss = (torch.nn.functional.mse_loss(reference(xr[:4]), yr[:4])
                    + torch.nn.functional.mse_loss(reference(xr[4:]), yr[4:])) / world_size
            loss.backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            if p.requires_grad and q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=f"{variant}: {name}")


def test_no_sync_accumulates_then_averages():
    run_on_ranks(_no_sync_accumulates, 2)


def _world_size_one(rank, world_size):
    torch.manual_seed(0)
    model = ToyModel()
    before = copy.deepcopy(model.state_dict())
    ddp = make_ddp(model, "bucketed", bucket_size_mb=0.001)
    x, y = toy_batches(1)[0]
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ddp.finish_gradient_synchronization()
    assert all(torch.equal(grads[n], p.grad) for n, p in model.named_parameters() if p.grad is not None)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_world_size_one_is_plain_training():
    run_on_ranks(_world_size_one, 1)


def _rank_raises(rank, world_size):
    model = make_ddp(ToyModel(), "overlap")
    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose")
    dist.barrier()  # rank 0 would wait here forever without the failure propagating
    model(torch.randn(2, 10))


def test_a_failing_rank_does_not_hang_the_others():
    with pytest.raises(Exception, match="rank 1 fails on purpose"):
        run_on_ranks(_rank_raises, 2)


def test_buckets_reverse_order_and_limits():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 1000, 10)]  # fp32: 4 bytes each
    mb = 2**20
    buckets = assign_buckets(params, 400 * 4 / mb)
    assert [[p.numel() for p in b.params] for b in buckets] == [[10], [1000], [50, 300], [100]]
    assert buckets[2].offsets == [0, 50] and buckets[2].numel == 350
    assert len(assign_buckets(params, None)) == 1
    assert [len(b.params) for b in assign_buckets(params, 1e-9)] == [1] * 5
    with pytest.raises(ValueError, match="bucket_size_mb"):
        assign_buckets(params, 0)


def test_buckets_separate_dtypes():
    params = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    buckets = assign_buckets(params, None)
    assert sorted(str(b.dtype) for b in buckets) == ["torch.float32", "torch.float64"]


def test_unknown_variant():
    with pytest.raises(ValueError, match="unknown variant 'magic'; valid: naive, flat, overlap, bucketed"):
        make_ddp(ToyModel(), "magic")


def _rank_reports_world(rank, world_size, seen_dir):
    with open(f"{seen_dir}/rank{rank}", "w") as f:
        f.write(f"{dist.get_rank()} {dist.get_world_size()}")


@pytest.mark.distributed
def test_spawn_binds_its_rendezvous_before_any_rank_starts(tmp_path):
    """The rendezvous port is held by the spawning process from the start (no window in which another process can
    take it); a port already taken is a clear error before any rank is started."""
    import socket

    from cs336_systems.parallel import comm

    comm.spawn(_rank_reports_world, 2, str(tmp_path))
    assert sorted(p.read_text() for p in tmp_path.iterdir()) == ["0 2", "1 2"]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"spawn: could not listen on port {port} .*pass another port"):
            comm.spawn(_rank_reports_world, 2, str(tmp_path / "never"), port=port)
    assert not (tmp_path / "never").exists()
