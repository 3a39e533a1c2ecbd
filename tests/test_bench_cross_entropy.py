"""The cross-entropy suite: every provider timed on CPU, the same loss from each, OOM as a row, bad input."""

import pytest
import torch

from cs336_systems.bench.cli import main
from cs336_systems.bench.suites import cross_entropy as cross_entropy_suite
from cs336_systems.results import load_rows

SMALL = ["cross-entropy", "--device", "cpu", "--tokens", "96", "--vocab", "300", "--d-model", "24",
         "--chunk-tokens", "40", "--warmup-ms", "1", "--rep-ms", "5", "--no-progress"]


def test_every_provider_is_timed_with_one_flop_model(tmp_path):
    assert main([*SMALL, "--results-dir", str(tmp_path)]) == 0
    rows = load_rows(tmp_path / "cross-entropy.jsonl")
    times = {r["provider"]: r for r in rows if r["metric"] == "time"}
    assert set(times) == {"fused", "fused-lean", "plain", "chunked"}
    assert all(r["status"] == "ok" for r in times.values())
    for r in rows:
        if r["metric"] == "tflops":  # 3 GEMMs of 2 n V d for every provider, over that provider's median
            expected = 3 * 2.0 * 96 * 300 * 24 / (times[r["provider"]]["median"] / 1e3) / 1e12
            assert r["median"] == pytest.approx(expected)
    # the lean loss chunks as Liger-Kernel does: 96 tokens / ceil(300 / 24) = 7.4 -> 8
    assert all(r["config"]["chunk_tokens"] == (8 if r["provider"] == "fused-lean" else 40) for r in rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_providers_compute_the_same_loss_and_gradients(dtype):
    torch.manual_seed(0)
    hidden = torch.randn(70, 16, dtype=dtype, requires_grad=True)
    weight = torch.randn(130, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, 130, (70,))
    results = {}
    for provider in [p for p in cross_entropy_suite.PROVIDERS if p != "liger"]:
        hidden.grad = weight.grad = None
        loss = cross_entropy_suite.loss_fn(provider, chunk_tokens=32)(hidden, weight, targets)
        loss.backward()
        results[provider] = (loss.detach().clone(), hidden.grad.clone(), weight.grad.clone())
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    for provider in ("fused", "fused-lean", "chunked"):
        for got, want in zip(results[provider], results["plain"]):
            torch.testing.assert_close(got.to(want.dtype), want, **tol)


def test_out_of_memory_is_a_row_and_the_sweep_goes_on(tmp_path, monkeypatch):
    real = cross_entropy_suite.loss_fn

    def loss_fn(provider, chunk_tokens):
        if provider == "plain":
            def fail(h, w, t):
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return fail
        return real(provider, chunk_tokens)

    monkeypatch.setattr(cross_entropy_suite, "loss_fn", loss_fn)
    assert main([*SMALL, "--results-dir", str(tmp_path)]) == 0
    status = {r["provider"]: r["status"] for r in load_rows(tmp_path / "cross-entropy.jsonl") if r["metric"] == "time"}
    assert status == {"fused": "ok", "fused-lean": "ok", "plain": "oom", "chunked": "ok"}


@pytest.mark.parametrize("option, value, message", [("--provider", "magic", "allowed: fused, fused-lean, plain"),
                                                    ("--vocab", "0", "must be >= 1"),
                                                    ("--dtype", "fp8", "allowed: fp32, bf16, fp16")])
def test_bad_input_names_the_option(option, value, message, capsys):
    with pytest.raises(SystemExit):
        main(["cross-entropy", "--device", "cpu", option, value])
    err = capsys.readouterr().err
    assert option in err and message in err


@pytest.mark.parametrize("installed, message", [(False, "--provider liger needs the liger-kernel package"),
                                                (True, "--provider liger runs on CUDA only")])
def test_liger_is_refused_before_any_case_where_it_cannot_run(installed, message, tmp_path, monkeypatch):
    monkeypatch.setattr(cross_entropy_suite, "liger_available", lambda: installed)
    with pytest.raises(SystemExit, match=message):
        main([*SMALL, "--provider", "fused,liger", "--results-dir", str(tmp_path)])
    assert not (tmp_path / "cross-entropy.jsonl").exists()


@pytest.mark.parametrize("tokens, vocab, d_model, chunk", [(32768, 151936, 4096, 1024), (96, 300, 24, 8),
                                                           (4096, 50257, 768, 64), (10, 10, 10, 16)])
def test_lean_chunk_is_liger_s(tokens, vocab, d_model, chunk):
    assert cross_entropy_suite.lean_chunk_tokens(tokens, vocab, d_model) == chunk
