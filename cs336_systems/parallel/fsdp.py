"""Fully sharded data parallel over cs336_basics Linear and Embedding weights.

Layout. Every `Linear` / `Embedding` weight (rows R) is cut into W equal row shards of
ceil(R / W) rows (the last zero-padded); rank r keeps shard r as an fp32 Parameter registered
on the *original module* under the name `weight`, so names, `isinstance` checks and the
optimizer all see the shard. Everything else (norm weights) stays replicated.

Gather units (`unit=`). "block" (default): the sharded weights of one element of a
ModuleList (a TransformerBlock: its 7 Linears) are gathered by one all-gather of their
concatenated shards, and every other sharded module (embedding, LM head) is a unit of its
own; "layer": one all-gather per weight (more, smaller collectives: each call's fixed cost
dominates on small models, e.g. 2-3x slower steps on gloo). After a group's gather, each
weight is copied out of the (ranks, group) buffer into its own full tensor.

Forward. Each sharded module's `forward` is replaced by an autograd Function that takes the
gathered full weight, runs the module class's own forward with it (the einsum or the row
lookup: the maths stays in cs336_basics) and saves only its input, never the full weight,
which is freed as soon as the layer is done. Units are all-gathered asynchronously just in
time: when unit i is first used, the gather of unit i+1 is launched, so at most two units'
full weights are alive.
`compute_dtype` casts the shard before it is communicated and computed with; fp32 masters
and optimizer updates stay on the shards.

Backward. Weights are re-gathered in reverse order with the same one-ahead prefetch. Under
activation checkpointing the recomputed forward gathers the weight and keeps it for the
backward right after, so a recomputed layer is gathered once, not twice. Weight gradients
are reduce-scattered (averaged) asynchronously; replicated gradients are all-reduced in
`finish_gradient_synchronization()`, after which every trainable master has a `.grad` of its
own shape and fp32 dtype (zeros where the layer got no gradient).

Exact mode (`exact_gradients=True`): each layer's gradients are redone on the full batch, bitwise those of
single-process training; a mode for tests, not for speed (exact_gradients.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from einops import einsum

from cs336_basics.model import Embedding, Linear
from cs336_systems.fused_model import forward_taken_over
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import average_coalesced, broadcast_from_rank0
from cs336_systems.parallel.exact_gradients import ExactGradients, original_forward


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _ShardedWeight:
    """One sharded weight, its full copy while in use, and its pending gradient reductions."""

    name: str
    module: nn.Module
    full_shape: tuple[int, ...]
    rows_per_rank: int
    full: torch.Tensor | None = None
    group: _GatherGroup | None = None
    pending_grad: list = field(default_factory=list)  # [(handle, reduced flat shard)]

    @property
    def shard(self) -> nn.Parameter:
        return self.module._parameters["weight"]


@dataclass
class _GatherGroup:
    """Weights gathered by one all-gather: buffer (ranks, sum of shard sizes), rank-major."""

    units: list[_ShardedWeight]
    buffer: torch.Tensor | None = None
    handle: object = None
    grads: dict = field(default_factory=dict)  # id(unit) -> padded full gradient, until the group's reduce
    @property
    def gathered(self) -> bool:
        return self.handle is not None or any(u.full is not None for u in self.units)


class FSDP(nn.Module):
    """`module` with its Linear and Embedding weights sharded over the ranks of the default process group (the
    module docstring says how). Train it as the module itself, then call `finish_gradient_synchronization()`
    after backward and before the optimizer step; the optimizer sees the shards.

    compute_dtype: the dtype weights are gathered and computed in (None: their own, fp32). exact_gradients:
    bitwise single-process gradients, for tests (exact_gradients.py). unit: "block" gathers each element of a
    ModuleList at once, "layer" each weight."""

    def __init__(self, module: nn.Module, compute_dtype: torch.dtype | None = None, *,
                 exact_gradients: bool = False, unit: str = "block"):
        super().__init__()
        if unit not in ("block", "layer"):
            raise ValueError(f"FSDP: unit must be 'block' or 'layer', got {unit!r}")
        self.module = module
        self.compute_dtype = compute_dtype
        self.world_size, self.rank = comm.world_size(), comm.rank()
        broadcast_from_rank0(list(module.parameters()) + list(module.buffers()))
        self._units: list[_ShardedWeight] = []
        self._unit_of: dict[int, _ShardedWeight] = {}
        for name, sub in module.named_modules():
            if isinstance(sub, (Linear, Embedding)) and id(sub) not in self._unit_of:
                self._shard(name, sub)
        self._groups = self._make_groups(module, unit)
        self._replicated = [(n, p) for n, p in module.named_parameters()
                            if p.requires_grad and not any(p is u.shard for u in self._units)]
        # Exact mode: every layer's gradients redone on the full batch (exact_gradients.py); None otherwise.
        self.exact = ExactGradients(module, set(self._unit_of)) if exact_gradients else None
        self._order: list[_GatherGroup] = []  # forward execution order, learned on the first forward
        self._order_known = False
        self.gather_stats = {"ready_before_use": 0, "waited": 0}

    # ---- set-up ----
    def _make_groups(self, module: nn.Module, unit: str) -> list[_GatherGroup]:
        """One group per ModuleList element (a block) holding sharded weights, one per other weight;
        in the order of their first weight."""
        roots = [child for sub in module.modules() if isinstance(sub, nn.ModuleList) for child in sub] \
            if unit == "block" else []
        root_of = {id(m): id(root) for root in roots for m in root.modules()}
        members: dict[int, list[_ShardedWeight]] = {}  # group key -> its weights, in insertion order
        for u in self._units:
            members.setdefault(root_of.get(id(u.module), id(u)), []).append(u)
        groups = [_GatherGroup(units) for units in members.values()]
        for group in groups:
            for u in group.units:
                u.group = group
        return groups

    def _shard(self, name: str, sub: nn.Module) -> None:
        full = sub.weight.detach()
        rows = full.shape[0]
        per_rank = -(-rows // self.world_size)
        padded = torch.zeros((per_rank * self.world_size, *full.shape[1:]), dtype=full.dtype, device=full.device)
        padded[:rows] = full
        shard = nn.Parameter(padded[self.rank * per_rank:(self.rank + 1) * per_rank].clone(),
                             requires_grad=sub.weight.requires_grad)
        sub.weight = shard  # same module object, same name: the shard is now `weight`
        unit = _ShardedWeight(f"{name}.weight" if name else "weight", sub, tuple(full.shape),
                              per_rank)
        self._units.append(unit)
        self._unit_of[id(sub)] = unit
        sub.forward = lambda x, unit=unit: _ShardedForward.apply(x, unit.shard, unit, self)
        forward_taken_over(sub)  # (a merged product of our fused model steps aside for it, compiled too)

    def forward(self, *args, **kwargs):
        if self._order and not self._order_known:
            self._order_known = True
            self._position = {id(u): i for i, u in enumerate(self._order)}
        return self.module(*args, **kwargs)

    # ---- gathering ----
    def _start_gather(self, group: _GatherGroup, force: bool = False) -> None:
        """Launch the group's all-gather (unless it is in flight, or, for a prefetch, already held)."""
        if group.handle is not None or (group.gathered and not force):
            return
        shards = [u.shard.detach() for u in group.units]
        if self.compute_dtype is not None:
            shards = [t.to(self.compute_dtype) for t in shards]  # cast first: communicate in the compute dtype
        send = shards[0].reshape(-1) if len(shards) == 1 else torch.cat([t.reshape(-1) for t in shards])
        group.buffer = torch.empty(self.world_size * send.numel(), dtype=send.dtype, device=send.device)
        group.handle = comm.all_gather_into(group.buffer, send, async_op=True)

    def _full_weight(self, unit: _ShardedWeight) -> torch.Tensor:
        if unit.full is None:
            group = unit.group
            if group.handle is None:  # other weights of the group may still be held (unused ones): regather
                self._start_gather(group, force=True)
            else:
                self.gather_stats["ready_before_use" if group.handle.is_completed() else "waited"] += 1
            group.handle.wait()
            group.handle = None
            ranks = group.buffer.view(self.world_size, -1)  # (ranks, sum of shard sizes)
            offset = 0
            for u in group.units:
                size = u.shard.numel()
                rows = ranks[:, offset:offset + size]  # each rank's shard of u, in rank order
                full = rows.reshape(u.rows_per_rank * self.world_size, *u.full_shape[1:])  # a copy if grouped
                u.full = full[:u.full_shape[0]]
                offset += size
            group.buffer = None
        return unit.full

    def _neighbour(self, group: _GatherGroup, step: int) -> _GatherGroup | None:
        if not self._order_known:
            return None
        position = self._position[id(group)] + step
        return self._order[position] if 0 <= position < len(self._order) else None

    def acquire(self, unit: _ShardedWeight, backward: bool, prefetch: bool = True) -> torch.Tensor:
        """The full weight of `unit` (gathered with its group, or waited for), and the next group's
        gather launched: the following one in forward, the previous one in backward."""
        if not backward and not self._order_known and unit.group not in self._order:
            self._order.append(unit.group)
        weight = self._full_weight(unit)
        nxt = self._neighbour(unit.group, -1 if backward else +1) if prefetch else None
        if nxt is not None:
            self._start_gather(nxt)
        return weight

    def release(self, unit: _ShardedWeight, keep: bool = False) -> None:
        if not keep:
            unit.full = None

    # ---- gradients ----
    def reduce_weight_gradient(self, unit: _ShardedWeight, full_grad: torch.Tensor) -> None:
        """Queue a full weight gradient (local batch) for its group's averaged reduce-scatter, which
        starts once every trainable weight of the group has one (the group's backward is done)."""
        group = unit.group
        padded = torch.zeros((unit.rows_per_rank * self.world_size, *unit.full_shape[1:]), dtype=full_grad.dtype,
                             device=full_grad.device)
        padded[:unit.full_shape[0]] = full_grad
        if id(unit) in group.grads:  # a weight used twice: its second gradient joins the first
            group.grads[id(unit)] += padded
        else:
            group.grads[id(unit)] = padded
        if all(id(u) in group.grads for u in group.units if u.shard.requires_grad):
            self._reduce_group(group)

    def _reduce_group(self, group: _GatherGroup) -> None:
        """One reduce-scatter for the group: rank r receives, for every weight, its rows of the sum."""
        units = [u for u in group.units if id(u) in group.grads]
        if not units:
            return
        sizes = [u.shard.numel() for u in units]
        sample = group.grads[id(units[0])]
        send = torch.empty((self.world_size, sum(sizes)), dtype=sample.dtype, device=sample.device)
        offset = 0
        for u, size in zip(units, sizes):
            send[:, offset:offset + size] = group.grads[id(u)].view(self.world_size, size)  # rank-major rows
            offset += size
        out = torch.empty(sum(sizes), dtype=sample.dtype, device=sample.device)
        handle = comm.reduce_scatter(out, send.view(-1), async_op=True)
        for u, piece in zip(units, out.split(sizes)):
            u.pending_grad.append((handle, piece))
        group.grads.clear()

    def set_shard_gradient(self, unit: _ShardedWeight, full_grad: torch.Tensor) -> None:
        """Exact mode: the full-batch gradient is already known; keep this rank's rows."""
        padded = torch.zeros((unit.rows_per_rank * self.world_size, *unit.full_shape[1:]), dtype=full_grad.dtype,
                             device=full_grad.device)
        padded[:unit.full_shape[0]] = full_grad
        rows = padded[self.rank * unit.rows_per_rank:(self.rank + 1) * unit.rows_per_rank]
        unit.pending_grad.append((None, rows.reshape(-1).clone()))

    @staticmethod
    def _accumulate(param: nn.Parameter, grad: torch.Tensor) -> None:
        grad = grad.to(param.dtype).view_as(param)
        if param.grad is None:
            param.grad = grad
        else:
            param.grad.add_(grad)

    def finish_gradient_synchronization(self) -> None:
        for group in self._groups:  # groups whose weights did not all get a gradient this step
            self._reduce_group(group)
        for unit in self._units:
            for handle, flat in unit.pending_grad:
                if handle is not None:
                    handle.wait()
                    flat = flat / self.world_size  # reduce-scatter summed; we average
                elif self.world_size > 1:
                    flat = flat / self.world_size
                self._accumulate(unit.shard, flat)
            unit.pending_grad.clear()
            unit.full = None
        for group in self._groups:
            if group.handle is not None:  # a prefetch nobody used (e.g. past the first layer)
                group.handle.wait()
            group.buffer, group.handle = None, None
        for unit in self._units:
            if unit.shard.requires_grad and unit.shard.grad is None:
                unit.shard.grad = torch.zeros_like(unit.shard)
        if self.exact is not None:
            self.exact.set_replicated_gradients([p for _, p in self._replicated])
        replicated = [p for _, p in self._replicated]
        for p in replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.world_size > 1 and replicated and self.exact is None:
            average_coalesced([p.grad for p in replicated])

    # ---- checkpoints ----
    @torch.no_grad()
    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """{original name: full fp32 tensor} on every rank (a collective: call it on all ranks)."""
        out = {}
        for name, p in self.module.named_parameters():
            unit = next((u for u in self._units if u.shard is p), None)
            if unit is None:
                out[name] = p.detach().clone()
                continue
            full = torch.empty((unit.rows_per_rank * self.world_size, *unit.full_shape[1:]), dtype=p.dtype,
                               device=p.device)
            comm.all_gather_into(full.view(-1), p.detach().contiguous().view(-1))
            out[name] = full[:unit.full_shape[0]].clone()
        return out


