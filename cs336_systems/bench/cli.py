"""`cs336-bench SUITE [options]`: the toolkit's benchmarking and profiling program."""

from __future__ import annotations

import argparse
import sys
from types import SimpleNamespace

from cs336_systems.bench import (
    attention_suite,
    attention_tuning,
    collectives_suite,
    cross_entropy_suite,
    leaderboard_suite,
    memory_suite,
    model_suite,
    parallel_suites,
    precision_suite,
)
from cs336_systems.kernels._triton_utils import missing_triton_message, triton_installed

SUITES = {
    "attention": (attention_suite, "our attention kernels vs PyTorch's: forward, backward, both; sweeps"),
    "attention-tune": (attention_tuning, "every tile config of each FlashAttention kernel, timed alone"),
    "model": (model_suite, "time forward / forward-backward / train-step of the LM (sweeps, profiling)"),
    "collectives": (collectives_suite, "all-reduce / all-gather / reduce-scatter timings and bandwidth"),
    "ddp": (SimpleNamespace(add_arguments=parallel_suites.add_ddp_arguments, run=parallel_suites.run_ddp,
                            __doc__=parallel_suites.__doc__), "our DDP variants vs torch DDP: step and exposed comm"),
    "sharding": (SimpleNamespace(add_arguments=parallel_suites.add_sharding_arguments,
                                 run=parallel_suites.run_sharding, __doc__=parallel_suites.__doc__),
                 "memory and step time with and without ZeRO-1 optimizer sharding"),
    "fsdp": (SimpleNamespace(add_arguments=parallel_suites.add_fsdp_arguments, run=parallel_suites.run_fsdp,
                             __doc__=parallel_suites.__doc__), "our FSDP vs DDP and torch FSDP2"),
    "cross-entropy": (cross_entropy_suite, "fused LM head + cross-entropy vs lm_head + cross_entropy: time, memory"),
    "leaderboard": (leaderboard_suite, "the full 8B training step with our kernels (and --verify)"),
    "memory": (memory_suite, "saved-tensor accounting by module and op"),
    "precision": (precision_suite, "the handout's accumulation loops and autocast dtypes, computed"),
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
        providers = dict.fromkeys(case.provider for case in attention_suite.cases(args))
        needs += [f"--provider {name}" for name in providers if name.startswith("triton")]
    attention = getattr(args, "attention", None)
    if isinstance(attention, str) and attention.startswith("triton"):
        needs.append(f"--attention {attention}")
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
