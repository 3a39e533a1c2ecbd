"""FSDP's exact-gradient mode (`FSDP(..., exact_gradients=True)`), a correctness mode for tests.

A reduce-scatter of per-rank weight gradients sums two partial matmuls, which differs from one full-batch
matmul in the last bits. Here each sharded layer's backward instead all-gathers its inputs and output gradients
in rank order and reruns the module's own op on the full batch under autograd, exactly as a single process
would, keeping its slice of the input gradient (`layer_gradients`). Replicated modules (norms) record their
inputs and output gradients during the step and get their parameter gradients the same way at its end
(`set_replicated_gradients`). With per-rank mean losses and a world size that is a power of two, the averaged
gradients are then bitwise those of single-process training. It costs one extra forward of each layer and
gathers of activations; all ranks must hold batches of equal shape.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from cs336_systems.parallel import comm


@contextlib.contextmanager
def _weight_swapped(module: nn.Module, weight: torch.Tensor):
    """Run the module class's own forward with `weight` in place of its shard."""
    shard = module._parameters["weight"]
    module._parameters["weight"] = weight
    try:
        yield
    finally:
        module._parameters["weight"] = shard


def original_forward(module: nn.Module, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """The module class's own forward (not an FSDP replacement), with `weight` in place of its own if given."""
    if weight is None:
        return type(module).forward(module, x)
    with _weight_swapped(module, weight):
        return type(module).forward(module, x)


def gather_batch(x: torch.Tensor) -> torch.Tensor:
    """Concatenate every rank's x along dim 0, in rank order."""
    ws = comm.world_size()
    if ws == 1:
        return x
    out = torch.empty((ws * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out.view(-1), x.contiguous().view(-1))
    return out


class ExactGradients:
    """The exact mode of one FSDP: hooks on `module`'s replicated submodules (those whose id is not in
    `sharded_ids` and that hold parameters of their own), and the full-batch gradient computations."""

    def __init__(self, module: nn.Module, sharded_ids: set[int]):
        self._records: list[tuple[nn.Module, torch.Tensor, torch.Tensor]] = []
        for sub in module.modules():
            if id(sub) not in sharded_ids and any(True for _ in sub.parameters(recurse=False)):
                sub.register_forward_hook(self._record)

    def _record(self, module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        """Keep (input, output gradient) of a replicated module; its parameter gradients are redone on the
        full batch in `set_replicated_gradients`. Its input gradient is left to autograd, so the engine sums
        gradient contributions in the same order as a single process (sums are not associative)."""
        if torch.is_grad_enabled() and output.requires_grad:
            x = inputs[0].detach()
            output.register_hook(lambda g: self._records.append((module, x, g.detach())))

    @staticmethod
    def layer_gradients(module: nn.Module, x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor):
        """(this rank's input gradient or None, the full weight gradient) of a sharded layer, by the module's own
        op under autograd on the full batch, as one process would compute them."""
        x_all, grad_all = gather_batch(x), gather_batch(grad_out.contiguous())
        with torch.enable_grad():
            w = weight.detach().requires_grad_()
            inputs = [w]
            x_leaf = x_all.detach()
            if x_leaf.is_floating_point():
                x_leaf.requires_grad_()
                inputs.append(x_leaf)
            y = original_forward(module, x_leaf, w)
            grads = torch.autograd.grad(y, inputs, grad_all)
        grad_x = grads[1].chunk(comm.world_size())[comm.rank()] if len(grads) > 1 else None
        return grad_x, grads[0]

    def set_replicated_gradients(self, replicated: list[nn.Parameter]) -> None:
        """Set each replicated parameter's `.grad` from the recorded (input, output gradient) pairs of this step,
        averaged over ranks; then forget the records."""
        world_size = comm.world_size()
        exact: dict[int, torch.Tensor] = {}
        for module, x, grad_out in self._records:
            x_all, grad_all = gather_batch(x.contiguous()), gather_batch(grad_out.contiguous())
            params = [p for p in module.parameters(recurse=False) if p.requires_grad]
            with torch.enable_grad():
                grads = torch.autograd.grad(original_forward(module, x_all), params, grad_all)
            for p, g in zip(params, grads):
                exact[id(p)] = exact[id(p)] + g if id(p) in exact else g
        self._records.clear()
        for p in replicated:
            if id(p) in exact:
                p.grad = exact[id(p)] / world_size if world_size > 1 else exact[id(p)]
