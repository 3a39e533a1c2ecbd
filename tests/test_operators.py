"""Our kernels as PyTorch operators (`torch.library`): schema, fake and autograd rules (`opcheck`), the CPU
implementations from the references, and a model built from them under torch.compile(fullgraph=True) with
dynamic shapes: no graph break, one graph per model over two context lengths, the eager model's loss and
gradients."""

from __future__ import annotations

import functools
import re

import pytest
import torch
import torch._dynamo.utils

from tests._support import kernel_device, relative_error


@pytest.fixture
def cpu_maths(monkeypatch):
    """Our operators on the CPU as a user without a GPU runs them: the reference maths in torch, not the Triton
    kernels under the interpreter (which the kernel tests cover)."""
    import cs336_systems.kernels._triton_utils as utils
    import cs336_systems.kernels.flash_attention.function  # noqa: F401  (its autotune configs are read at import)

    monkeypatch.setattr(utils, "interpreting", lambda: False)


def _operator_cases(device: str):
    """(operator, sample arguments) for every operator of the model path, small odd shapes."""
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy_op
    from cs336_systems.kernels.flash_attention.function import (
        flash_attention_backward_op,
        flash_attention_forward_op,
    )
    from cs336_systems.kernels.rmsnorm import (
        add_rmsnorm_backward_op,
        add_rmsnorm_op,
        add_rmsnorm_traced_backward_op,
        add_rmsnorm_traced_op,
        rmsnorm_backward_op,
        rmsnorm_op,
        rmsnorm_traced_backward_op,
        rmsnorm_traced_op,
    )
    from cs336_systems.kernels.rope import rope_op, rope_pair_op, rope_pair_traced_op, rope_traced_op
    from cs336_systems.kernels.swiglu import (
        silu_mul_backward_op,
        silu_mul_op,
        silu_mul_packed_backward_op,
        silu_mul_packed_op,
        silu_mul_packed_traced_backward_op,
        silu_mul_packed_traced_op,
        silu_mul_traced_backward_op,
        silu_mul_traced_op,
    )

    g = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g).to(device).requires_grad_(grad)

    x, w = rand(2, 3, 24, grad=True), rand(24, grad=True)
    a, b = rand(3, 37, grad=True), rand(3, 37, grad=True)
    cache = RotaryEmbedding(context_length=16, dim=8)._freq_cis_cache.to(device)
    heads = rand(2, 5, 3, 8).transpose(1, 2).requires_grad_()  # the model's strided head view
    qk = rand(2, 5, 2, 3, 8).permute(2, 0, 3, 1, 4)  # Q and K as column blocks of one product, head views
    q_heads, k_heads = qk[0].detach().requires_grad_(), qk[1].detach().requires_grad_()
    positions = torch.broadcast_to(torch.arange(5, device=device), heads.shape[:-1])
    q, k, v = (rand(2, 3, 7, 16, grad=True) for _ in range(3))
    out, lse = flash_attention_forward_op(q.detach(), k.detach(), v.detach(), True)
    gate_up = rand(3, 2, 74, grad=True)  # (a | b) of the merged w1/w3 product, d_ff 37
    stream, delta = rand(2, 3, 24, grad=True), rand(2, 3, 24).half().requires_grad_()  # fp32 residual, 16-bit delta
    h, rstd = (stream + delta).detach(), rand(2, 3).abs() + 0.5
    return [
        (rmsnorm_op, (x, w, 1e-5)),
        (rmsnorm_backward_op, (rand(2, 3, 24), x.detach(), w.detach(), rand(2, 3).abs() + 0.5)),
        (silu_mul_op, (a, b)),
        (silu_mul_backward_op, (rand(3, 37), a.detach(), b.detach())),
        (rope_op, (heads, positions, cache, 1.0)),
        (lm_head_cross_entropy_op, (rand(2, 5, 8, grad=True), rand(11, 8, grad=True),
                                    torch.randint(0, 11, (2, 5), generator=g).to(device), -100, "mean", 3)),
        # the products reading another matrix than the one the gradient is for (a weight's 16-bit copy)
        (lm_head_cross_entropy_op, (rand(2, 5, 8, grad=True), rand(11, 8, grad=True),
                                    torch.randint(0, 11, (2, 5), generator=g).to(device), -100, "sum", 4,
                                    rand(11, 8))),
        (flash_attention_forward_op, (q, k, v, True, "triton")),
        (flash_attention_backward_op, (q.detach(), k.detach(), v.detach(), out, lse, rand(2, 3, 7, 16), True,
                                       "triton")),
        (rmsnorm_traced_op, (x, w, 1e-5)),
        (rmsnorm_traced_backward_op, (rand(2, 3, 24), x.detach(), w.detach(), rand(2, 3).abs() + 0.5)),
        (silu_mul_traced_op, (a, b)),
        (silu_mul_traced_backward_op, (rand(3, 37), a.detach(), b.detach())),
        (rope_traced_op, (heads, positions, cache, 1.0)),
        (rmsnorm_op, (x, w, 1e-5, torch.float16)),
        (rmsnorm_traced_op, (x, w, 1e-5, torch.float16)),
        (silu_mul_packed_op, (gate_up,)),
        (silu_mul_packed_backward_op, (rand(3, 2, 37), gate_up.detach())),
        (silu_mul_packed_traced_op, (gate_up,)),
        (silu_mul_packed_traced_backward_op, (rand(3, 2, 37), gate_up.detach())),
        (rope_pair_op, (q_heads, k_heads, positions, cache, 1.0)),
        (rope_pair_traced_op, (q_heads, k_heads, positions, cache, 1.0)),
        (add_rmsnorm_op, (x, rand(2, 3, 24, grad=True), w, 1e-5)),
        (add_rmsnorm_op, (stream, delta, w, 1e-5, torch.float16)),
        (add_rmsnorm_backward_op, (rand(2, 3, 24), rand(2, 3, 24), h, w.detach(), rstd)),
        (add_rmsnorm_backward_op, (rand(2, 3, 24), rand(2, 3, 24).half(), h, w.detach(), rstd, torch.float16)),
        (add_rmsnorm_traced_op, (stream, delta, w, 1e-5, torch.float16)),
        (add_rmsnorm_traced_backward_op, (rand(2, 3, 24), rand(2, 3, 24).half(), h, w.detach(), rstd,
                                          torch.float16)),
    ]


