"""Host time of one FusedAdamW step over a preset's parameters, on any machine: the kernel's launch is stubbed (a
machine without a GPU has no launcher), so what is timed is the step's Python and its launch tables, with and
without the weights' bf16 copies (`cs336_systems/weight_copies.py`). A small model's CUDA-graph step is about 9 ms
on an H100, so a few hundred microseconds here are a few percent there.

    python scripts/optimizer_host_time.py [--preset small] [--steps 100] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time

import torch

import cs336_systems.kernels._triton_utils as triton_utils
import cs336_systems.kernels.adamw as adamw
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.recipe import Recipe, build_model


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def step_us(copies: bool, preset: str, steps: int, repeats: int) -> tuple[int, float]:
    """(parameters, the fastest repeat's mean host time of a step in microseconds)."""
    cfg = ModelConfig.from_name(preset, context_length=64)
    recipe = Recipe(fused=True, optimizer="fused", weight_copy_dtype=torch.bfloat16 if copies else None)
    model = build_model(cfg, recipe, "cpu")
    optimizer = adamw.FusedAdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    for _ in range(5):  # (tables built)
        optimizer.step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            optimizer.step()
        times.append((time.perf_counter() - start) / steps * 1e6)
    return len(list(model.parameters())), min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=preset_names(), default="small", help="model preset (default small)")
    parser.add_argument("--steps", type=int, default=100, help="steps per repeat (default 100)")
    parser.add_argument("--repeats", type=int, default=7, help="repeats; the fastest counts (default 7)")
    args = parser.parse_args()
    if args.steps < 1 or args.repeats < 1:
        parser.error(f"--steps and --repeats must be >= 1, got {args.steps} and {args.repeats}")
    triton_utils.interpreting = lambda: False  # (the model built with its torch maths)
    adamw.runs_kernel = lambda tensor: True  # the kernel path, its launch stubbed
    adamw._kernel = _NoLaunch
    for copies in (False, True):
        count, us = step_us(copies, args.preset, args.steps, args.repeats)
        print(f"{args.preset}: {count} parameters, copies {'on' if copies else 'off'}: {us:.0f} us a step")


if __name__ == "__main__":
    main()
