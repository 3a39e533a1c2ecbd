"""The `attention` suite: our attention kernels against PyTorch's, forward / backward / both.

Handout problems: pytorch_attention (sweep `handout`), torch_compile (a) (the `naive-compiled`
provider), flash_benchmarking (sweep `flash`), plus multi-head training shapes (sweep
`train`). Providers: ours -- `triton` (the default backward: on Hopper the Gluon passes where the inputs
qualify, one pass at head dim 128; `flash_attention`'s default launcher), `triton-native` (the same kernels,
repeat calls replayed from C++: native_launch.py), `triton-python` (repeat calls replayed from Python:
launch_plan.py), `triton-tf32x3` (fp32 only: the default kernels with tf32x3 dots, near-fp32 accuracy
on tensor cores, the arithmetic of `sdpa-efficient` in fp32; `triton` runs IEEE fp32),
`triton-two-pass-bwd` (always two passes), `triton-tl-bwd` (the `tl`
backward passes everywhere), `triton-fused-bwd`, `triton-compile-bwd`, `pytorch-flash` (tiled Python,
small N only), `naive` (the model's materialised attention), `naive-compiled`; baselines --
`sdpa-flash`, `sdpa-efficient`, `sdpa-cudnn` (torch's SDPA backends).

The `handout` sweep times 100 forward and 100 backward passes with the timing helper and
records the memory in use before backward; the others use triton.testing.do_bench (median
of all samples). TFLOP/s counts causal FLOPs: forward 4*B*H*N^2*d/2, backward 2.5x, both 3.5x.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd
import torch
from tqdm import tqdm

import cs336_basics.model as basics_model
from cs336_systems.attention import TRITON_BACKWARDS
from cs336_systems.bench import common
from cs336_systems.profiling.flops import attention_flops
from cs336_systems.profiling.timing import bench_kernel, kernel_time_ms, time_fn
from cs336_systems.results import ResultStore

OURS = ("triton", "triton-native", "triton-python", "triton-tf32x3", "triton-two-pass-bwd", "triton-tl-bwd",
        "triton-fused-bwd", "triton-compile-bwd", "pytorch-flash", "naive", "naive-compiled")
BASELINES = ("sdpa-flash", "sdpa-efficient", "sdpa-cudnn")
PROVIDERS = OURS + BASELINES
PASSES = ("fwd", "bwd", "fwd-bwd")
FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd-bwd": 3.5}
# The tiled PyTorch reference is a Python loop over 16x16 tiles: on the H200 its fwd+bwd took 1.9 s at seq 1024
# (bf16, d 16; results/attention.jsonl) and its seq-2048 case did not finish in 4 min of a sweep.
PYTORCH_FLASH_MAX_SEQ = 1024
# Providers that run torch.compile'd code, compiled per shape (dynamic=False): dynamo is reset before each of
# their cases, or past its recompile limit (8 shapes) a sweep would silently time eager code under their name.
COMPILED_PROVIDERS = ("naive-compiled", "triton-compile-bwd")
COMPILED_BWD_MAX_SCORES = 16384 * 16384  # it materialises P in fp32


@dataclass(frozen=True)
class AttentionCase:
    batch: int
    heads: int  # 0: 3-D inputs (batch, seq, d), as in the handout's sweep
    seq: int
    d: int
    dtype: str
    causal: bool
    provider: str


SWEEPS = {
    # pytorch_attention: batch 8, no heads, naive eager vs compiled, not causal.
    "handout": dict(batch=8, heads=0, seq=[256, 1024, 4096, 8192, 16384], d=[16, 32, 64, 128], dtype=["fp32"],
                    causal=False, provider=["naive", "naive-compiled"]),
    # flash_benchmarking: batch 1, causal, seq 128..65536, d 16..128, bf16 and fp32.
    # heads=1 (4-D) so SDPA's flash and cuDNN backends accept the inputs; the FLOPs are the same.
    "flash": dict(batch=1, heads=1, seq=[2**i for i in range(7, 17)], d=[16, 32, 64, 128], dtype=["bf16", "fp32"],
                  causal=True, provider=["naive", "pytorch-flash", "triton", "triton-fused-bwd", "triton-compile-bwd",
                                         "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]),
    # Multi-head training shapes (the leaderboard's attention is the last).
    "train": dict(shapes=[(4, 32, 16384, 64), (1, 32, 32768, 128), (2, 16, 16384, 128), (4, 32, 4096, 64)],
                  dtype=["bf16"], causal=True, provider=["triton", "triton-two-pass-bwd", "triton-fused-bwd",
                                                         "sdpa-flash", "sdpa-cudnn", "sdpa-efficient"]),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sweep", choices=[*SWEEPS, "custom"], default="custom",
                        help="a preset sweep: handout (pytorch_attention), flash (flash_benchmarking), train (the "
                             "training shapes); or custom, the default: the shape options below")
    # Shape options override the sweep's values; without a sweep they default to batch 1, 3-D, seq 128,256, d 16,64.
    parser.add_argument("--batch", type=common.positive_int("--batch"), default=None,
                        help="batch size (default: the sweep's; custom: 1)")
    parser.add_argument("--heads", type=common.positive_int("--heads", 0), default=None,
                        help="heads; 0 gives 3-D (batch, seq, d) inputs (default: the sweep's; custom: 0)")
    parser.add_argument("--seq", type=common.list_of(common.positive_int("--seq"), name="--seq"), default=None,
                        help="comma-separated sequence lengths, queries = keys (default: the sweep's; custom: 128,256)")
    parser.add_argument("--d", type=common.list_of(common.positive_int("--d"), name="--d"), default=None,
                        help="comma-separated head dimensions (default: the sweep's; custom: 16,64)")
    parser.add_argument("--dtype", type=common.list_of(str, tuple(common.DTYPES), "--dtype"), default=None,
                        help="fp32, bf16, fp16 (default bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--causal", choices=["on", "off"], default="on",
                        help="causal masking of a custom run (default: on); the preset sweeps set their own "
                             "(handout: off; flash, train: on)")
    parser.add_argument("--provider", type=common.list_of(str, PROVIDERS, "--provider"), default=None,
                        help=f"comma-separated from: {', '.join(PROVIDERS)} (default: the sweep's)")
    parser.add_argument("--pass", dest="passes", type=common.list_of(str, PASSES, "--pass"), default=list(PASSES),
                        help=f"comma-separated passes to time, from: {', '.join(PASSES)} (default: all three)")
    parser.add_argument("--precompile-workers", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes that compile our kernels' autotune candidates before the first case "
                             "(CUDA; 0: the autotuner compiles them in the first case, one by one)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement")
    parser.add_argument("--warmup-ms", type=float, default=25.0, help="do_bench warm-up time per measurement")
    parser.add_argument("--kernel-time", action="store_true",
                        help="also record each measurement's GPU kernel time per call (torch.profiler; metric "
                             "kernel_time): beside `time` it shows how host-bound a short call is (CUDA only)")
    parser.add_argument("--plot", default=None, help="write a TFLOP/s-vs-sequence plot of this run to this PNG")
    common.add_common_arguments(parser)


def cases(args) -> list[AttentionCase]:
    sweep = SWEEPS.get(args.sweep, {})
    default_dtype = ["bf16"] if args.device.type == "cuda" else ["fp32"]
    dtypes = args.dtype or sweep.get("dtype", default_dtype)
    providers = args.provider or sweep.get("provider", ["triton", "naive"] if args.device.type == "cuda"
                                           else ["pytorch-flash", "naive"])
    causal = sweep.get("causal", args.causal == "on")
    if "shapes" in sweep:
        shapes = sweep["shapes"]
    else:
        def pick(name, default):
            value = getattr(args, name)
            return value if value is not None else sweep.get(name, default)

        shapes = [(pick("batch", 1), pick("heads", 0), s, d)
                  for d, s in itertools.product(pick("d", [16, 64]), pick("seq", [128, 256]))]
    return [AttentionCase(b, h, s, d, dtype, causal, p)
            for (b, h, s, d), dtype, p in itertools.product(shapes, dtypes, providers)]


def attention_fn(provider: str, causal: bool):
    """provider -> f(q, k, v) for inputs (batch, [heads,] seq, d)."""
    backwards = TRITON_BACKWARDS | {"triton-tl-bwd": "tl"}  # (tl: a comparison only, not a model attention)
    launchers = {"triton-native": "native", "triton-python": "python"}  # the default backward, by launcher
    if provider == "triton-tf32x3":
        from cs336_systems.kernels.flash_attention.function import flash_attention

        return lambda q, k, v: flash_attention(q, k, v, causal, fp32_precision="tf32x3")
    if provider in backwards or provider in launchers:
        from cs336_systems.kernels.flash_attention.function import flash_attention

        if provider in launchers:
            return lambda q, k, v: flash_attention(q, k, v, causal, launcher=launchers[provider])
        return lambda q, k, v: flash_attention(q, k, v, causal, backward=backwards[provider])  # default launcher
    if provider == "pytorch-flash":
        from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch

        return lambda q, k, v: FlashAttentionPytorch.apply(q, k, v, causal)
    if provider in ("naive", "naive-compiled"):
        def naive(q, k, v):
            mask = None
            if causal:
                idx = torch.arange(q.shape[-2], device=q.device)
                mask = idx[None, :] <= idx[:, None]
            return basics_model.scaled_dot_product_attention(q, k, v, mask)
        if provider == "naive":
            return naive
        # One static graph per case: _run_case resets dynamo first, so a sweep of many shapes never
        # reaches the recompile limit (past it dynamo silently runs the function eagerly).
        return torch.compile(naive, dynamic=False)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"sdpa-flash": SDPBackend.FLASH_ATTENTION, "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
               "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}[provider]

    def sdpa(q, k, v):  # a baseline: torch's own kernels
        with sdpa_kernel(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return sdpa


def _skip_reason(case: AttentionCase, device: torch.device) -> str | None:
    if case.provider.startswith("sdpa") and device.type != "cuda":
        return "SDPA backends are CUDA kernels"
    if case.provider.startswith("triton") and device.type != "cuda":
        return "Triton kernels need CUDA (use the tests for the interpreter)"
    if case.provider == "triton-tf32x3" and case.dtype != "fp32":
        return "tf32x3 is a precision of fp32 dots (16-bit dots always run on tensor cores)"
    if case.provider == "pytorch-flash" and case.seq > PYTORCH_FLASH_MAX_SEQ:
        return f"tiled Python reference is too slow above seq {PYTORCH_FLASH_MAX_SEQ}"
    if case.provider == "triton-compile-bwd" and case.seq * case.seq > COMPILED_BWD_MAX_SCORES:
        return "the compiled backward materialises (seq x seq) P"
    return None


def run(args) -> int:
    device: torch.device = args.device
    all_cases = cases(args)
    store = ResultStore("attention", device, args.results_dir)
    if device.type == "cuda":
        from cs336_systems.kernels.flash_attention.warmup import precompile

        combos = {(c.d, common.DTYPES[c.dtype], c.causal) for c in all_cases if c.provider.startswith("triton")}
        failures = precompile(combos, args.precompile_workers)
        if failures:
            print(f"precompile: {len(failures)} candidate configs left to the autotuner, e.g. {failures[0]}")
        from cs336_systems.kernels.flash_attention import native_launch

        native = native_launch.native_enabled() or any(c.provider == "triton-native" for c in all_cases)
        if native and any(c.provider.startswith("triton") for c in all_cases):
            native_launch.load_module()  # built once here (about a minute), not inside a case's timing
    for case in tqdm(all_cases, desc=f"attention ({args.sweep})", disable=args.no_progress):
        _run_case(case, args, store)
    _print_table(store, args)
    if args.plot:
        from cs336_systems.plots import plot_attention_tflops

        plot_attention_tflops(store.frame(), Path(args.plot))
        print(f"plot: {args.plot}")
    return 0


def _run_case(case: AttentionCase, args, store: ResultStore) -> None:
    device = args.device
    config = {k: v for k, v in asdict(case).items() if k != "provider"}
    reason = _skip_reason(case, device)
    if reason:
        for p in args.passes:
            store.add(provider=case.provider, config=config | {"pass": p}, metric="time", unit="ms",
                      status="skipped", message=reason)
        return
    common.free_memory(device)
    lead = (case.batch,) if case.heads == 0 else (case.batch, case.heads)
    flops_fwd = attention_flops(case.batch, max(case.heads, 1), case.seq, case.seq, case.d, causal=case.causal)
    if case.provider in COMPILED_PROVIDERS:
        torch._dynamo.reset()
    aot_compiled = case.provider == "naive-compiled"  # (AOTAutograd: donated buffers, below)
    fn = attention_fn(case.provider, case.causal)
    for p in args.passes:
        try:
            torch.manual_seed(0)
            q, k, v = (torch.randn(*lead, case.seq, case.d, device=device, dtype=common.DTYPES[case.dtype],
                                   requires_grad=True) for _ in range(3))
            grad_out = torch.randn_like(q)
            # Donated buffers forbid the retained-graph backward the `bwd` pass times; AOTAutograd compiles
            # the backward lazily, at the first backward call, so the switch covers the whole measurement.
            with torch._functorch.config.patch(donated_buffer=False) if aot_compiled else contextlib.nullcontext():
                timing, memory, kernel_ms = measure_pass(p, fn, q, k, v, grad_out, args)
            row = config | {"pass": p}
            store.add(provider=case.provider, config=row, metric="time", unit="ms", stats=timing.stats())
            store.add(provider=case.provider, config=row, metric="tflops", unit="TFLOP/s",
                      value=flops_fwd * FLOP_FACTOR[p] / timing.median / 1e12)
            for name, value in memory.items():
                store.add(provider=case.provider, config=row, metric=name, unit="GiB", value=value / 2**30)
            if kernel_ms is not None:
                store.add(provider=case.provider, config=row, metric="kernel_time", unit="ms", value=kernel_ms)
        except Exception as error:
            status = "oom" if common.is_oom(error) else "unsupported"
            store.add(provider=case.provider, config=config | {"pass": p}, metric="time", unit="ms", status=status,
                      message=common.error_message(error))
        finally:
            q = k = v = grad_out = None
            common.free_memory(device)


def measure_pass(p: str, fn, q, k, v, grad_out, args):
    device = q.device
    memory = {}
    handout = getattr(args, "sweep", None) == "handout"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if p == "fwd":
        def call():
            with torch.no_grad():
                fn(q, k, v)
        timing = time_fn(call, warmup=5, steps=100, device=device) if handout else \
            bench_kernel(call, device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    elif p == "bwd":
        out = fn(q, k, v)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            memory["memory_before_backward"] = torch.cuda.memory_allocated(device)

        def call():
            for t in (q, k, v):
                t.grad = None
            out.backward(grad_out, retain_graph=True)
        timing = time_fn(call, warmup=5, steps=100, device=device) if handout else \
            bench_kernel(call, device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    else:
        def call():
            fn(q, k, v).backward(grad_out)
        timing = bench_kernel(call, device=device, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms,
                              grad_to_none=[q, k, v])
    if device.type == "cuda":
        memory["peak_allocated"] = torch.cuda.max_memory_allocated(device)
    kernel_ms = None
    if getattr(args, "kernel_time", False) and device.type == "cuda":
        kernel_ms = kernel_time_ms(call, grad_to_none=[q, k, v])
    return timing, memory, kernel_ms


def speedups(frame: pd.DataFrame, ours: str = "triton") -> pd.DataFrame:
    """Per shape and pass: our median time and each baseline's, and baseline_time / our_time."""
    if frame.empty:
        return frame
    times = frame[(frame["metric"] == "time") & (frame["status"] == "ok")]
    keys = ["batch", "heads", "seq", "d", "dtype", "causal", "pass"]
    wide = times.pivot_table(index=keys, columns="provider", values="median", aggfunc="last")
    if ours not in wide.columns:
        return pd.DataFrame()
    for base in BASELINES + ("naive",):
        if base in wide.columns:
            wide[f"{ours} speed-up vs {base}"] = wide[base] / wide[ours]
    return wide.reset_index()


def _print_table(store: ResultStore, args) -> None:
    frame = store.frame()
    if frame.empty:
        return
    times = frame[frame["metric"] == "time"].copy()
    times["cell"] = [f"{m:.3f}" if s == "ok" else s for m, s in zip(times["median"], times["status"])]
    keys = ["batch", "heads", "seq", "d", "dtype", "causal", "pass"]
    table = times.pivot_table(index=keys, columns="provider", values="cell", aggfunc="last")
    table = table.rename(columns=lambda provider: f"{provider} ms").reset_index()
    tables = [("median time per call (ms)", table)]
    for ours in [p for p in OURS if p.startswith("triton") and p != "triton-compile-bwd"]:
        ratio = speedups(frame, ours)
        if not ratio.empty and any("speed-up" in c for c in ratio.columns):
            cols = keys + [c for c in ratio.columns if "speed-up" in c]
            tables.append((f"speed-up of {ours} (baseline time / ours)", ratio[cols].round(3)))
    common.print_tables(store, args, *tables)

