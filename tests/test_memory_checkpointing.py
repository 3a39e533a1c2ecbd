"""Checkpointing policies: identical gradients to no checkpointing; nested memory sub-linear in depth."""

import pytest
import torch

from cs336_basics.nn_utils import cross_entropy
from cs336_systems.config import ModelConfig
from cs336_systems.memory.checkpointing import apply_checkpointing, group_size, parse_policy
from cs336_systems.memory.live_bytes import retained_bytes

POLICIES = ["none", "every-block", "every-k:2", "every-k:3", "partial:2", "partial:9", "sqrt", "nested", "ffn", "attn"]


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


def test_policy_parsing():
    assert parse_policy("every-k:4") == ("every-k", 4)
    assert parse_policy("partial:0") == ("partial", 0)
    with pytest.raises(ValueError, match="block count"):
        parse_policy("partial:x")
    assert group_size("sqrt", 32) == 6 and group_size("every-k:64", 32) == 32 and group_size("nested", 8) is None
    with pytest.raises(ValueError, match="unknown checkpoint policy 'all'; valid: none, every-block"):
        parse_policy("all")
    with pytest.raises(ValueError, match="positive group size"):
        parse_policy("every-k:0")