# (one id per case above, in order)
OPERATORS = ["rmsnorm", "rmsnorm_backward", "silu_mul", "silu_mul_backward", "rope", "lm_head_cross_entropy",
             "lm_head_cross_entropy_product_weight",
             "flash_attention_forward", "flash_attention_backward", "rmsnorm_traced", "rmsnorm_traced_backward",
             "silu_mul_traced", "silu_mul_traced_backward", "rope_traced", "rmsnorm_to_fp16", "rmsnorm_traced_to_fp16",
             "silu_mul_packed",
             "silu_mul_packed_backward", "silu_mul_packed_traced", "silu_mul_packed_traced_backward", "rope_pair",
             "rope_pair_traced", "add_rmsnorm", "add_rmsnorm_mixed", "add_rmsnorm_backward",
             "add_rmsnorm_backward_mixed", "add_rmsnorm_traced_mixed", "add_rmsnorm_traced_backward_mixed"]


@pytest.mark.parametrize("index", range(len(OPERATORS)), ids=OPERATORS)
def test_opcheck_cpu_maths(index, cpu_maths):
    operator, args = _operator_cases("cpu")[index]
    torch.library.opcheck(operator, args)


@pytest.mark.parametrize("index", range(len(OPERATORS)), ids=OPERATORS)
def test_opcheck_kernels(index):
    """The same checks with the Triton kernels (CUDA, or the interpreter on CPU; the triton_ops on CUDA only: their
    fake-tensor check would run the interpreter's kernels on fake tensors)."""
    from cs336_systems.kernels._triton_utils import interpreting

    if "_traced" in OPERATORS[index] and interpreting():
        pytest.skip("triton_ops trace their kernels through wrap_triton, which the interpreter cannot fake")
    operator, args = _operator_cases(kernel_device())[index]
    torch.library.opcheck(operator, args)


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_triton_op_bodies_trace_to_one_kernel_node_per_launch(monkeypatch, request, tracing_mode):
    """What torch.compile does with our triton_ops (CS336_TRITON_OPS=1), without a GPU: each body, traced on meta
    tensors as if they were CUDA ones, is its allocations plus one `triton_kernel_wrapper_mutation` node per kernel
    launch (inductor launches those itself), with the grid and sizes symbolic where the shapes are."""
    from torch.fx.experimental.proxy_tensor import make_fx

    import cs336_systems.kernels.rmsnorm as rmsnorm_module
    import cs336_systems.kernels.rope as rope_module
    import cs336_systems.kernels.swiglu as swiglu_module
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels._triton_utils import launch_wrapped

    # Compiled (not interpreted) kernels, as on a GPU: made afresh with the interpreter off, and dropped after.
    kernel_caches = (rmsnorm_module._kernels, rope_module._kernel, swiglu_module._kernels, swiglu_module._packed_kernel)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    for cached in kernel_caches:
        cached.cache_clear()
    request.addfinalizer(lambda: [cached.cache_clear() for cached in kernel_caches])
    for module in (rmsnorm_module, rope_module, swiglu_module):
        monkeypatch.setattr(module, "runs_kernel", lambda t: True)  # meta tensors stand in for CUDA ones
    meta = functools.partial(torch.empty, device="meta")
    cache = RotaryEmbedding(context_length=16, dim=8)._freq_cis_cache.to("meta")
    heads = meta(2, 5, 3, 8).transpose(1, 2)
    bodies = [
        (lambda x, w: rmsnorm_module._forward(x, w, 1e-5, launch=launch_wrapped), (meta(6, 24), meta(24))),
        (lambda dy, x, w, r: rmsnorm_module._backward(dy, x, w, r, launch=launch_wrapped),
         (meta(6, 24), meta(6, 24), meta(24), meta(6))),
        (lambda x, delta, w: rmsnorm_module._forward(x, w, 1e-5, launch=launch_wrapped, delta2d=delta),
         (meta(6, 24), meta(6, 24, dtype=torch.bfloat16), meta(24))),
        (lambda dy, h, w, r, dh: rmsnorm_module._backward(dy, h, w, r, launch=launch_wrapped, grad_h2d=dh,
                                                          second_dtype=torch.bfloat16),
         (meta(6, 24), meta(6, 24), meta(24), meta(6), meta(6, 24))),
        (lambda a, b: swiglu_module._forward(a, b, launch=launch_wrapped), (meta(3, 37), meta(3, 37))),
        (lambda dy, a, b: swiglu_module._backward(dy, a, b, launch=launch_wrapped),
         (meta(3, 37), meta(3, 37), meta(3, 37))),
        (lambda x, pos, cache: rope_module._rotate((x,), pos, cache, 1.0, launch=launch_wrapped),
         (heads, torch.broadcast_to(torch.arange(5, device="meta"), heads.shape[:-1]), cache)),
        (lambda q, k, pos, cache: rope_module._rotate((q, k), pos, cache, 1.0, launch=launch_wrapped),
         (heads, torch.empty_strided(heads.shape, heads.stride(), device="meta"),
          torch.broadcast_to(torch.arange(5, device="meta"), heads.shape[:-1]), cache)),
        (lambda gate_up: swiglu_module._packed_forward(gate_up, launch=launch_wrapped), (meta(3, 74),)),
        (lambda dy, gate_up: swiglu_module._packed_backward(dy, gate_up, False, launch=launch_wrapped),
         (meta(3, 37), meta(3, 74))),
    ]
    for body, inputs in bodies:
        graph = make_fx(body, tracing_mode=tracing_mode)(*inputs)
        launches = [node for node in graph.graph.nodes if "triton_kernel_wrapper" in str(node.target)]
        assert len(launches) == 1, graph.code
        if tracing_mode == "symbolic":
            assert "sym_size" in graph.code or "sym_numel" in graph.code, graph.code  # no recompile per shape


