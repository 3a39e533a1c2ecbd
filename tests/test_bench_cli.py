"""cs336-bench on CPU: option validation and a run of each path."""

import subprocess
import sys

import pytest
import torch

from cs336_systems.bench.cli import build_parser, main
from cs336_systems.results import load_rows

FAST = ["--device", "cpu", "--warmup", "1", "--steps", "2", "--no-progress"]


@pytest.mark.parametrize("argv,match", [
    (["model", "--preset", "huge"], "--preset: got 'huge'; allowed: tiny"),
    (["model", "--dtype", "fp8"], "--dtype: got 'fp8'; allowed: fp32, bf16, fp16"),
    (["model", "--mode", "backward"], "--mode: got 'backward'"),
    (["model", "--context", "0"], "--context: got 0; must be >= 1"),
    (["model", "--steps", "abc"], "--steps: 'abc' is not an integer"),
    (["model", "--device", "tpu"], "--device"),
    (["model", "--attention", "magic"], "invalid choice: 'magic'"),
    (["model", "--checkpoint", "every-k:x"], "--checkpoint: checkpoint policy every-k needs a positive group size"),
    (["nosuchsuite"], "invalid choice"),
])
def test_bad_options_are_rejected_with_the_argument_named(argv, match, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


def test_model_suite_all_modes_both_providers(tmp_path, capsys):
    assert main(["model", "--preset", "tiny", "--context", "32", "--provider", "ours,baseline",
                 "--results-dir", str(tmp_path), *FAST]) == 0
    out = capsys.readouterr().out
    assert "train-step" in out and "baseline" in out
    rows = load_rows(tmp_path / "model.jsonl")
    times = [r for r in rows if r["metric"] == "time"]
    assert len(times) == 6 and all(r["status"] == "ok" and r["n"] == 2 for r in times)
    assert {r["config"]["attention"] for r in times} == {"reference", "sdpa"}
    phases = {r["config"]["phase"] for r in rows if r["metric"] == "phase_time"}
    assert phases == {"forward", "loss", "backward", "optimizer"}
    assert all(r["median"] > 0 for r in rows if r["metric"] == "tflops")


def test_model_suite_warms_up_for_the_seconds_asked_and_records_the_steps_it_took(tmp_path):
    """--warmup-s keeps warming up past --warmup until the steps after the first ran that long (the GPU default,
    1 s, is for a GPU idle through a compile); the row's warmup is the number of warm-up steps made. Without it the
    CPU default is the count alone."""
    common = ["model", "--preset", "tiny", "--context", "16", "--mode", "forward", "--device", "cpu",
              "--warmup", "1", "--steps", "1", "--no-progress"]
    assert main([*common, "--results-dir", str(tmp_path / "count")]) == 0
    assert main([*common, "--warmup-s", "0.3", "--results-dir", str(tmp_path / "seconds")]) == 0
    warmups = [[r["warmup"] for r in load_rows(tmp_path / run / "model.jsonl") if r["metric"] == "time"]
               for run in ("count", "seconds")]
    assert warmups[0] == [1] and warmups[1][0] > 1


def test_model_suite_rounds_interleave_the_providers_and_pool_their_steps(tmp_path, monkeypatch):
    """--rounds R: every provider of a configuration built and warmed up first, then timed in R rounds, the order
    reversed every other round; each row pools R x --steps steps and records rounds."""
    from cs336_systems.bench.suites import model

    order = []
    timed_step = model._timed_step

    def recording(harness, mode, ranges):
        order.append(harness.case.provider)
        return timed_step(harness, mode, ranges)

    monkeypatch.setattr(model, "_timed_step", recording)
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward", "--device", "cpu",
                 "--provider", "ours,baseline", "--rounds", "3", "--warmup", "1", "--steps", "2", "--no-progress",
                 "--results-dir", str(tmp_path)]) == 0
    assert order == ["ours", "baseline", "baseline", "ours", "ours", "baseline"]
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert [(r["provider"], r["n"], r["warmup"], r["config"]["rounds"]) for r in times] == [
        ("ours", 6, 1, 3), ("baseline", 6, 1, 3)]


