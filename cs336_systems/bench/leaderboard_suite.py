"""The `leaderboard` suite: the fastest full training step (zero_grad, forward, loss, backward,
AdamW step) of the leaderboard model, with our kernels only, beside the PyTorch-native baseline.

Our step: BasicsTransformerLM (its parameters in --param-dtype), our attention (--attention,
Triton FlashAttention-2 on CUDA), the fused LM-head cross-entropy (no (tokens, vocab) logits),
our fused AdamW (Triton) and an activation-checkpointing policy (--checkpoint; `auto` takes the
cheapest that the analytic memory model says fits). Timed like the official harness with
triton.testing.do_bench (--warmup-ms / --rep-ms; the official harness uses 10000 / 30000) on
CUDA, with the timing helper on CPU; a per-phase breakdown comes from CUDA events.

`--verify` checks, on the configuration given (use a small one), that our step's loss and
gradients agree with the plain cs336_basics model step (reference attention, cross_entropy on
logits): the error against an fp64 run may be at most 2x that of the plain step at --param-dtype.

    cs336-bench leaderboard --preset tiny --device cpu --verify          # CI-sized
    cs336-bench leaderboard --preset xl --context 8192                   # without an H200
    cs336-bench leaderboard                                              # the 8B model at 32k
"""

from __future__ import annotations

import contextlib

import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_basics.optimizer import AdamW
from cs336_systems.attention import attention_names, use_attention
from cs336_systems.bench.common import DTYPES, add_common_arguments, positive_int
from cs336_systems.bench.results import ResultStore, format_table, rows_to_frame
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy
from cs336_systems.memory.checkpointing import apply_checkpointing, parse_policy
from cs336_systems.memory.model import activation_bytes
from cs336_systems.profiling.flops import flops_for_mode, measure_matmul_peak
from cs336_systems.profiling.ranges import PhaseRanges
from cs336_systems.profiling.timing import bench_kernel

AUTO_CANDIDATES = ("none", "every-k:4", "every-k:2", "every-block", "nested")


def add_arguments(parser) -> None:
    parser.add_argument("--preset", choices=preset_names(), default="leaderboard-8b")
    parser.add_argument("--context", type=positive_int("--context"), default=None, help="default: the preset's")
    parser.add_argument("--batch", type=positive_int("--batch"), default=1, help="sequences per step (default 1)")
    parser.add_argument("--param-dtype", choices=list(DTYPES), default=None,
                        help="parameters, gradients and optimizer state (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--attention", choices=attention_names(), default=None,
                        help="default: triton on CUDA, pytorch-flash on CPU")
    parser.add_argument("--checkpoint", default="auto", help="auto, or a policy: none, every-block, every-k:K, ...")
    parser.add_argument("--optimizer", choices=["fused", "cs336"], default=None,
                        help="fused (our Triton AdamW; default on CUDA) or cs336 (cs336_basics AdamW)")
    parser.add_argument("--chunk-tokens", type=positive_int("--chunk-tokens"), default=4096,
                        help="token chunk of the fused cross-entropy (default 4096)")
    parser.add_argument("--warmup-ms", type=float, default=2000.0)
    parser.add_argument("--rep-ms", type=float, default=6000.0)
    parser.add_argument("--verify", action="store_true", help="check loss and gradients against the plain step")
    add_common_arguments(parser)


def choose_policy(cfg: ModelConfig, batch: int, seq: int, device: torch.device, param_bytes_each: int,
                  attention: str) -> str:
    """The cheapest (least recompute) policy whose predicted peak fits in 90% of the device's free memory."""
    if device.type != "cuda":
        return "none"
    free, _ = torch.cuda.mem_get_info(device)
    n_params = sum(p.numel() for p in cfg.build(device="meta").parameters())
    fixed = n_params * param_bytes_each * 4  # parameters, gradients, two optimizer states
    scale = param_bytes_each / 4  # activations follow the compute dtype: the fp32 model, scaled
    kind = "flash" if attention.startswith(("triton", "pytorch-flash")) else "reference"
    for policy in AUTO_CANDIDATES:
        if fixed + scale * activation_bytes(cfg, batch, seq, policy, kind) < 0.9 * free:
            return policy
    return "nested"


def hidden_states(model, tokens: torch.Tensor) -> torch.Tensor:
    """The model's forward up to (not including) the LM head: embeddings, blocks, final norm."""
    h = model.token_embeddings(tokens)
    for layer in model.layers:
        h = layer(h)
    return model.ln_final(h)


def _build(cfg, device, dtype, policy):
    torch.manual_seed(0)
    model = cfg.build(device=device, dtype=dtype)
    return apply_checkpointing(model, policy)


def _optimizer(kind: str, model):
    if kind == "fused":
        from cs336_systems.kernels.adamw import FusedAdamW

        return FusedAdamW(model.parameters(), lr=1e-4, maths="torch")
    return AdamW(model.parameters(), lr=1e-4)


