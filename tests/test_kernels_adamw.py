"""Fused AdamW against cs336_basics' AdamW and torch's AdamW, 10 steps (CUDA, or CPU under the interpreter)."""

import pytest
import torch

from cs336_basics.optimizer import AdamW
from cs336_systems.kernels.adamw import FusedAdamW
from tests._support import kernel_device


def _run(make_opt, device, steps=10):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=device)) for shape in ((37,), (5, 300), (2049,))]
    opt = make_opt(params)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(device)
        opt.step()
    return params, opt


@pytest.mark.parametrize("maths,reference", [("cs336", AdamW), ("torch", torch.optim.AdamW)])
def test_fused_adamw_matches_reference_for_ten_steps(maths, reference):
    device = kernel_device()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ours, opt = _run(lambda ps: FusedAdamW(ps, maths=maths, **kw), device)
    ref, _ = _run(lambda ps: reference(ps, **kw), device)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7)
    assert opt.state[ours[0]]["t"] == 10 and set(opt.state[ours[0]]) == {"m", "v", "t"}


def test_bf16_state_stays_close_to_fp32_state():
    device = kernel_device()
    kw = dict(lr=1e-3, weight_decay=0.01)
    fp32, _ = _run(lambda ps: FusedAdamW(ps, **kw), device)
    bf16, opt = _run(lambda ps: FusedAdamW(ps, state_dtype=torch.bfloat16, **kw), device)
    assert opt.state[bf16[0]]["m"].dtype == torch.bfloat16
    for a, b in zip(fp32, bf16):
        # Each Adam step moves a weight by about lr; bf16 m and v (8 mantissa bits) perturb that move by
        # under 2%, so after 10 steps the two runs differ by at most 2% of 10 x lr.
        assert 0 < (a - b).abs().max() <= 0.02 * 10 * 1e-3


def test_bad_options():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="maths must be one of cs336, torch"):
        FusedAdamW(p, maths="adam")
    with pytest.raises(ValueError, match="state_dtype"):
        FusedAdamW(p, state_dtype=torch.float16)


def test_multi_tensor_launch_matches_per_tensor_launches_exactly():
    device = kernel_device()
    kw = dict(lr=1e-2, weight_decay=0.1, maths="torch")
    multi, opt = _run(lambda ps: FusedAdamW(ps, **kw), device)
    single, _ = _run(lambda ps: FusedAdamW(ps, multi_tensor=False, **kw), device)
    for a, b in zip(multi, single):
        assert torch.equal(a, b)
    assert len(opt._tables_cache) == 1  # the tensors never change: one cached set of launch tables


def test_multi_tensor_with_mixed_dtypes_and_missing_gradients():
    device = kernel_device()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(300, device=device)),
              torch.nn.Parameter(torch.randn(70, device=device).to(torch.bfloat16)),
              torch.nn.Parameter(torch.randn(5, device=device))]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours = FusedAdamW(params, lr=1e-2, maths="torch")
    ref = FusedAdamW(copies, lr=1e-2, maths="torch", multi_tensor=False)
    for step in range(3):
        for i, (p, q) in enumerate(zip(params, copies)):
            has_grad = not (i == 2 and step == 1)  # one parameter skips a step: its t falls behind
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(device, p.dtype)
            p.grad, q.grad = (g.clone(), g.clone()) if has_grad else (None, None)
        ours.step()
        ref.step()
    assert ours.state[params[2]]["t"] == 2 and ours.state[params[0]]["t"] == 3
    for p, q in zip(params, copies):
        assert torch.equal(p, q)


def test_whole_aligned_blocks_and_misaligned_views_update_alike(monkeypatch):
    """Whole blocks at 16-byte aligned addresses take the kernel's unmasked 16-byte loads and stores; a tensor's
    last partial block, or a parameter (or gradient) that is a view 4 bytes into its storage, the masked form. Both
    forms must give the same bits, bf16 weight copies included, and the host must pick the masked form for any
    misaligned address."""
    from cs336_systems.kernels import adamw

    device = kernel_device()
    launched = []
    real_kernel = adamw._kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append(kwargs["ALIGNED"])
                return real_kernel()[grid](*args, **kwargs)
            return launch

    monkeypatch.setattr(adamw, "_kernel", Spy)
    sizes = (adamw.BLOCK, 2 * adamw.BLOCK + 37, 5)  # a whole block; two and a tail; a tail alone

    def run(offset_params: bool, offset_grads: bool):
        torch.manual_seed(0)
        storage = [torch.randn(n + 1, device=device) for n in sizes]
        params = [torch.nn.Parameter(s[1:] if offset_params else s[1:].clone()) for s in storage]
        for p in params:
            p.compute_copy = torch.zeros(p.shape, dtype=torch.bfloat16, device=device)
        opt = FusedAdamW(params, lr=1e-2, weight_decay=0.1)
        for step in range(3):
            for i, p in enumerate(params):
                g = torch.randn(p.numel() + 1, generator=torch.Generator().manual_seed(10 * step + i)).to(device)
                p.grad = g[1:] if offset_grads else g[1:].clone()
            opt.step()
        return params

    aligned = run(False, False)
    assert launched == [True] * 3
    for offset_params, offset_grads in ((True, False), (False, True)):
        launched.clear()
        for ours, expected in zip(run(offset_params, offset_grads), aligned):
            assert ours.data_ptr() % 16 != 0 or ours.grad.data_ptr() % 16 != 0
            assert torch.equal(ours, expected) and torch.equal(ours.compute_copy, expected.compute_copy)
        assert launched == [False] * 3