def test_cpu_maths_match_the_references(cpu_maths):
    """Each operator's CPU implementation against its reference, forward and gradients, in fp64 references."""
    from cs336_basics.model import RotaryEmbedding
    from cs336_systems.kernels.cross_entropy import lm_head_cross_entropy, lm_head_cross_entropy_reference
    from cs336_systems.kernels.flash_attention.function import flash_attention
    from cs336_systems.kernels.flash_attention.reference import naive_attention
    from cs336_systems.kernels.rmsnorm import rmsnorm, rmsnorm_reference
    from cs336_systems.kernels.rope import rope, rope_reference
    from cs336_systems.kernels.swiglu import silu_mul, silu_mul_reference

    torch.manual_seed(0)
    cache = RotaryEmbedding(context_length=16, dim=8)._freq_cis_cache
    heads = torch.randn(2, 9, 3, 8).transpose(1, 2)
    cases = [
        (rmsnorm, rmsnorm_reference, (torch.randn(3, 5, 40), torch.randn(40)), {}),
        (silu_mul, silu_mul_reference, (torch.randn(4, 33), torch.randn(4, 33)), {}),
        (lambda x: rope(x, torch.arange(9), cache), lambda x: rope_reference(x, torch.arange(9), cache.double()),
         (heads,), {}),
        (lambda h, w: lm_head_cross_entropy(h, w, torch.arange(10).remainder(13).view(2, 5), chunk_tokens=4),
         lambda h, w: lm_head_cross_entropy_reference(h, w, torch.arange(10).remainder(13).view(2, 5)),
         (torch.randn(2, 5, 16), torch.randn(13, 16)), {}),
        (lambda q, k, v: flash_attention(q, k, v, True), lambda q, k, v: naive_attention(q, k, v, True),
         tuple(torch.randn(2, 3, 11, 16) for _ in range(3)), {}),
    ]
    for ours, reference, inputs, _ in cases:
        leaves = [t.clone().requires_grad_() for t in inputs]
        leaves64 = [t.double().requires_grad_() for t in inputs]
        out, ref = ours(*leaves), reference(*leaves64)
        assert relative_error(out, ref) < 1e-5, ours
        grad_out = torch.randn(out.shape, dtype=torch.float64)
        grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
        grads64 = torch.autograd.grad(ref, leaves64, grad_out)
        for grad, grad64 in zip(grads, grads64):
            assert relative_error(grad, grad64) < 1e-5, ours


