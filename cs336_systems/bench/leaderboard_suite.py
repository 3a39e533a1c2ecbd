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
import math
import os
import time

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_systems.attention import attention_names, use_attention
from cs336_systems.bench.common import (
    DTYPES,
    add_common_arguments,
    error_message,
    fraction,
    free_memory,
    is_oom,
    list_of,
    positive_int,
)
from cs336_systems.bench.distributed_common import add_launch_arguments, launch, local_device
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy
from cs336_systems.memory.checkpointing import (
    KEEP_ATTENTION,
    SELECTIVE,
    apply_checkpointing,
    keeps_attention,
    parse_policy,
    selective_rest,
)
from cs336_systems.memory.model import block_activation_bytes, predict, selective_block_bytes
from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import VARIANTS as DDP_VARIANTS
from cs336_systems.parallel.ddp import make_ddp
from cs336_systems.profiling.flops import flops_for_mode, measure_matmul_peak
from cs336_systems.profiling.ranges import PhaseRanges
from cs336_systems.profiling.timing import bench_kernel, time_fn
from cs336_systems.results import ResultStore, format_table

PROVIDERS = ("ours", "baseline")
PHASES = ("forward", "loss", "backward", "sync", "optimizer")  # the step's named ranges, in order
# Of the free memory at start: the allocator's fragmentation and the CUDA context need the rest. 0.95 ran the 8B
# step at a 133.0 GiB peak on the H200 (predicted 131.2); an out-of-memory falls back to the next policy.
FIT_FRACTION = 0.95


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
    parser.add_argument("--checkpoint", default="auto",
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


def recompute_flops(cfg: ModelConfig, batch: int, seq: int, policy: str) -> float:
    """Forward FLOPs a policy adds to the step (matmuls and causal attention of what it recomputes)."""
    tokens, d, f, n = batch * seq, cfg.d_model, cfg.d_ff, cfg.num_layers
    ffn = 2 * tokens * 3 * d * f
    attention = 2 * batch * seq * seq * d  # causal
    block = 2 * tokens * 4 * d * d + ffn + attention  # projections, SwiGLU, attention
    if keeps_attention(policy):  # the recompute reuses the kept attention outputs
        block -= attention
    name, arg = parse_policy(policy)
    if name == "none":
        return 0.0
    if name == "ffn":
        return n * ffn
    if name == "partial":
        return min(arg, n) * block
    if name == "nested":
        return math.ceil(math.log2(max(n, 2))) * n * block / 2
    return n * block  # every-block, every-k:K, sqrt: one extra forward


# Pointwise recompute priced against products: on the H200 bf16 matmuls run at about 730-790 TFLOP/s and device
# copies at about 4 TB/s (../shared/BASELINES.md), so one byte moved costs about 200 FLOPs. Session 4's step
# suggested several times this; session 5's profile found the excess in a slow RoPE and layout copies (fixed):
# the forward's pointwise kernels now take about 1.5 ms per block, in line with this price (notes/leaderboard.md).
POINTWISE_FLOPS_PER_BYTE = 200.0


def recompute_cost(cfg: ModelConfig, batch: int, seq: int, policy: str, *, attention: str = "flash",
                   dtype: str = "bf16", fused: bool = True) -> float:
    """The ladder's sort key, in FLOP-equivalents: `recompute_flops`, plus for each block under selective
    checkpointing the traffic of its pointwise recompute, taken as twice what it regenerates (its
    activations less what it keeps: written once, read about once)."""
    cost = recompute_flops(cfg, batch, seq, policy)
    if selective_rest(policy):
        rest = cfg.num_layers - min(parse_policy(policy)[1], cfg.num_layers)
        regenerated = (block_activation_bytes(cfg, batch, seq, attention, dtype, fused)
                       - selective_block_bytes(cfg, batch, seq, attention, dtype))
        cost += rest * 2 * regenerated * POINTWISE_FLOPS_PER_BYTE
    return cost


def policy_candidates(cfg: ModelConfig, batch: int, seq: int, device: torch.device, *, dtype: str, state_dtype: str,
                      attention: str, fused: bool, chunk_tokens: int, fit_fraction: float = FIT_FRACTION) -> list[str]:
    """Policies from least to most recompute (`recompute_cost`: none, ffn, partial:1 .. partial:N-1,
    every-block, nested; the +keep-attn variants, which recompute no attention at a few hundred MiB per
    block; and `selective` / partial:M+keep-attn+selective, whose other blocks keep their products for a
    pointwise-only recompute): the first the memory model says fits in `fit_fraction` of the free memory,
    then, as fallbacks after an out-of-memory, the costlier ones predicted to need less memory than it."""
    n = cfg.num_layers
    kind = "flash" if attention.startswith(("triton", "pytorch-flash")) else "reference"
    single = [*(f"partial:{m}" for m in range(1, n)), "every-block"]
    selective = ["selective", *(f"partial:{m}{KEEP_ATTENTION}{SELECTIVE}" for m in range(1, n))]
    ladder = sorted(["none", "ffn", *single, *(p + KEEP_ATTENTION for p in single), *selective, "nested"],
                    key=lambda p: recompute_cost(cfg, batch, seq, p, attention=kind, dtype=dtype, fused=fused))
    if device.type != "cuda":
        return ladder[:1]
    free, _ = torch.cuda.mem_get_info(device)
    peaks = [predict(cfg, batch, seq, policy=policy, attention=kind, dtype=dtype, fused=fused, loss="fused",
                     chunk_tokens=chunk_tokens, state_dtype=state_dtype).peak for policy in ladder]
    for i, peak in enumerate(peaks):
        if peak < fit_fraction * free:
            return [ladder[i], *(p for p, q in zip(ladder[i + 1:], peaks[i + 1:]) if q < peak)]
    return ladder[-1:]


def hidden_states(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's forward up to (not including) the LM head: embeddings, blocks, final norm."""
    h = model.token_embeddings(tokens)
    for layer in model.layers:
        h = layer(h)
    return model.ln_final(h)


def _build(cfg, device, dtype, policy, fused, fused_rope=False):
    torch.manual_seed(0)
    model = cfg.build(device=device, dtype=dtype)
    if fused:
        from cs336_systems.fused_model import apply_fused_kernels

        apply_fused_kernels(model, rope=fused_rope)
    return apply_checkpointing(model, policy)


def _optimizer(kind: str, model, state_dtype: torch.dtype):
    if kind == "fused":
        from cs336_systems.kernels.adamw import FusedAdamW

        return FusedAdamW(model.parameters(), lr=1e-4, maths="torch", state_dtype=state_dtype)
    return AdamW(model.parameters(), lr=1e-4)


def _training_step(optimizer, forward, loss_fn, phase, ddp=None):
    def step():
        optimizer.zero_grad(set_to_none=True)
        if ddp is not None:
            ddp.on_train_batch_start()
        with phase("forward"):
            h = forward()
        with phase("loss"):
            loss = loss_fn(h)
        with phase("backward"):
            loss.backward()
        if ddp is not None:
            with phase("sync"):  # what is left of the all-reduces once backward is done
                ddp.finish_gradient_synchronization()
        with phase("optimizer"):
            optimizer.step()
        return loss
    return step


def _timed_and_plain(optimizer, forward, loss_fn, ddp=None):
    """build(phase) -> (the step with phase ranges, the same step without): what _measure times."""
    def build(phase):
        return (_training_step(optimizer, forward, loss_fn, phase, ddp),
                _training_step(optimizer, forward, loss_fn, lambda name: contextlib.nullcontext(), ddp))
    return build


def verify(cfg, device, dtype, attention, policy, chunk_tokens, fused, fused_rope=False) -> dict[str, float]:
    """Relative errors (vs an fp64 plain step) of our step and of the plain step at `dtype`."""
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), device=device,
                           generator=torch.Generator(device).manual_seed(3))
    targets = torch.roll(tokens, -1, dims=1)

    def grads_of(run_dtype, ours: bool):
        model = _build(cfg, device, run_dtype, policy if ours else "none", fused and ours, fused_rope and ours)
        with use_attention(attention if ours else "reference"):
            if ours:
                loss = lm_head_cross_entropy(hidden_states(model, tokens), model.lm_head.weight, targets,
                                             chunk_tokens=chunk_tokens)
            else:
                logits = model(tokens)
                loss = cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), targets)
            loss.backward()
        return loss.detach().double(), [p.grad.double() for p in model.parameters()]

    exact_loss, exact = grads_of(torch.float64, ours=False)
    out = {}
    for name, ours in (("ours", True), ("plain", False)):
        loss, grads = grads_of(dtype, ours)
        num = sum(((g - e) ** 2).sum() for g, e in zip(grads, exact))
        den = sum((e**2).sum() for e in exact)
        out[f"{name}_grad_rel_error"] = float((num / den).sqrt())
        out[f"{name}_loss_abs_error"] = float((loss - exact_loss).abs())
    return out


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
    for _ in range(3):
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


