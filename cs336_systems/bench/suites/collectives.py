"""The `collectives` suite: all-reduce, all-gather and reduce-scatter of fp32 tensors over ranks.

Handout problem: distributed_communication_single_node. Each size is run `--warmup` times, then
timed `--steps` times (barrier, synchronise, call, synchronise); a step counts as long as its
slowest rank (times gathered with all_gather_object). Bandwidths follow nccl-tests: size is the
full tensor (the all-gather's output, the reduce-scatter's input); algbw = size / time; busbw =
algbw x 2(n-1)/n for all-reduce and x (n-1)/n for the other two. On gloo, reduce-scatter is
all-reduce + slice (gloo has none), so its times are an all-reduce's.

    cs336-bench collectives --world-size 4 --sizes-mb 1,10,100
    torchrun --nproc-per-node 2 -m cs336_systems.bench collectives --device cuda
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cs336_systems.bench.common import add_common_arguments, error_message, list_of, positive_int, print_tables
from cs336_systems.bench.distributed_common import (
    add_launch_arguments,
    gather_samples,
    launch,
    local_device,
    slowest_rank_stats,
    timed,
)
from cs336_systems.parallel import comm
from cs336_systems.results import ResultStore, metric_labels, rows_to_frame

OPS = ("all-reduce", "all-gather", "reduce-scatter")
BUS_FACTOR = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
              "reduce-scatter": lambda n: (n - 1) / n}


def add_arguments(parser) -> None:
    parser.add_argument("--op", type=list_of(str, OPS, "--op"), default=list(OPS),
                        help=f"comma-separated collectives from: {', '.join(OPS)} (default: all)")
    parser.add_argument("--sizes-mb", type=list_of(float, name="--sizes-mb"), default=[1.0, 10.0, 100.0, 1000.0],
                        help="tensor sizes in MB (10^6 bytes), comma-separated (default 1,10,100,1000)")
    parser.add_argument("--warmup", type=positive_int("--warmup", 0), default=5,
                        help="untimed calls before timing (default 5)")
    parser.add_argument("--steps", type=positive_int("--steps"), default=10, help="timed calls (default 10)")
    parser.add_argument("--plot", default=None, help="write time and bus-bandwidth plots of the results file here")
    add_launch_arguments(parser)
    add_common_arguments(parser)


def run(args) -> int:
    for size in args.sizes_mb:
        if size <= 0:
            raise SystemExit(f"--sizes-mb: sizes must be positive, got {size}")
    return launch(_rank_main, args)


def _call(op: str, size_bytes: int, device: torch.device):
    n = comm.world_size()
    numel = max(n, size_bytes // 4 // n * n)  # divisible by the world size
    full = torch.randn(numel, device=device)
    part = torch.randn(numel // n, device=device)
    if op == "all-reduce":
        return lambda: comm.all_reduce(full)
    if op == "all-gather":
        return lambda: comm.all_gather_into(full, part)
    return lambda: comm.reduce_scatter(part, full)


def _rank_main(args) -> None:
    device = local_device(args)
    n, rank = comm.world_size(), comm.rank()
    store = ResultStore("collectives", device, args.results_dir) if rank == 0 else None
    backend = dist.get_backend() if dist.is_initialized() else "none"
    for op in args.op:
        for size_mb in args.sizes_mb:
            size_bytes = int(size_mb * 1e6)
            config = dict(op=op, size_mb=size_mb, world_size=n, backend=backend, dtype="fp32")
            try:
                call = _call(op, size_bytes, device)
                for _ in range(args.warmup):
                    timed(call, device)
                samples = []
                for _ in range(args.steps):
                    if n > 1:
                        dist.barrier()
                    samples.append(timed(call, device))
                per_rank = gather_samples(samples)
            except Exception as error:  # e.g. out of memory at 1 GB: a row, and on to the next size
                if store:
                    store.add(provider="ours", config=config, metric="time", unit="ms",
                              status="oom" if "out of memory" in str(error).lower() else "error",
                              message=error_message(error))
                continue
            if store:
                stats = slowest_rank_stats(per_rank, args.warmup)
                store.add(provider="torch.distributed", config=config, metric="time", unit="ms", stats=stats)
                seconds = stats["median"] / 1e3
                store.add(provider="torch.distributed", config=config, metric="algbw", unit="GB/s",
                          value=size_bytes / seconds / 1e9)
                store.add(provider="torch.distributed", config=config, metric="busbw", unit="GB/s",
                          value=size_bytes / seconds / 1e9 * BUS_FACTOR[op](n))
    if store:
        frame = rows_to_frame(store.rows)
        ok = frame[frame["status"] == "ok"]
        table = ok.pivot_table(index=["op", "size_mb", "world_size", "backend"], columns="metric",
                               values="median", aggfunc="last").rename(columns=metric_labels(ok)).reset_index().round(3)
        print_tables(store, args, (None, table))
        if args.plot:
            from pathlib import Path

            from cs336_systems.plots import plot_collectives
            from cs336_systems.results import load_rows

            plot_collectives(rows_to_frame(load_rows(store.path)), Path(args.plot))  # every run in the file
            print(f"plot: {args.plot}")