def _compiled_step_matches_eager(preset_contexts, device: str, **recipe_options):
    """For each preset: one model compiled with fullgraph=True and dynamic shapes, run at two context lengths;
    returns the number of graphs dynamo captured. Loss and gradients are asserted against the eager model."""
    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.config import ModelConfig
    from cs336_systems.recipe import Recipe, attention_context, build_model

    recipe = Recipe(**recipe_options)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for preset, contexts in preset_contexts:
        cfg = ModelConfig.from_name(preset, context_length=max(contexts), num_layers=2)
        model = build_model(cfg, recipe, device)
        compiled = torch.compile(model, fullgraph=True, dynamic=True)
        for context in contexts:
            tokens = torch.randint(0, cfg.vocab_size, (2, context), generator=torch.Generator().manual_seed(context))
            tokens = tokens.to(device)
            with attention_context(recipe):
                losses, grads = [], []
                for forward in (compiled, model):
                    model.zero_grad(set_to_none=True)
                    loss = cross_entropy(forward(tokens).float(), tokens)
                    loss.backward()
                    losses.append(loss.detach())
                    grads.append({name: p.grad.clone() for name, p in model.named_parameters()})
            torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-5)
            for name in grads[1]:
                torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


@pytest.mark.parametrize("triton_ops", ["0", "1"], ids=["custom-ops", "triton-ops"])
def test_our_model_compiles_without_breaks_or_recompiles_per_size(cpu_maths, monkeypatch, triton_ops):
    """Two presets, two context lengths each, in one process (the second preset once failed with dynamo's
    'SymNodeVariable has no attribute value'): one graph per model, none per size; with our operators as custom ops
    (their Python runs per call) and as triton_ops (CS336_TRITON_OPS=1: their bodies are traced)."""
    import cs336_systems.kernels.rmsnorm as rmsnorm_module
    import cs336_systems.kernels.rope as rope_module
    import cs336_systems.kernels.swiglu as swiglu_module

    monkeypatch.setenv("CS336_TRITON_OPS", triton_ops)
    for module, name in [(rmsnorm_module, "rmsnorm"), (rmsnorm_module, "add_rmsnorm"), (swiglu_module, "silu_mul"),
                         (swiglu_module, "silu_mul_packed"), (rope_module, "rope")]:
        unused = f"{name}_op" if triton_ops == "1" else f"{name}_traced_op"  # the other form must not be traced

        def refuse(*args, _unused=unused):
            raise AssertionError(f"{_unused} was called")

        monkeypatch.setattr(module, unused, refuse)
    graphs = _compiled_step_matches_eager([("tiny", (24, 40)), ("small", (16, 33))], "cpu", attention="triton",
                                          fused=True, fused_rope=True)
    assert graphs == 2


