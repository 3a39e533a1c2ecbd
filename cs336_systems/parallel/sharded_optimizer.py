"""ZeRO-1-style optimizer state sharding, as a real torch.optim.Optimizer.

`ShardedOptimizer(params, optimizer_cls, **kwargs)`: every parameter gets one owner rank,
chosen greedily by numel (each parameter, in order, goes to the rank with the fewest
elements so far; ties to the lowest rank), which is deterministic and equal on every rank.
Each rank holds an `optimizer_cls` over the parameters it owns only, so optimizer state
(AdamW's m and v: 2x the parameters in fp32) is divided by the world size. `step()` steps
the owned shard, then every rank receives each parameter from its owner: one flat
broadcast per (owner, dtype), not one per tensor.

Communication per step, for N parameter elements on W ranks, on top of DDP's all-reduce
of gradients (2N(W-1)/W sent per rank): the broadcasts move N elements, received by W-1
ranks. `ZeroReduceScatterOptimizer` is the paper's arrangement instead: gradients are
reduce-scattered (N(W-1)/W), each rank updates its contiguous shard of the flat parameter
vector, and the parameters are all-gathered (N(W-1)/W): 2N(W-1)/W in all, the same as
DDP's all-reduce alone, with no separate gradient synchronisation.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.parallel import comm


class ShardedOptimizer(torch.optim.Optimizer):
    def __init__(self, params: Iterable, optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        # Optimizer.__init__ calls our add_param_group, which needs these first.
        self.optimizer_cls = optimizer_cls
        self.optimizer_kwargs = kwargs
        self.world_size, self.rank = comm.world_size(), comm.rank()
        self._owner: dict[int, int] = {}  # id(param) -> rank
        self._owned_numel = [0] * self.world_size
        self.inner: torch.optim.Optimizer | None = None  # None while this rank owns nothing
        self._inner_group_of: list[int | None] = []  # outer group index -> inner group index
        super().__init__(params, defaults=kwargs)

    # ---- ownership ----
    def _assign(self, p: torch.nn.Parameter) -> int:
        if id(p) not in self._owner:
            owner = min(range(self.world_size), key=lambda r: (self._owned_numel[r], r))
            self._owner[id(p)] = owner
            self._owned_numel[owner] += p.numel()
        return self._owner[id(p)]

    def owner_of(self, p: torch.nn.Parameter) -> int:
        return self._owner[id(p)]

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)  # validates, fills defaults, keeps the full group
        group = self.param_groups[-1]
        owned = [p for p in group["params"] if self._assign(p) == self.rank]
        if not owned:
            self._inner_group_of.append(None)
            return
        inner_group = {k: v for k, v in group.items() if k != "params"} | {"params": owned}
        if self.inner is None:
            self.inner = self.optimizer_cls([inner_group], **self.optimizer_kwargs)
        else:
            self.inner.add_param_group(inner_group)
        self._inner_group_of.append(len(self.inner.param_groups) - 1)

    # ---- stepping ----
    def _push_hyperparameters(self) -> None:
        """Schedulers write lr and friends into our param_groups; the inner optimizer must see them."""
        for outer, inner_index in zip(self.param_groups, self._inner_group_of):
            if inner_index is not None:
                inner = self.inner.param_groups[inner_index]
                for key, value in outer.items():
                    if key != "params":
                        inner[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, **kwargs):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.inner is not None:
            self._push_hyperparameters()
            self.inner.step(**kwargs)
        self._synchronize_parameters()
        return loss

    def _synchronize_parameters(self) -> None:
        if self.world_size == 1:
            return
        params = [p for group in self.param_groups for p in group["params"]]
        for owner in range(self.world_size):
            owned = [p for p in params if self._owner[id(p)] == owner]
            by_dtype: dict[tuple, list[torch.Tensor]] = {}
            for p in owned:
                by_dtype.setdefault((p.dtype, p.device), []).append(p)
            for group in by_dtype.values():
                flat = _flatten_dense_tensors([p.detach() for p in group])
                comm.broadcast(flat, src=owner)
                if owner != self.rank:
                    for p, value in zip(group, _unflatten_dense_tensors(flat, group)):
                        p.copy_(value)

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        """This rank's shard: the inner optimizer's state, plus what is needed to check a reload."""
        return {"world_size": self.world_size, "rank": self.rank,
                "inner": None if self.inner is None else self.inner.state_dict(),
                "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]}

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["world_size"] != self.world_size or state_dict["rank"] != self.rank:
            raise ValueError(f"ShardedOptimizer.load_state_dict: saved on rank {state_dict['rank']} of "
                             f"{state_dict['world_size']}, loading on rank {self.rank} of {self.world_size}")
        if (state_dict["inner"] is None) != (self.inner is None):
            raise ValueError("ShardedOptimizer.load_state_dict: parameter ownership differs from the saved one")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update(saved)
        if self.inner is not None:
            self.inner.load_state_dict(state_dict["inner"])


class ZeroReduceScatterOptimizer:
    """The paper's ZeRO-1: reduce-scatter gradients, update a contiguous shard, all-gather parameters.

    Holds a flat fp32 copy of the parameters' shard as the inner optimizer's parameter. Call
    `step()` after backward *instead of* a DDP gradient all-reduce (it averages gradients itself).
    All parameters must share one dtype and device.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], optimizer_cls: type[torch.optim.Optimizer], **kwargs):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("ZeroReduceScatterOptimizer: got no trainable parameters")
        dtypes = {(p.dtype, p.device) for p in self.params}
        if len(dtypes) != 1:
            raise ValueError(f"ZeroReduceScatterOptimizer: parameters must share dtype and device, got {dtypes}")
        self.world_size, self.rank = comm.world_size(), comm.rank()
        total = sum(p.numel() for p in self.params)
        self.shard_numel = -(-total // self.world_size)  # ceil: the flat vector is zero-padded
        self.padded_numel = self.shard_numel * self.world_size
        flat = torch.zeros(self.padded_numel, dtype=self.params[0].dtype, device=self.params[0].device)
        flat[:total] = _flatten_dense_tensors([p.detach() for p in self.params])
        start = self.rank * self.shard_numel
        self.shard = torch.nn.Parameter(flat[start:start + self.shard_numel].clone())
        self.optimizer = optimizer_cls([self.shard], **kwargs)
        self.total = total
        self._start = start
        self._offsets = [0]
        for p in self.params:
            self._offsets.append(self._offsets[-1] + p.numel())

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def step(self) -> None:
        # Parameters without a gradient (unused everywhere) must not move, as with a plain optimizer;
        # in the flat shard they would still see weight decay, so their shard values are put back.
        untouched = [i for i, p in enumerate(self.params) if p.grad is None]
        saved = {i: self._shard_slice(i).clone() for i in untouched}
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat_grad = torch.zeros(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        flat_grad[:self.total] = _flatten_dense_tensors(grads)
        shard_grad = torch.empty_like(self.shard)
        comm.reduce_scatter(shard_grad, flat_grad)
        self.shard.grad = shard_grad.div_(self.world_size)
        self.optimizer.step()
        for i, value in saved.items():
            self._shard_slice(i).copy_(value)
        flat = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        comm.all_gather_into(flat, self.shard.detach())
        for p, value in zip(self.params, _unflatten_dense_tensors(flat[:self.total], self.params)):
            p.copy_(value)

    def _shard_slice(self, index: int) -> torch.Tensor:
        """The part of this rank's shard that holds parameter `index` (possibly empty)."""
        lo = max(self._offsets[index], self._start) - self._start
        hi = min(self._offsets[index + 1], self._start + self.shard_numel) - self._start
        return self.shard.data[lo:max(lo, hi)]


def communication_volume(n_elements: int, world_size: int, mode: str) -> dict[str, float]:
    """Elements each rank sends per step (ring algorithms), by phase, for the modes above."""
    share = (world_size - 1) / world_size
    if mode == "ddp":
        phases = {"all-reduce gradients": 2 * n_elements * share}
    elif mode == "sharded-broadcast":
        # Owners send their shard to W-1 peers: on average N/W elements to each of W-1 ranks.
        phases = {"all-reduce gradients": 2 * n_elements * share, "broadcast parameters": n_elements * share}
    elif mode == "zero1-reduce-scatter":
        phases = {"reduce-scatter gradients": n_elements * share, "all-gather parameters": n_elements * share}
    else:
        raise ValueError(f"communication_volume: mode must be ddp, sharded-broadcast or zero1-reduce-scatter, "
                         f"got {mode!r}")
    return phases | {"total": sum(phases.values())}
