"""Where the host time of one training step goes, ours against the baseline, on the model suite's harness.

At small sizes a step is host-bound (notes/model_sizes.md): the GPU waits for Python. This builds the model
suite's configurations (the same `_Harness` the `model` suite times), warms each up, then runs the timed steps
under cProfile and prints, per configuration, the wall time per step and the functions with the most own time
(tottime) and the most time below them (cumtime) over the profiled steps, then torch.profiler's CPU self time
per operator (dispatch, our custom operators, launches: what cProfile sees only as the Python call reaching
them). A variant list takes our pieces away one at a time, so the cost of each (fused kernels, fused AdamW) shows
as a difference of step times.

    python scripts/step_host_profile.py --preset small --context 512 --compile off,on --out DIR
    python scripts/step_host_profile.py --variants ours,baseline --steps 20

Without a GPU, `--stub-kernels` times the same Python on the CPU: our kernels' launches do nothing and our operators
take their CUDA path on CPU tensors (`operator_host_overhead.stub_launches`), so a step is the host work that sits
between kernels on a GPU, plus torch's own ops on small CPU tensors (both providers: pick a small --d-model so their
maths is negligible).

    python scripts/step_host_profile.py --device cpu --stub-kernels --compile off --dtype fp32 --d-model 64 \
        --vocab-size 256 --context 32 --batch 1
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import math
import os
import pstats
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

from cs336_systems.bench.suites.model import ModelCase, _Harness
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.profiling.timing import default_warmup_seconds, warm_up

# name -> (provider, attention, fused, optimizer): ours, then ours without one piece at a time, then our model
# with none of them (the staff attention maths), beside the baseline.
VARIANTS = {
    "baseline": ("baseline", "sdpa", False, "torch-fused"),
    "ours": ("ours", "triton", True, "fused"),
    "ours-no-fused-kernels": ("ours", "triton", False, "fused"),
    "ours-cs336-adamw": ("ours", "triton", True, "cs336"),
    "ours-plain-loss": ("ours", "triton", True, "fused"),  # (CASE_OPTIONS)
    "ours-no-weight-copies": ("ours", "triton", True, "fused"),  # (CASE_OPTIONS)
    "ours-unmerged": ("ours", "triton", True, "fused"),  # (RECIPE_OPTIONS)
    "ours-custom-ops": ("ours", "triton", True, "fused"),  # (VARIANT_ENVIRONMENT)
    "ours-python-attention": ("ours", "triton", True, "fused"),  # (VARIANT_SETTINGS)
    "plain": ("ours", "reference", False, "cs336"),
}
RECIPE_OPTIONS = {"ours-unmerged": {"merge_projections": False}}  # what else a variant changes in our Recipe
# A variant's model-suite case fields where they are not the suite's default for its pieces (with our fused kernels:
# the fused loss; with the fused optimizer in 16 bits too: the weights' copies)
CASE_OPTIONS = {"ours-plain-loss": {"fused_loss": False}, "ours-no-weight-copies": {"weight_copies": False}}
# Environment a variant runs under: our pointwise operators as custom operators under torch.compile, where the
# default traces them as triton_ops (read when traced).
VARIANT_ENVIRONMENT = {"ours-custom-ops": {"CS336_TRITON_OPS": "0"}}


@contextlib.contextmanager
def _python_attention_launches():
    """Our attention's Python launch path (launch plans replayed from Python), not the native C++ plans: eagerly
    and in the registered operators torch.compile's graphs call."""
    from cs336_systems.kernels.flash_attention import native_launch

    was = native_launch.native_enabled()
    native_launch.use_native(False)
    try:
        yield
    finally:
        native_launch.use_native(was)


# Process settings a variant runs under (besides its environment).
VARIANT_SETTINGS = {"ours-python-attention": _python_attention_launches}


