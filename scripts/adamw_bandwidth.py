"""How fast the optimizer step moves bytes over a preset's parameters: our FusedAdamW against torch's fused AdamW
(the model suite's baseline optimizer), in one run (GPU only).

At ctx 512 the optimizer is a large share of a GPU-bound step (large: about 11 ms of 39 on an H100), and both ours
and torch's moved about 2.6 TB/s there. This builds the preset's model as our model suite's "ours" does (fused
kernels, merged projections, bf16 weight copies that our step writes), gives every parameter an fp32 gradient, and
times `step()` (`triton.testing.do_bench` median and spread) for:
  ours            FusedAdamW as the recipe makes it (16-byte loads and stores where the addresses are aligned)
  ours-capturable the same with its step counts on the device, as the step graph (`--step-graph on`) runs it
  ours-4-byte     the same with `adamw.VECTORISE` off (the masked 4-byte form everywhere, the kernel before it)
  ours-BLOCKxW    other block sizes and warps (--blocks)
  torch-fused     torch.optim.AdamW(fused=True) over the same parameters, no weight copies (what it writes); and
                  its capturable form (torch-fused-capturable), as the baseline's step graph runs it
GB/s counts the bytes each must move: p, g, m, v read and p, m, v written in fp32 (28 a parameter), plus 2 for each
weight copy ours writes. A measurement to choose the kernel's form from, not a test; rows (metric step_ms, one per
case) go to `<results-dir>/optimizer-step.jsonl`.

    python scripts/adamw_bandwidth.py                          # large and xl
    python scripts/adamw_bandwidth.py --preset small --blocks 2048x4,4096x8
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import torch

from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.kernels import adamw
from cs336_systems.profiling.timing import bench_kernel
from cs336_systems.results import DEFAULT_RESULTS_DIR, ResultStore


def _model(preset: str):
    from cs336_systems.recipe import Recipe, build_model

    recipe = Recipe(attention="triton", fused=True, optimizer="fused", weight_copy_dtype=torch.bfloat16)
    model = build_model(ModelConfig.from_name(preset), recipe, "cuda")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def _time(step, rep_ms: int) -> dict:
    """do_bench's times of `step` (L2 flushed between calls) as a row's stats."""
    return bench_kernel(step, device="cuda", warmup_ms=100, rep_ms=rep_ms).stats()


def _record(store: ResultStore, provider: str, stats: dict, sizes: dict, moved: int, **form) -> None:
    """One case's row (the preset's `sizes`, the bytes it must move, its kernel's `form`) and its printed line."""
    store.add(provider=provider, config=dict(**sizes, bytes_moved=moved, **form), metric="step_ms", unit="ms",
              stats=stats)
    ms, spread = stats["median"], (stats["max"] - stats["min"]) / stats["median"]
    print(f"  {provider:22s} {ms:7.3f} ms ({spread:5.1%})  {moved / ms / 1e6:6.0f} GB/s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="large,xl", help="comma-separated model presets (default large,xl)")
    parser.add_argument("--blocks", default="2048x4,4096x8",
                        help="comma-separated BLOCKxWARPS variants of ours to time beside the default (default "
                             "2048x4,4096x8; '' for none)")
    parser.add_argument("--rep-ms", type=int, default=500, help="milliseconds of timed steps each (default 500)")
    parser.add_argument("--results-dir", default=str(DEFAULT_RESULTS_DIR),
                        help=f"where optimizer-step.jsonl gets its rows (default {DEFAULT_RESULTS_DIR})")
    args = parser.parse_args(argv)
    presets = args.preset.split(",")
    unknown = [p for p in presets if p not in preset_names()]
    if unknown:
        parser.error(f"--preset: unknown {', '.join(unknown)}; allowed: {', '.join(preset_names())}")
    try:
        variants = [tuple(int(n) for n in v.split("x")) for v in args.blocks.split(",") if v]
    except ValueError:
        parser.error(f"--blocks must be BLOCKxWARPS pairs like 2048x4, got {args.blocks!r}")
    if not all(len(v) == 2 and v[0] >= 128 and v[0] & (v[0] - 1) == 0 and v[1] in (1, 2, 4, 8, 16) for v in variants):
        parser.error(f"--blocks: BLOCK a power of two >= 128, WARPS one of 1, 2, 4, 8, 16; got {args.blocks!r}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    if args.rep_ms < 1:
        parser.error(f"--rep-ms must be >= 1, got {args.rep_ms}")
    store = ResultStore("optimizer-step", "cuda", args.results_dir)
    print(f"{torch.cuda.get_device_name()}; median ms of step() (spread), GB/s of the bytes each must move")

    for preset in presets:
        model = _model(preset)
        params = list(model.parameters())
        elements = sum(p.numel() for p in params)
        copied = sum(p.numel() for p in params if getattr(p, "compute_copy", None) is not None)
        print(f"{preset}: {elements / 1e6:.0f} M parameters in {len(params)} tensors, {copied / 1e6:.0f} M with a "
              f"bf16 copy")
        sizes = dict(preset=preset, parameters=elements, copied=copied)
        cases = [("ours", {}), ("ours-capturable", {}), ("ours-4-byte", {"VECTORISE": False})]
        cases += [(f"ours-{b}x{w}", {"BLOCK": b, "NUM_WARPS": w}) for b, w in variants]
        for name, settings in cases:
            with mock.patch.multiple(adamw, **settings) if settings else contextlib.nullcontext():
                # a new one each (its launch tables use BLOCK); capturable as the step graph makes it
                optimizer = adamw.FusedAdamW(params, lr=1e-4, capturable=name == "ours-capturable")
                stats = _time(optimizer.step, args.rep_ms)
                form = dict(block=adamw.BLOCK, warps=adamw.NUM_WARPS, vectorise=adamw.VECTORISE,
                            capturable=optimizer.capturable)
            _record(store, name, stats, sizes, 28 * elements + 2 * copied, **form)
            del optimizer
        for capturable in (False, True):
            optimizer = torch.optim.AdamW(params, lr=1e-4, fused=True, capturable=capturable)
            _record(store, "torch-fused" + ("-capturable" if capturable else ""), _time(optimizer.step, args.rep_ms),
                    sizes, 28 * elements, capturable=capturable)
            del optimizer
        del model, params
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
