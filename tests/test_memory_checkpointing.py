"""Checkpointing policies: identical gradients to no checkpointing; nested memory sub-linear in depth."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.config import ModelConfig
from cs336_systems.memory.checkpointing import apply_checkpointing
from cs336_systems.memory.live_bytes import retained_bytes
from cs336_systems.memory.policy import CheckpointPolicy
from tests._support import kernel_device

POLICIES = ["none", "every-block", "every-k:2", "every-k:3", "partial:2", "partial:9", "sqrt", "nested", "ffn", "attn",
            "selective", "partial:2+selective"]


def _grads(policy, layers=5):
    torch.manual_seed(0)
    model = ModelConfig.from_name("tiny", num_layers=layers).build()
    apply_checkpointing(model, policy)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(model(tokens), tokens)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, list(model.state_dict())


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_policy_gradients_equal_no_checkpointing(policy):
    loss, grads, names = _grads("none")
    loss_c, grads_c, names_c = _grads(policy)
    assert names == names_c  # the model's names and state dict are untouched
    assert torch.equal(loss, loss_c)
    for name in grads:
        assert torch.equal(grads[name], grads_c[name]), name


def _retained(policy, layers):
    torch.manual_seed(0)
    model = ModelConfig.from_name("tiny", num_layers=layers, context_length=64).build()
    apply_checkpointing(model, policy)
    tokens = torch.randint(0, 512, (2, 64))
    _, held = retained_bytes(lambda: model(tokens).sum())
    return held


def test_nested_memory_grows_sub_linearly_with_depth():
    plain = [_retained("none", n) for n in (4, 16)]
    nested = [_retained("nested", n) for n in (4, 16)]
    assert plain[1] / plain[0] > 3.5  # no checkpointing: linear in depth
    assert nested[1] / nested[0] < 2.0  # nested: O(log N) boundaries plus one block
    assert nested[1] < plain[1] / 4


def test_every_block_keeps_only_boundaries():
    assert _retained("every-block", 8) < _retained("none", 8) / 4


def test_partial_keeps_the_unchecked_blocks_whole():
    none, every = _retained("none", 8), _retained("every-block", 8)
    half = _retained("partial:4", 8)
    assert every < half < none
    assert abs(half - (none + every) / 2) < 0.1 * none  # half the blocks whole, half as boundaries



# ---- +keep-attn: selective checkpointing that keeps our attention's outputs ----

def _triton_grads(policy, counter, layers=3):
    from cs336_systems.attention import use_attention

    device = kernel_device()
    counter[0] = 0
    torch.manual_seed(0)
    model = ModelConfig.from_name("tiny", num_layers=layers, context_length=32).build(device=device)
    apply_checkpointing(model, policy)
    tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
    with use_attention("triton"):
        loss = cross_entropy(model(tokens), tokens)
        forwards = counter[0]
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}, forwards, counter[0] - forwards


@pytest.fixture
def attention_forward_calls(monkeypatch):
    """Counts our attention's forward kernel launches (on the GPU, or under the interpreter on CPU)."""
    kernel_device()
    from cs336_systems.kernels.flash_attention import dispatch, native_launch

    # Counted in the Python launcher: a native plan's replay runs no Python to count. How native plans and
    # checkpointing meet is tested in test_kernels_flash_launch_plan.py.
    monkeypatch.setattr(native_launch, "_enabled", False)
    counter = [0]
    real = dispatch.flash_forward

    def counted(*args, **kwargs):
        counter[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(dispatch, "flash_forward", counted)
    return counter


@pytest.mark.parametrize("policy", ["every-block", "every-k:2", "partial:2", "sqrt"])
def test_keep_attn_skips_the_attention_recompute_with_identical_gradients(policy, attention_forward_calls):
    counter = attention_forward_calls
    loss, grads, fwd, bwd = _triton_grads("none", counter)
    assert (fwd, bwd) == (3, 0)
    loss_p, grads_p, fwd_p, bwd_p = _triton_grads(policy, counter)
    recomputed = 3 if policy != "partial:2" else 2
    assert (fwd_p, bwd_p) == (3, recomputed)  # plain checkpointing runs the attention again
    loss_k, grads_k, fwd_k, bwd_k = _triton_grads(policy + "+keep-attn", counter)
    assert (fwd_k, bwd_k) == (3, 0)  # kept: no attention forward in backward
    assert torch.equal(loss, loss_k) and torch.equal(loss_p, loss_k)
    for name in grads:
        assert torch.equal(grads_p[name], grads_k[name]), name
        torch.testing.assert_close(grads[name], grads_k[name], rtol=1e-6, atol=1e-7)


def test_keep_attn_holds_the_attention_outputs_of_checkpointed_blocks():
    from cs336_systems.attention import use_attention

    device = kernel_device()

    def held(policy):
        torch.manual_seed(0)
        cfg = ModelConfig.from_name("tiny", num_layers=4, context_length=64)
        model = apply_checkpointing(cfg.build(device=device), policy)
        tokens = torch.randint(0, 512, (2, 64), device=device)
        with use_attention("triton"):
            return retained_bytes(lambda: model(tokens).sum())[1], cfg

    plain, cfg = held("every-block")
    kept, _ = held("every-block+keep-attn")
    per_block = 2 * 64 * (cfg.d_model * 4 + cfg.num_heads * 4)  # O (fp32 model) and L, batch 2 x 64 tokens
    assert kept - plain == pytest.approx(4 * per_block, rel=0.05)





def test_keep_attn_composes_with_per_block_compile(attention_forward_calls):
    """Checkpointing first, then each block compiled (the torchtitan order): same gradients, and the
    attention still runs once per block."""
    from cs336_systems.attention import use_attention

    def run(compiled):
        counter = attention_forward_calls
        counter[0] = 0
        device = kernel_device()
        torch.manual_seed(0)
        model = apply_checkpointing(ModelConfig.from_name("tiny", num_layers=2, context_length=32).build(device=device),
                                    "every-block+keep-attn")
        if compiled:
            for block in model.layers:
                block.compile()
        tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
        with use_attention("triton"):
            cross_entropy(model(tokens), tokens).backward()
        return {n: p.grad for n, p in model.named_parameters()}, counter[0]

    eager, eager_calls = run(False)
    compiled, compiled_calls = run(True)
    assert eager_calls == compiled_calls == 2
    for name in eager:
        torch.testing.assert_close(compiled[name], eager[name], rtol=1e-5, atol=1e-6)


# ---- selective: keep the products and attention outputs, recompute only pointwise ops ----




class _ProductCounter(TorchDispatchMode):
    """Counts matmul ops (mm, bmm, addmm) at the dispatcher while active."""

    def __init__(self):
        super().__init__()
        aten = torch.ops.aten
        self.products, self.count = {aten.mm.default, aten.bmm.default, aten.addmm.default}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.products
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("policy", ["selective", "partial:1+keep-attn+selective"])
def test_selective_recomputes_no_product_and_no_attention(policy, attention_forward_calls):
    """Backward runs exactly the products of the plain step's backward (none recomputed; the full
    checkpoint of partial:1 recomputes its block's six but w2), attention is never run again, and the
    gradients are bitwise those of plain checkpointing."""
    from cs336_systems.attention import use_attention

    def step(policy):
        device = kernel_device()
        attention_forward_calls[0] = 0
        torch.manual_seed(0)
        model = apply_checkpointing(ModelConfig.from_name("tiny", num_layers=3, context_length=32).build(device=device),
                                    policy)
        tokens = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(1)).to(device)
        with use_attention("triton"):
            loss = cross_entropy(model(tokens), tokens)
            forwards = attention_forward_calls[0]
            with _ProductCounter() as products:
                loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        return grads, products.count, attention_forward_calls[0] - forwards

    plain_grads, plain_products, _ = step("none")
    checkpointed_grads, _, _ = step("every-block")
    grads, products, attention_again = step(policy)
    fully_checkpointed = CheckpointPolicy.parse(policy).size
    assert attention_again == 0
    assert products == plain_products + 6 * fully_checkpointed  # q, k, v, o, w1, w3 (early stop spares w2)
    for name in grads:
        assert torch.equal(grads[name], checkpointed_grads[name]), name
        torch.testing.assert_close(grads[name], plain_grads[name], rtol=1e-6, atol=1e-7)


def test_selective_holds_what_the_memory_model_counts():
    from cs336_systems.attention import use_attention
    from cs336_systems.memory.model import selective_block_bytes

    device = kernel_device()
    cfg = ModelConfig.from_name("tiny", num_layers=4, context_length=64)

    def held(policy):
        torch.manual_seed(0)
        model = apply_checkpointing(cfg.build(device=device), policy)
        tokens = torch.randint(0, 512, (2, 64), device=device)
        with use_attention("triton"):
            return retained_bytes(lambda: model(tokens).sum())[1]

    every, selective, none = held("every-block"), held("selective"), held("none")
    assert selective - every == pytest.approx(4 * selective_block_bytes(cfg, 2, 64, "flash", "fp32"), rel=0.05)
    assert every < selective < 0.8 * none
