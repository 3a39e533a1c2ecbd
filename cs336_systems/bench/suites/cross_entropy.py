"""The `cross-entropy` suite: our fused LM head + cross-entropy against PyTorch's lm_head + cross_entropy.

Each case times the loss and its gradients together: one forward and backward, with gradients for the
hidden states and the head weight. The fused function forms dH and dW in its forward pass, so a
forward-only time would not compare like with like. Each case also records the peak memory above its
inputs.

Providers:
  fused     ours, `kernels.cross_entropy.lm_head_cross_entropy`: token chunks, the chunk's logits only,
            one Triton softmax-gradient kernel per chunk on CUDA, dW accumulated in fp32.
  fused-lean  ours with Liger-Kernel's memory choices: dW accumulated in the weight's dtype
            (`weight_grad_accumulation="weight"`) and chunks sized as Liger sizes its own (`lean_chunk_tokens`:
            about tokens / (vocab / d_model), a power of two), so the logits chunk is about the size of dH.
  liger     Liger-Kernel's `liger_fused_linear_cross_entropy` (accum_dtype None: dW in the weight's dtype), when
            the `liger-kernel` package is installed, on CUDA; the default list takes it only then.
  plain     `F.cross_entropy(h @ W^T in fp32, t)`: the whole (tokens, vocab) logits, upcast to fp32 as
            cs336_basics does (fp64 stays fp64).
  chunked   the leaderboard baseline's loss: the same per chunk, each chunk checkpointed, so its logits
            are recomputed in backward.

TFLOP/s counts the model's three GEMMs, logits, dH and dW, at 2 x tokens x vocab x d each, for every
provider (chunked executes a fourth). Out-of-memory cases are result rows.

    cs336-bench cross-entropy                              # the leaderboard's shape on CUDA, a small one on CPU
    cs336-bench cross-entropy --tokens 8192,32768 --vocab 151936 --d-model 4096 --dtype bf16
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import pandas as pd
import torch
import torch.nn.functional as F

from cs336_systems.bench import common
from cs336_systems.bench.baseline_lm import chunked_cross_entropy
from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy
from cs336_systems.results import ResultStore

PROVIDERS = ("fused", "fused-lean", "plain", "chunked", "liger")
# The leaderboard's loss: one 32k sequence, Qwen-sized vocab, d_model 4096 (CUDA default); a CPU-sized one.
CUDA_DEFAULT = dict(tokens=[32768], vocab=[151936], d_model=[4096], dtype=["bf16"])
CPU_DEFAULT = dict(tokens=[512], vocab=[2048], d_model=[128], dtype=["fp32"])


@dataclass(frozen=True)
class LossCase:
    provider: str
    tokens: int
    vocab: int
    d_model: int
    dtype: str
    chunk_tokens: int


def add_arguments(parser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--tokens", type=common.list_of(common.positive_int("--tokens"), name="--tokens"), default=None,
                        help="comma-separated token counts (default: 32768 on CUDA, 512 on CPU)")
    parser.add_argument("--vocab", type=common.list_of(common.positive_int("--vocab"), name="--vocab"), default=None,
                        help="comma-separated vocab sizes (default: 151936 on CUDA, 2048 on CPU)")
    parser.add_argument("--d-model", type=common.list_of(common.positive_int("--d-model"), name="--d-model"),
                        default=None,
                        help="comma-separated hidden sizes (default: 4096 on CUDA, 128 on CPU)")
    parser.add_argument("--dtype", type=common.list_of(str, tuple(common.DTYPES), "--dtype"), default=None,
                        help="comma-separated from: fp32, bf16, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--provider", type=common.list_of(str, PROVIDERS, "--provider"), default=None,
                        help=f"comma-separated from: {', '.join(PROVIDERS)} (default: all; liger only where "
                             "liger-kernel is installed)")
    parser.add_argument("--chunk-tokens", type=common.positive_int("--chunk-tokens"), default=4096,
                        help="token chunk of the fused and the chunked losses (default 4096)")
    parser.add_argument("--warmup-ms", type=float, default=100.0, help="do_bench warm-up time per case")
    parser.add_argument("--rep-ms", type=float, default=1000.0, help="do_bench repetition time per case")


def liger_available() -> bool:
    return importlib.util.find_spec("liger_kernel") is not None


def check_liger(providers: list[str] | None, device: torch.device, suite: str) -> None:
    """Refuse --provider liger, before any case runs, where it cannot run: without the package, or off CUDA
    (Liger's kernels are Triton kernels for the GPU)."""
    if not providers or "liger" not in providers:
        return
    if not liger_available():
        raise SystemExit(f"cs336-bench {suite}: --provider liger needs the liger-kernel package "
                         "(pip install liger-kernel)")
    if device.type != "cuda":
        raise SystemExit(f"cs336-bench {suite}: --provider liger runs on CUDA only, got --device {device}")


def liger_by_default(device: torch.device) -> bool:
    """Whether the default provider list takes liger: installed, and on CUDA."""
    return device.type == "cuda" and liger_available()


def lean_chunk_tokens(tokens: int, vocab: int, d_model: int) -> int:
    """Liger-Kernel's chunk size for its fused linear cross-entropy: tokens / ceil(vocab / d_model), rounded up to
    a power of two, so that a chunk's logits (chunk x vocab) are about the size of the hidden states."""
    chunk = -(-tokens // -(-vocab // d_model))
    return 1 << (chunk - 1).bit_length()


def cases(args) -> list[LossCase]:
    default = CUDA_DEFAULT if args.device.type == "cuda" else CPU_DEFAULT
    providers = args.provider or [p for p in PROVIDERS if p != "liger" or liger_by_default(args.device)]
    axes = [providers, args.tokens or default["tokens"], args.vocab or default["vocab"],
            args.d_model or default["d_model"], args.dtype or default["dtype"]]
    return [LossCase(p, n, v, d, dt, lean_chunk_tokens(n, v, d) if p == "fused-lean" else args.chunk_tokens)
            for n, v, d, dt, p in itertools.product(*axes[1:], axes[0])]


def loss_fn(provider: str, chunk_tokens: int):
    """(hidden (n, d), weight (vocab, d), targets (n,)) -> mean loss, by the named implementation."""
    if provider == "fused":
        return lambda h, w, t: lm_head_cross_entropy(h, w, t, chunk_tokens=chunk_tokens)
    if provider == "fused-lean":
        return lambda h, w, t: lm_head_cross_entropy(h, w, t, chunk_tokens=chunk_tokens,
                                                     weight_grad_accumulation="weight")
    if provider == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return lambda h, w, t: liger_fused_linear_cross_entropy(h, w, t)
    if provider == "plain":
        return lambda h, w, t: F.cross_entropy((h @ w.T).to(torch.promote_types(h.dtype, torch.float32)), t)
    if provider == "chunked":
        return lambda h, w, t: chunked_cross_entropy(SimpleNamespace(head=lambda x: F.linear(x, w)), h[None],
                                                     t[None], chunk=chunk_tokens)
    raise ValueError(f"cross-entropy: provider must be one of {', '.join(PROVIDERS)}, got {provider!r}")


def run(args) -> int:
    check_liger(args.provider, args.device, "cross-entropy")
    _print_table(common.run_cases("cross-entropy", args, cases(args), _run_case), args)
    return 0


def _run_case(case: LossCase, args, store: ResultStore) -> None:
    device = args.device
    config = {k: v for k, v in asdict(case).items() if k != "provider"}

    def make_step():
        generator = torch.Generator(device).manual_seed(0)
        dtype = common.DTYPES[case.dtype]
        hidden = torch.randn(case.tokens, case.d_model, device=device, dtype=dtype, generator=generator)
        weight = (torch.randn(case.vocab, case.d_model, device=device, dtype=dtype, generator=generator)
                  / case.d_model ** 0.5)
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
        targets = torch.randint(0, case.vocab, (case.tokens,), device=device, generator=generator)
        loss = loss_fn(case.provider, case.chunk_tokens)

        def step():
            loss(hidden, weight, targets).backward()

        return step, [hidden, weight]

    flops = 3 * 2.0 * case.tokens * case.vocab * case.d_model  # logits, dH, dW
    common.time_and_peak(make_step, device, store, case.provider, config, warmup_ms=args.warmup_ms,
                         rep_ms=args.rep_ms,
                         extra_rows=lambda timing: [("tflops", "TFLOP/s", flops / timing.median / 1e12)])


CASE_KEYS = ["tokens", "vocab", "d_model", "dtype"]


def summary_table(frame: pd.DataFrame, digits: int = 2) -> pd.DataFrame:
    """One row per shape: each provider's median ms (or its status), fused's speed-up over the others, each
    provider's peak GiB above the inputs and TFLOP/s. Used by the printed table and the report."""
    times = frame[frame["metric"] == "time"]
    cells = times.assign(cell=[f"{m:.{digits}f}" if s == "ok" else s for m, s in zip(times["median"], times["status"])])
    table = cells.pivot_table(index=CASE_KEYS, columns="provider", values="cell", aggfunc="last")
    table.columns = [f"{c} ms" for c in table.columns]
    ok = times[times["status"] == "ok"].pivot_table(index=CASE_KEYS, columns="provider", values="median")
    for base in ("plain", "chunked", "liger"):
        if {"fused", base} <= set(ok.columns):
            table[f"fused speed-up vs {base}"] = (ok[base] / ok["fused"]).round(2)
    for metric, label, rounding in (("peak_above_inputs", "peak GiB", 2), ("tflops", "TFLOP/s", 1)):
        part = frame[frame["metric"] == metric].pivot_table(index=CASE_KEYS, columns="provider", values="median")
        for provider in part.columns:
            table[f"{provider} {label}"] = part[provider].round(rounding)
    return table.reset_index()


def _print_table(store: ResultStore, args) -> None:
    frame = store.frame()
    if frame.empty:
        return
    common.print_tables(store, args, ("median ms per loss + gradients", summary_table(frame)))