@pytest.mark.parametrize("where", ["build", "first round"])
def test_model_suite_rounds_time_the_providers_apart_where_they_do_not_fit_together(where, tmp_path, monkeypatch):
    """--rounds keeps every provider's model resident; where the second does not fit beside the first (an
    out-of-memory while building it, or in its first steps), the configuration is timed one provider at a time
    instead: every row ok, none of them recording rounds, no failure row."""
    from cs336_systems.bench.suites import model

    calls = {"build": [], "first round": []}
    real_harness, real_time_fn = model._Harness, model.time_fn

    def harness(case, cfg, device):
        calls["build"].append(case.provider)
        if where == "build" and len(calls["build"]) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_harness(case, cfg, device)

    def time_fn(*args, **kwargs):
        calls["first round"].append(None)
        if where == "first round" and len(calls["first round"]) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_time_fn(*args, **kwargs)

    monkeypatch.setattr(model, "_Harness", harness)
    monkeypatch.setattr(model, "time_fn", time_fn)
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward", "--device", "cpu",
                 "--provider", "ours,baseline", "--rounds", "2", "--warmup", "1", "--steps", "2", "--no-progress",
                 "--results-dir", str(tmp_path)]) == 0
    assert calls["build"] == ["ours", "baseline", "ours", "baseline"]
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert [(r["provider"], r["status"], r["n"], "rounds" in r["config"]) for r in times] == [
        ("ours", "ok", 2, False), ("baseline", "ok", 2, False)]


def test_model_suite_drops_each_compiled_configurations_graphs_when_it_is_done(tmp_path, monkeypatch):
    """A compiled configuration's graphs (and, as CUDA graphs, their private memory pool) are dropped when it is
    done, not held while the next configuration runs: dynamo is reset once as each compiled case starts and once as
    it ends; eager cases leave it alone."""
    from cs336_systems.bench.suites import model

    events = []
    real_reset, real_harness = torch._dynamo.reset, model._Harness
    monkeypatch.setattr(torch._dynamo, "reset", lambda: (events.append("reset"), real_reset())[1])
    monkeypatch.setattr(model, "_Harness", lambda case, *a: (events.append(f"build {case.compile}"),
                                                            real_harness(case, *a))[1])
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward", "--compile", "on,off",
                 "--provider", "baseline", "--results-dir", str(tmp_path), *FAST]) == 0
    assert events == ["build True", "reset", "reset", "build False"]


def test_model_suite_rounds_group_each_configuration_with_all_its_providers():
    from cs336_systems.bench.suites.model import cases, interleaved_groups

    args = build_parser().parse_args(["model", "--preset", "tiny,small", "--context", "16,32", "--device", "cpu",
                                      "--provider", "ours,baseline", "--rounds", "2"])
    groups = interleaved_groups(cases(args))
    assert len(groups) == 4 and all([c.provider for c in g] == ["ours", "baseline"] for g in groups)
    assert len({(g[0].preset, g[0].context) for g in groups}) == 4
    assert all(len({(c.preset, c.context) for c in g}) == 1 for g in groups)


def test_model_suite_runs_our_whole_stack_compiled_on_the_cpu(tmp_path, monkeypatch):
    """Issue 32's CPU command: our attention, fused kernels and fused AdamW, compiled, on a machine without a GPU
    (the operators' torch maths, not the interpreter); every row ok, and the compile mode recorded."""
    import cs336_systems.kernels._triton_utils as utils
    import cs336_systems.kernels.flash_attention.function  # noqa: F401  (its autotune configs are read at import)

    monkeypatch.setattr(utils, "interpreting", lambda: False)
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "train-step", "--attention", "triton",
                 "--fused", "--optimizer", "fused", "--compile", "on", "--results-dir", str(tmp_path), *FAST]) == 0
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert [(r["status"], r["config"]["compile"], r["config"]["compile_mode"]) for r in times] == [
        ("ok", True, "default")]


def test_model_suite_takes_our_loss_fused_by_default_and_both_ways_when_asked(tmp_path, monkeypatch):
    """With --fused, ours takes its training loss by our fused LM head + cross-entropy (`fused_loss` in its rows);
    `--fused-loss on,off` times both, each a row of its own (bf16 autocast: the head's product reads its weight copy);
    the baseline takes the plain loss."""
    import cs336_systems.kernels._triton_utils as utils
    import cs336_systems.kernels.flash_attention.function  # noqa: F401  (its autotune configs are read at import)
    from cs336_systems.bench.suites.model import cases

    monkeypatch.setattr(utils, "interpreting", lambda: False)
    args = build_parser().parse_args(["model", "--device", "cpu", "--fused", "--provider", "ours,baseline"])
    assert [(c.provider, c.fused_loss) for c in cases(args)] == [("ours", True), ("baseline", False)]
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward-backward,train-step",
                 "--dtype", "bf16", "--attention", "reference", "--fused", "--optimizer", "fused", "--fused-loss",
                 "on,off", "--results-dir", str(tmp_path), *FAST]) == 0
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert sorted((r["config"]["mode"], r["config"]["fused_loss"]) for r in times) == [
        ("forward-backward", False), ("forward-backward", True), ("train-step", False), ("train-step", True)]
    assert all(r["status"] == "ok" for r in times)


