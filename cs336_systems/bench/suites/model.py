"""The `model` suite: forward, forward-backward and train-step timings of the LM.

Handout problems: benchmarking_script, mixed_precision_accumulation's autocast part,
torch_compile (b). Each configuration is (preset, context, dtype, compile, provider);
the model is built once per configuration and every requested mode is timed on it.
Providers: `ours` (cs336_basics model, our AdamW, attention chosen by --attention) and
`baseline` (PyTorch-native LM, SDPA attention, torch's fused AdamW).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.attention import attention_names
from cs336_systems.bench import common
from cs336_systems.bench.baseline_lm import BaselineLM, baseline_optimizer
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.kernels._triton_utils import triton_ops_enabled
from cs336_systems.memory.policy import NO_CHECKPOINTING, CheckpointPolicy
from cs336_systems.profiling.flops import flops_for_mode, measure_matmul_peak
from cs336_systems.profiling.ranges import PhaseRanges, annotated_attention
from cs336_systems.profiling.timing import Timing, default_warmup_seconds, time_fn
from cs336_systems.recipe import (
    Recipe,
    attention_context,
    build_model,
    build_optimizer,
    forward_of,
    hidden_forward_of,
    lm_head_loss,
)
from cs336_systems.results import ResultStore, format_table, pivot_table
from cs336_systems.step_graph import StepGraph, make_capturable

MODES = ("forward", "forward-backward", "train-step")
PROVIDERS = ("ours", "baseline")
PHASES = ("forward", "loss", "backward", "optimizer")
COMPILE_CHOICES = ("off", "on", "reduce-overhead")


@dataclass(frozen=True)
class ModelCase:
    preset: str
    context: int
    batch: int
    dtype: str
    compile: bool
    provider: str
    attention: str
    checkpoint: CheckpointPolicy = NO_CHECKPOINTING
    fused: bool = False  # our Triton RMSNorm, SwiGLU gate and RoPE (ours only)
    compile_scope: str = "model"  # with compile: the whole model or each block
    compile_mode: str = "-"  # with compile: torch.compile's mode, "default" or "reduce-overhead" (CUDA graphs)
    optimizer: str = "cs336"  # cs336 (cs336_basics AdamW) or fused (our Triton AdamW); ours only
    weight_copies: bool = False  # ours, fused, fused AdamW, 16-bit autocast: the weights' copies (weight_copies.py)
    fused_loss: bool = False  # ours, fused: the loss by our fused LM head + cross-entropy (no logits held)
    residual_norm: bool = False  # ours, fused: each block's mid-block residual add fused into its norm
    skip_guards: bool = False  # compiled: the timed steps run without dynamo's guard checks (--skip-guards)
    step_graph: bool = False  # the whole step captured as CUDA graphs and replayed (--step-graph)

    def model_config(self, overrides: dict) -> ModelConfig:
        return ModelConfig.from_name(self.preset, context_length=self.context, **overrides)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", type=common.list_of(str, preset_names(), "--preset"), default=["tiny"],
                        help=f"model preset(s), comma-separated: {', '.join(preset_names())} (default tiny)")
    parser.add_argument("--context", type=common.list_of(common.positive_int("--context"), name="--context"),
                        default=None,
                        help="context length(s), comma-separated (default: 512, or 128 for tiny)")
    parser.add_argument("--batch", type=common.positive_int("--batch"), default=4, help="batch size (default 4)")
    parser.add_argument("--dtype", type=common.list_of(str, tuple(common.DTYPES), "--dtype"), default=["fp32"],
                        help="fp32, bf16, fp16 (autocast), comma-separated (default fp32)")
    parser.add_argument("--compile", type=common.list_of(str, COMPILE_CHOICES, "--compile"), default=["off"],
                        help="torch.compile the model: off, on, reduce-overhead (compiled, and replayed as CUDA "
                             "graphs: no host time between kernels), comma-separated (default off)")
    parser.add_argument("--compile-scope", choices=["model", "block"], default="model",
                        help="what --compile on compiles: the whole model (default, as the handout) or each "
                             "Transformer block on its own (regional: one block's graph, reused by all, so large "
                             "models compile in seconds)")
    parser.add_argument("--mode", type=common.list_of(str, MODES, "--mode"), default=list(MODES),
                        help="forward, forward-backward, train-step, comma-separated (default all)")
    parser.add_argument("--provider", type=common.list_of(str, PROVIDERS, "--provider"), default=["ours"],
                        help="ours, baseline (PyTorch-native LM, SDPA, fused AdamW), or ours,baseline")
    parser.add_argument("--attention", choices=attention_names(), default="reference",
                        help="our attention implementation (default: reference, the staff maths)")
    parser.add_argument("--checkpoint", type=common.checkpoint_policy("--checkpoint"), default="none",
                        help="activation checkpointing of our model: none, every-block, every-k:K, partial:M, "
                             "sqrt, nested, ffn, attn; +keep-attn on every-block/every-k/partial/sqrt keeps the "
                             "attention outputs (default none; the baseline is never checkpointed)")
    parser.add_argument("--fused", action="store_true",
                        help="install our Triton RMSNorm, SwiGLU gate and RoPE on our model, and take its training "
                             "loss by our fused LM head + cross-entropy (--fused-loss; their torch maths on the CPU)")
    parser.add_argument("--skip-guards", action="store_true",
                        help="with --compile on/reduce-overhead, both providers: after warm-up, time the steps under "
                             "torch.compiler.set_stance(skip_guard_eval_unsafe=True), where dynamo runs each "
                             "compiled region's graph without checking its guards first (what they cost a small "
                             "model's host; safe here, where nothing they check changes between the timed steps). "
                             "Rows carry skip_guards")
    parser.add_argument("--step-graph", type=common.list_of(str, ("on", "off"), "--step-graph"), default=["off"],
                        help="CUDA only, both providers: capture each timed step whole as CUDA graphs after warm-up "
                             "and replay it, so the host launches two graphs a step instead of every kernel "
                             "(cs336_systems/step_graph.py; the optimizers switch to their capturable forms). on, "
                             "off (default), or on,off; with --compile off or on (reduce-overhead's own graphs "
                             "cannot nest inside one: that pairing is skipped). Rows carry step_graph")
    parser.add_argument("--fused-loss", type=common.list_of(str, ("on", "off"), "--fused-loss"), default=["on"],
                        help="with --fused, in forward-backward and train-step: our fused LM head + cross-entropy "
                             "on the hidden states (on, default: the (tokens, vocab) logits are never held, the "
                             "gradients formed in the loss's one pass) or the model's logits and cross_entropy as "
                             "the baseline takes them (off); on,off times both")
    parser.add_argument("--residual-norm", type=common.list_of(str, ("on", "off"), "--residual-norm"),
                        default=["on"],
                        help="with --fused: each block's mid-block residual add fused into its second norm, one "
                             "pass each way (on, default; kernels.rmsnorm.add_rmsnorm) or the add and the norm as "
                             "two kernels (off); on,off times both")
    parser.add_argument("--optimizer", choices=["cs336", "fused"], default="cs336",
                        help="our model's AdamW: cs336 (cs336_basics, default) or fused (our Triton AdamW)")
    parser.add_argument("--weight-copies", type=common.list_of(str, ("on", "off"), "--weight-copies"),
                        default=["on"],
                        help="with --fused --optimizer fused and --dtype bf16/fp16: our fused AdamW keeps 16-bit "
                             "copies of the Linear weights that the products read, instead of casting every weight "
                             "each step: on (default), off, or on,off to time both")
    parser.add_argument("--warmup", type=common.positive_int("--warmup", 0), default=5,
                        help="warm-up steps (default 5)")
    parser.add_argument("--warmup-s", type=common.non_negative_float("--warmup-s"), default=None,
                        help="after the --warmup steps, keep warming up until the steps after the first (which "
                             "compiles) have run this many seconds: a GPU idle through a compile is not back at "
                             "speed after a few short steps (default 1 on CUDA, 0 on the CPU)")
    parser.add_argument("--steps", type=common.positive_int("--steps"), default=10, help="timed steps (default 10)")
    parser.add_argument("--rounds", type=common.positive_int("--rounds"), default=1,
                        help="time the providers of each configuration in this many interleaved rounds of --steps "
                             "steps (ours, baseline, then baseline, ours, ...), all models built and warmed up first: "
                             "a host that speeds up or slows down over a minute then weighs on both sides alike. "
                             "Rows pool the rounds' steps and record rounds; no peak-memory row (both models are "
                             "resident; where they do not fit together, that configuration is timed one provider at a "
                             "time). Default 1: each provider timed once, one after the other")
    for field, help_text in (("d-model", "d_model"), ("d-ff", "d_ff"), ("num-layers", "layers"),
                             ("num-heads", "heads"), ("vocab-size", "vocabulary")):
        parser.add_argument(f"--{field}", type=common.positive_int(f"--{field}"), default=None,
                            help=f"override the preset's {help_text}")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak for MFU (default: measured with a large bf16 matmul on CUDA)")
    parser.add_argument("--nvtx", action="store_true", help="NVTX ranges around phases and attention parts")
    parser.add_argument("--profile", action="store_true",
                        help="torch.profiler over the timed steps of each mode: trace file, kernel summary, "
                             "kernel time by kind of work")
    parser.add_argument("--memory", action="store_true",
                        help="CUDA memory history: snapshot pickle, timeline PNG and per-phase peaks")
    common.add_common_arguments(parser)


def _overrides(args) -> dict:
    names = {"d_model": args.d_model, "d_ff": args.d_ff, "num_layers": args.num_layers,
             "num_heads": args.num_heads, "vocab_size": args.vocab_size}
    return {k: v for k, v in names.items() if v is not None}


def cases(args) -> list[ModelCase]:
    contexts = args.context or [None]
    out = []
    step_graphs = dict.fromkeys(choice == "on" for choice in args.step_graph)
    for preset, context, dtype, comp, graphed, provider in itertools.product(args.preset, contexts, args.dtype,
                                                                              args.compile, step_graphs, args.provider):
        if graphed and comp == "reduce-overhead":  # (CUDA graphs within a CUDA graph's capture)
            continue
        ctx = context or ModelConfig.from_name(preset).context_length
        attention = args.attention if provider == "ours" else "sdpa"  # the baseline always runs torch's SDPA
        policy = args.checkpoint if provider == "ours" else NO_CHECKPOINTING
        ours = provider == "ours"
        compiled = comp != "off"
        copies_apply = ours and args.fused and args.optimizer == "fused" and dtype in ("bf16", "fp16")
        copy_choices = dict.fromkeys(choice == "on" for choice in args.weight_copies) if copies_apply else [False]
        loss_choices = dict.fromkeys(choice == "on" for choice in args.fused_loss) if ours and args.fused else [False]
        residual_choices = ([False] if not (ours and args.fused)
                            else dict.fromkeys(choice == "on" for choice in args.residual_norm))
        for copies, fused_loss, residual_norm in itertools.product(copy_choices, loss_choices, residual_choices):
            out.append(ModelCase(preset, ctx, args.batch, dtype, compiled, provider, attention, policy,
                                 fused=args.fused and ours, optimizer=args.optimizer if ours else "torch-fused",
                                 compile_scope=args.compile_scope if compiled else "-",
                                 compile_mode=("default" if comp == "on" else comp) if compiled else "-",
                                 weight_copies=copies, fused_loss=fused_loss, residual_norm=residual_norm,
                                 skip_guards=compiled and args.skip_guards and not graphed, step_graph=graphed))
    return out


class _Harness:
    """The model, optimizer, batch and step functions of one configuration (`recipe_options`: more `Recipe` fields
    for ours, beyond what the case sets)."""

    def __init__(self, case: ModelCase, cfg: ModelConfig, device: torch.device, **recipe_options):
        self.case, self.cfg, self.device = case, cfg, device
        self.skipping_guards = False  # (from the first timed step on, with case.skip_guards)
        self.step_graph: tuple[str, StepGraph] | None = None  # (mode, its captured step), with case.step_graph
        if case.compile:
            # Each compiled configuration starts from an empty dynamo cache: its first call then carries its own
            # compile, and a sweep never reaches dynamo's recompile limit (past it, calls run eagerly, silently).
            torch._dynamo.reset()
        if case.provider == "ours":
            self.recipe = Recipe(attention=case.attention, fused=case.fused, fused_rope=case.fused,
                                 checkpoint=case.checkpoint,
                                 compile=case.compile_scope if case.compile else "off",
                                 compile_mode=case.compile_mode if case.compile else "default",
                                 optimizer=case.optimizer,
                                 weight_copy_dtype=common.DTYPES[case.dtype] if case.weight_copies else None,
                                 fused_loss=case.fused_loss, residual_norm=case.residual_norm,
                                 **recipe_options)
            self.model = build_model(cfg, self.recipe, device)
            self.optimizer = build_optimizer(self.model, self.recipe)
            self.forward_model = forward_of(self.model, self.recipe)
            if self.recipe.fused_loss:  # (the forward mode still times the logits)
                self.hidden_forward = hidden_forward_of(self.model, self.recipe)
        else:  # the PyTorch-native baseline, compiled the same way
            torch.manual_seed(0)
            with torch.device(device):
                self.model = BaselineLM(cfg)
            self.optimizer = baseline_optimizer(self.model, device)
            self.forward_model = self.model
            if case.compile and case.compile_scope == "block":
                for block in self.model.blocks:
                    block.compile(mode=case.compile_mode)  # in place; identical blocks share one compiled graph
            elif case.compile:
                self.forward_model = torch.compile(self.model, mode=case.compile_mode)
        self.x = torch.randint(0, cfg.vocab_size, (case.batch, case.context), device=device)
        self.y = torch.randint(0, cfg.vocab_size, (case.batch, case.context), device=device)
        self.prepare_optimizer_capture = make_capturable(self.optimizer) if case.step_graph else None

    def start_timing(self) -> None:
        """Called after warm-up: the steps from here on are timed."""
        self.skipping_guards = self.case.skip_guards

    def attention_context(self):
        return attention_context(self.recipe) if self.case.provider == "ours" else contextlib.nullcontext()

    def step_fn(self, mode: str, phase):
        if self.case.step_graph:
            return self._graphed_step(mode)
        return self._eager_step(mode, phase)

    def _graphed_step(self, mode: str):
        """The mode's step captured as CUDA graphs on its first call (one per mode, the last mode's dropped: its
        memory pool holds the step's activations); no phase ranges (events inside a graph are not timed)."""
        if self.step_graph is None or self.step_graph[0] != mode:
            self.step_graph = None
            no_phase = lambda name: contextlib.nullcontext()  # noqa: E731
            if mode == "train-step":  # the optimizer in a graph of its own (StepGraph's docstring says why)
                forward_backward = self._eager_step("forward-backward", no_phase)
                drop_gradients = functools.partial(self.optimizer.zero_grad, set_to_none=True)

                def zero_grad_forward_backward():
                    drop_gradients()
                    forward_backward()

                # The warm-up's gradients are dropped before the capture, not inside it: freed there they would
                # stay in the ordinary pool beside the graph's, one set of gradients more at the capture's peak.
                graph = StepGraph([zero_grad_forward_backward, self.optimizer.step],
                                  prepare=[drop_gradients, self.prepare_optimizer_capture])
            else:
                graph = StepGraph([self._eager_step(mode, no_phase)])
            self.step_graph = (mode, graph)
        return self.step_graph[1]

    def _eager_step(self, mode: str, phase):
        autocast = common.autocast_context(self.device, self.case.dtype)
        # CUDA graphs (reduce-overhead) reuse their output buffers from one replay to the next: each step says
        # where it begins, so a step's outputs are never read after the next step overwrote them.
        graphs = self.case.compile_mode == "reduce-overhead"
        begin_step = torch.compiler.cudagraph_mark_step_begin if graphs else (lambda: None)

        def forward():
            begin_step()
            with torch.no_grad(), autocast, phase("forward"):
                self.forward_model(self.x)

        def forward_backward():
            begin_step()
            with autocast:
                if self.case.fused_loss:
                    with phase("forward"):
                        hidden = self.hidden_forward(self.x)
                    with phase("loss"):
                        loss = lm_head_loss(self.model, hidden, self.y)
                else:
                    with phase("forward"):
                        logits = self.forward_model(self.x)
                    with phase("loss"):
                        loss = cross_entropy(logits.float(), self.y)
            with phase("backward"):
                loss.backward()

        def train_step():
            self.optimizer.zero_grad(set_to_none=True)
            forward_backward()
            with phase("optimizer"):
                self.optimizer.step()

        return {"forward": forward, "forward-backward": forward_backward, "train-step": train_step}[mode]


