"""A whole training step captured as CUDA graphs (`cs336_systems.step_graph`, `cs336-bench model --step-graph`): the
suite's choices and refusals on any machine; on a GPU, graphed steps of our stack and of the baseline take the same
steps as eager twins, parameters and optimizer state alike."""

import contextlib

import pytest
import torch

from cs336_systems.bench.cli import build_parser, main
from cs336_systems.step_graph import StepGraph, make_capturable


def test_step_graph_pairs_with_eager_and_compiled_but_not_reduce_overhead():
    from cs336_systems.bench.suites.model import cases

    args = build_parser().parse_args(["model", "--compile", "off,on,reduce-overhead", "--step-graph", "off,on",
                                      "--device", "cpu"])
    assert [(c.compile, c.compile_mode, c.step_graph) for c in cases(args)] == [
        (False, "-", False), (False, "-", True), (True, "default", False), (True, "default", True),
        (True, "reduce-overhead", False)]


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu"], "needs --device cuda, got cpu"),
    (["--device", "cpu", "--compile", "reduce-overhead"], "no configuration to run"),
])
def test_the_model_suite_refuses_a_step_graph_it_cannot_capture(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as raised:
        main(["model", "--preset", "tiny", "--mode", "train-step", "--step-graph", "on", "--no-progress",
              "--results-dir", str(tmp_path), *argv])
    assert message in str(raised.value)
    assert not (tmp_path / "model.jsonl").exists()  # refused before any work


def test_make_capturable_switches_each_optimizer_to_its_device_side_form():
    from cs336_basics.optimizer import AdamW
    from cs336_systems.kernels.adamw import FusedAdamW

    params = [torch.nn.Parameter(torch.ones(3))]
    ours = FusedAdamW(params)
    assert make_capturable(ours) == ours.prepare_capture and ours.capturable
    torch_adamw = torch.optim.AdamW(params)
    assert make_capturable(torch_adamw) is None and torch_adamw.param_groups[0]["capturable"]
    with pytest.raises(ValueError, match="cs336_basics.optimizer.AdamW has no capturable form"):
        make_capturable(AdamW(params))


def test_step_graph_refuses_bad_arguments():
    with pytest.raises(ValueError, match="at least one"):
        StepGraph([])
    with pytest.raises(ValueError, match="one entry .* per part: 2 parts, got 1"):
        StepGraph([lambda: None, lambda: None], prepare=[None])
    with pytest.raises(ValueError, match="warmup must be >= 1"):
        StepGraph([lambda: None], warmup=0)


def _twin_runs(provider: str, compiled: bool):
    """A graphed and an eager harness of the model suite for one tiny configuration, the same weights and optimizer
    maths, after the same six train steps: three on one batch (the graphed one's warm-up), a fourth on it (its first
    replay), then two on new batches (so a replay that reused stale gradients would show). Returns (graphed,
    eager, the weights at the start)."""
    from cs336_systems.bench.suites.model import ModelCase, _Harness
    from cs336_systems.config import ModelConfig

    cfg = ModelConfig.from_name("tiny", context_length=64)
    harnesses = []
    for graphed in (True, False):
        case = ModelCase("tiny", 64, 2, "bf16", compiled, provider, "triton" if provider == "ours" else "sdpa",
                         fused=provider == "ours", compile_scope="block" if compiled else "-",
                         compile_mode="default" if compiled else "-",
                         optimizer="fused" if provider == "ours" else "torch-fused",
                         weight_copies=provider == "ours", fused_loss=provider == "ours", step_graph=graphed)
        torch.manual_seed(0)
        harnesses.append(_Harness(case, cfg, torch.device("cuda")))
    graphed, eager = harnesses
    start = {k: v.clone() for k, v in graphed.model.state_dict().items()}
    eager.model.load_state_dict(start)
    make_capturable(eager.optimizer)  # the same maths as the graphed one's (step counts on the device)
    batches = [torch.randint(0, cfg.vocab_size, (2, 2, 64), generator=torch.Generator().manual_seed(seed)).cuda()
               for seed in range(3)]
    for harness, calls in ((graphed, [0, 1, 2]), (eager, [0, 0, 0, 0, 1, 2])):
        with harness.attention_context():
            step = harness.step_fn("train-step", lambda name: contextlib.nullcontext())
            for batch in calls:
                harness.x.copy_(batches[batch][0])
                harness.y.copy_(batches[batch][1])
                step()
    torch.cuda.synchronize()
    return graphed, eager, start


@pytest.mark.gpu
@pytest.mark.parametrize("provider", ["ours", "baseline"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_graphed_train_step_takes_the_eager_steps(provider, compiled):
    """Six train steps, the last three replays of the captured step (forward, loss, backward in one graph; the
    optimizer, capturable, in another), leave each weight where six eager steps of a twin leave it: apart by under
    a thousandth of how far it moved (a frozen bias correction or a stale gradient in the graph is percents). Ours:
    Triton attention, fused kernels, the fused loss, FusedAdamW with the weights' bf16 copies; the baseline: SDPA
    and torch's fused AdamW."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    graphed, eager, start = _twin_runs(provider, compiled)
    assert graphed.step_graph is not None and graphed.step_graph[1].captured
    for (name, a), b in zip(graphed.model.state_dict().items(), eager.model.state_dict().values()):
        if a.is_floating_point() and name in start:
            moved = (b.float() - start[name].float()).norm()
            assert (a.float() - b.float()).norm() <= 1e-3 * moved, (name, (a - b).abs().max().item(), moved.item())
    if provider == "ours":  # the weights' bf16 copies, written by the captured optimizer, follow the weights
        copies = [(p, p.compute_copy) for p in graphed.model.parameters() if hasattr(p, "compute_copy")]
        assert copies
        for p, copy in copies:
            torch.testing.assert_close(copy, p.detach().to(copy.dtype), rtol=0, atol=0)


@pytest.mark.gpu
def test_the_model_suite_times_graphed_steps_of_both_providers(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cs336_systems.results import load_rows

    assert main(["model", "--preset", "tiny", "--context", "64", "--mode", "train-step,forward", "--dtype", "bf16",
                 "--provider", "ours,baseline", "--attention", "triton", "--fused", "--optimizer", "fused",
                 "--step-graph", "on", "--warmup", "2", "--steps", "3", "--warmup-s", "0", "--no-progress",
                 "--results-dir", str(tmp_path)]) == 0
    times = [r for r in load_rows(tmp_path / "model.jsonl") if r["metric"] == "time"]
    assert sorted((r["provider"], r["config"]["mode"]) for r in times) == [
        ("baseline", "forward"), ("baseline", "train-step"), ("ours", "forward"), ("ours", "train-step")]
    assert all(r["status"] == "ok" and r["config"]["step_graph"] and r["median"] > 0 for r in times), times


def test_step_graph_warms_up_then_captures_each_part_after_its_preparation(monkeypatch):
    """The order a capture needs, on any machine (CUDA's graph calls recorded, not made): `warmup` eager steps of
    every part on a side stream; then per part its `prepare` (outside any capture), its capture into the pool of the
    part before; later calls only replay, in the parts' order."""
    events = []

    class Graph:
        count = 0

        def __init__(self):
            Graph.count += 1
            self.name = f"graph{Graph.count}"

        def pool(self):
            return f"pool of {self.name}"

        def replay(self):
            events.append(f"replay {self.name}")

    capturing = []

    class Capture:
        def __init__(self, graph, pool=None):
            self.graph, self.pool = graph, pool

        def __enter__(self):
            capturing.append(self.graph)
            events.append(f"capture {self.graph.name} into {self.pool}")

        def __exit__(self, *exc):
            capturing.pop()

    class Stream:
        def wait_stream(self, other):
            pass

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", Capture)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("synchronize"))

    def part(name):
        def run():
            events.append(f"{name}{' (captured)' if capturing else ''}")
            return name
        return run

    step = StepGraph([part("a"), part("b")], prepare=[None, lambda: events.append("prepare b")], warmup=2)
    assert not step.captured
    assert step() == ["a", "b"] and step.captured
    assert events == ["a", "b", "a", "b", "synchronize",
                      "capture graph1 into None", "a (captured)",
                      "prepare b", "capture graph2 into pool of graph1", "b (captured)",
                      "replay graph1", "replay graph2"]
    events.clear()
    step()
    assert events == ["replay graph1", "replay graph2"]


def test_the_suites_graphed_train_step_drops_the_warm_ups_gradients_before_its_capture(monkeypatch):
    """Freed inside the capture, the warm-up's gradients would stay in the ordinary pool beside the graph's: one set
    of gradients more at the capture's peak (xl at ctx 512 did not fit an 80 GB card beside it). So the first part's
    preparation, which runs before `torch.cuda.graph` empties the cache, sets them to None."""
    from cs336_systems.bench.suites.model import ModelCase, _Harness
    from cs336_systems.config import ModelConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # StepGraph's own check; nothing is captured here
    cfg = ModelConfig.from_name("tiny", context_length=16)
    case = ModelCase("tiny", 16, 1, "fp32", False, "baseline", "sdpa", fused=False, compile_scope="-",
                     compile_mode="-", optimizer="torch-fused", weight_copies=False, fused_loss=False, step_graph=True)
    harness = _Harness(case, cfg, torch.device("cpu"))
    graph = harness.step_fn("train-step", None)
    assert isinstance(graph, StepGraph) and not graph.captured
    for p in harness.model.parameters():
        p.grad = torch.ones_like(p)
    graph.prepare[0]()
    assert all(p.grad is None for p in harness.model.parameters())