def test_model_suite_skips_guards_in_the_timed_steps_of_compiled_configurations_only(tmp_path, monkeypatch):
    """--skip-guards: each compiled configuration's timed steps (not its warm-up, which compiles) run under
    torch.compiler.set_stance(skip_guard_eval_unsafe=True), both providers; eager rows unaffected; rows say which."""
    entered = []
    real = torch.compiler.set_stance

    def recording(*args, **kwargs):
        entered.append(kwargs.get("skip_guard_eval_unsafe", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", recording)
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "train-step", "--compile", "off,on",
                 "--provider", "ours,baseline", "--skip-guards", "--results-dir", str(tmp_path), "--device", "cpu",
                 "--warmup", "2", "--steps", "3", "--no-progress"]) == 0
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert sorted((r["provider"], r["config"]["compile"], r["config"]["skip_guards"]) for r in times) == [
        ("baseline", False, False), ("baseline", True, True), ("ours", False, False), ("ours", True, True)]
    assert all(r["status"] == "ok" for r in times)
    assert entered == [True] * 6  # the 3 timed steps of each compiled provider


def test_model_suite_compile_choices():
    from cs336_systems.bench.suites.model import cases

    args = build_parser().parse_args(["model", "--compile", "off,on,reduce-overhead", "--device", "cpu"])
    assert [(c.compile, c.compile_mode) for c in cases(args)] == [
        (False, "-"), (True, "default"), (True, "reduce-overhead")]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["model", "--compile", "max"])


def test_model_suite_rows_name_our_operators_form_under_compile(monkeypatch):
    """A row of ours compiled with our fused kernels says `operators: triton_op` (the default; the report shows those
    rows apart from the custom-operator rows before it); eager rows, the baseline's and rows with CS336_TRITON_OPS=0
    carry no such field."""
    from cs336_systems.bench.suites.model import ModelCase, row_config
    from cs336_systems.config import ModelConfig

    cfg = ModelConfig.from_name("tiny")
    ours = ModelCase("tiny", 32, 2, "bf16", True, "ours", "triton", fused=True, compile_scope="block",
                     compile_mode="default", optimizer="fused")
    baseline = ModelCase("tiny", 32, 2, "bf16", True, "baseline", "sdpa", compile_scope="block",
                         compile_mode="default", optimizer="torch-fused")
    eager = ModelCase("tiny", 32, 2, "bf16", False, "ours", "triton", fused=True, optimizer="fused")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # (the switch is off under the interpreter)
    monkeypatch.delenv("CS336_TRITON_OPS", raising=False)
    assert row_config(ours, cfg)["operators"] == "triton_op"
    monkeypatch.setenv("CS336_TRITON_OPS", "1")
    assert row_config(ours, cfg)["operators"] == "triton_op"
    assert "operators" not in row_config(baseline, cfg) and "operators" not in row_config(eager, cfg)
    assert row_config(ours, cfg)["d_model"] == cfg.d_model and "provider" not in row_config(ours, cfg)
    monkeypatch.setenv("CS336_TRITON_OPS", "0")
    assert "operators" not in row_config(ours, cfg)


def test_model_suite_sweep_and_override(tmp_path):
    main(["model", "--preset", "tiny", "--context", "16,32", "--dtype", "fp32,bf16", "--mode", "forward",
          "--num-layers", "1", "--results-dir", str(tmp_path), *FAST])
    rows = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert sorted((r["config"]["context"], r["config"]["dtype"]) for r in rows) == [
        (16, "bf16"), (16, "fp32"), (32, "bf16"), (32, "fp32")]
    assert {r["config"]["num_layers"] for r in rows} == {1}


