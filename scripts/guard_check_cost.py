"""What dynamo's guard check of one compiled block costs inside a training step, ours against the baseline.

A small model's step is host-bound (notes/model_sizes.md), and torch.profiler puts "TorchDynamo Cache Lookup" at
several times the baseline's cost for our compiled block. This builds both models as the model suite does (ours:
Triton attention, fused kernels, fused AdamW, the weights' copies, the fused loss; each block compiled), runs a few
steps, takes the guard manager of the block's compiled forward, and times its `check` on the block's own inputs:
repeated at once (warm), and right after each part of a step (the optimizer step, zero_grad, a forward, a whole step).

    python scripts/guard_check_cost.py --device cuda --preset small --context 512
    python scripts/guard_check_cost.py --device cpu    (tiny, the operators' torch maths; fp32 attention on the CPU)
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import statistics
import time

import torch


def _models(args, device):
    """{name: (first block, optimizer, attention context, loss, forward to the hidden states)} for ours and the
    baseline."""
    from cs336_systems.bench.baseline_lm import BaselineLM
    from cs336_systems.config import ModelConfig
    from cs336_systems.recipe import (
        Recipe,
        attention_context,
        build_model,
        build_optimizer,
        hidden_states,
        lm_head_loss,
    )

    cfg = ModelConfig.from_name(args.preset, context_length=args.context)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.context), device=device)
    recipe = Recipe(attention="triton", fused=True, fused_rope=True, optimizer="fused", fused_loss=True,
                    weight_copy_dtype=torch.bfloat16 if args.dtype == "bf16" else None, compile="block")
    ours = build_model(cfg, recipe, device)
    baseline = BaselineLM(cfg).to(device)
    for block in baseline.blocks:
        block.compile()
    baseline_optimizer = torch.optim.AdamW(baseline.parameters(), fused=device.type == "cuda")

    def baseline_loss():
        return torch.nn.functional.cross_entropy(baseline(tokens).flatten(0, 1).float(), tokens.flatten())

    return {
        "ours": (ours.layers[0], build_optimizer(ours, recipe), attention_context(recipe),
                 lambda: lm_head_loss(ours, hidden_states(ours, tokens), tokens), lambda: hidden_states(ours, tokens)),
        "baseline": (baseline.blocks[0], baseline_optimizer, contextlib.nullcontext(), baseline_loss,
                     lambda: baseline.hidden(tokens)),
    }


def _block_inputs(block, run) -> dict:
    """The block's forward arguments by name, as the model passes them (what the guards read as the frame's locals)."""
    seen = {}

    def grab(module, args, kwargs):
        seen.update(inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments)

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return seen


def _costs(name, block, optimizer, loss_fn, forward, repeats: int, sync) -> list[float]:
    """Median us of the block's guard check: warm, then after the optimizer step, zero_grad, a forward, a step."""
    def step():
        optimizer.zero_grad(set_to_none=True)
        loss_fn().backward()
        optimizer.step()

    for _ in range(3):
        step()
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(type(block).forward.__code__)
    if not entries:
        raise SystemExit(f"{name}: the block's forward has no compiled entry (it ran eagerly?)")
    guards = entries[0].guard_manager
    frame_locals = _block_inputs(block, forward)
    if not guards.check(frame_locals):
        raise SystemExit(f"{name}: the guards fail on the block's own inputs")

    def timed(part) -> float:
        times = []
        for _ in range(repeats):
            part()
            sync()
            start = time.perf_counter()
            guards.check(frame_locals)
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    with torch.no_grad():
        after_forward = timed(forward)
    return [timed(lambda: None), timed(optimizer.step), timed(lambda: optimizer.zero_grad(set_to_none=True)),
            after_forward, timed(step)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default) or cpu")
    parser.add_argument("--preset", default=None, help="model preset (default: small on cuda, tiny on cpu)")
    parser.add_argument("--context", type=int, default=None, help="context length (default: 512 on cuda, 32 on cpu)")
    parser.add_argument("--batch", type=int, default=4, help="batch size (default 4)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                        help="autocast dtype (default: bf16 on cuda, fp32 on the cpu)")
    parser.add_argument("--repeats", type=int, default=60, help="timed checks after each part (default 60)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or (args.context is not None and args.context < 1):
        parser.error(f"--repeats, --batch and --context must be >= 1, got {args.repeats}, {args.batch}, "
                     f"{args.context}")
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU here")
    args.preset = args.preset or ("small" if cuda else "tiny")
    args.context = args.context or (512 if cuda else 32)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if not cuda:  # the operators' torch maths, not Triton's interpreter
        import cs336_systems.kernels._triton_utils as utils
        import cs336_systems.kernels.flash_attention.function  # noqa: F401  (its autotune configs are read at import)

        utils.interpreting = lambda: False
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = torch.autocast(device.type, torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()
    print(f"{args.preset}/{args.context}, batch {args.batch}, {args.dtype}, {args.device}; median us of one guard "
          f"check of the first block's compiled forward, {args.repeats} checks each")
    print(f"{'':<10} {'warm':>8} {'after optimizer step':>22} {'after zero_grad':>16} {'after forward':>14} "
          f"{'after whole step':>17}")
    for name, (block, optimizer, context, loss_fn, forward) in _models(args, device).items():
        with context, autocast:
            row = _costs(name, block, optimizer, loss_fn, forward, args.repeats, sync)
        print(f"{name:<10} {row[0]:>8.1f} {row[1]:>22.1f} {row[2]:>16.1f} {row[3]:>14.1f} {row[4]:>17.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
