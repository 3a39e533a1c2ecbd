"""Run a set of tests N times, each in a fresh pytest process, and report the ones that failed in some runs but not
all (flakes). By default the distributed tests (`-m distributed`: gloo ranks, the fault-injection suite), one run
after another, never two at once (the official suites' fixed port 12390).

    python scripts/repeat_tests.py --runs 20                      # the distributed tests, 20 times
    python scripts/repeat_tests.py --runs 5 -- tests/test_parallel_ddp.py -k bucketed

Writes one JSON row per run (`--out`, default runs/repeat_tests.jsonl: run, seconds, exit code, passed, failed
tests) and prints a summary; exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

from tqdm import tqdm


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--runs: {text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"--runs: got {value}; must be >= 1")
    return value


def run_once(pytest_args: list[str], report: Path) -> tuple[int, int, list[str], list[str]]:
    """(exit code, tests passed, ids of tests failed or errored, their messages) of one pytest process."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *pytest_args]
    code = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode
    if not report.exists():
        return code, 0, ["<pytest produced no report>"], []
    passed, failed, messages = 0, [], []
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        problem = case.find("failure") if case.find("failure") is not None else case.find("error")
        if problem is not None:
            failed.append(name)
            messages.append((problem.get("message") or "")[:500])
        elif case.find("skipped") is None:
            passed += 1
    return code, passed, failed, messages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=positive_int, default=20, help="how many runs (default 20)")
    parser.add_argument("--out", type=Path, default=Path("runs/repeat_tests.jsonl"),
                        help="one JSON row per run is appended here (default runs/repeat_tests.jsonl)")
    parser.add_argument("pytest_args", nargs="*", default=None,
                        help="what pytest runs, after `--` (default: -m distributed)")
    args = parser.parse_args(argv)
    pytest_args = args.pytest_args or ["-m", "distributed"]
    if args.out.exists() and args.out.is_dir():
        parser.error(f"--out: {args.out} is a folder; give a file")
    args.out.parent.mkdir(parents=True, exist_ok=True)

    failures: Counter[str] = Counter()
    failed_runs = 0
    with tempfile.TemporaryDirectory() as scratch, open(args.out, "a") as rows:
        for run in tqdm(range(1, args.runs + 1), desc="runs", unit="run"):
            start = time.monotonic()
            code, passed, failed, messages = run_once(pytest_args, Path(scratch) / f"run{run}.xml")
            seconds = time.monotonic() - start
            failures.update(failed)
            failed_runs += code != 0
            rows.write(json.dumps(dict(run=run, seconds=round(seconds, 1), exit_code=code, passed=passed,
                                       failed=failed, messages=messages, pytest_args=pytest_args)) + "\n")
            rows.flush()
            tqdm.write(f"run {run}: exit {code}, {passed} passed, {len(failed)} failed in {seconds:.0f} s")
    print(f"{args.runs} runs of `pytest {' '.join(pytest_args)}`: {args.runs - failed_runs} clean, "
          f"{failed_runs} with a failure")
    for name, count in failures.most_common():
        kind = "fails every run" if count == args.runs else "flaky"
        print(f"  {kind}: {name} failed in {count} of {args.runs} runs")
    return 1 if failed_runs else 0


if __name__ == "__main__":
    sys.exit(main())
