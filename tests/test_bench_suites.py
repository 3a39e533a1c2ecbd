"""The attention, collectives, ddp, sharding and fsdp suites, run small on CPU (gloo, 2 processes)."""

import re

import pytest
import torch

from cs336_systems.bench.cli import build_parser, main
from cs336_systems.results import load_rows

QUICK = ["--device", "cpu", "--warmup", "1", "--steps", "2"]


def test_attention_suite_cpu_providers_and_skips(tmp_path):
    assert main(["attention", "--device", "cpu", "--seq", "32", "--d", "16", "--provider",
                 "naive,pytorch-flash,triton,sdpa-flash", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    rows = load_rows(tmp_path / "attention.jsonl")
    status = {(r["provider"], r["config"]["pass"]): r["status"] for r in rows if r["metric"] == "time"}
    assert status[("naive", "fwd-bwd")] == "ok" and status[("pytorch-flash", "bwd")] == "ok"
    assert status[("triton", "fwd")] == "skipped" and status[("sdpa-flash", "fwd")] == "skipped"
    flops = [r for r in rows if r["metric"] == "tflops" and r["provider"] == "naive"]
    assert len(flops) == 3 and all(r["median"] > 0 for r in flops)


def test_attention_sweep_options_override_the_sweep():
    from cs336_systems.bench.suites.attention import cases

    args = build_parser().parse_args(["attention", "--sweep", "flash", "--seq", "256", "--d", "64",
                                      "--dtype", "bf16", "--provider", "triton", "--device", "cpu"])
    got = cases(args)
    assert [(c.batch, c.heads, c.seq, c.d, c.dtype, c.causal) for c in got] == [(1, 1, 256, 64, "bf16", True)]


def test_collectives_suite_two_ranks(tmp_path):
    main(["collectives", "--world-size", "2", "--sizes-mb", "0.5", "--results-dir", str(tmp_path),
          "--plot", str(tmp_path / "c.png"), *QUICK])
    rows = load_rows(tmp_path / "collectives.jsonl")
    assert {r["config"]["op"] for r in rows} == {"all-reduce", "all-gather", "reduce-scatter"}
    bus = {r["config"]["op"]: r["median"] for r in rows if r["metric"] == "busbw"}
    alg = {r["config"]["op"]: r["median"] for r in rows if r["metric"] == "algbw"}
    assert bus["all-reduce"] == pytest.approx(alg["all-reduce"])  # 2(n-1)/n = 1 at n = 2
    assert bus["all-gather"] == pytest.approx(alg["all-gather"] / 2)
    assert all(r["config"]["world_size"] == 2 and r["config"]["backend"] == "gloo" for r in rows)
    assert (tmp_path / "c.png").exists()


@pytest.mark.parametrize("suite,extra,metrics", [
    ("ddp", ["--variant", "naive,bucketed,torch-ddp", "--bucket-mb", "0.01", "--profile"],
     {"step_time", "exposed_comm_time", "step_time_vs_torch_ddp"}),
    ("sharding", [], {"step_time", "bytes_parameters", "bytes_gradients", "bytes_optimizer_state",
                      "bytes_activations"}),
    ("fsdp", ["--compute-dtype", "fp32", "--provider", "fsdp,ddp"], {"step_time", "gathers_ready_before_use"}),
])
def test_parallel_suites_two_ranks(tmp_path, suite, extra, metrics):
    assert main([suite, "--world-size", "2", "--results-dir", str(tmp_path), *extra, *QUICK]) == 0
    rows = load_rows(tmp_path / f"{suite}.jsonl")
    assert all(r["status"] == "ok" for r in rows), [r["message"] for r in rows if r["status"] != "ok"]
    assert metrics <= {r["metric"] for r in rows}
    if suite == "ddp":
        assert len(list((tmp_path / "traces").glob("ddp_*.pt.trace.json"))) == 3  # naive, bucketed, torch-ddp
    if suite == "sharding":
        state = {r["config"]["optimizer"]: r["median"] for r in rows if r["metric"] == "bytes_optimizer_state"}
        params = [r["median"] for r in rows if r["metric"] == "bytes_parameters"][0]
        assert state["adamw"] == pytest.approx(2 * params, rel=1e-3)  # m and v (plus a step scalar each)
        assert state["zero1-sharded-adamw"] < 0.8 * state["adamw"]
        held = {(r["config"]["optimizer"], r["metric"]): r["median"] for r in rows
                if r["metric"].startswith("bytes_held")}
        for optimizer in ("adamw", "zero1-sharded-adamw"):  # state appears at the first step; gradients by then
            assert held[(optimizer, "bytes_held_after_init")] == pytest.approx(params, rel=1e-3)
            assert held[(optimizer, "bytes_held_after_step")] >= held[(optimizer, "bytes_held_before_step")]
        assert (held[("adamw", "bytes_held_after_step")] - held[("zero1-sharded-adamw", "bytes_held_after_step")]
                == pytest.approx(state["adamw"] - state["zero1-sharded-adamw"], rel=1e-3))


def test_collectives_rejects_bad_sizes():
    with pytest.raises(SystemExit, match="--sizes-mb"):
        main(["collectives", "--device", "cpu", "--sizes-mb", "0"])


def test_attention_tuning_space_respects_the_causal_split():
    from cs336_systems.bench.suites.attention_tune import tuning_space

    for kernel, outer, inner in (("forward", 0, 1), ("dq", 0, 1), ("dkdv", 1, 0)):
        space = tuning_space(kernel)
        assert len(space) == len(set(space)) > 20
        assert all(c[outer] % c[inner] == 0 for c in space), kernel


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter would stick to the process's kernels; "
                    "on a GPU the attention-tune stage runs the real thing")
def test_attention_tuning_times_each_kernel_config_under_the_interpreter(tmp_path, monkeypatch, capsys):
    # Triton binds a kernel to the interpreter at its first launch in the process: setting TRITON_INTERPRET here
    # on a GPU machine would send every later GPU test in this worker through the interpreter.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # fp16: bf16 is refused on the CPU (the interpreter's bf16 products are wrong; test_bad_inputs.py).
    assert main(["attention-tune", "--device", "cpu", "--dtype", "fp16", "--shape", "1x2x40x16", "--limit", "1",
                 "--rep-ms", "1", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    # The shape's line comes as soon as it is done (a run cut by a time limit keeps it): best of each kernel, then
    # the shipped passes against cuDNN's (absent on the CPU).
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("1x2x40x16: "))
    assert re.search(r"forward \d+\.\d{3} \(\d+x\d+ w\d s\d\)", line) and "triton fwd " in line, line
    rows = load_rows(tmp_path / "attention-tune.jsonl")
    timed = {r["config"]["kernel"]: r for r in rows if r["metric"] == "time" and r["status"] == "ok"}
    assert {"forward", "dkdv", "dq", "preprocess", "fwd"} <= set(timed)
    assert all(timed[k]["median"] > 0 for k in ("forward", "dkdv", "dq"))
    assert (timed["dkdv"]["config"]["block_n"], timed["dkdv"]["config"]["num_stages"]) == (64, 2)
    assert any(r["metric"] == "autotune_choice" and r["config"]["kernel"] == "forward" for r in rows)


def test_attention_tuning_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(SystemExit, match="CUDA device"):
        main(["attention-tune", "--device", "cpu"])


def test_attention_naive_compiled_times_every_pass_and_resets_per_case(tmp_path, monkeypatch):
    """The handout sweep's compiled provider: the retained-graph backward runs (no donated buffers), and
    dynamo starts fresh per case, so a long sweep never falls back to eager at the recompile limit."""
    import torch._dynamo

    resets = []
    real_reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (resets.append(1), real_reset()))
    assert main(["attention", "--device", "cpu", "--seq", "16,24", "--d", "8", "--provider", "naive-compiled",
                 "--causal", "off", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    rows = load_rows(tmp_path / "attention.jsonl")
    times = [r for r in rows if r["metric"] == "time"]
    assert len(times) == 6 and all(r["status"] == "ok" for r in times), [r["message"] for r in times]
    assert len(resets) == 2


def test_attention_compiled_backward_also_resets_dynamo_per_case(tmp_path, monkeypatch):
    """triton-compile-bwd compiles per shape too: without a reset, the 9th shape of a sweep would run eager under
    its name. (Its Triton forward needs CUDA, so the case's function is swapped for the naive one here.)"""
    import torch._dynamo

    from cs336_systems.bench.suites import attention as attention_suite

    resets = []
    real_reset = torch._dynamo.reset
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (resets.append(1), real_reset()))
    monkeypatch.setattr(attention_suite, "_skip_reason", lambda case, device: None)
    naive = attention_suite.attention_fn("naive", True)
    monkeypatch.setattr(attention_suite, "attention_fn", lambda provider, causal: naive)
    assert main(["attention", "--device", "cpu", "--seq", "16,24,32", "--d", "8", "--provider",
                 "triton-compile-bwd,naive", "--pass", "fwd-bwd", "--results-dir", str(tmp_path),
                 "--no-progress"]) == 0
    rows = [r for r in load_rows(tmp_path / "attention.jsonl") if r["metric"] == "time"]
    assert len(rows) == 6 and all(r["status"] == "ok" for r in rows)
    assert len(resets) == 3  # once per triton-compile-bwd case, never for naive


def test_attention_tune_compiles_on_a_short_sequence_of_the_same_specialisation():
    """Compile workers launch a short sequence where it is a multiple of 16 (Triton's specialisation is the same,
    the memory a sliver) and the shape itself otherwise."""
    from cs336_systems.bench.suites.attention_tune import COMPILE_SEQ, compile_shape

    assert compile_shape((4, 32, 16384, 64)) == (4, 32, COMPILE_SEQ, 64)
    assert COMPILE_SEQ % 16 == 0 and COMPILE_SEQ > 1
    assert compile_shape((1, 1, 128, 128)) == (1, 1, 128, 128)  # already short
    assert compile_shape((2, 3, 1000, 64)) == (2, 3, 1000, 64)  # 1000 % 16 == 8: its own specialisation