def _ours(cfg, args, device, tokens, targets, policy, settings):
    dtype = DTYPES[settings["param_dtype"]]
    model = _build(cfg, device, dtype, policy, settings["fused"], settings["fused_rope"])
    # Several ranks: our DDP (its hooks sit on the parameters, so the forward below needs no wrapper call).
    ddp = make_ddp(model, args.ddp) if comm.world_size() > 1 else None
    optimizer = _optimizer(settings["optimizer"], model, DTYPES[settings["state_dtype"]])

    def loss_fn(h):
        return lm_head_cross_entropy(h, model.lm_head.weight, targets, chunk_tokens=args.chunk_tokens)

    return _timed_and_plain(optimizer, lambda: hidden_states(model, tokens), loss_fn, ddp)


class _HiddenStates(torch.nn.Module):
    """The baseline LM's forward up to the hidden states, as a module torch's DDP can wrap (its reducer
    is armed in forward); the LM head is used by the chunked loss after it."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, tokens):
        return self.lm.hidden(tokens)


def _baseline(cfg, args, device, tokens, targets, settings):
    from cs336_systems.bench.baseline_lm import BaselineLM, baseline_optimizer, chunked_cross_entropy

    torch.manual_seed(0)
    with torch.device(device):
        model = BaselineLM(cfg, checkpoint_blocks=True)
    model.to(dtype=DTYPES[settings["param_dtype"]])
    optimizer = baseline_optimizer(model, device)
    forward = lambda: model.hidden(tokens)  # noqa: E731
    if comm.world_size() > 1:  # a baseline: torch's own DDP
        wrapped = torch.nn.parallel.DistributedDataParallel(_HiddenStates(model), gradient_as_bucket_view=True)
        forward = lambda: wrapped(tokens)  # noqa: E731

    def loss_fn(h):
        return chunked_cross_entropy(model, h, targets, args.chunk_tokens)

    return _timed_and_plain(optimizer, forward, loss_fn)


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


def _run_rank(args) -> int:
    started = time.perf_counter()
    distributed = comm.world_size() > 1
    if distributed:
        args.device = local_device(args)
    device: torch.device = args.device
    on_cuda = device.type == "cuda"
    dtype_name = args.param_dtype or ("bf16" if on_cuda else "fp32")
    state_name = args.state_dtype or ("fp32" if dtype_name == "fp32" else "bf16")
    attention = args.attention or ("triton" if on_cuda else "pytorch-flash")
    fused = (args.fused or ("on" if on_cuda else "off")) == "on"
    optimizer_kind = args.optimizer or ("fused" if on_cuda else "cs336")
    seq = args.context or ModelConfig.from_name(args.preset).context_length
    cfg = ModelConfig.from_name(args.preset, context_length=seq)
    if args.checkpoint != "auto":
        try:
            parse_policy(args.checkpoint)
        except ValueError as e:
            raise SystemExit(f"--checkpoint: {e}") from None
    if fused and not on_cuda:
        from cs336_systems.kernels._triton_utils import interpreting

        if not interpreting():
            raise SystemExit("--fused on: our Triton RMSNorm/SwiGLU need CUDA (or TRITON_INTERPRET=1 on CPU)")
    if on_cuda:
        with contextlib.suppress(Exception):  # fewer fragmentation OOMs near the limit; absent in old torch
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
    if args.fused_rope and not fused:
        raise SystemExit("--fused-rope needs --fused on")
    args.fused_rope = fused if args.fused_rope is None else args.fused_rope
    settings = dict(param_dtype=dtype_name, state_dtype=state_name, fused=fused, fused_rope=args.fused_rope,
                    optimizer=optimizer_kind)
    store = ResultStore("leaderboard", device, args.results_dir) if comm.rank() == 0 else _NoRows()
    base_config = dict(preset=args.preset, context=seq, batch=args.batch, param_dtype=dtype_name,
                       state_dtype=state_name, chunk_tokens=args.chunk_tokens)
    if distributed:  # batch is per rank: one sequence per GPU is --batch 1
        base_config |= dict(world_size=comm.world_size(), ddp=args.ddp)
    our_config = base_config | dict(attention=attention, fused=fused, fused_rope=args.fused_rope,
                                    optimizer=optimizer_kind)
    candidates = ([args.checkpoint] if args.checkpoint != "auto" else policy_candidates(
        cfg, args.batch, seq, device, dtype=dtype_name, state_dtype=state_name, attention=attention, fused=fused,
        chunk_tokens=args.chunk_tokens, fit_fraction=args.fit_fraction))
    if args.verify:
        errors = verify(cfg, device, DTYPES[dtype_name], attention, candidates[0], args.chunk_tokens, fused,
                        args.fused_rope)
        for metric, value in errors.items():
            store.add(provider="ours" if metric.startswith("ours") else "plain",
                      config=our_config | dict(checkpoint=candidates[0]), metric=metric, unit="", value=value)
        budget = 2 * errors["plain_grad_rel_error"] + 2 * torch.finfo(DTYPES[dtype_name]).eps
        ok = errors["ours_grad_rel_error"] <= budget
        print(f"verify: gradient relative error ours {errors['ours_grad_rel_error']:.2e}, plain "
              f"{errors['plain_grad_rel_error']:.2e} (budget {budget:.2e}): {'ok' if ok else 'FAILED'}")
        if not ok:
            raise SystemExit("leaderboard --verify: our step's gradients are outside the error budget")
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
        policies = candidates if provider == "ours" else ["every-block"]
        for policy in policies:
            config = (our_config if provider == "ours" else base_config | dict(attention="sdpa", fused=False,
                                                                                 optimizer="torch-fused"))
            config = config | dict(checkpoint=policy)
            try:
                with use_attention(attention) if provider == "ours" else contextlib.nullcontext():
                    build = (_ours(cfg, args, device, tokens, targets, policy, settings) if provider == "ours"
                             else _baseline(cfg, args, device, tokens, targets, settings))
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
    if comm.rank() != 0:
        return 0
    import pandas as pd

    table = pd.DataFrame(summaries)
    if {"ours", "baseline"} <= set(table.get("provider", [])):
        ours_ms = table.loc[table.provider == "ours", "step_ms"].iloc[0]
        base_ms = table.loc[table.provider == "baseline", "step_ms"].iloc[0]
        store.add(provider="ours", config=our_config, metric="speedup_vs_baseline", unit="x", value=base_ms / ours_ms)
        print(f"ours {ours_ms:.1f} ms vs baseline {base_ms:.1f} ms: {base_ms / ours_ms:.3f}x")
    if len(table):
        print(format_table(table.round(2), "latex" if args.latex else "markdown"))
    print(f"\nwall time {wall:.0f} s; attention {attention}, fused {fused}, optimizer {optimizer_kind}; "
          f"rows appended to {store.path}")
    return 0
