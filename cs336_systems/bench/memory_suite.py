"""The `memory` suite. `cs336-bench memory saved`: what autograd saves for backward, by module and op.

    cs336-bench memory saved --preset xl --context 2048 --block            # one TransformerBlock
    cs336-bench memory saved --preset xl --context 2048 --block --compile  # the same, torch.compile'd
    cs336-bench memory saved --preset xl --context 2048 --rmsnorm          # RMSNorm alone

Handout problem: memory_profiling's saved-tensor question (the 3.6 GiB example). Parameters are
left out; a storage saved twice counts once. Rows: total, per module, and per top op.
(The analytic memory model and the checkpoint-policy search land here next.)
"""

from __future__ import annotations

import torch

from cs336_basics.model import RMSNorm, TransformerBlock
from cs336_systems.bench.common import DTYPES, add_common_arguments, autocast_context, positive_int
from cs336_systems.bench.results import ResultStore, format_table
from cs336_systems.config import ModelConfig, preset_names
from cs336_systems.memory.saved_tensors import SavedTensorLog


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["saved"], help="saved: saved-tensor accounting of one forward")
    parser.add_argument("--preset", choices=preset_names(), default="tiny")
    parser.add_argument("--context", type=positive_int("--context"), default=None)
    parser.add_argument("--batch", type=positive_int("--batch"), default=4)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="autocast dtype (default fp32)")
    part = parser.add_mutually_exclusive_group()
    part.add_argument("--block", action="store_true", help="one TransformerBlock instead of the whole model")
    part.add_argument("--rmsnorm", action="store_true", help="one RMSNorm alone")
    parser.add_argument("--compile", action="store_true", help="torch.compile the module first")
    parser.add_argument("--top", type=positive_int("--top"), default=10, help="top operations to list")
    add_common_arguments(parser)


def run(args) -> int:
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
            module = cfg.build(device=device)
            inputs = torch.randint(0, cfg.vocab_size, (args.batch, context))
    target = torch.compile(module) if args.compile else module
    with SavedTensorLog(module) as log, autocast_context(device, args.dtype):
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


def _rope(cfg: ModelConfig):
    from cs336_basics.model import RotaryEmbedding

    return RotaryEmbedding(cfg.context_length, cfg.d_head, cfg.rope_theta)
