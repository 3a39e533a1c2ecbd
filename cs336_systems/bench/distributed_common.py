"""Launching a suite on several processes: under torchrun each process runs it; otherwise it spawns
`--world-size` processes itself. Every rank measures; rank 0 gathers (all_gather_object) and writes rows.
Also what the data-parallel suites (ddp, sharding, fsdp) share: their options, each rank's set-up and model,
the timed steps, the table and the failure rows."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from timeit import default_timer

import torch
import torch.distributed as dist

from cs336_systems.bench.common import add_common_arguments, error_message, positive_int, print_tables
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.parallel import comm
from cs336_systems.recipe import Recipe, build_model
from cs336_systems.results import ResultStore, metric_labels, rows_to_frame


def add_launch_arguments(parser: argparse.ArgumentParser, default_world_size: int = 2) -> None:
    parser.add_argument("--world-size", type=positive_int("--world-size"), default=default_world_size,
                        help=f"processes to spawn when not under torchrun (default {default_world_size})")
    parser.add_argument("--backend", choices=["gloo", "nccl"], default=None,
                        help="default: nccl with CUDA, gloo otherwise")


def launch(rank_main: Callable, args) -> int:
    """Run rank_main(args) on every rank (torchrun or spawned); returns 0."""
    backend = args.backend or ("nccl" if args.device.type == "cuda" else "gloo")
    if backend == "nccl" and args.device.type != "cuda":
        raise SystemExit("--backend nccl needs --device cuda")
    args.device = str(args.device)  # picklable across spawn
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # torchrun
        with comm.distributed(backend, device=args.device):
            rank_main(args)
    else:
        comm.spawn(_spawned, args.world_size, rank_main, args, backend=backend)
    return 0


def _spawned(rank: int, world_size: int, rank_main: Callable, args) -> None:
    rank_main(args)


def local_device(args) -> torch.device:
    """This rank's device. On CPU each rank also takes its share of the cores: with torch's default
    (all cores per process) W ranks oversubscribe the machine W times, and gloo's waits then spin
    against compute threads (on 2 cores, 2 ranks: FSDP steps 5-7x slower and erratic)."""
    if str(args.device).startswith("cuda"):
        return torch.device("cuda", torch.cuda.current_device())
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", comm.world_size()))
    torch.set_num_threads(cpu_threads_per_rank(local_ranks))
    return torch.device("cpu")


def cpu_threads_per_rank(local_ranks: int) -> int:
    return max(1, (os.cpu_count() or 1) // max(1, local_ranks))


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds for one call, synchronised before and after."""
    synchronize(device)
    start = default_timer()
    fn()
    synchronize(device)
    return default_timer() - start


def gather_samples(samples: list[float]) -> list[list[float]]:
    """Every rank's samples, on every rank."""
    if comm.world_size() == 1:
        return [samples]
    out: list = [None] * comm.world_size()
    dist.all_gather_object(out, samples)
    return out


def slowest_rank_stats(per_rank: list[list[float]], warmup: int, scale: float = 1e3) -> dict:
    """Step i takes as long as its slowest rank; the distribution over steps of that."""
    steps = [max(values) for values in zip(*per_rank)]
    return dict(median=statistics.median(steps) * scale, mean=statistics.fmean(steps) * scale,
                std=(statistics.stdev(steps) if len(steps) > 1 else 0.0) * scale, min=min(steps) * scale,
                max=max(steps) * scale, n=len(steps), warmup=warmup)


def add_model_arguments(parser) -> None:
    """The options every data-parallel suite (ddp, sharding, fsdp) takes: the model, the batch per rank, the
    steps, the launch and the common ones."""
    parser.add_argument("--preset", choices=preset_names(), default="tiny", help="model size (default tiny)")
    parser.add_argument("--context", type=positive_int("--context"), default=None, help="default: 128 (tiny: 64)")
    parser.add_argument("--batch", type=positive_int("--batch"), default=2, help="sequences per rank (default 2)")
    parser.add_argument("--warmup", type=positive_int("--warmup", 0), default=3,
                        help="untimed training steps before timing (default 3)")
    parser.add_argument("--steps", type=positive_int("--steps"), default=8, help="timed training steps (default 8)")
    add_launch_arguments(parser)
    add_common_arguments(parser)


def setup_rank(args):
    """This rank's (device, model config, inputs x, targets y, result store or None off rank 0, base config)."""
    device = local_device(args)
    cfg = ModelConfig.from_name(args.preset)
    context = args.context or min(cfg.context_length, 64 if args.preset == "tiny" else 128)
    cfg = ModelConfig.from_name(args.preset, context_length=context)
    torch.manual_seed(100 + comm.rank())  # each rank its own data
    x = torch.randint(0, cfg.vocab_size, (args.batch, context), device=device)
    y = torch.randint(0, cfg.vocab_size, (args.batch, context), device=device)
    store = ResultStore(args.suite, device, args.results_dir) if comm.rank() == 0 else None
    base = dict(preset=args.preset, context=context, batch_per_rank=args.batch, world_size=comm.world_size(),
                backend=dist.get_backend() if dist.is_initialized() else "none")
    if device.type == "cpu":
        base["threads_per_rank"] = torch.get_num_threads()
    return device, cfg, x, y, store, base


def rank_model(cfg: ModelConfig, device) -> torch.nn.Module:
    """The model every rank starts from (the same seed): the recipe's plain stack; the suites wrap it in the
    data parallelism they compare."""
    return build_model(cfg, Recipe(), device)


def measure_steps(step, finish_times: list[float], args, device):
    """Run warm-up then timed steps; returns (step seconds, exposed-communication seconds) per step."""
    for _ in range(args.warmup):
        step()
    finish_times.clear()
    samples = []
    for _ in range(args.steps):
        if comm.world_size() > 1:
            dist.barrier()
        samples.append(timed(step, device))
    return samples, list(finish_times)


def print_report(store, args, index, metrics=("step_time", "exposed_comm_time")):
    """Rank 0's table of this run's rows: one row per configuration (`index`), one column per metric."""
    if not store:
        return
    frame = rows_to_frame(store.rows)
    frame = frame[frame["metric"].isin(metrics)]
    cells = frame.assign(cell=[f"{m:.3f}" if s == "ok" else s for m, s in zip(frame["median"], frame["status"])])
    cells[index] = cells[index].astype(object).where(cells[index].notna(), "-")  # pivots drop NaN keys
    table = cells.pivot_table(index=index, columns="metric", values="cell", aggfunc="last")
    table = table.rename(columns=metric_labels(frame)).reset_index()  # headed with their units
    print_tables(store, args, (None, table))


def failure_row(store, provider, config, error):
    """Record a configuration that failed (out of memory or an error) as a row, so the sweep carries on."""
    if store:
        store.add(provider=provider, config=config, metric="step_time", unit="ms",
                  status="oom" if "out of memory" in str(error).lower() else "error",
                  message=error_message(error))
