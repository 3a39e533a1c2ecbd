"""The fused-ops suite on CPU: each op's providers timed, the same values from each, liger refused without it."""

import pytest
import torch

from cs336_systems.bench.cli import main
from cs336_systems.bench.suites import fused_ops
from cs336_systems.results import load_rows

SMALL = ["fused-ops", "--device", "cpu", "--tokens", "33", "--warmup-ms", "1", "--rep-ms", "5", "--no-progress"]


def test_every_op_and_provider_is_timed(tmp_path, monkeypatch):
    from cs336_systems.bench.suites import cross_entropy

    monkeypatch.setattr(cross_entropy, "liger_available", lambda: True)  # installed, but not on the CPU by default
    assert main([*SMALL, "--results-dir", str(tmp_path)]) == 0
    rows = [r for r in load_rows(tmp_path / "fused-ops.jsonl") if r["metric"] == "time"]
    assert {(r["config"]["op"], r["provider"]) for r in rows} == {
        ("rmsnorm", "ours"), ("rmsnorm", "torch"), ("add-rmsnorm", "ours"), ("add-rmsnorm", "ours-unfused"),
        ("add-rmsnorm", "torch"), ("swiglu", "ours"), ("swiglu", "ours-out-of-place"), ("swiglu", "torch")}
    assert all(r["status"] == "ok" and r["median"] > 0 and r["config"]["tokens"] == 33 for r in rows)


@pytest.mark.parametrize("op", fused_ops.OPS)
def test_providers_compute_the_same_gradients(op):
    """Each step computes what the others do: the gradients its leaves receive (fp32, CPU)."""
    got = {}
    for provider in [p for p in fused_ops.PROVIDERS[op] if p != "liger"]:
        case = fused_ops.OpCase(op, provider, tokens=17, width=40, dtype="fp32")
        step, leaves = fused_ops.step_fn(case, torch.device("cpu"))
        step()
        got[provider] = [leaf.grad.clone() for leaf in leaves]
    for provider, grads in got.items():
        for mine, want in zip(grads, got["torch"]):
            torch.testing.assert_close(mine, want, rtol=1e-5, atol=1e-5, msg=provider)


@pytest.mark.parametrize("installed, message", [(False, "needs the liger-kernel package"),
                                                (True, "runs on CUDA only, got --device cpu")])
def test_liger_is_refused_before_any_case_where_it_cannot_run(installed, message, tmp_path, monkeypatch):
    from cs336_systems.bench.suites import cross_entropy

    monkeypatch.setattr(cross_entropy, "liger_available", lambda: installed)
    with pytest.raises(SystemExit, match=message):
        main([*SMALL, "--provider", "ours,liger", "--results-dir", str(tmp_path)])
    assert not (tmp_path / "fused-ops.jsonl").exists()


def test_bad_op_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["fused-ops", "--device", "cpu", "--op", "gelu"])
    assert "--op" in capsys.readouterr().err
