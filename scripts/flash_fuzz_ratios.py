"""Each fuzz case's error as a ratio to its budget: what `tests/test_kernels_flash_fuzz.py` asserts, printed.

For each case and tensor (the output, dq, dk, dv): our max error against fp64, PyTorch's own error at the same
precision, and ours / budget, the budget being 2x PyTorch's error plus two rounding units at the reference's scale
(`tests._support.error_and_budget`). Above 1.00 the fuzz test fails. For fp32 the Triton kernels' dot precision
can be chosen, and the launcher (the Python path, or the native plans on a repeat call).

    python scripts/flash_fuzz_ratios.py --cases 8 --dtype fp32 --precision ieee,tf32x3
    TRITON_INTERPRET=1 python scripts/flash_fuzz_ratios.py --cases 0-19 --device cpu
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root: the tests' fuzz cases
from tests._support import error_and_budget  # noqa: E402
from tests.test_kernels_flash_fuzz import CASES, DTYPES, fuzz_results  # noqa: E402


def _case_list(text: str) -> list[int]:
    cases = []
    for part in text.split(","):
        first, _, last = part.partition("-")
        try:
            cases.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"--cases: {part!r} is not N or N-M") from None
    for case in cases:
        if not 0 <= case < len(CASES):
            raise argparse.ArgumentTypeError(f"--cases: {case} is outside 0-{len(CASES) - 1}")
    return cases


def print_summary(ratios: dict[str, list[float]]) -> None:
    """Per tensor: the number of cases, the mean, 95th percentile and max of ours / budget, and how many are over."""
    for name, values in ratios.items():
        ranked = sorted(values)
        p95 = ranked[min(len(ranked) - 1, int(0.95 * len(ranked)))]
        print(f"summary {name:<4} cases {len(values):>4}  mean {sum(values) / len(values):.3f}  p95 {p95:.3f}  "
              f"max {ranked[-1]:.3f}  over {sum(v > 1 for v in values)}")


def summarize_files(paths: list[str]) -> int:
    """The summary of rows this script printed into files (several processes, one share of the cases each)."""
    missing = [path for path in paths if not Path(path).is_file()]
    if missing:
        print(f"--summarize: no such file: {', '.join(missing)}")
        return 2
    ratios: dict[str, list[float]] = {}
    for path in paths:
        for line in Path(path).read_text().splitlines():
            fields = line.split()
            if len(fields) >= 8 and fields[0].isdigit() and fields[-4] in ("out", "dq", "dk", "dv"):
                ratios.setdefault(fields[-4], []).append(float(fields[-1]))
    if not ratios:
        print(f"--summarize: no rows in {', '.join(paths)}")
        return 1
    print_summary(ratios)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=_case_list, default=_case_list(f"0-{len(CASES) - 1}"),
                        help=f"case numbers, e.g. 8 or 0-19,120 (default all {len(CASES)})")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32", help="input dtype (default fp32)")
    parser.add_argument("--impl", choices=("triton", "pytorch"), default="triton",
                        help="the Triton kernels (default) or the PyTorch tiled class")
    parser.add_argument("--precision", default="default",
                        help="fp32 dot precisions to try, comma-separated: default, ieee, tf32x3, tf32 (default: "
                             "default, the process's setting)")
    parser.add_argument("--launcher", choices=("python", "native"), default="python",
                        help="Triton: the Python launcher (default) or the native plans (each case run twice, the "
                             "second call measured: the first makes the plan)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (Triton: TRITON_INTERPRET=1)")
    parser.add_argument("--over-only", action="store_true", help="print only tensors over their budget")
    parser.add_argument("--summary", action="store_true",
                        help="also print, per tensor, the mean, 95th percentile and max of ours / budget")
    parser.add_argument("--summarize", nargs="+", metavar="FILE",
                        help="only summarise rows this script printed earlier into FILEs (e.g. parallel shares)")
    args = parser.parse_args(argv)
    if args.summarize:
        return summarize_files(args.summarize)
    precisions = args.precision.split(",")
    for precision in precisions:
        if precision not in ("default", "ieee", "tf32x3", "tf32"):
            parser.error(f"--precision: unknown {precision!r}; choose from default, ieee, tf32x3, tf32")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no GPU here (use --device cpu with TRITON_INTERPRET=1)")
    dtype = DTYPES[args.dtype]

    print(f"{'case':>4} {'shape (b, h, nq, nk, d)':<26} {'causal':<6} {'precision':<9} {'tensor':<6} "
          f"{'ours':>10} {'torch':>10} {'ours/budget':>11}")
    worst, over = 0.0, 0
    ratios: dict[str, list[float]] = {}  # per tensor, every case's ours / budget (the summary)
    for precision in precisions:
        for case in args.cases:
            if args.impl == "pytorch":
                from cs336_systems.kernels.flash_attention.reference import FlashAttentionPytorch

                fn = FlashAttentionPytorch.apply
            else:
                from cs336_systems.kernels.flash_attention.function import flash_attention

                def fn(q, k, v, causal, _precision=None if precision == "default" else precision):
                    call = dict(launcher=args.launcher, fp32_precision=_precision)
                    if args.launcher == "native":  # a first call makes the plan; the measured one replays it
                        flash_attention(q.detach(), k.detach(), v.detach(), causal, **call)
                    return flash_attention(q, k, v, causal, **call)
            try:
                results = fuzz_results(fn, case, dtype, args.device)
            except Exception as error:  # one case's failure is a row; the rest still run
                print(f"{case:>4} failed: {type(error).__name__}: {error}")
                over += 1
                continue
            shape, causal = CASES[case]
            for name, mine, want, torch_low in results:
                ours, budget = error_and_budget(mine, want, torch_low)
                torch_error = error_and_budget(torch_low, want, torch_low)[0]
                ratio = ours / budget
                ratios.setdefault(name, []).append(ratio)
                worst, over = max(worst, ratio), over + (ratio > 1)
                if ratio > 1 or not args.over_only:
                    print(f"{case:>4} {str(shape):<26} {str(causal):<6} {precision:<9} {name:<6} {ours:>10.3e} "
                          f"{torch_error:>10.3e} {ratio:>11.2f}")
    if args.summary:  # a variant judged on the whole fuzz, not on its worst case alone
        print_summary(ratios)
    print(f"worst ours/budget {worst:.2f}; {over} tensor(s) or case(s) over budget")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