class _ShardedForward(torch.autograd.Function):
    """y = module(x) with the gathered weight; saves x, not the weight."""

    @staticmethod
    def forward(ctx, x, shard, unit: _ShardedWeight, owner: FSDP):
        recomputing = _in_backward()  # activation checkpointing re-runs forward inside backward
        weight = owner.acquire(unit, backward=False, prefetch=not recomputing)
        x_in = x.to(owner.compute_dtype) if owner.compute_dtype is not None and x.is_floating_point() else x
        y = original_forward(unit.module, x_in, weight)
        ctx.save_for_backward(x)
        ctx.unit, ctx.owner = unit, owner
        # A recomputed layer keeps its weight for the backward that follows (one gather, not two).
        owner.release(unit, keep=recomputing)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        unit, owner = ctx.unit, ctx.owner
        weight = owner.acquire(unit, backward=True)
        x_in = x.to(owner.compute_dtype) if owner.compute_dtype is not None and x.is_floating_point() else x
        if owner.exact is not None:
            grad_x, grad_w = owner.exact.layer_gradients(unit.module, x_in, weight, grad_out)
            owner.set_shard_gradient(unit, grad_w)
        else:
            grad_x, grad_w = _local_grads(unit.module, x_in, weight, grad_out)
            owner.reduce_weight_gradient(unit, grad_w)
        owner.release(unit)
        if grad_x is not None:
            grad_x = grad_x.to(x.dtype)
        return grad_x, None, None, None


def _local_grads(module, x, weight, grad_out):
    """Gradients of this rank's batch: dx and the (full-shape) dW, without recomputing y."""
    if isinstance(module, Linear):
        grad_x = einsum(grad_out, weight, "... d_out, d_out d_in -> ... d_in")
        grad_w = einsum(grad_out, x, "... d_out, ... d_in -> d_out d_in")
        return grad_x, grad_w
    grad_w = torch.zeros_like(weight)
    grad_w.index_add_(0, x.reshape(-1), grad_out.reshape(-1, weight.shape[1]).to(weight.dtype))
    return None, grad_w


def fsdp_gather_full_params(model: FSDP) -> dict[str, torch.Tensor]:
    return model.gather_full_params()
