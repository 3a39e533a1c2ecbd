"""The leaderboard step on CPU: runs, verifies against the plain model step, and catches a wrong step."""

import pytest

from cs336_systems.bench.cli import main
from cs336_systems.results import load_rows

TINY = ["leaderboard", "--preset", "tiny", "--context", "32", "--device", "cpu", "--warmup-ms", "1", "--rep-ms", "1"]


@pytest.mark.parametrize("checkpoint", ["auto", "every-block", "nested", "partial:1+keep-attn"])
def test_leaderboard_tiny_verifies(tmp_path, checkpoint, capsys):
    assert main([*TINY, "--verify", "--checkpoint", checkpoint, "--results-dir", str(tmp_path)]) == 0
    assert "verify" in capsys.readouterr().out
    rows = load_rows(tmp_path / "leaderboard.jsonl")
    metrics = {r["metric"] for r in rows}
    assert {"ours_grad_rel_error", "plain_grad_rel_error", "step_time", "tokens_per_s", "phase_time"} <= metrics
    phases = {r["config"]["phase"] for r in rows if r["metric"] == "phase_time"}
    assert phases == {"forward", "loss", "backward", "optimizer"}


def test_verify_catches_a_wrong_step(tmp_path, monkeypatch):
    import cs336_systems.bench.leaderboard_step as suite  # where verify and our step compute the loss

    real = suite.lm_head_loss
    monkeypatch.setattr(suite, "lm_head_loss", lambda *a, **k: real(*a, **k) * 1.01)
    with pytest.raises(SystemExit, match="outside the error budget"):
        main([*TINY, "--verify", "--results-dir", str(tmp_path)])


@pytest.mark.parametrize("fraction", ["0", "1.5", "most"])
def test_bad_fit_fraction(fraction, capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--fit-fraction", fraction])
    assert "--fit-fraction" in capsys.readouterr().err


def test_bad_checkpoint_policy(tmp_path, capsys):
    with pytest.raises(SystemExit, match="2"):  # refused while parsing the command line, before any work
        main([*TINY, "--checkpoint", "sometimes", "--results-dir", str(tmp_path)])
    assert "--checkpoint: unknown checkpoint policy 'sometimes'" in capsys.readouterr().err


def test_baseline_beside_ours_in_one_run(tmp_path, capsys):
    assert main([*TINY, "--provider", "ours,baseline", "--results-dir", str(tmp_path)]) == 0
    rows = load_rows(tmp_path / "leaderboard.jsonl")
    steps = {r["provider"]: r for r in rows if r["metric"] == "step_time"}
    assert set(steps) == {"ours", "baseline"}
    assert steps["baseline"]["config"]["checkpoint"] == "every-block"
    ratio = [r for r in rows if r["metric"] == "speedup_vs_baseline"][0]["median"]
    assert abs(ratio - steps["baseline"]["median"] / steps["ours"]["median"]) < 1e-9
    assert any(r["metric"] == "command_wall_time" for r in rows)
    assert "vs baseline" in capsys.readouterr().out


@pytest.mark.parametrize("checkpoint", ["auto", "partial:1+keep-attn+selective"])
def test_fused_kernels_verify(tmp_path, checkpoint):
    """Our fused kernels (and the 8B step's policy shape: some blocks recomputed, the rest selective), on the
    GPU where there is one, else under the interpreter."""
    from tests._support import kernel_device

    tiny = [*TINY[:-6], "--device", kernel_device(), *TINY[-4:]]
    assert main([*tiny, "--verify", "--fused", "on", "--checkpoint", checkpoint, "--provider",
                 "ours", "--results-dir", str(tmp_path)]) == 0
    rows = load_rows(tmp_path / "leaderboard.jsonl")
    assert all(r["config"]["fused"] and r["config"]["fused_rope"] for r in rows if r["provider"] == "ours")  # default


def test_unknown_provider_is_refused(capsys):
    with pytest.raises(SystemExit):
        main([*TINY, "--provider", "ours,ddp"])
    assert "--provider" in capsys.readouterr().err


def test_fused_rope_needs_the_fused_kernels(tmp_path):
    with pytest.raises(SystemExit, match="--fused-rope needs --fused on"):
        main([*TINY, "--fused-rope", "--fused", "off", "--results-dir", str(tmp_path)])


def test_two_ranks_data_parallel_on_gloo(tmp_path, capsys):
    """One sequence per rank, our DDP beside torch's; rank 0 alone writes the rows."""
    assert main([*TINY, "--world-size", "2", "--provider", "ours,baseline", "--results-dir", str(tmp_path)]) == 0
    rows = load_rows(tmp_path / "leaderboard.jsonl")
    steps = [r for r in rows if r["metric"] == "step_time"]
    assert sorted(r["provider"] for r in steps) == ["baseline", "ours"]  # not once per rank
    assert all(r["status"] == "ok" and r["config"]["world_size"] == 2 for r in steps)
    assert {r["config"]["ddp"] for r in steps} == {"overlap"}
    phases = {r["config"]["phase"] for r in rows if r["metric"] == "phase_time" and r["provider"] == "ours"}
    assert phases == {"forward", "loss", "backward", "sync", "optimizer"}


def test_verify_refuses_several_ranks(tmp_path):
    with pytest.raises(SystemExit, match="--verify runs in one process"):
        main([*TINY, "--verify", "--world-size", "2", "--results-dir", str(tmp_path)])


def _lockstep_rank(rank, world_size, out_dir):
    import time

    import torch

    from cs336_systems.bench.suites.leaderboard import _bench_in_lockstep
    from cs336_systems.parallel import comm

    calls = []

    def step():
        calls.append(1)
        time.sleep(0.002 * (rank + 1))  # rank 1 is slower: its estimate must set both counts
        comm.all_reduce(torch.ones(1))

    timing = _bench_in_lockstep(step, torch.device("cpu"), warmup_ms=10, rep_ms=30)
    with open(f"{out_dir}/rank{rank}", "w") as f:
        f.write(f"{len(calls)} {timing.n}")


@pytest.mark.distributed
def test_lockstep_timing_agrees_on_step_counts(tmp_path):
    """With several ranks every rank must run the same number of steps (do_bench would size its own)."""
    from cs336_systems.parallel import comm

    comm.spawn(_lockstep_rank, 2, str(tmp_path))
    counts = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert counts[0] == counts[1]
    assert int(counts[0].split()[1]) >= 3


def test_profile_reports_kernel_time_by_phase_and_kind(tmp_path, capsys):
    assert main([*TINY, "--provider", "ours", "--profile", "--results-dir", str(tmp_path)]) == 0
    rows = [r for r in load_rows(tmp_path / "leaderboard.jsonl") if r["metric"] == "profile_category_time"]
    by_range = {(r["config"]["range"], r["config"]["category"]): r["median"] for r in rows}
    # The products of the step run in forward and again (their gradients) in backward.
    assert by_range[("forward", "matmul")] > 0 and by_range[("backward", "matmul")] > 0
    assert all(r["median"] >= 0 and r["config"]["calls_per_step"] > 0 for r in rows)
    assert any(r["metric"] == "profile_kernel_time" for r in load_rows(tmp_path / "leaderboard.jsonl"))
    assert "kernel time per step by phase and kind" in capsys.readouterr().out
