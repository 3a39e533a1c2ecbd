"""The `memory` suite. `cs336-bench memory saved`: what autograd saves for backward, by module and op.

    cs336-bench memory saved --preset xl --context 2048 --block            # one TransformerBlock
    cs336-bench memory saved --preset xl --context 2048 --block --compile  # the same, torch.compile'd
    cs336-bench memory saved --preset xl --context 2048 --rmsnorm          # RMSNorm alone

Handout problem: memory_profiling's saved-tensor question (the 3.6 GiB example). Parameters are
left out; a storage saved twice counts once. Rows: total, per module, and per top op.

`cs336-bench memory search` (gradient_checkpointing, CUDA): one checkpointing level over group sizes k,
each policy's measured peak and step time beside the analytic memory model's prediction.

    cs336-bench memory search --preset xl --context 2048 --policies none,every-block,every-k:3
"""

from __future__ import annotations

import torch

from cs336_basics.model import RMSNorm, TransformerBlock
from cs336_systems.bench import common
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.memory.saved_tensors import SavedTensorLog
from cs336_systems.recipe import Recipe, build_model, build_optimizer
from cs336_systems.results import ResultStore, format_table


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["saved", "search"],
                        help="saved: saved-tensor accounting of one forward; search: single-level checkpointing "
                             "over group sizes k, measured peak and step time beside the memory model")
    parser.add_argument("--preset", choices=preset_names(), default="tiny", help="model size (default tiny)")
    parser.add_argument("--context", type=common.positive_int("--context"), default=None,
                        help="context length (default: the preset's)")
    parser.add_argument("--batch", type=common.positive_int("--batch"), default=4,
                        help="sequences per step (default 4)")
    parser.add_argument("--dtype", choices=list(common.DTYPES), default="fp32", help="autocast dtype (default fp32)")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--block", action="store_true", help="one TransformerBlock instead of the whole model")
    part.add_argument("--rmsnorm", action="store_true", help="one RMSNorm alone")
    parser.add_argument("--compile", action="store_true", help="torch.compile the module first")
    parser.add_argument("--top", type=common.positive_int("--top"), default=10, help="top operations to list")
    parser.add_argument("--policies", type=common.list_of(common.checkpoint_policy("--policies"), name="--policies"),
                        default=None,
                        help="search: comma-separated policies to measure (default: none, every-k over the candidate "
                             "group sizes, nested)")
    parser.add_argument("--steps", type=common.positive_int("--steps"), default=3,
                        help="search: timed steps (default 3)")
    common.add_common_arguments(parser)


def run(args) -> int:
    if args.action == "search":
        return search(args)
    device = args.device
    cfg = ModelConfig.from_name(args.preset)
    context = args.context or cfg.context_length
    cfg = ModelConfig.from_name(args.preset, context_length=context)
    torch.manual_seed(0)
    with torch.device(device):
        if args.block:
            module = TransformerBlock(cfg.d_model, cfg.num_heads, cfg.d_ff, _rope(cfg))
            inputs = torch.randn(args.batch, context, cfg.d_model, requires_grad=True)
        elif args.rmsnorm:
            module = RMSNorm(cfg.d_model)
            inputs = torch.randn(args.batch, context, cfg.d_model, requires_grad=True)
        else:
            module = build_model(cfg, Recipe(), device)
            inputs = torch.randint(0, cfg.vocab_size, (args.batch, context))
    target = torch.compile(module) if args.compile else module
    with SavedTensorLog(module) as log, common.autocast_context(device, args.dtype):
        out = target(inputs)
    del out
    part = "block" if args.block else "rmsnorm" if args.rmsnorm else "model"
    config = dict(preset=args.preset, context=context, batch=args.batch, dtype=args.dtype, part=part,
                  compile=args.compile)
    store = ResultStore("memory", device, args.results_dir)
    summary = log.summary(top=args.top, module_depth=2)
    store.add(provider="ours", config=config | {"what": "total"}, metric="saved_bytes", unit="GiB",
              value=summary["total_bytes"] / 2**30)
    for row in summary["per_module"].itertuples():
        store.add(provider="ours", config=config | {"what": "module", "module": row.module}, metric="saved_bytes",
                  unit="GiB", value=row.bytes / 2**30)
    for row in summary["top_ops"].itertuples():
        store.add(provider="ours", config=config | {"what": "op", "op": row.op, "tensors": int(row.tensors),
                                                    "share": round(float(row.share), 4)},
                  metric="saved_bytes", unit="GiB", value=row.bytes / 2**30)
    fmt = "latex" if args.latex else "markdown"
    print(f"saved for backward: {summary['total_bytes'] / 2**30:.3f} GiB ({part}, {args.preset}, ctx {context}, "
          f"batch {args.batch}, {args.dtype}{', compiled' if args.compile else ''})")
    print("\nper module\n" + format_table(summary["per_module"].assign(GiB=summary["per_module"]["bytes"] / 2**30)
                                         .drop(columns="bytes").round(4), fmt))
    print("\ntop operations\n" + format_table(summary["top_ops"].assign(GiB=summary["top_ops"]["bytes"] / 2**30)
                                             .drop(columns="bytes").round(4), fmt))
    print(f"\nrows appended to {store.path}")
    return 0


