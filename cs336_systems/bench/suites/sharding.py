"""The `sharding` suite: memory and step time with and without our ZeRO-1 optimizer-state sharding.

Handout problem: optimizer_state_sharding_accounting. Bytes of parameters, gradients and optimizer state held
per rank (counted from the tensors themselves) and of activations (what one forward saves for backward,
SavedTensorLog); at three points, after init / before / after the optimizer step, the bytes the model's
state holds (parameters, gradients and optimizer state, counted on any device) and, on CUDA, the allocator's
peak; time per step; with AdamW unsharded and with our ZeRO-1 ShardedOptimizer (both under bucketed DDP).

    cs336-bench sharding --preset small --world-size 2
"""

from __future__ import annotations

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.bench import distributed_common as harness
from cs336_systems.memory.saved_tensors import SavedTensorLog
from cs336_systems.parallel.ddp import make_ddp
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer


def add_arguments(parser) -> None:
    harness.add_model_arguments(parser)


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (bucket views count their buffer once)."""
    storages = {}
    for t in tensors:
        if t is not None:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _optimizer_state_bytes(opt) -> int:
    inner = opt.inner if isinstance(opt, ShardedOptimizer) else opt
    if inner is None:
        return 0
    return _tensor_bytes(v for state in inner.state.values() for v in state.values() if torch.is_tensor(v))


def _held_bytes(model, opt) -> int:
    """What the training state holds right now: parameters, gradients and optimizer state."""
    return (_tensor_bytes([*model.parameters(), *(p.grad for p in model.parameters())])
            + _optimizer_state_bytes(opt))


def run(args) -> int:
    return harness.launch(_sharding_rank, args)


def _sharding_rank(args) -> None:
    device, cfg, x, y, store, base = harness.setup_rank(args)
    for sharded in (False, True):
        config = base | {"optimizer": "zero1-sharded-adamw" if sharded else "adamw"}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            model = make_ddp(harness.rank_model(cfg, device), "bucketed", bucket_size_mb=25.0)
            opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4) if sharded
                   else torch.optim.AdamW(model.parameters(), lr=1e-4))
            peaks, held = {}, {"after_init": _held_bytes(model, opt)}
            if device.type == "cuda":
                peaks["after_init"] = torch.cuda.max_memory_allocated(device)
            samples, _ = harness.measure_steps(_sharding_step(model, opt, peaks, held, x, y, device), [], args,
                                               device)
            with SavedTensorLog(model.module) as saved:  # what one forward keeps for backward
                activations_probe = cross_entropy(model(x), y)
            del activations_probe
            breakdown = {"parameters": _tensor_bytes(model.parameters()),
                         "gradients": _tensor_bytes(p.grad for p in model.parameters()),
                         "optimizer_state": _optimizer_state_bytes(opt),
                         "activations": saved.total_bytes}
            points = ("after_init", "before_step", "after_step")
            cuda_peaks = [peaks.get(k, float("nan")) for k in points]
            per_rank = harness.gather_samples(list(breakdown.values()) + cuda_peaks + [held[k] for k in points])
            times = harness.gather_samples(samples)
            if store:
                store.add(provider="ours", config=config, metric="step_time", unit="ms",
                          stats=harness.slowest_rank_stats(times, args.warmup))
                names = (list(breakdown) + [f"peak_{point}" for point in points]
                         + [f"held_{point}" for point in points])
                for i, name in enumerate(names):
                    value = max(r[i] for r in per_rank)
                    if value == value:  # not NaN (CUDA peaks only)
                        store.add(provider="ours", config=config, metric=f"bytes_{name}", unit="MiB",
                                  value=value / 2**20)
        except Exception as error:
            harness.failure_row(store, "ours", config, error)
        finally:
            model = opt = None
    harness.print_report(store, args, ["preset", "world_size", "optimizer"],
            metrics=("step_time", "bytes_parameters", "bytes_gradients", "bytes_optimizer_state", "bytes_activations",
                     "bytes_peak_after_init", "bytes_peak_before_step", "bytes_peak_after_step",
                     "bytes_held_after_init", "bytes_held_before_step", "bytes_held_after_step"))


def _sharding_step(model, opt, peaks, held, x, y, device):
    def step():
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
        if "before_step" not in held:  # the same every step: counted once (a warm-up step), not in the timing
            held["before_step"] = _held_bytes(model, opt)
        if device.type == "cuda":
            harness.synchronize(device)
            peaks["before_step"] = torch.cuda.max_memory_allocated(device)
        opt.step()
        if "after_step" not in held:
            held["after_step"] = _held_bytes(model, opt)
        if device.type == "cuda":
            harness.synchronize(device)
            peaks["after_step"] = torch.cuda.max_memory_allocated(device)
    return step