def test_compiled_model_makes_one_product_per_merged_group(cpu_maths):
    """Compiled, the fused model keeps its merged products (one for Q/K/V, one for w1/w3), as eager does: per block
    4 products forward (QKV, output, w1/w3, w2) and 8 backward, where separate projections take 7 and 14 (each
    product a kernel launch and, at small sizes, host time). Counted in the graphs AOTAutograd hands inductor. A
    Linear marked `forward_taken_over` (our FSDP's) makes its group's merged product step aside."""
    import torch._dynamo.testing

    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.config import ModelConfig
    from cs336_systems.fused_model import forward_taken_over
    from cs336_systems.recipe import Recipe, attention_context, build_model

    counts = {}
    for merge in (True, False, "one taken over"):
        recipe = Recipe(attention="triton", fused=True, fused_rope=True, merge_projections=bool(merge))
        cfg = ModelConfig.from_name("tiny", context_length=16, num_layers=2)
        model = build_model(cfg, recipe, "cpu")
        if merge == "one taken over":  # as our FSDP marks a Linear whose forward it replaced
            forward_taken_over(model.layers[0].attn.k_proj)
        backend = torch._dynamo.testing.AotEagerAndRecordGraphs()
        tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
        torch._dynamo.reset()
        with attention_context(recipe):
            loss = cross_entropy(torch.compile(model, backend=backend, fullgraph=True)(tokens).float(), tokens)
            loss.backward()
            grads = {name: p.grad.clone() for name, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
            cross_entropy(model(tokens).float(), tokens).backward()
        for name, p in model.named_parameters():  # the merged graph computes the eager model's gradients
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-5, msg=name)
        counts[merge] = [sum(node.target is torch.ops.aten.mm.default for graph in graphs for node in graph.graph.nodes)
                         for graphs in (backend.fw_graphs, backend.bw_graphs)]
    head = [1, 2]  # the LM head's product, forward and backward
    assert counts[True] == [2 * 4 + head[0], 2 * 8 + head[1]], counts
    assert counts[False] == [2 * 7 + head[0], 2 * 14 + head[1]], counts
    assert counts["one taken over"] == [2 * 4 + 2 + head[0], 2 * 8 + 4 + head[1]], counts  # that Q/K/V steps aside


