"""The `leaderboard` suite: the fastest full training step (zero_grad, forward, loss, backward,
AdamW step) of the leaderboard model, with our kernels only, beside the PyTorch-native baseline.

Our step (provider `ours`): BasicsTransformerLM with its parameters in --param-dtype, our attention
(--attention, Triton FlashAttention-2 on CUDA), our fused RMSNorm and SwiGLU gate (--fused), the
fused LM-head cross-entropy (no (tokens, vocab) logits), our fused AdamW (Triton, state in
--state-dtype) and an activation-checkpointing policy (--checkpoint; `auto` takes the least
recompute that the analytic memory model says fits, and moves to more checkpointing if the
device still runs out of memory). The baseline (provider `baseline`, as ../shared/baselines/
ref_lm.py): a PyTorch-native LM of the same shape with cuDNN/flash SDPA, every block
checkpointed, chunked cross-entropy and torch's fused AdamW, parameters and state in the same dtype.

Timed like the official harness with triton.testing.do_bench (--warmup-ms / --rep-ms; the
official harness uses 10000 / 30000) on CUDA, with the timing helper on CPU; a per-phase
breakdown comes from CUDA events over three more steps. `command_wall_time` is the whole run
of the suite from its start (model builds, Triton autotuning and compiles included): from an
empty cache it is the cold-start time.

`--verify` checks, on the configuration given (use a small one), that our step's loss and
gradients agree with the plain cs336_basics model step (reference attention, cross_entropy on
logits): the error against an fp64 run may be at most 2x that of the plain step at --param-dtype.

Several GPUs (one sequence per rank): under torchrun, or `--world-size N` to spawn the ranks. Ours
runs data parallel through our DDP (`--ddp`, default `overlap`: each gradient's all-reduce starts
from its accumulation hook, in place, so no bucket copies add memory and communication hides
under the rest of backward); the baseline through torch's DistributedDataParallel. The phase
`sync` is the wait for the last all-reduces after backward (the exposed communication). Each
rank times its own step (every step waits on the collectives, so they agree); rank 0 writes the
rows. With several ranks only the first policy of the ladder is tried: an out-of-memory on one
rank ends the run (the others would wait in a collective), with the error named.

    cs336-bench leaderboard --preset tiny --device cpu --verify          # CI-sized
    cs336-bench leaderboard --preset xl --context 8192                   # without an H200
    cs336-bench leaderboard                                              # the 8B model at 32k
    cs336-bench leaderboard --provider ours --rep-ms 3000 --profile      # where the step's time goes
    torchrun --nproc-per-node 2 -m cs336_systems.bench leaderboard --batch 1   # 2 GPUs, 2 sequences
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import time

import torch

from cs336_systems.attention import attention_names
from cs336_systems.bench.common import (
    DTYPES,
    add_common_arguments,
    checkpoint_policy,
    error_message,
    fraction,
    free_memory,
    is_oom,
    list_of,
    positive_int,
)
from cs336_systems.bench.distributed_common import add_launch_arguments, launch, local_device
from cs336_systems.bench.leaderboard_step import baseline_step, our_step, verify
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.memory.planner import FIT_FRACTION, policy_candidates
from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import VARIANTS as DDP_VARIANTS
from cs336_systems.profiling.flops import flops_for_mode, measure_matmul_peak
from cs336_systems.profiling.ranges import PhaseRanges
from cs336_systems.profiling.timing import bench_kernel, time_fn
from cs336_systems.recipe import Recipe, attention_context
from cs336_systems.results import ResultStore, format_table

PROVIDERS = ("ours", "baseline")
PHASES = ("forward", "loss", "backward", "sync", "optimizer")  # the step's named ranges, in order
PHASE_STEPS = 3  # steps timed phase by phase after the whole-step timing


def add_arguments(parser) -> None:
    parser.add_argument("--preset", choices=preset_names(), default="leaderboard-8b",
                        help="model size (default leaderboard-8b; tiny for a CPU check)")
    parser.add_argument("--context", type=positive_int("--context"), default=None, help="default: the preset's")
    parser.add_argument("--batch", type=positive_int("--batch"), default=1, help="sequences per step (default 1)")
    parser.add_argument("--provider", type=list_of(str, PROVIDERS, "--provider"), default=["ours", "baseline"],
                        help="comma-separated: ours, baseline (default both, baseline measured in the same run)")
    parser.add_argument("--param-dtype", choices=list(DTYPES), default=None,
                        help="parameters and gradients (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--state-dtype", choices=["fp32", "bf16"], default=None,
                        help="AdamW moments (default: the parameter dtype, as the baseline keeps them)")
    parser.add_argument("--attention", choices=attention_names(), default=None,
                        help="default: triton on CUDA, pytorch-flash on CPU")
    parser.add_argument("--fused", choices=["on", "off"], default=None,
                        help="our Triton RMSNorm and SwiGLU gate (default on for CUDA, off on CPU)")
    parser.add_argument("--fused-rope", action=argparse.BooleanOptionalAction, default=None,
                        help="our Triton RoPE too (default: on with --fused on; on the H200 it took the 8B step's "
                             "RoPE from 227 to 33 ms)")
    parser.add_argument("--checkpoint", type=_policy_or_auto, default="auto",
                        help="auto (the memory model's ladder), or a policy: none, every-block, every-k:K, "
                             "partial:M, nested, selective, ...; +keep-attn on the single-level ones keeps "
                             "attention outputs; partial:M[+keep-attn]+selective keeps the other blocks' "
                             "products and recomputes only their pointwise ops")
    parser.add_argument("--fit-fraction", type=fraction("--fit-fraction"), default=FIT_FRACTION,
                        help=f"with --checkpoint auto: the share of the free memory the predicted peak may take "
                             f"(default {FIT_FRACTION}; the ladder falls back to more recompute after an "
                             f"out-of-memory)")
    parser.add_argument("--optimizer", choices=["fused", "cs336"], default=None,
                        help="fused (our Triton AdamW; default on CUDA) or cs336 (cs336_basics AdamW)")
    parser.add_argument("--chunk-tokens", type=positive_int("--chunk-tokens"), default=4096,
                        help="token chunk of the fused cross-entropy and of the baseline's chunked loss (default 4096)")
    parser.add_argument("--warmup-ms", type=float, default=2000.0, help="untimed steps for this long (default 2000)")
    parser.add_argument("--rep-ms", type=float, default=6000.0, help="timed steps for this long (default 6000)")
    parser.add_argument("--verify", action="store_true", help="check loss and gradients against the plain step")
    parser.add_argument("--profile", action="store_true",
                        help="after timing, one more step of each provider under torch.profiler: kernel time per "
                             "phase and kind of work (matmul, attention, pointwise, ...) as rows and a table")
    add_launch_arguments(parser, default_world_size=1)
    parser.add_argument("--ddp", choices=list(DDP_VARIANTS), default="overlap",
                        help="our DDP variant with several ranks (default overlap)")
    add_common_arguments(parser)


def _policy_or_auto(text: str) -> CheckpointPolicy | str:
    """argparse type of --checkpoint: "auto" (the memory model's ladder), or a policy."""
    return text if text == "auto" else checkpoint_policy("--checkpoint")(text)


def _our_recipe(args, on_cuda: bool) -> Recipe:
    """Our step's recipe, its defaults resolved for the device (the policy is filled in per rung of the ladder):
    on CUDA bf16 parameters and state, our Triton attention, fused kernels and fused AdamW (torch's update); on
    the CPU fp32, the tiled PyTorch attention and the plain pieces. Bad combinations stop here, before work."""
    param = args.param_dtype or ("bf16" if on_cuda else "fp32")
    fused = (args.fused or ("on" if on_cuda else "off")) == "on"
    if fused and not on_cuda:
        from cs336_systems.kernels._triton_utils import interpreting

        if not interpreting():
            raise SystemExit("--fused on: our Triton RMSNorm/SwiGLU need CUDA (or TRITON_INTERPRET=1 on CPU)")
    if args.fused_rope and not fused:
        raise SystemExit("--fused-rope needs --fused on")
    return Recipe(attention=args.attention or ("triton" if on_cuda else "pytorch-flash"), fused=fused,
                  fused_rope=fused if args.fused_rope is None else args.fused_rope, param_dtype=DTYPES[param],
                  optimizer=args.optimizer or ("fused" if on_cuda else "cs336"), optimizer_maths="torch",
                  state_dtype=DTYPES[args.state_dtype or ("fp32" if param == "fp32" else "bf16")], fused_loss=True)


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


def _measure(store, provider, config, cfg, args, device, build_step, matmul_peak) -> dict:
    """Time one provider's step; rows for time, tokens/s, MFU, peak memory and phases. Returns a summary."""
    seq, batch = config["context"], config["batch"]
    if device.type == "cuda":  # the peak of the steps, not of the model's build (fp32 init, then the cast)
        torch.cuda.reset_peak_memory_stats(device)
    ranges = PhaseRanges(device, time=True)
    step, plain_step = build_step(ranges.phase)
    if comm.world_size() > 1:
        timing = _bench_in_lockstep(plain_step, device, args.warmup_ms, args.rep_ms)
    else:
        timing = bench_kernel(plain_step, device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    ranges.reset()
    for _ in range(PHASE_STEPS):
        step()
    phases = {name: sum(v) / len(v) * 1e3 for name, v in ranges.collect().items()}
    flops = flops_for_mode(cfg, batch, seq, "train-step")
    store.add(provider=provider, config=config, metric="step_time", unit="ms", stats=timing.stats())
    store.add(provider=provider, config=config, metric="tokens_per_s", unit="tok/s", value=batch * seq / timing.median)
    summary = dict(provider=provider, checkpoint=config["checkpoint"], step_ms=timing.median * 1e3)
    if device.type == "cuda":
        summary["mfu_%"] = 100 * flops / timing.median / matmul_peak
        summary["peak_GiB"] = torch.cuda.max_memory_allocated(device) / 2**30
        store.add(provider=provider, config=config, metric="mfu", unit="%", value=summary["mfu_%"])
        store.add(provider=provider, config=config, metric="peak_allocated", unit="GiB", value=summary["peak_GiB"])
    for name, ms in phases.items():
        store.add(provider=provider, config=config | {"phase": name}, metric="phase_time", unit="ms", value=ms)
        summary[f"{name}_ms"] = ms
    if args.profile:
        _profile(store, provider, config, device, build_step)
    return summary


def _profile(store, provider, config, device, build_step, steps: int = 1) -> None:
    """Kernel time of `steps` more steps by phase and kind of work: rows (`profile_category_time`, and
    `profile_kernel_time` for the 40 costliest kernels) and a printed table. No trace file: at 8B a
    step launches thousands of kernels and the trace would run to hundreds of MB."""
    from cs336_systems.profiling.trace import category_summary, profile_steps

    ranges = PhaseRanges(device, record=True, sync=True)
    step, _ = build_step(ranges.phase)
    kernels = profile_steps(step, steps=steps, device=device, range_names=PHASES)
    categories = category_summary(kernels, steps=steps)
    for row in categories.itertuples():
        store.add(provider=provider, config=config | {"range": row.range, "category": row.category,
                                                      "calls_per_step": row.calls_per_step},
                  metric="profile_category_time", unit="ms", value=row.ms_per_step)
    for row in kernels.head(40).itertuples():
        store.add(provider=provider, config=config | {"range": row.range, "kernel": row.kernel[:120],
                                                      "calls_per_step": row.calls_per_step},
                  metric="profile_kernel_time", unit="ms", value=row.total_ms / steps)
    table = categories.pivot_table(index="category", columns="range", values="ms_per_step", aggfunc="sum",
                                   fill_value=0.0)
    table["total"] = table.sum(axis=1)
    print(f"\nkernel time per step by phase and kind ({provider}, {config['checkpoint']}), ms:")
    print(format_table(table.sort_values("total", ascending=False).round(1).reset_index()))


def _bench_in_lockstep(step, device, warmup_ms: float, rep_ms: float):
    """do_bench's warm-up / repetition budget with step counts every rank agrees on: do_bench sizes its
    loops from each rank's own estimate, and ranks that run different step counts deadlock in the
    collectives. One warm step is timed, the slowest rank's time sets both counts."""
    step()  # first call: compiles and autotunes
    first = time_fn(step, warmup=0, steps=1, device=device).median * 1e3
    estimate = torch.tensor([first], dtype=torch.float64, device=device)
    comm.all_reduce(estimate, op=torch.distributed.ReduceOp.MAX)
    per_step = max(float(estimate), 1e-3)
    warmup = max(1, math.ceil(warmup_ms / per_step))
    steps = max(3, math.ceil(rep_ms / per_step))
    return time_fn(step, warmup=warmup, steps=steps, device=device)


def run(args) -> int:
    under_torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ
    if (under_torchrun or args.world_size > 1) and args.verify:
        raise SystemExit("--verify runs in one process; drop --world-size / torchrun for it")
    if under_torchrun or args.world_size > 1:
        return launch(_run_rank, args)
    return _run_rank(args)


class _NoRows:
    """The store of ranks other than 0: they measure, rank 0 writes."""

    path = "(rank 0 writes the rows)"

    def add(self, **kwargs) -> dict:
        return {}


def _verify(store, cfg, device, recipe: Recipe, policy: CheckpointPolicy, args, config: dict) -> None:
    """--verify: our step's gradients against an fp64 plain step, within twice the plain step's own error."""
    dtype = recipe.param_dtype
    errors = verify(cfg, device, dtype, recipe.attention, policy, args.chunk_tokens, recipe.fused, recipe.fused_rope)
    for metric, value in errors.items():
        store.add(provider="ours" if metric.startswith("ours") else "plain",
                  config=config | dict(checkpoint=str(policy)), metric=metric, unit="", value=value)
    budget = 2 * errors["plain_grad_rel_error"] + 2 * torch.finfo(dtype).eps
    ok = errors["ours_grad_rel_error"] <= budget
    print(f"verify: gradient relative error ours {errors['ours_grad_rel_error']:.2e}, plain "
          f"{errors['plain_grad_rel_error']:.2e} (budget {budget:.2e}): {'ok' if ok else 'FAILED'}")
    if not ok:
        raise SystemExit("leaderboard --verify: our step's gradients are outside the error budget")


def _print_summary(store, summaries: list[dict], config: dict, recipe: Recipe, wall: float, args) -> None:
    import pandas as pd

    table = pd.DataFrame(summaries)
    if {"ours", "baseline"} <= set(table.get("provider", [])):
        ours_ms = table.loc[table.provider == "ours", "step_ms"].iloc[0]
        base_ms = table.loc[table.provider == "baseline", "step_ms"].iloc[0]
        store.add(provider="ours", config=config, metric="speedup_vs_baseline", unit="x", value=base_ms / ours_ms)
        print(f"ours {ours_ms:.1f} ms vs baseline {base_ms:.1f} ms: {base_ms / ours_ms:.3f}x")
    if len(table):
        print(format_table(table.round(2), "latex" if args.latex else "markdown"))
    print(f"\nwall time {wall:.0f} s; attention {recipe.attention}, fused {recipe.fused}, optimizer "
          f"{recipe.optimizer}; rows appended to {store.path}")


def _run_rank(args) -> int:
    started = time.perf_counter()
    distributed = comm.world_size() > 1
    if distributed:
        args.device = local_device(args)
    device: torch.device = args.device
    on_cuda = device.type == "cuda"
    recipe = _our_recipe(args, on_cuda)
    dtype_name, state_name = _dtype_name(recipe.param_dtype), _dtype_name(recipe.state_dtype)
    seq = args.context or ModelConfig.from_name(args.preset).context_length
    cfg = ModelConfig.from_name(args.preset, context_length=seq)
    if on_cuda:
        with contextlib.suppress(Exception):  # fewer fragmentation OOMs near the limit; absent in old torch
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    store = ResultStore("leaderboard", device, args.results_dir) if comm.rank() == 0 else _NoRows()
    base_config = dict(preset=args.preset, context=seq, batch=args.batch, param_dtype=dtype_name,
                       state_dtype=state_name, chunk_tokens=args.chunk_tokens)
    if distributed:  # batch is per rank: one sequence per GPU is --batch 1
        base_config |= dict(world_size=comm.world_size(), ddp=args.ddp)
    our_config = base_config | dict(attention=recipe.attention, fused=recipe.fused, fused_rope=recipe.fused_rope,
                                    optimizer=recipe.optimizer)
    if isinstance(args.checkpoint, CheckpointPolicy):
        try:
            args.checkpoint.check_fits(cfg.num_layers, "--checkpoint")
        except ValueError as error:
            raise SystemExit(f"cs336-bench leaderboard: {error}") from None
    candidates = ([args.checkpoint] if isinstance(args.checkpoint, CheckpointPolicy) else policy_candidates(
        cfg, args.batch, seq, device, dtype=dtype_name, state_dtype=state_name, attention=recipe.attention,
        fused=recipe.fused, chunk_tokens=args.chunk_tokens, fit_fraction=args.fit_fraction))
    if args.verify:
        _verify(store, cfg, device, recipe, candidates[0], args, our_config)
    matmul_peak = measure_matmul_peak(device) if on_cuda else None
    if matmul_peak:  # MFU's denominator, measured in this run (it drifts with clocks and heat by up to ~10 %)
        store.add(provider="suite", config=our_config, metric="matmul_ceiling", unit="TFLOP/s",
                  value=matmul_peak / 1e12)
    data = torch.Generator(device).manual_seed(1234 + comm.rank())  # each rank its own sequences
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device, generator=data)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device, generator=data)
    if distributed:  # rank 0's choice for every rank (free memory, and so the ladder, can differ a little)
        choice = candidates[:1]
        torch.distributed.broadcast_object_list(choice, src=0)
        candidates = choice
    summaries = []
    for provider in args.provider:
        policies = candidates if provider == "ours" else [CheckpointPolicy("every-block")]
        for policy in policies:
            config = (our_config if provider == "ours" else base_config | dict(attention="sdpa", fused=False,
                                                                                 optimizer="torch-fused"))
            config = config | dict(checkpoint=str(policy))
            rung = dataclasses.replace(recipe, checkpoint=policy)
            try:
                with attention_context(rung) if provider == "ours" else contextlib.nullcontext():
                    build = (our_step(cfg, args, device, tokens, targets, rung) if provider == "ours"
                             else baseline_step(cfg, args, device, tokens, targets, rung))
                    summaries.append(_measure(store, provider, config, cfg, args, device, build, matmul_peak))
                break
            except Exception as error:  # out of memory is a result: record it, then try more checkpointing
                if not is_oom(error):
                    raise
                if distributed:
                    raise SystemExit(f"rank {comm.rank()}: out of memory with checkpoint policy {policy} "
                                     f"({provider}); give --checkpoint a policy with more recompute") from None
                store.add(provider=provider, config=config, metric="step_time", unit="ms", status="oom",
                          message=error_message(error))
                print(f"{provider}: out of memory with checkpoint policy {policy}; trying the next")
            finally:
                build = None
                free_memory(device)
    wall = time.perf_counter() - started
    store.add(provider="suite", config=our_config, metric="command_wall_time", unit="s", value=wall)
    if comm.rank() == 0:
        _print_summary(store, summaries, our_config, recipe, wall, args)
    return 0