def run(args) -> int:
    device: torch.device = args.device
    if args.memory and device.type != "cuda":
        raise SystemExit("--memory records CUDA allocator history; it needs --device cuda")
    overrides = _overrides(args)
    all_cases = cases(args)
    if any(case.step_graph for case in all_cases):
        if device.type != "cuda":
            raise SystemExit(f"cs336-bench model: --step-graph on captures CUDA graphs; it needs --device cuda, "
                             f"got {device.type}")
        if "ours" in args.provider and args.optimizer != "fused" and "train-step" in args.mode:
            raise SystemExit(f"cs336-bench model: --step-graph on with --mode train-step needs a capturable "
                             f"optimizer for ours: --optimizer fused (got {args.optimizer}, whose step reads host "
                             f"numbers a CUDA graph would freeze)")
    if not all_cases:
        raise SystemExit("cs336-bench model: no configuration to run (--step-graph on pairs only with --compile off "
                         "or on)")
    for case in all_cases:  # validate every configuration before any work starts
        try:
            case.checkpoint.check_fits(case.model_config(overrides).num_layers, "--checkpoint")
        except ValueError as error:  # a bad --preset / --d-model / --num-heads / ... combination, or policy
            raise SystemExit(f"cs336-bench model: {error}") from None
    if args.rounds > 1 and (args.memory or args.profile):
        raise SystemExit(f"cs336-bench model: --rounds {args.rounds} interleaves timing only; --memory and --profile "
                         "record one model at a time: drop them or use --rounds 1")
    store = ResultStore("model", device, args.results_dir)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (
        measure_matmul_peak(device) if device.type == "cuda" else None)
    if peak:
        store.add(provider="torch", config={"op": "matmul", "dtype": "bf16", "size": 8192},
                  metric="matmul_peak", unit="TFLOP/s", value=peak / 1e12)
    if args.rounds > 1:
        groups = interleaved_groups(all_cases)
        for group in tqdm(groups, desc="model suite", disable=args.no_progress):
            _run_rounds(group, group[0].model_config(overrides), args, store, peak)
    else:
        for case in tqdm(all_cases, desc="model suite", disable=args.no_progress):
            _run_case(case, case.model_config(overrides), args, store, peak)
    _print_table(store, args)
    return 0