def _our_step(model, optimizer, tokens, targets, phase, chunk_tokens):
    def step():
        optimizer.zero_grad(set_to_none=True)
        with phase("forward"):
            h = hidden_states(model, tokens)
        with phase("loss"):
            loss = lm_head_cross_entropy(h, model.lm_head.weight, targets, chunk_tokens=chunk_tokens)
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            optimizer.step()
        return loss
    return step


def verify(cfg, device, dtype, attention, policy, chunk_tokens) -> dict[str, float]:
    """Relative errors (vs an fp64 plain step) of our step and of the plain step at `dtype`."""
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length), device=device,
                           generator=torch.Generator(device).manual_seed(3))
    targets = torch.roll(tokens, -1, dims=1)

    def grads_of(run_dtype, ours: bool):
        model = _build(cfg, device, run_dtype, policy if ours else "none")
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


def run(args) -> int:
    device: torch.device = args.device
    on_cuda = device.type == "cuda"
    dtype_name = args.param_dtype or ("bf16" if on_cuda else "fp32")
    dtype = DTYPES[dtype_name]
    attention = args.attention or ("triton" if on_cuda else "pytorch-flash")
    optimizer_kind = args.optimizer or ("fused" if on_cuda else "cs336")
    cfg = ModelConfig.from_name(args.preset)
    seq = args.context or cfg.context_length
    cfg = ModelConfig.from_name(args.preset, context_length=seq)
    if args.checkpoint != "auto":
        try:
            parse_policy(args.checkpoint)
        except ValueError as e:
            raise SystemExit(f"--checkpoint: {e}") from None
    policy = args.checkpoint if args.checkpoint != "auto" else choose_policy(
        cfg, args.batch, seq, device, torch.empty((), dtype=dtype).element_size(), attention)
    store = ResultStore("leaderboard", device, args.results_dir)
    config = dict(preset=args.preset, context=seq, batch=args.batch, param_dtype=dtype_name, attention=attention,
                  checkpoint=policy, optimizer=optimizer_kind, chunk_tokens=args.chunk_tokens)
    if args.verify:
        errors = verify(cfg, device, dtype, attention, policy, args.chunk_tokens)
        for metric, value in errors.items():
            store.add(provider="ours" if metric.startswith("ours") else "plain", config=config, metric=metric,
                      unit="", value=value)
        budget = 2 * errors["plain_grad_rel_error"] + 2 * torch.finfo(dtype).eps
        ok = errors["ours_grad_rel_error"] <= budget
        print(f"verify: gradient relative error ours {errors['ours_grad_rel_error']:.2e}, plain "
              f"{errors['plain_grad_rel_error']:.2e} (budget {budget:.2e}): {'ok' if ok else 'FAILED'}")
        if not ok:
            raise SystemExit("leaderboard --verify: our step's gradients are outside the error budget")
    if on_cuda:
        torch.cuda.reset_peak_memory_stats(device)
    model = _build(cfg, device, dtype, policy)
    optimizer = _optimizer(optimizer_kind, model)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    targets = torch.randint(0, cfg.vocab_size, (args.batch, seq), device=device)
    ranges = PhaseRanges(device, time=True)
    with use_attention(attention):
        step = _our_step(model, optimizer, tokens, targets, ranges.phase, args.chunk_tokens)
        plain = _our_step(model, optimizer, tokens, targets, lambda name: contextlib.nullcontext(), args.chunk_tokens)
        timing = bench_kernel(plain, device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
        ranges.reset()
        for _ in range(3):
            step()
    phases = {name: sum(v) / len(v) * 1e3 for name, v in ranges.collect().items()}
    flops = flops_for_mode(cfg, args.batch, seq, "train-step")
    store.add(provider="ours", config=config, metric="step_time", unit="ms", stats=timing.stats())
    store.add(provider="ours", config=config, metric="tokens_per_s", unit="tok/s",
              value=args.batch * seq / timing.median)
    if on_cuda:
        peak = measure_matmul_peak(device)
        store.add(provider="ours", config=config, metric="mfu", unit="%", value=100 * flops / timing.median / peak)
        store.add(provider="ours", config=config, metric="peak_allocated", unit="GiB",
                  value=torch.cuda.max_memory_allocated(device) / 2**30)
    for name, ms in phases.items():
        store.add(provider="ours", config=config | {"phase": name}, metric="phase_time", unit="ms", value=ms)
    frame = rows_to_frame(store.rows)
    shown = frame[frame["metric"].isin(["step_time", "tokens_per_s", "mfu", "peak_allocated", "phase_time"])]
    label = shown.get("phase", shown["metric"]).fillna("")
    shown = shown.assign(what=[f"{m} {p}".strip() for m, p in zip(shown["metric"], label)])
    print(format_table(shown[["what", "median", "unit"]].round(3), "latex" if args.latex else "markdown"))
    print(f"\npolicy {policy}, attention {attention}, optimizer {optimizer_kind}; rows appended to {store.path}")
    return 0
