"""scripts/repeat_tests.py: every run in a fresh pytest process, a row per run, flakes told from steady failures."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "repeat_tests.py"

FLAKY_TESTS = '''
from pathlib import Path

COUNTER = Path(__file__).with_name("count.txt")


def test_flaky():
    runs = int(COUNTER.read_text()) + 1 if COUNTER.exists() else 1
    COUNTER.write_text(str(runs))
    assert runs % 2, "fails on every second run"


def test_steady():
    assert True


def test_broken():
    assert False
'''


def test_repeat_script_counts_flakes_and_steady_failures(tmp_path):
    (tmp_path / "test_sample.py").write_text(FLAKY_TESTS)
    out = tmp_path / "rows.jsonl"
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs", "3", "--out", str(out), "--",
                           str(tmp_path / "test_sample.py")], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 1  # some run failed
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["run"] for row in rows] == [1, 2, 3]
    assert [row["passed"] for row in rows] == [2, 1, 2]
    assert "flaky: test_sample::test_flaky failed in 1 of 3 runs" in done.stdout
    assert "fails every run: test_sample::test_broken failed in 3 of 3 runs" in done.stdout


def test_repeat_script_refuses_a_bad_run_count(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--runs", "0"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "--runs: got 0; must be >= 1" in done.stderr
