"""A newcomer's set-up: README's two commands are the ones CI runs, the main job runs and prints its table, and
the command-line tools start and explain themselves without Triton installed."""

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from scripts.readme_commands import setup_commands

ROOT = Path(__file__).resolve().parents[1]
# Runs the CLI's `main` once per argument list, in one fresh interpreter in which `import triton` fails (as on a
# machine with torch's CPU build; one process for all: each start imports torch). A JSON line per run: the exit code,
# what it printed to stdout and to stderr.
WITHOUT_TRITON = """\
import contextlib, io, json, sys
sys.modules['triton'] = None
from cs336_systems.bench.cli import main
for args in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(args)
        except SystemExit as exit_:
            code = exit_.code
    print(json.dumps([code, out.getvalue(), err.getvalue()]))
"""


def _each_without_triton(argvs: list[list[str]], cwd: Path) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of `cs336-bench ARGS` for each of `argvs`, in one Triton-less interpreter."""
    result = subprocess.run([sys.executable, "-c", WITHOUT_TRITON, json.dumps(argvs)], capture_output=True, text=True,
                            cwd=cwd, timeout=240, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr[-2000:]
    outcomes = [tuple(json.loads(line)) for line in result.stdout.splitlines()]
    assert len(outcomes) == len(argvs), result.stdout[-2000:]
    return outcomes


def test_readme_states_two_commands_and_ci_runs_exactly_them():
    commands = setup_commands()
    assert set(commands) == {1, 2}
    install, main_job = commands[1].split(" && ")
    assert install.startswith("pip install ") and " -e . " in f"{install} " and main_job.startswith("cs336-bench ")
    assert "-e \".[dev]\"" in commands[2] and commands[2].endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text()
    # CI takes the commands from the README (so the two cannot differ) and runs them in a venv of its own.
    assert "scripts/readme_commands.py 1" in ci and "scripts/readme_commands.py 2" in ci
    assert 'bash -c "$command_1"' in ci and 'bash -c "$command_2"' in ci and "-m venv" in ci


def test_readme_command_1_main_job_prints_its_table(tmp_path):
    """The part of README command 1 after the install, verbatim, in an empty folder."""
    main_job = shlex.split(setup_commands()[1].split(" && ")[1])
    program = shutil.which(main_job[0], path=str(Path(sys.executable).parent))
    command = [program] if program else [sys.executable, "-m", "cs336_systems.bench"]
    result = subprocess.run(command + main_job[1:], capture_output=True, text=True, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-2000:]
    header = next(line for line in result.stdout.splitlines() if line.startswith("| preset"))
    assert re.search(r"\|\s+time ms\s+\|", header) and re.search(r"\|\s+time std ms\s+\|", header), header
    assert (tmp_path / "runs" / "model.jsonl").stat().st_size > 0


def test_cli_help_and_the_main_job_run_without_triton(tmp_path):
    from cs336_systems.bench.cli import SUITES

    helps = [[*suite, "--help"] for suite in ([], *([name] for name in SUITES))]
    *help_runs, (code, stdout, stderr) = _each_without_triton(
        [*helps, ["model", "--preset", "tiny", "--device", "cpu"]], cwd=tmp_path)
    for args, (help_code, help_text, help_errors) in zip(helps, help_runs):
        assert help_code == 0 and "usage: cs336-bench" in help_text, (args, help_errors[-2000:])
    assert code == 0 and re.search(r"\|\s+time ms\s+\|", stdout), stderr[-2000:]


def test_a_triton_option_without_triton_stops_before_work_naming_the_install(tmp_path):
    cases = [(["model", "--preset", "tiny", "--device", "cpu", "--attention", "triton", "--fused"],
              "--attention triton, --fused needs Triton"),
             (["model", "--preset", "tiny", "--device", "cpu", "--optimizer", "fused"], "--optimizer fused needs"),
             (["attention", "--device", "cpu", "--provider", "naive,triton-fused-bwd"],
              "--provider triton-fused-bwd needs Triton"),
             (["attention-tune", "--device", "cpu"], "the attention-tune suite needs Triton"),
             (["leaderboard", "--preset", "tiny", "--device", "cpu", "--fused", "on"], "--fused needs Triton")]
    runs = tmp_path / "runs"
    outcomes = _each_without_triton([[*args, "--results-dir", str(runs)] for args, _ in cases], cwd=tmp_path)
    for (args, message), (code, _, stderr) in zip(cases, outcomes):
        lines = stderr.strip().splitlines()
        assert code == 2 and len(lines) == 1, (args, stderr[-2000:])
        assert message in lines[0] and "pip install 'triton" in lines[0], lines
    assert not runs.exists()  # nothing ran


def test_attention_by_name_without_triton_says_what_to_install():
    code = ("import sys; sys.modules['triton'] = None\n"
            "from cs336_systems.attention import get_attention\n"
            "try:\n    get_attention('triton-fused-bwd')\n"
            "except ModuleNotFoundError as error:\n    print(error.name, '|', error)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.stdout.startswith("triton | attention 'triton-fused-bwd' needs Triton"), result.stderr[-2000:]


def _all_options(parser: argparse.ArgumentParser, prefix: str):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_options(sub, f"{prefix} {name}")
        elif action.dest != "help":
            yield prefix, action


def test_every_option_of_every_command_has_a_help_text():
    from cs336_systems.analysis.cli import build_parser as analyze_parser
    from cs336_systems.bench.cli import build_parser as bench_parser

    missing = [f"{prefix} {'/'.join(action.option_strings) or action.dest}"
               for parser, name in ((bench_parser(), "cs336-bench"), (analyze_parser(), "cs336-analyze"))
               for prefix, action in _all_options(parser, name)
               if not action.help and action.option_strings]
    assert not missing, missing


def test_results_dir_naming_a_file_is_refused_before_any_work(tmp_path):
    kept = tmp_path / "notes.txt"
    kept.write_text("the user's file")
    result = subprocess.run([sys.executable, "-m", "cs336_systems.bench", "model", "--preset", "tiny", "--device",
                             "cpu", "--results-dir", str(kept)], capture_output=True, text=True, cwd=tmp_path,
                            timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 2 and f"--results-dir: '{kept}' is a file" in result.stderr
    assert "Traceback" not in result.stderr and kept.read_text() == "the user's file"


def test_child_processes_share_the_sessions_bytecode_cache_where_writing_it_is_off(tmp_path):
    """Where PYTHONDONTWRITEBYTECODE is set (conftest.py), a child's bytecode goes to the session's own cache, not
    beside the sources: so the suite's hundreds of children compile torch once, and nothing lands in the user's tree."""
    conftest = sys.modules.get("tests.conftest") or sys.modules["conftest"]
    if conftest._session_pycache is None:
        pytest.skip("PYTHONDONTWRITEBYTECODE is not set here (or PYTHONPYCACHEPREFIX is): children write as usual")
    assert os.environ["PYTHONPYCACHEPREFIX"] == conftest._session_pycache
    assert "PYTHONDONTWRITEBYTECODE" not in os.environ
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    subprocess.run([sys.executable, "-c", "import probe_module"], cwd=tmp_path, check=True, timeout=60)
    assert not (tmp_path / "__pycache__").exists()
    assert list(Path(conftest._session_pycache).rglob("probe_module*.pyc"))
