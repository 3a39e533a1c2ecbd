"""`cs336-bench SUITE [options]`: the toolkit's benchmarking and profiling program."""

from __future__ import annotations

import argparse
import sys

from cs336_systems.bench import attention_suite, model_suite, precision_suite

SUITES = {
    "attention": (attention_suite, "our attention kernels vs PyTorch's: forward, backward, both; sweeps"),
    "model": (model_suite, "time forward / forward-backward / train-step of the LM (sweeps, profiling)"),
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module, _ = SUITES[args.suite]
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
