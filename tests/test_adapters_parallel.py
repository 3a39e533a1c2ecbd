"""The DDP, sharded-optimizer and FSDP adapters, called the way both suite releases call them."""

import pytest
import torch

import tests.adapters as adapters
from cs336_systems.parallel.ddp import BucketedDDP, OverlapDDP
from tests._distributed import ToyModel, local_rows, run_on_ranks, toy_batches

pytestmark = pytest.mark.distributed  # spawns gloo ranks

INTERFACE_NAMES = [
    "get_flashattention_autograd_function_pytorch", "get_flashattention_autograd_function_triton", "get_ddp",
    "ddp_on_after_backward", "get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward",
    "get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start",
    "get_sharded_optimizer", "get_fsdp", "fsdp_on_after_backward", "fsdp_gather_full_params"]


def test_every_interface_adapter_exists():
    assert all(callable(getattr(adapters, name)) for name in INTERFACE_NAMES)


def _suite_style(rank, world_size):
    for make, after, start in (
        (lambda m: adapters.get_ddp(m), lambda d, o: adapters.ddp_on_after_backward(d, o), None),
        (lambda m: adapters.get_ddp_individual_parameters(m),
         lambda d, o: adapters.ddp_individual_parameters_on_after_backward(d, o), None),
        (lambda m: adapters.get_ddp_bucketed(m, bucket_size_mb=None),
         lambda d, o: adapters.ddp_bucketed_on_after_backward(ddp_model=d, optimizer=o),
         lambda d, o: adapters.ddp_bucketed_on_train_batch_start(ddp_model=d, optimizer=o)),
    ):
        torch.manual_seed(rank)
        ddp = make(ToyModel())
        assert isinstance(ddp, (OverlapDDP, BucketedDDP)) and isinstance(ddp.module, ToyModel)
        torch.manual_seed(0)
        reference = ToyModel()
        reference.load_state_dict(ddp.module.state_dict())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
        for x, y in toy_batches(2):
            if start:
                start(ddp, opt)
            opt.zero_grad()
            out = ddp(local_rows(x, rank, world_size))
            torch.nn.functional.mse_loss(out, local_rows(y, rank, world_size)).backward()
            after(ddp, opt)
            opt.step()
            ref_opt.zero_grad()
            torch.nn.functional.mse_loss(reference(x), y).backward()
            ref_opt.step()
        for p, q in zip(ddp.module.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q)
    # Sharded optimizer, AdamW as the suites use it.
    torch.manual_seed(0)
    model, reference = ToyModel(), ToyModel()
    reference.load_state_dict(model.state_dict())
    opt = adapters.get_sharded_optimizer(model.parameters(), torch.optim.AdamW, lr=0.1, weight_decay=0.1)
    assert isinstance(opt, torch.optim.Optimizer)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=0.1, weight_decay=0.1)
    for x, y in toy_batches(2):
        for m, o in ((model, opt), (reference, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-7, atol=0)


def test_parallel_adapters_suite_style():
    run_on_ranks(_suite_style, 2)


def _fsdp_adapter(rank, world_size):
    from cs336_basics.model import BasicsTransformerLM
    from cs336_basics.nn_utils import cross_entropy

    torch.manual_seed(0)
    model = BasicsTransformerLM(vocab_size=32, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=24)
    names = [n for n, _ in model.named_parameters()]
    fsdp = adapters.get_fsdp(model, compute_dtype=None)
    opt = torch.optim.SGD(fsdp.parameters(), lr=0.1)
    x = torch.randint(0, 32, (4, 8))
    cross_entropy(fsdp(local_rows(x, rank, world_size)), local_rows(x, rank, world_size)).backward()
    adapters.fsdp_on_after_backward(fsdp, opt)
    opt.step()
    full = adapters.fsdp_gather_full_params(fsdp)
    assert list(full) == names and all(t.dtype == torch.float32 for t in full.values())
    assert full["lm_head.weight"].shape == (32, 16)


def test_fsdp_adapters():
    run_on_ranks(_fsdp_adapter, 2)