def interleaved_groups(all_cases: list[ModelCase]) -> list[list[ModelCase]]:
    """The cases in groups timed together by `--rounds`: those that differ only in provider and weight copies (one
    configuration, every form of it), in the order `cases` made them."""
    groups: dict[tuple, list[ModelCase]] = {}
    for case in all_cases:
        key = (case.preset, case.context, case.batch, case.dtype, case.compile, case.compile_scope, case.compile_mode,
               case.step_graph)
        groups.setdefault(key, []).append(case)
    return list(groups.values())


def _record_failure(store: ResultStore, provider: str, config: dict, metric: str, error: BaseException) -> None:
    """A failed configuration is a row with its status; the sweep goes on."""
    status = "oom" if common.is_oom(error) else "error"
    message = common.error_message(error)
    if status == "error":
        traceback.print_exception(error, file=sys.stderr)
    store.add(provider=provider, config=config, metric=metric, unit="ms", status=status, message=message)


def row_config(case: ModelCase, cfg: ModelConfig) -> dict:
    """A case's row config: its fields (provider is a row field of its own; the policy as the string it was given
    as), the model's width and depth, and, where our pointwise operators run as triton_ops under torch.compile
    (the default; CS336_TRITON_OPS=0 turns them off), `operators: triton_op`."""
    config = {k: v for k, v in asdict(case).items() if k != "provider"} | {"checkpoint": str(case.checkpoint)}
    config |= {"d_model": cfg.d_model, "num_layers": cfg.num_layers}
    if case.provider == "ours" and case.compile and case.fused and triton_ops_enabled():
        config["operators"] = "triton_op"
    if case.provider == "ours" and case.fused:
        from cs336_systems.fused_model import FP32_WEIGHT_GRADIENTS_FROM_THE_PRODUCT  # (imports Triton)

        if not FP32_WEIGHT_GRADIENTS_FROM_THE_PRODUCT:
            config["weight_gradients"] = "16-bit product, cast"  # CS336_FP32_WEIGHT_GRADIENTS=0 (an A/B run)
    return config


