"""`cs336-bench SUITE [options]`: the toolkit's benchmarking and profiling program."""

from __future__ import annotations

import argparse
import sys

from cs336_systems.bench.suites import (
    attention,
    attention_tune,
    collectives,
    cross_entropy,
    ddp,
    fsdp,
    fused_ops,
    leaderboard,
    memory,
    model,
    precision,
    sharding,
)
from cs336_systems.kernels._triton_utils import missing_triton_message, triton_installed

SUITES = {
    "attention": (attention, "our attention kernels vs PyTorch's: forward, backward, both; sweeps"),
    "attention-tune": (attention_tune, "every tile config of each FlashAttention kernel, timed alone"),
    "model": (model, "time forward / forward-backward / train-step of the LM (sweeps, profiling)"),
    "collectives": (collectives, "all-reduce / all-gather / reduce-scatter timings and bandwidth"),
    "ddp": (ddp, "our DDP variants vs torch DDP: step and exposed comm"),
    "sharding": (sharding, "memory and step time with and without ZeRO-1 optimizer sharding"),
    "fsdp": (fsdp, "our FSDP vs DDP and torch FSDP2"),
    "cross-entropy": (cross_entropy, "fused LM head + cross-entropy vs lm_head + cross_entropy: time, memory"),
    "fused-ops": (fused_ops, "our fused RMSNorm and SwiGLU gate vs torch and Liger-Kernel: time, memory"),
    "leaderboard": (leaderboard, "the full 8B training step with our kernels (and --verify)"),
    "memory": (memory, "saved-tensor accounting by module and op"),
    "precision": (precision, "the handout's accumulation loops and autocast dtypes, computed"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cs336-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="suite", metavar="SUITE", required=True)
    for name, (module, help_text) in SUITES.items():
        suite_parser = sub.add_parser(name, help=help_text, description=module.__doc__,
                                      formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(suite_parser)
    return parser


def triton_options(args: argparse.Namespace) -> list[str]:
    """The options of a parsed command line that run one of our Triton kernels (empty: Triton is not needed).
    Checked before any work starts, so a machine without Triton gets one line, not a traceback mid-sweep."""
    needs = []
    if args.suite == "attention-tune":
        needs.append("the attention-tune suite")
    if args.suite == "attention":
        providers = dict.fromkeys(case.provider for case in attention.cases(args))
        needs += [f"--provider {name}" for name in providers if name.startswith("triton")]
    attention_name = getattr(args, "attention", None)
    if isinstance(attention_name, str) and attention_name.startswith("triton"):
        needs.append(f"--attention {attention_name}")
    if getattr(args, "fused", None) in (True, "on"):
        needs.append("--fused")
    if getattr(args, "optimizer", None) == "fused":
        needs.append("--optimizer fused")
    return needs


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = SUITES[args.suite]  # args.suite names the results file too
    needs = triton_options(args) if not triton_installed() else []
    if needs:
        print(f"cs336-bench {args.suite}: " + missing_triton_message(", ".join(needs)), file=sys.stderr)
        return 2
    try:
        return module.run(args)
    except ModuleNotFoundError as error:  # a Triton path the check above does not know of
        if (error.name or "").partition(".")[0] != "triton":
            raise
        print(f"cs336-bench {args.suite}: " + missing_triton_message("this run"), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