def _steps_ms(step, steps: int, device: torch.device) -> list[float]:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    for _ in range(steps):
        sync()
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _environment(values: dict[str, str]):
    """These environment variables set for the block, the previous values back after it."""
    return mock.patch.dict(os.environ, values)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small", choices=preset_names(), help="model preset (default small)")
    parser.add_argument("--context", type=int, default=512, help="context length (default 512)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--compile", default="off,on",
                        help="comma-separated: off, on (each block compiled), reduce-overhead (default off,on)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"comma-separated, from: {', '.join(VARIANTS)} (default all)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps, and profiled steps (default 20)")
    parser.add_argument("--top", type=int, default=30, help="functions listed per table (default 30)")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to try the script itself")
    parser.add_argument("--out", type=Path, default=None, help="folder for one text file per configuration")
    parser.add_argument("--stub-kernels", action="store_true",
                        help="CPU only: our launches do nothing and our operators take their CUDA path (see above)")
    parser.add_argument("--d-model", type=int, default=None, help="override the preset's d_model (d_ff: 8/3 of it, "
                        "a multiple of 64; heads: the preset's, or fewer where d_model needs)")
    parser.add_argument("--vocab-size", type=int, default=None, help="override the preset's vocabulary")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16",
                        help="autocast dtype (default bf16; fp32 on the CPU: its bf16 matmuls are slow)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    for name in variants:
        if name not in VARIANTS:
            parser.error(f"--variants: unknown {name!r}; choose from {', '.join(VARIANTS)}")
    compiles = args.compile.split(",")
    for choice in compiles:
        if choice not in ("off", "on", "reduce-overhead"):
            parser.error(f"--compile: unknown {choice!r}; choose from off, on, reduce-overhead")
    for name in ("steps", "context", "batch", "top"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.vocab_size is not None and args.vocab_size < 2:
        parser.error(f"--vocab-size must be >= 2, got {args.vocab_size}")
    if args.d_model is not None and (args.d_model < 16 or args.d_model % 16):
        parser.error(f"--d-model must be a positive multiple of 16, got {args.d_model}")
    if args.stub_kernels and (args.device != "cpu" or compiles != ["off"]):
        parser.error(f"--stub-kernels: runs with --device cpu --compile off only (got --device {args.device}, "
                     f"--compile {args.compile})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here (this measures host time between CUDA kernels)")
    cfg = ModelConfig.from_name(args.preset, context_length=args.context)
    if args.d_model is not None:
        heads = math.gcd(cfg.num_heads, args.d_model // 2)  # (head dim even, for RoPE)
        cfg = dataclasses.replace(cfg, d_model=args.d_model, num_heads=heads,
                                  d_ff=max(64, round(args.d_model * 8 / 3 / 64) * 64))
    if args.vocab_size is not None:
        cfg = dataclasses.replace(cfg, vocab_size=args.vocab_size)
    if args.stub_kernels:
        from operator_host_overhead import stub_launches  # (this folder: the script's own, as launch_host_cost's)

        stub_launches()
    print(f"{args.preset}/{args.context} (d_model {cfg.d_model}, {cfg.num_layers} layers), batch {args.batch}, "
          f"{args.dtype} autocast, train step; {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}"
          f"{', kernels stubbed' if args.stub_kernels else ''}, torch {torch.__version__}")
    print(f"{'variant':<24} {'compile':<16} {'median ms':>10} {'min ms':>8} {'max ms':>8}")
    for compile_choice in compiles:
        for name in variants:
            provider, attention, fused, optimizer = VARIANTS[name]
            compiled = compile_choice != "off"
            defaults = {"fused_loss": fused, "weight_copies": fused and optimizer == "fused" and args.dtype != "fp32"}
            case = ModelCase(args.preset, args.context, args.batch, args.dtype, compiled, provider, attention,
                             fused=fused, optimizer=optimizer, compile_scope="block" if compiled else "-",
                             compile_mode=("default" if compile_choice == "on" else compile_choice)
                             if compiled else "-", **(defaults | CASE_OPTIONS.get(name, {})))
            try:
                harness = _Harness(case, cfg, device, **RECIPE_OPTIONS.get(name, {}))
                with (harness.attention_context(), _environment(VARIANT_ENVIRONMENT.get(name, {})),
                      VARIANT_SETTINGS.get(name, contextlib.nullcontext)()):
                    step = harness.step_fn("train-step", lambda _name: contextlib.nullcontext())
                    # Warm-up (and compilation), then by time on CUDA, as the model suite's --warmup-s default.
                    warm_up(step, calls=5, device=device, seconds=default_warmup_seconds(device))
                    times = _steps_ms(step, args.steps, device)
                    profiler = cProfile.Profile()
                    profiler.enable()
                    _steps_ms(step, args.steps, device)
                    profiler.disable()
                    # The operators' own host time (dispatch, custom ops, launches), which cProfile sees only
                    # as the Python call that reached them: torch.profiler's CPU side, self time per op.
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as ops:
                        _steps_ms(step, args.steps, device)
            except Exception as error:  # a failing variant is reported and the rest still run
                print(f"{name:<24} {compile_choice:<16} failed: {type(error).__name__}: {error}")
                continue
            print(f"{name:<24} {compile_choice:<16} {statistics.median(times):>10.2f} {min(times):>8.2f} "
                  f"{max(times):>8.2f}")
            text = io.StringIO()
            stats = pstats.Stats(profiler, stream=text)
            text.write(f"# {name}, compile {compile_choice}: unprofiled step median {statistics.median(times):.2f} ms "
                       f"(min {min(times):.2f}, max {max(times):.2f}) over {args.steps} steps\n"
                       f"# {args.steps} profiled steps; times below are per {args.steps} steps\n")
            stats.sort_stats("tottime").print_stats(args.top)
            stats.sort_stats("cumulative").print_stats(args.top)
            text.write(f"\n# torch.profiler, CPU self time per op over {args.steps} steps\n")
            text.write(ops.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
            if args.out:
                (args.out / f"host_{name}_{compile_choice}.txt").write_text(text.getvalue())
            del harness, step
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