def _run_case(case: ModelCase, cfg: ModelConfig, args, store: ResultStore, peak: float | None) -> None:
    device = args.device
    config = row_config(case, cfg)
    common.free_memory(device)
    ranges = PhaseRanges(device, nvtx=args.nvtx, time=True)
    harness = None
    try:
        harness = _Harness(case, cfg, device)
    except Exception as error:
        for mode in args.mode:
            _record_failure(store, case.provider, config | {"mode": mode}, "time", error)
        return
    names_attention = case.provider == "ours" and case.attention == "reference"
    with harness.attention_context(), annotated_attention(ranges) if names_attention else contextlib.nullcontext():
        for mode in args.mode:
            # --memory records each mode right after timing it, before later modes create gradients and
            # optimizer state: a forward-mode peak is then that of a forward-only process.
            stages = [("time", functools.partial(_time_mode, harness, mode, config, args, store, ranges, peak))]
            if args.memory:
                stages.append(("memory", functools.partial(_memory, harness, mode, config, args, store)))
            for metric, stage in stages:
                try:
                    stage()
                except Exception as error:
                    _record_failure(store, case.provider, config | {"mode": mode}, metric, error)
                else:
                    continue
                # After a failure, outside the except block (whose traceback holds the failed step's tensors).
                harness.optimizer.zero_grad(set_to_none=True)
                common.free_memory(device)
                break
        if args.profile:  # one trace per mode (nsys_profile compares a forward-only profile with a step's)
            for mode in args.mode:
                try:
                    _profile(harness, mode, config, args, store)
                except Exception as error:
                    _record_failure(store, case.provider, config | {"mode": mode}, "profile", error)
                    harness.optimizer.zero_grad(set_to_none=True)
                    common.free_memory(device)
    del harness
    _release(case.compile, device)