def test_gradient_table_is_copied_to_the_device_only_for_new_addresses(monkeypatch):
    """Steps whose gradients sit at the addresses of an earlier step reuse its table (no host-to-device copy);
    gradients at new addresses get a new table, and the update follows them."""
    import cs336_systems.kernels.adamw as adamw

    device = kernel_device()
    built = []
    real = adamw._addresses
    monkeypatch.setattr(adamw, "_addresses", lambda tensors, dev: built.append(len(tensors)) or real(tensors, dev))
    starts = [torch.randn(n, device=device) for n in (3, 1500)]
    params = [torch.nn.Parameter(s.clone()) for s in starts]
    optimizer = FusedAdamW(params, lr=0.1)
    grads = [torch.ones_like(p) for p in params]
    for _ in range(3):  # the same gradient tensors each step
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    assert len(built) == 3 + 1  # p, m, v tables once, and one gradient table
    for p in params:
        p.grad = -torch.ones_like(p)  # new tensors, new addresses: a new table, and the step uses them
    optimizer.step()
    assert len(built) == 5
    # the same four steps without a table: per tensor, the addresses passed fresh each launch
    monkeypatch.setattr(FusedAdamW, "_gradient_table",
                        lambda self, ps: (real([p.grad for p in ps], ps[0].device), True))
    fresh = [torch.nn.Parameter(p0) for p0 in starts]
    plain = FusedAdamW(fresh, lr=0.1)
    for sign in (1, 1, 1, -1):
        for p in fresh:
            p.grad = sign * torch.ones_like(p)
        plain.step()
    for ours, expected in zip(params, fresh):
        assert torch.equal(ours.detach(), expected.detach())


@pytest.mark.parametrize("maths,reference", [("cs336", AdamW), ("torch", torch.optim.AdamW)])
def test_capturable_steps_match_the_reference_with_step_counts_on_the_device(maths, reference):
    """capturable=True: the step counts are device tensors and the kernel forms the bias corrections from them (in
    fp32, where the host forms them in fp64: a relative difference of a few fp32 ulps in each step's size). One
    parameter skips a step, so one launch carries two step counts."""
    device = kernel_device()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch.manual_seed(0)
    starts = [torch.randn(shape, device=device) for shape in ((37,), (5, 300), (2049,))]
    ours = [torch.nn.Parameter(s.clone()) for s in starts]
    ref = [torch.nn.Parameter(s.clone()) for s in starts]
    opt, ref_opt = FusedAdamW(ours, maths=maths, capturable=True, **kw), reference(ref, **kw)
    for step in range(10):
        for i, (p, q) in enumerate(zip(ours, ref)):
            skip = i == 1 and step == 4
            g = torch.randn(p.shape, generator=torch.Generator().manual_seed(10 * step + i)).to(device)
            p.grad, q.grad = (None, None) if skip else (g, g.clone())
        opt.step()
        ref_opt.step()
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    t = opt.state[ours[0]]["t"]
    assert isinstance(t, torch.Tensor) and t.device.type == device and t.item() == 10
    assert opt.state[ours[1]]["t"].item() == 9
    assert len(opt._tables_cache) == 2  # with and without the parameter that skipped, both launched on the device


def test_an_optimizer_made_capturable_after_some_steps_carries_its_step_counts_over():
    device = kernel_device()
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    plain, _ = _run(lambda ps: FusedAdamW(ps, **kw), device, steps=6)

    def switched(ps):
        opt = FusedAdamW(ps, **kw)
        original = opt.step

        def step():  # capturable from the fourth step on
            if opt.state and next(iter(opt.state.values()))["t"] == 3:
                opt.capturable = True
            return original()

        opt.step = step
        return opt

    ours, opt = _run(switched, device, steps=6)
    assert opt.state[ours[0]]["t"].item() == 6
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_prepare_capture_needs_a_capturable_optimizer_with_its_state():
    p = [torch.nn.Parameter(torch.ones(4))]
    with pytest.raises(RuntimeError, match="capturable=True"):
        FusedAdamW(p).prepare_capture()
    p[0].grad = torch.ones(4)
    with pytest.raises(RuntimeError, match="run a step first"):
        FusedAdamW(p, capturable=True).prepare_capture()


@pytest.mark.gpu
@pytest.mark.parametrize("maths", ["cs336", "torch"])
def test_a_capturable_step_replays_as_a_cuda_graph(maths):
    """step() captured once (after prepare_capture) and replayed with new gradients takes the same steps as eager
    steps of a twin optimizer; an optimizer that is not capturable refuses the capture."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    starts = [torch.randn(shape, device="cuda") for shape in ((37,), (5, 300), (2049,))]
    graphed = [torch.nn.Parameter(s.clone()) for s in starts]
    eager = [torch.nn.Parameter(s.clone()) for s in starts]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, maths=maths, capturable=True)
    opt, twin = FusedAdamW(graphed, **kw), FusedAdamW(eager, **kw)
    grads = [torch.zeros_like(p) for p in graphed]  # the graph reads these addresses every replay
    for p, q, g in zip(graphed, eager, grads):
        p.grad, q.grad = g, g
    opt.step()  # the state, made outside the capture
    twin.step()
    opt.prepare_capture()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        opt.step()
    for seed in range(5):
        for g in grads:
            g.copy_(torch.randn(g.shape, generator=torch.Generator().manual_seed(seed)).cuda())
        graph.replay()
        twin.step()
    for a, b in zip(graphed, eager):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert opt.state[graphed[0]]["t"].item() == 6
    plain = FusedAdamW([torch.nn.Parameter(torch.ones(8, device="cuda"))])
    plain.param_groups[0]["params"][0].grad = torch.ones(8, device="cuda")
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            plain.step()
