"""The `fsdp` suite: our FSDP against bucketed DDP and torch's FSDP2 (fully_shard, the baseline).

Our FSDP in fp32 and each `--compute-dtype` (`fsdp` gathers per block, `fsdp-layer` per weight): time per step,
peak memory, and how many weight gathers were complete before use.

    cs336-bench fsdp --preset tiny --world-size 2
"""

from __future__ import annotations

import contextlib
import copy

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.bench import distributed_common as harness
from cs336_systems.bench.common import DTYPES, list_of
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import make_ddp
from cs336_systems.parallel.fsdp import FSDP


def add_arguments(parser) -> None:
    parser.add_argument("--compute-dtype", type=list_of(str, tuple(DTYPES), "--compute-dtype"),
                        default=["fp32", "bf16"], help="comma-separated compute dtypes (default fp32,bf16)")
    parser.add_argument("--provider", type=list_of(str, ("fsdp", "fsdp-layer", "ddp", "torch-fsdp2"), "--provider"),
                        default=["fsdp", "ddp", "torch-fsdp2"],
                        help="comma-separated from: fsdp, fsdp-layer, ddp, torch-fsdp2 (PyTorch's, the baseline); "
                             "default fsdp,ddp,torch-fsdp2")
    harness.add_model_arguments(parser)


def run(args) -> int:
    return harness.launch(_fsdp_rank, args)


def _torch_fsdp2(model, device, dtype_name):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (comm.world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[dtype_name]) if dtype_name != "fp32" else MixedPrecisionPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)  # the baseline


def _fsdp_step(wrapped, opt, finish, autocast, x, y):
    def step():
        opt.zero_grad(set_to_none=True)
        with autocast:
            logits = wrapped(x)
        cross_entropy(logits.float(), y).backward()
        finish()
        opt.step()
    return step


def _fsdp_rank(args) -> None:
    device, cfg, x, y, store, base = harness.setup_rank(args)
    for dtype_name in args.compute_dtype:
        for provider in args.provider:
            config = base | {"provider_kind": provider, "compute_dtype": dtype_name}
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                model = harness.rank_model(cfg, device)
                autocast = contextlib.nullcontext()
                if provider in ("fsdp", "fsdp-layer"):  # one all-gather per block, or per weight
                    wrapped = FSDP(model, compute_dtype=None if dtype_name == "fp32" else DTYPES[dtype_name],
                                   unit="layer" if provider == "fsdp-layer" else "block")
                    finish = wrapped.finish_gradient_synchronization
                elif provider == "ddp":
                    wrapped = make_ddp(model, "bucketed", bucket_size_mb=25.0)
                    finish = wrapped.finish_gradient_synchronization
                    if dtype_name != "fp32":
                        autocast = torch.autocast(device.type, dtype=DTYPES[dtype_name])
                else:
                    wrapped = _torch_fsdp2(model, device, dtype_name)
                    finish = lambda: None  # noqa: E731
                opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
                samples, _ = harness.measure_steps(_fsdp_step(wrapped, opt, finish, autocast, x, y), [], args, device)
                times = harness.gather_samples(samples)
                stats = copy.copy(getattr(wrapped, "gather_stats", {}))
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
                peaks = harness.gather_samples([peak])
                if store:
                    label = "torch" if provider == "torch-fsdp2" else "ours"
                    store.add(provider=label, config=config, metric="step_time", unit="ms",
                              stats=harness.slowest_rank_stats(times, args.warmup))
                    if peak == peak:
                        store.add(provider=label, config=config, metric="peak_allocated", unit="GiB",
                                  value=max(p[0] for p in peaks) / 2**30)
                    if stats:
                        total = stats["ready_before_use"] + stats["waited"]
                        store.add(provider=label, config=config, metric="gathers_ready_before_use", unit="fraction",
                                  value=stats["ready_before_use"] / total if total else float("nan"))
            except Exception as error:
                harness.failure_row(store, "torch" if provider == "torch-fsdp2" else "ours", config, error)
            finally:
                model = wrapped = opt = None
    harness.print_report(store, args, ["preset", "world_size", "compute_dtype", "provider_kind"],
            metrics=("step_time", "peak_allocated", "gathers_ready_before_use"))