def _time_mode(harness: _Harness, mode: str, config: dict, args, store: ResultStore, ranges: PhaseRanges,
               peak: float | None) -> None:
    device = args.device
    timed = _timed_step(harness, mode, ranges)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_fn(timed, warmup=args.warmup, steps=args.steps, device=device,
                     after_warmup=lambda: (ranges.reset(), harness.start_timing()), warmup_s=_warmup_seconds(args))
    _record_timing(harness, mode, config, store, timing, ranges, args.steps, peak)
    if device.type == "cuda":
        store.add(provider=harness.case.provider, config=config | {"mode": mode}, metric="peak_allocated",
                  unit="GiB", value=torch.cuda.max_memory_allocated(device) / 2**30)


def _timed_step(harness: _Harness, mode: str, ranges: PhaseRanges):
    step = harness.step_fn(mode, ranges.phase)
    measured = (lambda: torch.cuda.nvtx.range("measured")) if ranges.nvtx else contextlib.nullcontext

    def timed():
        # (set_stance as a context: the guards are checked again once the step is done)
        skipping = (torch.compiler.set_stance("default", skip_guard_eval_unsafe=True) if harness.skipping_guards
                    else contextlib.nullcontext())
        with measured(), skipping:
            step()

    return timed


def _warmup_seconds(args) -> float:
    return args.warmup_s if args.warmup_s is not None else default_warmup_seconds(args.device)


