"""Launch plans (kernels/flash_attention/launch_plan.py): repeat attention calls replay the compiled kernels.

On CPU: the pieces (argument binding, slot naming, the signature, the bounded cache) with stand-ins for a
compiled kernel. On the GPU: a replayed call gives exactly what the normal launch path gives, for every
backward, layout and dtype, and inputs that share an address make no plan.
"""

import pytest
import torch
import triton
import triton.language as tl

from cs336_systems.kernels.flash_attention import launch_plan
from tests._support import requires_cuda


@triton.jit
def _scale_kernel(src, dst, n, factor, BLOCK: tl.constexpr, EVEN: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n) * factor, mask=offs < n)


def test_bound_values_lists_every_parameter_in_order_with_defaults():
    src, dst = torch.zeros(4), torch.zeros(4)
    values = launch_plan.bound_values(_scale_kernel, (src, dst, 4), dict(factor=2.0, BLOCK=16, num_warps=4))
    assert values[:2] == [src, dst] and values[2:] == [4, 2.0, 16, False]  # num_warps is a launch option


class _FakeCompiled:
    """Stands in for a CompiledKernel: `compiled[grid]` gives a launcher that records its arguments."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args: self.calls.append((grid, args))


def test_capture_names_tensor_arguments_and_replays_with_new_addresses():
    q, out = torch.zeros(8), torch.zeros(8)
    compiled = _FakeCompiled()
    captured = launch_plan.capture(compiled, (3, 2), [q, out, 8, 0.5], dict(q=q, out=out))
    assert captured.slots == ((0, "q"), (1, "out")) and captured.values == [None, None, 8, 0.5]
    captured(dict(q=111, out=222))
    captured(dict(q=333, out=444))
    assert compiled.calls == [((3, 2, 1), (111, 222, 8, 0.5)), ((3, 2, 1), (333, 444, 8, 0.5))]


def test_capture_refuses_aliased_or_unknown_tensors():
    x, y = torch.zeros(8), torch.zeros(8)
    assert launch_plan.capture(_FakeCompiled(), (1,), [x, 1], dict(q=x, k=x)) is None  # one address, two roles
    assert launch_plan.capture(_FakeCompiled(), (1,), [x, y], dict(q=x)) is None  # y has no name


def test_a_view_is_named_by_its_base_tensor():
    q = torch.zeros(2, 5, 4)
    captured = launch_plan.capture(_FakeCompiled(), (1,), [q.unsqueeze(1)], dict(q=q))
    assert captured.slots == ((0, "q"),)


def test_signature_tells_layouts_dtypes_and_alignment_apart():
    base = torch.zeros(64)
    a = base[:32].view(4, 8)
    assert launch_plan.tensor_signature(a) == launch_plan.tensor_signature(torch.zeros(4, 8))
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(a.t())
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(a.double())
    assert launch_plan.tensor_signature(a) != launch_plan.tensor_signature(base[1:33].view(4, 8))  # 4-byte offset


def test_plan_cache_is_bounded_and_drops_the_oldest(monkeypatch):
    monkeypatch.setattr(launch_plan, "MAX_PLANS", 3)
    monkeypatch.setattr(launch_plan, "_plans", type(launch_plan._plans)())
    for i in range(5):
        launch_plan.store(("key", i), i)
    assert launch_plan.plan_count() == 3
    assert launch_plan.lookup(("key", 0)) is None and launch_plan.lookup(("key", 4)) == 4


# ---- GPU: a replay is the normal path's result exactly ----

# (batch, heads or None, n_queries, n_keys, d, dtype): the Gluon paths (d 64, 128 in bf16/fp16), the tl paths
# (d 32, fp32), ragged lengths.
PLAN_CASES = [(1, 2, 1000, 1000, 128, torch.bfloat16), (2, 3, 513, 257, 64, torch.bfloat16),
              (1, None, 300, 300, 128, torch.float16), (2, 2, 77, 130, 32, torch.bfloat16),
              (1, 2, 200, 200, 64, torch.float32)]


def _attend(q, k, v, causal, backward, grad_out):
    from cs336_systems.kernels.flash_attention.function import flash_attention

    for t in (q, k, v):
        t.grad = None
    out = flash_attention(q, k, v, causal, backward=backward)
    out.backward(grad_out)
    return out.detach().clone(), q.grad.clone(), k.grad.clone(), v.grad.clone()


def _fresh_inputs(batch, heads, nq, nk, d, dtype, seed):
    torch.manual_seed(seed)
    lead = (batch,) if heads is None else (batch, heads)
    return [torch.randn(*lead, n, d, device="cuda", dtype=dtype, requires_grad=True) for n in (nq, nk, nk)]


@requires_cuda
@pytest.mark.parametrize("backward", ["triton", "two-pass", "tl", "fused"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", PLAN_CASES)
def test_replayed_plan_matches_the_launch_path(case, causal, backward):
    *shape, dtype = case
    launch_plan.use_plans(True)
    q, k, v = _fresh_inputs(*shape, dtype, seed=0)
    _attend(q, k, v, causal, backward, torch.randn_like(q))  # makes the plans (and tunes)
    before = launch_plan.plan_count()
    q, k, v = _fresh_inputs(*shape, dtype, seed=1)  # new addresses and values
    grad_out = torch.randn_like(q)
    replayed = _attend(q, k, v, causal, backward, grad_out)
    assert launch_plan.plan_count() == before  # replayed, not made again
    launch_plan.use_plans(False)
    try:
        direct = _attend(q, k, v, causal, backward, grad_out)
    finally:
        launch_plan.use_plans(True)
    for name, ours, expected in zip(("out", "dq", "dk", "dv"), replayed, direct):
        if name == "dq" and backward in ("triton", "fused"):
            # One-pass dQ is an fp32 sum in arrival order: equal up to that order's rounding.
            torch.testing.assert_close(ours, expected, rtol=2e-2, atol=2e-2 * expected.abs().max().item())
        else:
            assert torch.equal(ours, expected), name


@requires_cuda
def test_plans_follow_the_models_head_views():
    """(batch, seq, heads, d) storage read as (batch, heads, seq, d): strided inputs and gradients."""
    from cs336_systems.kernels.flash_attention.function import flash_attention

    def attend(qkv):
        qkv.grad = None
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # (batch, heads, seq, d) views
        out = flash_attention(q, k, v, True)
        out.backward(torch.ones_like(out))
        return out.detach().clone(), qkv.grad.clone()

    launch_plan.use_plans(True)
    for seed in (0, 1):  # the first call makes the plans, the second replays them
        torch.manual_seed(seed)
        qkv = torch.randn(2, 300, 3, 4, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        replayed = attend(qkv)
    launch_plan.use_plans(False)
    try:
        direct = attend(qkv)
    finally:
        launch_plan.use_plans(True)
    assert torch.equal(replayed[0], direct[0])
    torch.testing.assert_close(replayed[1], direct[1], rtol=2e-2, atol=2e-2 * direct[1].abs().max().item())


@requires_cuda
def test_self_attention_on_one_tensor_makes_no_plan_and_replays_correctly():
    from cs336_systems.kernels.flash_attention.function import flash_forward

    x, y, z = (torch.randn(1, 2, 190, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    launch_plan.clear_plans()
    out, _ = flash_forward(x, x, x, True)  # one address in three roles: no plan
    assert launch_plan.plan_count() == 0
    flash_forward(y, x, z, True)  # the same signature, three addresses: a plan
    assert launch_plan.plan_count() == 1
    again, _ = flash_forward(x, x, x, True)  # replayed with one address in three roles
    assert launch_plan.plan_count() == 1
    assert torch.equal(again, out)
