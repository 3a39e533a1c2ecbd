"""The `ddp`, `sharding` and `fsdp` suites: our data-parallel stack against torch's, on any preset.

Handout problems: naive_ddp_benchmarking, minimal_ddp_flat_benchmarking, ddp_overlap_individual_
parameters_benchmarking, ddp_bucketed_benchmarking, optimizer_state_sharding_accounting, and the
FSDP comparison. Every rank trains its own shard of the batch (`--batch` rows per rank) with
torch's AdamW; a step counts as long as its slowest rank.

* ddp: time per step and the exposed communication time (the wait in
  finish_gradient_synchronization after backward) per variant: naive, flat, overlap, bucketed at
  each `--bucket-mb`, and torch's DistributedDataParallel as the baseline row.
* sharding: bytes of parameters, gradients and optimizer state held per rank (counted from the
  tensors themselves) and of activations (what one forward saves for backward, SavedTensorLog);
  CUDA peaks after init / before / after the optimizer step; time per step; with AdamW
  unsharded and with our ZeRO-1 ShardedOptimizer (both under bucketed DDP).
* fsdp: our FSDP (fp32 and --compute-dtype; `fsdp` gathers per block, `fsdp-layer` per weight)
  against bucketed DDP and torch's FSDP2 (fully_shard, baseline): time per step, peak memory, and
  how many weight gathers were complete before use.

    cs336-bench ddp --preset tiny --world-size 2
    torchrun --nproc-per-node 2 -m cs336_systems.bench ddp --preset xl --device cuda
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.bench.common import DTYPES, add_common_arguments, error_message, list_of, positive_int
from cs336_systems.bench.distributed_common import (
    add_launch_arguments,
    gather_samples,
    launch,
    local_device,
    slowest_rank_stats,
    synchronize,
    timed,
)
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.memory.saved_tensors import SavedTensorLog
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import make_ddp
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from cs336_systems.profiling.ranges import PhaseRanges
from cs336_systems.results import ResultStore, format_table, rows_to_frame


def _add_model_arguments(parser) -> None:
    parser.add_argument("--preset", choices=preset_names(), default="tiny", help="model size (default tiny)")
    parser.add_argument("--context", type=positive_int("--context"), default=None, help="default: 128 (tiny: 64)")
    parser.add_argument("--batch", type=positive_int("--batch"), default=2, help="sequences per rank (default 2)")
    parser.add_argument("--warmup", type=positive_int("--warmup", 0), default=3,
                        help="untimed training steps before timing (default 3)")
    parser.add_argument("--steps", type=positive_int("--steps"), default=8, help="timed training steps (default 8)")
    add_launch_arguments(parser)
    add_common_arguments(parser)


def add_ddp_arguments(parser) -> None:
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler trace of the timed steps per variant (rank 0), to see comm overlap")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges: forward, backward, finish, optimizer")
    parser.add_argument("--variant", type=list_of(str, ("naive", "flat", "overlap", "bucketed", "torch-ddp"),
                                                  "--variant"),
                        default=["naive", "flat", "overlap", "bucketed", "torch-ddp"],
                        help="comma-separated DDP variants (default: all; torch-ddp is PyTorch's, the baseline)")
    parser.add_argument("--bucket-mb", type=list_of(float, name="--bucket-mb"), default=[1.0, 10.0, 100.0, 1000.0],
                        help="comma-separated bucket sizes in MB for the bucketed variant (default 1,10,100,1000)")
    _add_model_arguments(parser)


def add_sharding_arguments(parser) -> None:
    _add_model_arguments(parser)


def add_fsdp_arguments(parser) -> None:
    parser.add_argument("--compute-dtype", type=list_of(str, tuple(DTYPES), "--compute-dtype"),
                        default=["fp32", "bf16"], help="comma-separated compute dtypes (default fp32,bf16)")
    parser.add_argument("--provider", type=list_of(str, ("fsdp", "fsdp-layer", "ddp", "torch-fsdp2"), "--provider"),
                        default=["fsdp", "ddp", "torch-fsdp2"],
                        help="comma-separated from: fsdp, fsdp-layer, ddp, torch-fsdp2 (PyTorch's, the baseline); "
                             "default fsdp,ddp,torch-fsdp2")
    _add_model_arguments(parser)


def _setup(args):
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


def _build(cfg: ModelConfig, device) -> torch.nn.Module:
    torch.manual_seed(0)
    return cfg.build(device=device)


def _measure(step, finish_times: list[float], args, device):
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


def _report(store, args, index, metrics=("step_time", "exposed_comm_time")):
    if not store:
        return
    frame = rows_to_frame(store.rows)
    frame = frame[frame["metric"].isin(metrics)]
    cells = frame.assign(cell=[f"{m:.3f}" if s == "ok" else s for m, s in zip(frame["median"], frame["status"])])
    cells[index] = cells[index].astype(object).where(cells[index].notna(), "-")  # pivots drop NaN keys
    table = cells.pivot_table(index=index, columns="metric", values="cell", aggfunc="last").reset_index()
    print(format_table(table, "latex" if args.latex else "markdown"))
    print(f"\nrows appended to {store.path}")


def _failure_row(store, provider, config, error):
    if store:
        store.add(provider=provider, config=config, metric="step_time", unit="ms",
                  status="oom" if "out of memory" in str(error).lower() else "error",
                  message=error_message(error))


# ---- ddp ----
def run_ddp(args) -> int:
    return launch(_ddp_rank, args)


def _ddp_rank(args) -> None:
    device, cfg, x, y, store, base = _setup(args)
    configs = []
    for variant in args.variant:
        configs += [(variant, mb) for mb in args.bucket_mb] if variant == "bucketed" else [(variant, None)]
    for variant, bucket_mb in configs:
        config = base | {"variant": variant, "bucket_mb": bucket_mb}
        try:
            model = _build(cfg, device)
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
            samples, exposed = _measure(step, finish_times, args, device)
            if args.profile:
                _trace_steps(step, args, device, f"ddp_{variant}" + (f"_{bucket_mb:g}mb" if bucket_mb else ""))
            per_rank, exposed_per_rank = gather_samples(samples), gather_samples(exposed)
            if store:
                store.add(provider="torch" if variant == "torch-ddp" else "ours", config=config, metric="step_time",
                          unit="ms", stats=slowest_rank_stats(per_rank, args.warmup))
                if variant != "torch-ddp":
                    store.add(provider="ours", config=config, metric="exposed_comm_time", unit="ms",
                              stats=slowest_rank_stats(exposed_per_rank, args.warmup))
        except Exception as error:
            _failure_row(store, "ours", config, error)
        finally:
            model = wrapped = opt = None
    _report(store, args, ["preset", "world_size", "backend", "variant", "bucket_mb"])
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
            finish_times.append(timed(finish, device))  # the communication backward left exposed
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
        synchronize(device)
    if comm.rank() == 0:
        path = Path(args.results_dir) / "traces" / f"{name}_ws{comm.world_size()}.pt.trace.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        print(f"trace: {path}")


# ---- sharding ----
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


def run_sharding(args) -> int:
    return launch(_sharding_rank, args)


def _sharding_rank(args) -> None:
    device, cfg, x, y, store, base = _setup(args)
    for sharded in (False, True):
        config = base | {"optimizer": "zero1-sharded-adamw" if sharded else "adamw"}
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
            model = make_ddp(_build(cfg, device), "bucketed", bucket_size_mb=25.0)
            opt = (ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-4) if sharded
                   else torch.optim.AdamW(model.parameters(), lr=1e-4))
            peaks = {}
            if device.type == "cuda":
                peaks["after_init"] = torch.cuda.max_memory_allocated(device)
            samples, _ = _measure(_sharding_step(model, opt, peaks, x, y, device), [], args, device)
            with SavedTensorLog(model.module) as saved:  # what one forward keeps for backward
                activations_probe = cross_entropy(model(x), y)
            del activations_probe
            breakdown = {"parameters": _tensor_bytes(model.parameters()),
                         "gradients": _tensor_bytes(p.grad for p in model.parameters()),
                         "optimizer_state": _optimizer_state_bytes(opt),
                         "activations": saved.total_bytes}
            cuda_peaks = [peaks.get(k, float("nan")) for k in ("after_init", "before_step", "after_step")]
            per_rank = gather_samples(list(breakdown.values()) + cuda_peaks)
            times = gather_samples(samples)
            if store:
                store.add(provider="ours", config=config, metric="step_time", unit="ms",
                          stats=slowest_rank_stats(times, args.warmup))
                names = list(breakdown) + ["peak_after_init", "peak_before_step", "peak_after_step"]
                for i, name in enumerate(names):
                    value = max(r[i] for r in per_rank)
                    if value == value:  # not NaN (CUDA peaks only)
                        store.add(provider="ours", config=config, metric=f"bytes_{name}", unit="MiB",
                                  value=value / 2**20)
        except Exception as error:
            _failure_row(store, "ours", config, error)
        finally:
            model = opt = None
    _report(store, args, ["preset", "world_size", "optimizer"],
            metrics=("step_time", "bytes_parameters", "bytes_gradients", "bytes_optimizer_state", "bytes_activations",
                     "bytes_peak_after_init", "bytes_peak_before_step", "bytes_peak_after_step"))


def _sharding_step(model, opt, peaks, x, y, device):
    def step():
        opt.zero_grad(set_to_none=True)
        cross_entropy(model(x), y).backward()
        model.finish_gradient_synchronization()
        if device.type == "cuda":
            synchronize(device)
            peaks["before_step"] = torch.cuda.max_memory_allocated(device)
        opt.step()
        if device.type == "cuda":
            synchronize(device)
            peaks["after_step"] = torch.cuda.max_memory_allocated(device)
    return step


# ---- fsdp ----
def run_fsdp(args) -> int:
    return launch(_fsdp_rank, args)


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
    device, cfg, x, y, store, base = _setup(args)
    for dtype_name in args.compute_dtype:
        for provider in args.provider:
            config = base | {"provider_kind": provider, "compute_dtype": dtype_name}
            try:
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                    torch.cuda.reset_peak_memory_stats(device)
                model = _build(cfg, device)
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
                samples, _ = _measure(_fsdp_step(wrapped, opt, finish, autocast, x, y), [], args, device)
                times = gather_samples(samples)
                stats = copy.copy(getattr(wrapped, "gather_stats", {}))
                peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else float("nan")
                peaks = gather_samples([peak])
                if store:
                    label = "torch" if provider == "torch-fsdp2" else "ours"
                    store.add(provider=label, config=config, metric="step_time", unit="ms",
                              stats=slowest_rank_stats(times, args.warmup))
                    if peak == peak:
                        store.add(provider=label, config=config, metric="peak_allocated", unit="GiB",
                                  value=max(p[0] for p in peaks) / 2**30)
                    if stats:
                        total = stats["ready_before_use"] + stats["waited"]
                        store.add(provider=label, config=config, metric="gathers_ready_before_use", unit="fraction",
                                  value=stats["ready_before_use"] / total if total else float("nan"))
            except Exception as error:
                _failure_row(store, "torch" if provider == "torch-fsdp2" else "ours", config, error)
            finally:
                model = wrapped = opt = None
    _report(store, args, ["preset", "world_size", "compute_dtype", "provider_kind"],
            metrics=("step_time", "peak_allocated", "gathers_ready_before_use"))