def _record_timing(harness: _Harness, mode: str, config: dict, store: ResultStore, timing: Timing,
                   ranges: PhaseRanges, steps: int, peak: float | None) -> None:
    """A timed mode's rows: time, first call, tokens/s, TFLOP/s, MFU and the phases' mean time per step."""
    provider = harness.case.provider
    row_config = config | {"mode": mode}
    store.add(provider=provider, config=row_config, metric="time", unit="ms", stats=timing.stats())
    if timing.first_call_s is not None:  # carries compilation when --compile on
        store.add(provider=provider, config=row_config, metric="first_call_time", unit="ms",
                  value=timing.first_call_s * 1e3)
    tokens = harness.case.batch * harness.case.context
    store.add(provider=provider, config=row_config, metric="tokens_per_s", unit="tok/s", value=tokens / timing.median)
    flops = flops_for_mode(harness.cfg, harness.case.batch, harness.case.context, mode)
    store.add(provider=provider, config=row_config, metric="tflops", unit="TFLOP/s", value=flops / timing.median / 1e12)
    if peak:
        store.add(provider=provider, config=row_config, metric="mfu", unit="%",
                  value=100 * flops / timing.median / peak)
    for phase, samples in ranges.collect().items():
        store.add(provider=provider, config=row_config | {"phase": phase}, metric="phase_time", unit="ms",
                  value=sum(samples) / steps * 1e3)


class _ProvidersDoNotFit(Exception):
    """A configuration's providers do not fit in memory together (`--rounds`): they are timed one at a time."""


def _run_rounds(group: list[ModelCase], cfg: ModelConfig, args, store: ResultStore, peak: float | None) -> None:
    """`--rounds`: build every case of one configuration, warm each up, then time them in args.rounds rounds of
    args.steps steps, the order reversed every other round; one set of rows per case over all its rounds' steps.
    Where the models do not fit in memory together (an out-of-memory while building them or in the first round), the
    modes not yet recorded are timed one case at a time, as without --rounds (their rows carry no `rounds`)."""
    recorded: list[str] = []  # modes whose rows are written
    try:
        _time_in_rounds(group, cfg, args, store, peak, recorded)
        return
    except _ProvidersDoNotFit as error:
        reason = str(error)
    # (outside the except block, whose traceback holds the models)
    _release(any(case.compile for case in group), args.device)
    remaining = [mode for mode in args.mode if mode not in recorded]
    tqdm.write(f"model suite: {group[0].preset} at context {group[0].context}: the providers do not fit in memory "
               f"together ({reason}); timing {', '.join(remaining)} one provider at a time")
    one_at_a_time = argparse.Namespace(**(vars(args) | {"mode": remaining}))
    for case in group:
        _run_case(case, cfg, one_at_a_time, store, peak)


