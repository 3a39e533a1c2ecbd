"""Launching a suite on several processes: under torchrun each process runs it; otherwise it spawns
`--world-size` processes itself. Every rank measures; rank 0 gathers (all_gather_object) and writes rows."""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable
from timeit import default_timer

import torch
import torch.distributed as dist

from cs336_systems.bench.common import positive_int
from cs336_systems.parallel import comm


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
