"""Options and helpers shared by every suite: device choice, dtype names, list parsing, OOM handling."""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
from pathlib import Path

import torch
from tqdm import tqdm

from cs336_systems.memory.policy import CheckpointPolicy
from cs336_systems.results import ResultStore, format_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(value: str) -> torch.device:
    try:
        device = torch.device(value)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"--device: got {value!r}; allowed: cpu, cuda, cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"--device: got {value!r}; allowed: cpu, cuda, cuda:N")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"--device: got {value!r} but no CUDA device is visible; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"--device: got {value!r} but only {torch.cuda.device_count()} CUDA "
                                         f"device(s) are visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")
    return device


def list_of(kind, allowed=None, name: str = "value"):
    """argparse type for comma-separated lists, each item converted by `kind` and checked against `allowed`."""

    def parse(text: str):
        items = []
        for raw in text.split(","):
            raw = raw.strip()
            try:
                item = kind(raw)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{name}: {raw!r} is not a valid {kind.__name__}") from None
            if allowed is not None and item not in allowed:
                raise argparse.ArgumentTypeError(f"{name}: got {raw!r}; allowed: {', '.join(map(str, allowed))}")
            items.append(item)
        return items

    return parse


def positive_int(name: str, minimum: int = 1):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{name}: got {value}; must be >= {minimum}")
        return value

    return parse


def _number(name: str, accepts, allowed: str):
    """argparse type: a number that `accepts(value)`, the error naming the option and what is `allowed`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}: {text!r} is not a number") from None
        if not accepts(value):
            raise argparse.ArgumentTypeError(f"{name}: got {text!r}; must be {allowed}")
        return value

    return parse


def fraction(name: str):
    """argparse type: a number in (0, 1]."""
    return _number(name, lambda value: 0 < value <= 1, "in (0, 1]")


def positive_float(name: str):
    """argparse type: a finite number > 0."""
    return _number(name, lambda value: value > 0 and math.isfinite(value), "a finite number > 0")


def non_negative_float(name: str):
    """argparse type: a finite number >= 0."""
    return _number(name, lambda value: value >= 0 and math.isfinite(value), "a finite number >= 0")


def checkpoint_policy(name: str):
    """argparse type: a checkpointing policy, parsed here once (memory/policy.py), the error naming the option."""
    def parse(text: str) -> CheckpointPolicy:
        try:
            return CheckpointPolicy.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{name}: {error}") from None

    return parse


def results_folder(text: str) -> str:
    """argparse type of --results-dir: a folder (made where missing), never an existing file."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"--results-dir: {text!r} is a file; give a folder (made if missing)")
    return text


def print_tables(store: ResultStore, args, *tables) -> None:
    """Each (title or None, table) as --latex asks (LaTeX or Markdown), then where the run's rows went."""
    for position, (title, table) in enumerate(tables):
        print(("\n" if position else "") + (f"{title}\n" if title else ""), end="")
        print(format_table(table, "latex" if args.latex else "markdown"))
    print(f"\nrows appended to {store.path}")


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", type=parse_device, default=default_device(),
                        help=f"cpu, cuda or cuda:N (default: cuda when a CUDA device is visible, else cpu; "
                             f"here: {default_device()})")
    parser.add_argument("--results-dir", type=results_folder, default="runs",
                        help="folder for the JSON-Lines result rows (default: runs/, git-ignored)")
    parser.add_argument("--latex", action="store_true", help="print the table as LaTeX instead of Markdown")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def autocast_context(device: torch.device, dtype_name: str):
    """bf16/fp16 autocast, or a nullcontext for fp32 (parameters stay fp32 either way)."""
    if dtype_name == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[dtype_name])


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def error_message(error: BaseException, limit: int = 300) -> str:
    """The first line of an error, for a result row's message (its type when the text is empty)."""
    return (str(error).splitlines() or [type(error).__name__])[0][:limit]


def is_oom(error: BaseException) -> bool:
    """An out-of-memory error, on the GPU or the CPU (whose allocator says "can't allocate memory")."""
    text = str(error).lower()
    return (isinstance(error, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in text
            or "can't allocate memory" in text)



def peak_above_inputs(step, device: torch.device, leaves: list[torch.Tensor]) -> int | None:
    """Bytes allocated at the peak of one call of `step` beyond what was allocated before it (CUDA; elsewhere the
    call runs and None is returned). The leaves' gradients are cleared first, so the gradients the step makes
    count."""
    if device.type != "cuda":
        step()
        return None
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def run_cases(command: str, args, cases, run_case):
    """Runs `run_case(case, args, store)` for each case under a progress bar, its rows into the command's result
    store, which it returns for the summary table."""
    store = ResultStore(command, args.device, args.results_dir)
    for case in tqdm(cases, desc=command, disable=args.no_progress):
        run_case(case, args, store)
    return store


def time_and_peak(make_step, device: torch.device, store, provider: str, config: dict, *, warmup_ms: float,
                  rep_ms: float, extra_rows=None) -> None:
    """One case of an op benchmark: `make_step()` -> (step, leaves); the step's do_bench time and its peak above
    the inputs become rows (`extra_rows(timing)` may add more); an out-of-memory case is a row of its own."""
    from cs336_systems.profiling.timing import bench_kernel

    free_memory(device)
    try:
        step, leaves = make_step()
        peak = peak_above_inputs(step, device, leaves)
        timing = bench_kernel(step, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=leaves)
    except Exception as error:
        if not is_oom(error):
            raise
        store.add(provider=provider, config=config, metric="time", unit="ms", status="oom",
                  message=error_message(error))
        return
    finally:
        step = leaves = None
        free_memory(device)
    store.add(provider=provider, config=config, metric="time", unit="ms", stats=timing.stats())
    for metric, unit, value in (extra_rows(timing) if extra_rows else ()):
        store.add(provider=provider, config=config, metric=metric, unit=unit, value=value)
    if peak is not None:
        store.add(provider=provider, config=config, metric="peak_above_inputs", unit="GiB", value=peak / 2**30)
