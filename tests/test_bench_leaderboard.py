"""The leaderboard step on CPU: runs, verifies against the plain model step, and catches a wrong step."""

import pytest

from cs336_systems.bench.cli import main
from cs336_systems.bench.results import load_rows

TINY = ["leaderboard", "--preset", "tiny", "--context", "32", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "1"]


@pytest.mark.parametrize("checkpoint", ["auto", "every-block", "nested"])
def test_leaderboard_tiny_verifies(tmp_path, checkpoint, capsys):
    assert main([*TINY, "--verify", "--checkpoint", checkpoint, "--results-dir", str(tmp_path)]) == 0
    assert "verify" in capsys.readouterr().out
    rows = load_rows(tmp_path / "leaderboard.jsonl")
    metrics = {r["metric"] for r in rows}
    assert {"ours_grad_rel_error", "plain_grad_rel_error", "step_time", "tokens_per_s", "phase_time"} <= metrics
    phases = {r["config"]["phase"] for r in rows if r["metric"] == "phase_time"}
    assert phases == {"forward", "loss", "backward", "optimizer"}


def test_verify_catches_a_wrong_step(tmp_path, monkeypatch):
    import cs336_systems.bench.leaderboard_suite as suite

    real = suite.lm_head_cross_entropy
    monkeypatch.setattr(suite, "lm_head_cross_entropy", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(SystemExit, match="outside the error budget"):
        main([*TINY, "--verify", "--results-dir", str(tmp_path)])


def test_bad_checkpoint_policy(tmp_path):
    with pytest.raises(SystemExit, match="--checkpoint"):
        main([*TINY, "--checkpoint", "sometimes", "--results-dir", str(tmp_path)])