def _time_in_rounds(group: list[ModelCase], cfg: ModelConfig, args, store: ResultStore, peak: float | None,
                    recorded: list[str]) -> None:
    device = args.device
    common.free_memory(device)
    built = []  # (case, config, harness, ranges)
    for case in group:
        config = row_config(case, cfg) | {"rounds": args.rounds}
        try:
            # (each compiled harness resets dynamo when built: all are built before any compiles, on first call)
            built.append((case, config, _Harness(case, cfg, device), PhaseRanges(device, nvtx=args.nvtx, time=True)))
        except torch.OutOfMemoryError as error:
            raise _ProvidersDoNotFit(f"building {case.provider}: {str(error).splitlines()[0]}") from None
        except Exception as error:
            for mode in args.mode:
                _record_failure(store, case.provider, config | {"mode": mode}, "time", error)
            common.free_memory(device)
    for mode in args.mode:
        live = list(built)
        timings: dict[_Harness, Timing] = {}
        for round_index in range(args.rounds):
            for case, config, harness, ranges in (live if round_index % 2 == 0 else live[::-1]):
                first = round_index == 0
                try:
                    with harness.attention_context():
                        timing = time_fn(_timed_step(harness, mode, ranges), warmup=args.warmup if first else 0,
                                         steps=args.steps, device=device,
                                         after_warmup=(lambda h=harness, r=ranges: (r.reset(), h.start_timing()))
                                         if first else None,
                                         warmup_s=_warmup_seconds(args) if first else 0.0)
                except Exception as error:  # this case leaves the rounds; the others go on
                    if isinstance(error, torch.OutOfMemoryError) and first and len(live) > 1:
                        # warm-up's memory on top of the other models': apart, it may fit
                        raise _ProvidersDoNotFit(f"{case.provider}'s first steps: "
                                                 f"{str(error).splitlines()[0]}") from None
                    _record_failure(store, case.provider, config | {"mode": mode}, "time", error)
                    live, timings = _drop(live, timings, harness, device)
                    continue
                timings[harness] = timing if first else timings[harness].pooled(timing)
        for _case, config, harness, ranges in live:
            _record_timing(harness, mode, config, store, timings[harness], ranges, args.steps * args.rounds, peak)
        recorded.append(mode)
    built = live = None
    _release(any(case.compile for case in group), device)


def _release(compiled: bool, device: torch.device) -> None:
    """After a configuration: its compiled graphs dropped where it compiled (CUDA graphs keep a private memory pool
    until dynamo's reset: large's took 11.5 GiB from xl's models that came after it on an H100), memory freed."""
    if compiled:
        torch._dynamo.reset()
    common.free_memory(device)


def _drop(live: list, timings: dict, harness: _Harness, device) -> tuple[list, dict]:
    """A case that failed leaves the rounds: its gradients freed, the others go on."""
    harness.optimizer.zero_grad(set_to_none=True)
    common.free_memory(device)
    return [entry for entry in live if entry[2] is not harness], {h: t for h, t in timings.items() if h is not harness}


def _artifact_stem(args, case: ModelCase, mode: str) -> Path:
    name = f"{case.preset}_ctx{case.context}_{case.dtype}_{case.provider}_{mode}"
    name += "_compiled" if case.compile else ""
    return Path(args.results_dir) / "traces" / name