@pytest.mark.gpu
@pytest.mark.parametrize("triton_ops", ["0", "1"], ids=["custom-ops", "triton-ops"])
def test_our_model_compiles_with_the_kernels(monkeypatch, triton_ops):
    """As above with the Triton kernels: launched by our operators' Python, or (triton_ops) by inductor's code."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (the interpreter has no compiled path)")
    monkeypatch.setenv("CS336_TRITON_OPS", triton_ops)
    graphs = _compiled_step_matches_eager([("tiny", (64, 100)), ("small", (32, 48))], "cuda", attention="triton",
                                          fused=True, fused_rope=True)
    assert graphs == 2


@pytest.mark.gpu
def test_a_step_of_our_model_replays_as_a_cuda_graph():
    """Forward and backward of our model (Triton attention, fused RMSNorm/SwiGLU/RoPE) captured once in a CUDA
    graph and replayed on new tokens: the loss and every gradient as the eager step computes them. (The optimizer
    stays outside: FusedAdamW passes its bias corrections as host scalars, which a graph would freeze.)"""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cs336_basics.nn_utils import cross_entropy
    from cs336_systems.config import ModelConfig
    from cs336_systems.recipe import Recipe, attention_context, build_model

    recipe = Recipe(attention="triton", fused=True, fused_rope=True)
    cfg = ModelConfig.from_name("tiny", context_length=64, num_layers=2)
    model = build_model(cfg, recipe, "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (2, 64), device="cuda")

    def step():
        loss = cross_entropy(model(tokens).float(), tokens)
        loss.backward()
        return loss

    with attention_context(recipe):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (autotuning, launch plans) outside the capture
            for _ in range(3):
                model.zero_grad(set_to_none=True)
                step()
        torch.cuda.current_stream().wait_stream(side)
        model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_loss = step()
        graph_grads = {name: p.grad for name, p in model.named_parameters()}  # written by every replay
        for seed in (1, 2):
            tokens.copy_(torch.randint(0, cfg.vocab_size, (2, 64), generator=torch.Generator().manual_seed(seed)))
            graph.replay()
            replayed_loss, replayed = graph_loss.clone(), {n: g.clone() for n, g in graph_grads.items()}
            model.zero_grad(set_to_none=True)
            eager_loss = step()
            torch.testing.assert_close(replayed_loss, eager_loss)
            for name, p in model.named_parameters():
                torch.testing.assert_close(replayed[name], p.grad, msg=name)


def test_host_integer_helpers_match_tritons():
    """The launch code's cdiv and next_power_of_2 (plain integer maths, where Triton's are ~2 us ConstexprFunction
    calls on the host) agree with Triton's over sizes a launch sees."""
    triton = pytest.importorskip("triton")
    from cs336_systems.kernels._triton_utils import cdiv, next_power_of_2

    for n in [1, 2, 3, 15, 16, 17, 63, 64, 65, 80, 127, 128, 129, 255, 256, 1000, 4096, 131071, 131072, 131073]:
        assert next_power_of_2(n) == triton.next_power_of_2(n), n
        for block in (1, 16, 64, 128):
            assert cdiv(n, block) == triton.cdiv(n, block), (n, block)
    assert cdiv(0, 64) == 0