def _candidate_group_sizes(n: int) -> list[int]:
    """Powers of two up to n, n itself and round(sqrt(n)) with its neighbours."""
    ks = {1, n, max(1, round(n ** 0.5))}
    k = 2
    while k < n:
        ks.add(k)
        k *= 2
    root = round(n ** 0.5)
    ks.update(x for x in (root - 1, root + 1) if 1 <= x <= n)
    return sorted(ks)


def _measure_policy(cfg, policy, args, device):
    """(peak bytes, median step seconds) of a train step under `policy`; CPU peak = retained bytes + state."""
    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.memory.live_bytes import retained_bytes
    from cs336_systems.profiling.timing import time_fn

    # A failed (out-of-memory) policy leaves its model in reference cycles through the traceback:
    # collect them, or their bytes count in this policy's peak.
    common.free_memory(device)
    torch.manual_seed(0)
    recipe = Recipe(checkpoint=policy)
    model = build_model(cfg, recipe, device)
    opt = build_optimizer(model, recipe)
    x = torch.randint(0, cfg.vocab_size, (args.batch, cfg.context_length), device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        with common.autocast_context(device, args.dtype):
            logits = model(x)
        cross_entropy(logits.float(), x).backward()
        opt.step()

    step()  # optimizer state exists from here on, as in steady training
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timing = time_fn(step, warmup=1, steps=args.steps, device=device)
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    else:
        opt.zero_grad(set_to_none=True)
        _, held = retained_bytes(lambda: cross_entropy(model(x), x))
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        peak = held + 4 * params  # parameters, gradients, two AdamW moments
    return peak, timing.median


def search(args) -> int:
    from cs336_systems.memory.model import predict

    device = args.device
    cfg = ModelConfig.from_name(args.preset, context_length=args.context or ModelConfig.from_name(
        args.preset).context_length)
    store = ResultStore("memory", device, args.results_dir)
    rows = []
    policies = args.policies or [CheckpointPolicy(), *(CheckpointPolicy("every-k", k)
                                                      for k in _candidate_group_sizes(cfg.num_layers)),
                                 CheckpointPolicy("nested")]
    for policy in policies:
        config = dict(preset=args.preset, context=cfg.context_length, batch=args.batch, dtype=args.dtype,
                      policy=str(policy))
        predicted = predict(cfg, args.batch, cfg.context_length, policy=policy).peak if args.dtype == "fp32" else None
        failure = None
        try:
            peak, seconds = _measure_policy(cfg, policy, args, device)
        except Exception as error:  # out of memory is a result, and the search goes on
            failure = ("oom" if common.is_oom(error) else "error", common.error_message(error))
        if failure:
            # Outside the except block: the traceback (and the frames holding the failed model) is gone.
            common.free_memory(device)
            store.add(provider="ours", config=config, metric="peak_memory", unit="GiB", status=failure[0],
                      message=failure[1])
            rows.append(dict(policy=str(policy), peak_GiB=failure[0], predicted_GiB=predicted and predicted / 2**30,
                             step_ms=None))
            continue
        store.add(provider="ours", config=config, metric="peak_memory", unit="GiB", value=peak / 2**30)
        store.add(provider="ours", config=config, metric="step_time", unit="ms", value=seconds * 1e3)
        if predicted is not None:
            store.add(provider="ours", config=config, metric="predicted_peak_memory", unit="GiB",
                      value=predicted / 2**30)
        rows.append(dict(policy=str(policy), peak_GiB=round(peak / 2**30, 4),
                         predicted_GiB=None if predicted is None else round(predicted / 2**30, 4),
                         step_ms=round(seconds * 1e3, 2)))
    import pandas as pd

    table = pd.DataFrame(rows)
    print(format_table(table, "latex" if args.latex else "markdown"))
    measured = [r for r in rows if isinstance(r["peak_GiB"], float) and r["policy"].startswith("every-k")]
    if measured:
        best = min(measured, key=lambda r: r["peak_GiB"])
        print(f"\nlowest measured peak of one checkpointing level: {best['policy']} ({best['peak_GiB']} GiB, "
              f"{best['step_ms']} ms/step); fewer groups keep more activations live during recompute, more groups "
              f"keep more boundaries")
    print(f"rows appended to {store.path}")
    return 0


def _rope(cfg: ModelConfig):
    from cs336_basics.model import RotaryEmbedding

    return RotaryEmbedding(cfg.context_length, cfg.d_head, cfg.rope_theta)
