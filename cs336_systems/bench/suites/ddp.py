"""The `ddp` suite: our DDP variants against torch's DistributedDataParallel, on any preset.

Handout problems: naive_ddp_benchmarking, minimal_ddp_flat_benchmarking,
ddp_overlap_individual_parameters_benchmarking, ddp_bucketed_benchmarking. Every rank trains its own shard of
the batch (`--batch` rows per rank) with torch's AdamW; a step counts as long as its slowest rank. Rows: time per
step and the exposed communication time (the wait in finish_gradient_synchronization after backward) per
variant: naive, flat, overlap, bucketed at each `--bucket-mb`, and torch's DistributedDataParallel as the
baseline row.

    cs336-bench ddp --preset tiny --world-size 2
    torchrun --nproc-per-node 2 -m cs336_systems.bench ddp --preset xl --device cuda
"""

from __future__ import annotations

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.bench import distributed_common as harness
from cs336_systems.bench.common import list_of, positive_float
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import make_ddp
from cs336_systems.profiling.ranges import PhaseRanges
from cs336_systems.results import format_table, rows_to_frame


def add_arguments(parser) -> None:
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler trace of the timed steps per variant (rank 0), to see comm overlap")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges: forward, backward, finish, optimizer")
    parser.add_argument("--variant", type=list_of(str, ("naive", "flat", "overlap", "bucketed", "torch-ddp"),
                                                  "--variant"),
                        default=["naive", "flat", "overlap", "bucketed", "torch-ddp"],
                        help="comma-separated DDP variants (default: all; torch-ddp is PyTorch's, the baseline)")
    parser.add_argument("--bucket-mb", type=list_of(positive_float("--bucket-mb"), name="--bucket-mb"),
                        default=[1.0, 10.0, 100.0, 1000.0],
                        help="comma-separated bucket sizes in MB for the bucketed variant (default 1,10,100,1000)")
    harness.add_model_arguments(parser)


def run(args) -> int:
    return harness.launch(_ddp_rank, args)


def _ddp_rank(args) -> None:
    device, cfg, x, y, store, base = harness.setup_rank(args)
    configs = []
    for variant in args.variant:
        configs += [(variant, mb) for mb in args.bucket_mb] if variant == "bucketed" else [(variant, None)]
    for variant, bucket_mb in configs:
        config = base | {"variant": variant, "bucket_mb": bucket_mb}
        try:
            model = harness.rank_model(cfg, device)
            if variant == "torch-ddp":  # the baseline
                wrapped = torch.nn.parallel.DistributedDataParallel(
                    model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=25)
                finish = lambda: None  # noqa: E731  (its communication is inside backward)
            else:
                kwargs = {"bucket_size_mb": bucket_mb} if variant == "bucketed" else {}
                wrapped = make_ddp(model, variant, **kwargs)
                finish = wrapped.finish_gradient_synchronization
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
            finish_times: list[float] = []
            ranges = PhaseRanges(device, nvtx=args.nvtx, record=args.profile)
            step = _ddp_step(wrapped, opt, finish, finish_times, x, y, device, ranges.phase)
            samples, exposed = harness.measure_steps(step, finish_times, args, device)
            if args.profile:
                _trace_steps(step, args, device, f"ddp_{variant}" + (f"_{bucket_mb:g}mb" if bucket_mb else ""))
            per_rank, exposed_per_rank = harness.gather_samples(samples), harness.gather_samples(exposed)
            if store:
                store.add(provider="torch" if variant == "torch-ddp" else "ours", config=config, metric="step_time",
                          unit="ms", stats=harness.slowest_rank_stats(per_rank, args.warmup))
                if variant != "torch-ddp":
                    store.add(provider="ours", config=config, metric="exposed_comm_time", unit="ms",
                              stats=harness.slowest_rank_stats(exposed_per_rank, args.warmup))
        except Exception as error:
            harness.failure_row(store, "ours", config, error)
        finally:
            model = wrapped = opt = None
    harness.print_report(store, args, ["preset", "world_size", "backend", "variant", "bucket_mb"])
    if store:
        frame = rows_to_frame(store.rows)
        steps = frame[(frame["metric"] == "step_time") & (frame["status"] == "ok")]
        torch_row = steps[steps["variant"] == "torch-ddp"]
        if not torch_row.empty:
            baseline = torch_row["median"].iloc[-1]
            for row in steps[steps["variant"] != "torch-ddp"].itertuples():
                store.add(provider="ours", config={k: getattr(row, k) for k in base} | {
                    "variant": row.variant, "bucket_mb": None if row.bucket_mb != row.bucket_mb else row.bucket_mb},
                          metric="step_time_vs_torch_ddp", unit="x", value=row.median / baseline)
            ratios = rows_to_frame([r for r in store.rows if r["metric"] == "step_time_vs_torch_ddp"])
            ratios["bucket_mb"] = ratios["bucket_mb"].astype(object).where(ratios["bucket_mb"].notna(), "-")
            print("\nour step time / torch DDP's (same run)")
            print(format_table(ratios[["variant", "bucket_mb", "median"]].rename(columns={"median": "ratio"}).round(3),
                               "latex" if args.latex else "markdown"))


def _ddp_step(wrapped, opt, finish, finish_times, x, y, device, phase):
    def step():
        if hasattr(wrapped, "on_train_batch_start"):
            wrapped.on_train_batch_start()
        opt.zero_grad(set_to_none=True)
        with phase("forward"):
            loss = cross_entropy(wrapped(x), y)
        with phase("backward"):
            loss.backward()
        with phase("finish_gradient_synchronization"):
            finish_times.append(harness.timed(finish, device))  # the communication backward left exposed
        with phase("optimizer"):
            opt.step()
    return step


def _trace_steps(step, args, device, name: str) -> None:
    """A Perfetto trace of a few steps on every rank (rank 0's is written): communication kernels
    after backward (naive) or under it (overlap, bucketed) is what a user looks for."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(min(args.steps, 3)):
            step()
        harness.synchronize(device)
    if comm.rank() == 0:
        path = Path(args.results_dir) / "traces" / f"{name}_ws{comm.world_size()}.pt.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        print(f"trace: {path}")