def test_operator_host_overhead_script_runs():
    """scripts/operator_host_overhead.py (in its own process: it stubs the kernels' launches) prints a time per
    operator, and refuses a non-positive count."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "operator_host_overhead.py"
    done = subprocess.run([sys.executable, str(script), "--calls", "20", "--repeats", "1"], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 15 and all(float(line.split()[-1]) > 0 for line in lines[1:])
    bad = subprocess.run([sys.executable, str(script), "--calls", "0"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--calls" in bad.stderr


def test_launch_host_cost_script_runs():
    """scripts/launch_host_cost.py prints Triton's binding cost and a launch plan's replay cost per launch."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "launch_host_cost.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # (the JIT's binder, not the interpreter)
    done = subprocess.run([sys.executable, str(script), "--calls", "20", "--repeats", "1"], capture_output=True,
                          text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()[1:]
    assert [line.split()[0] for line in lines] == ["Triton", "launch"] and all(float(line.split()[-2]) > 0
                                                                               for line in lines)


def test_guard_check_cost_script_runs():
    """scripts/guard_check_cost.py on the CPU: both models' compiled blocks found, their guards pass on the blocks'
    own inputs, and a cost in us after each part of a step; bad counts refused before any work."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "guard_check_cost.py"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--context", "16", "--repeats", "2"],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in done.stdout.splitlines()
            if line.startswith(("ours ", "baseline "))}
    assert set(rows) == {"ours", "baseline"} and all(len(r) == 5 and min(r) > 0 for r in rows.values())
    refused = subprocess.run([sys.executable, str(script), "--device", "cpu", "--repeats", "0"], capture_output=True,
                             text=True, timeout=60, env=env)
    assert refused.returncode == 2 and "--repeats" in refused.stderr


def test_step_host_profile_script_runs(tmp_path):
    """scripts/step_host_profile.py (on the CPU here; the GPU stage `host-profile` runs it at small/512) times each
    variant's step and writes its profile tables, and refuses bad counts and unknown variants before any work."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "step_host_profile.py"
    # Our operators' CPU maths, as a user without a GPU runs them (the interpreter refuses bf16 autocast's inputs).
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    for stub in ([], ["--stub-kernels", "--dtype", "fp32", "--d-model", "32", "--vocab-size", "64"]):
        # (stubbed: our operators' CUDA path, launches doing nothing, our attention replaced by its outputs)
        done = subprocess.run([sys.executable, str(script), "--device", "cpu", "--preset", "tiny", "--context", "16",
                               "--compile", "off", "--steps", "1", "--variants", "ours,baseline", "--top", "1000",
                               "--out", str(tmp_path), *stub], capture_output=True, text=True, timeout=600, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        assert ("kernels stubbed" in done.stdout) == bool(stub)
        rows = [line.split() for line in done.stdout.splitlines() if line.startswith(("ours ", "baseline "))]
        assert [row[:2] for row in rows] == [["ours", "off"], ["baseline", "off"]]
        assert all(float(r[2]) > 0 for r in rows)
        for name in ("ours", "baseline"):
            text = (tmp_path / f"host_{name}_off.txt").read_text()
            assert "Ordered by: internal time" in text and "CPU self time per op" in text
            assert re.match(rf"# {name}, compile off: unprofiled step median \d+\.\d\d ms", text), text[:200]
        # (--top 1000 lists every function and op, whatever this host's CPU ranks first: on the H100's host the
        # autograd Functions fell out of the top 30)
        if stub:  # our operators took their CUDA path (their autograd Functions), and our attention the stub
            ours = (tmp_path / "host_ours_off.txt").read_text()
            assert "RMSNormFunction" in ours and "_NoAttention" in ours
    for bad, option in ((["--steps", "0"], "--steps"), (["--variants", "mine"], "--variants"),
                        (["--stub-kernels", "--compile", "on"], "--stub-kernels"),
                        (["--d-model", "30"], "--d-model")):
        refused = subprocess.run([sys.executable, str(script), "--device", "cpu", *bad], capture_output=True,
                                 text=True, timeout=300)
        assert refused.returncode == 2 and option in refused.stderr


def test_host_profile_variant_environment_is_set_and_restored(monkeypatch):
    """scripts/step_host_profile.py's `ours-custom-ops` variant runs with CS336_TRITON_OPS=0 and leaves the
    environment as it found it (set, unset, or with the user's own value)."""
    import importlib.util
    import os
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "step_host_profile.py"
    spec = importlib.util.spec_from_file_location("step_host_profile", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.VARIANT_ENVIRONMENT["ours-custom-ops"] == {"CS336_TRITON_OPS": "0"}
    for before in (None, "1"):
        if before is None:
            monkeypatch.delenv("CS336_TRITON_OPS", raising=False)
        else:
            monkeypatch.setenv("CS336_TRITON_OPS", before)
        with script._environment({"CS336_TRITON_OPS": "0"}):
            assert os.environ["CS336_TRITON_OPS"] == "0"
        assert os.environ.get("CS336_TRITON_OPS") == before