def test_model_suite_records_a_failing_configuration_and_goes_on(tmp_path, monkeypatch):
    import cs336_systems.bench.suites.model as suite

    real = suite._Harness.step_fn

    def broken(self, mode, phase):
        if mode == "forward":
            def fail():
                raise RuntimeError("CUDA out of memory. Tried to allocate 1 GiB")
            return fail
        return real(self, mode, phase)

    monkeypatch.setattr(suite._Harness, "step_fn", broken)
    main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward,train-step",
          "--results-dir", str(tmp_path), *FAST])
    rows = {r["config"]["mode"]: r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"}
    assert rows["forward"]["status"] == "oom" and "out of memory" in rows["forward"]["message"]
    assert rows["train-step"]["status"] == "ok"


def test_model_suite_profile_on_cpu(tmp_path, capsys):
    main(["model", "--preset", "tiny", "--context", "16", "--mode", "train-step", "--profile",
          "--results-dir", str(tmp_path), *FAST])
    assert "kernel summary" in capsys.readouterr().out
    rows = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "profile_kernel_time"]
    ranges = {r["config"]["range"] for r in rows}
    assert {"forward", "backward", "optimizer"} <= ranges
    assert 0 < sum(r["config"]["share"] for r in rows) <= 1.0 + 1e-6
    assert list((tmp_path / "traces").glob("*.pt.trace.json"))


def test_profile_of_each_mode_answers_nsys_profile(tmp_path):
    """--profile profiles every requested mode; the kernel time by kind of work of a forward and a training step
    answers nsys_profile (a)-(e) in the report."""
    from cs336_systems.report.build import main as report_main

    results = tmp_path / "results"
    main(["model", "--preset", "tiny", "--context", "32", "--mode", "forward,train-step", "--profile",
          "--results-dir", str(results), *FAST])
    rows = [r for r in load_rows(results / "model.jsonl") if r["metric"] == "profile_category_time"]
    assert {r["config"]["mode"] for r in rows} == {"forward", "train-step"}
    step = [r for r in rows if r["config"]["mode"] == "train-step"]
    assert {"forward", "backward", "optimizer"} <= {r["config"]["range"] for r in step}
    assert abs(sum(r["config"]["share"] for r in step) - 1) < 1e-3  # every kernel, not the top ones
    assert any(r["config"]["category"] == "matmul" for r in step)
    assert report_main(["--results-dir", str(results), "--out", str(tmp_path / "docs")]) == 0
    section = (tmp_path / "docs" / "report.md").read_text().split("## nsys_profile")[1].split("\n## ")[0]
    for label in ("(a)", "(b)", "(c)", "(d)", "(e)"):
        assert label in section, label
    assert "| tiny " in section and "Missing: (a)-(e)" not in section


def test_model_suite_with_checkpointing(tmp_path):
    main(["model", "--preset", "tiny", "--context", "16", "--mode", "train-step", "--checkpoint", "nested",
          "--provider", "ours,baseline", "--results-dir", str(tmp_path), *FAST])
    rows = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert {(r["provider"], r["config"]["checkpoint"]) for r in rows} == {("ours", "nested"), ("baseline", "none")}
    assert all(r["status"] == "ok" for r in rows)


def test_memory_needs_cuda(tmp_path):
    with pytest.raises(SystemExit, match="needs --device cuda"):
        main(["model", "--memory", "--results-dir", str(tmp_path), *FAST])


def test_nvtx_flag_is_harmless_on_cpu(tmp_path):
    assert main(["model", "--preset", "tiny", "--context", "16", "--mode", "forward", "--nvtx",
                 "--results-dir", str(tmp_path), *FAST]) == 0


def test_precision_suite(tmp_path, capsys):
    assert main(["precision", "--device", "cpu", "--results-dir", str(tmp_path)]) == 0
    rows = load_rows(tmp_path / "precision.jsonl")
    sums = {r["config"]["loop"]: r["median"] for r in rows if r["metric"] == "sum"}
    assert sums["fp32 += fp32"] == pytest.approx(10.0, abs=1e-3)
    assert abs(sums["fp16 += fp16"] - 10) > 0.01  # fp16 accumulation visibly drifts
    dtypes = {r["config"]["tensor"]: r["message"] for r in rows if r["metric"] == "dtype"}
    assert dtypes["parameters"] == "float32" and dtypes["logits"] == "bfloat16" and dtypes["gradients"] == "float32"


def test_module_entry_point_help():
    out = subprocess.run([sys.executable, "-m", "cs336_systems.bench", "model", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "--preset" in out.stdout