def _profile(harness: _Harness, mode: str, config: dict, args, store: ResultStore) -> None:
    from cs336_systems.profiling.trace import category_summary, profile_steps

    ranges = PhaseRanges(args.device, record=True, nvtx=args.nvtx, sync=True)
    step = harness.step_fn(mode, ranges.phase)
    trace_path = _artifact_stem(args, harness.case, mode).with_suffix(".pt.trace.json")
    range_names = PHASES + ("attention/scores", "attention/softmax", "attention/matmul")
    # Only the reference attention has parts to name; any other stays as the case chose it.
    names_attention = harness.case.provider == "ours" and harness.case.attention == "reference"
    with annotated_attention(ranges) if names_attention else contextlib.nullcontext():
        summary = profile_steps(step, steps=args.steps, device=args.device, trace_path=trace_path,
                                range_names=range_names)
    print(f"\nkernel summary, {mode} ({harness.case.preset}, ctx {harness.case.context}, "
          f"{harness.case.dtype}, {harness.case.provider}); trace: {trace_path}")
    print(format_table(summary.head(20).round(4)))
    for row in summary.head(40).itertuples():
        store.add(provider=harness.case.provider,
                  config=config | {"mode": mode, "range": row.range, "kernel": row.kernel,
                                   "calls_per_step": row.calls_per_step, "share": round(row.share, 5)},
                  metric="profile_kernel_time", unit="ms", value=row.total_ms / args.steps)
    # Every kernel, folded into kinds of work per range: the matmul share and the other kernels' shares are
    # read from these, not from the top 40 alone.
    for row in category_summary(summary, steps=args.steps).itertuples():
        store.add(provider=harness.case.provider,
                  config=config | {"mode": mode, "range": row.range, "category": row.category,
                                   "calls_per_step": row.calls_per_step, "share": round(row.share, 5)},
                  metric="profile_category_time", unit="ms", value=row.ms_per_step)


def _memory(harness: _Harness, mode: str, config: dict, args, store: ResultStore) -> None:
    from cs336_systems.plots import plot_memory_timeline
    from cs336_systems.profiling.memory_timeline import (
        PhaseClock,
        largest_allocations,
        record_memory_history,
        timeline_points,
    )

    clock = PhaseClock()
    per_phase = PhaseRanges(args.device, memory=True)

    @contextlib.contextmanager
    def phase(name):
        with clock.phase(name), per_phase.phase(name):
            yield

    step = harness.step_fn(mode, phase)
    stem = _artifact_stem(args, harness.case, mode)
    steps = min(args.steps, 3)
    with record_memory_history(stem.with_suffix(".memory.pickle")) as recorded:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(args.device)
    # The timeline as rows (results/memory-timeline.jsonl: the report draws its figure from them) and as a PNG.
    points = timeline_points(recorded["snapshot"], clock.marks)
    timeline = ResultStore("memory-timeline", args.device, args.results_dir)
    for index, point in enumerate(points):
        timeline.add(provider=harness.case.provider,
                     config=config | {"mode": mode, "steps": steps, "point": index, "ms": round(point["ms"], 3),
                                      "phase": point["phase"]},
                     metric="active_memory", unit="GiB", value=point["gib"])
    png = Path(args.results_dir) / (stem.name + "_memory.png")
    if points:
        plot_memory_timeline(pd.DataFrame(points), png, f"{harness.case.preset} ctx {harness.case.context} "
                             f"{harness.case.dtype} {mode}: active memory over {steps} steps")
    print(f"memory timeline: {png}; snapshot for pytorch.org/memory_viz: {stem.with_suffix('.memory.pickle')}")
    for rank, allocation in enumerate(largest_allocations(recorded["snapshot"])):
        store.add(provider=harness.case.provider,
                  config=config | {"mode": mode, "rank": rank + 1, "count": allocation["count"],
                                   "origin": allocation["origin"]},
                  metric="largest_allocation", unit="MiB", value=allocation["bytes"] / 2**20)
    for name, peaks in per_phase.peak_bytes.items():
        for kind, value in peaks.items():
            store.add(provider=harness.case.provider, config=config | {"mode": mode, "phase": name},
                      metric=f"peak_{kind}", unit="GiB", value=value / 2**30)


def _print_table(store: ResultStore, args) -> None:
    frame = store.frame()
    if frame.empty:
        return
    frame = frame[frame["metric"].isin(["time", "mfu", "peak_allocated", "first_call_time"])]
    if "phase" in frame.columns:  # per-phase rows stay in the file, out of the summary
        frame = frame[frame["phase"].isna()]
    index = [c for c in ("preset", "context", "dtype", "compile", "compile_scope", "compile_mode", "step_graph",
                         "provider",
                         "attention", "checkpoint", "fused", "optimizer", "weight_copies", "fused_loss",
                         "residual_norm", "mode")
             if c in frame.columns]
    frame = frame.fillna({c: "-" for c in ("fused", "optimizer", "compile_scope", "compile_mode", "weight_copies",
                                           "fused_loss", "residual_norm", "step_graph")
                          if c in frame.columns})
    table = pivot_table(frame, index=index)
    spread = frame[(frame["metric"] == "time") & (frame["status"] == "ok")][index + ["mean", "std"]]
    if not spread.empty:
        spread = spread.rename(columns={"mean": "time mean ms", "std": "time std ms"}).round(3)
        table = table.merge(spread, on=index, how="left")
    common.print_tables(store, args, (None, table))
