"""The analytic memory model against what autograd really saves (SavedTensorLog), exactly, in fp32."""

import pytest
import torch

from cs336_basics.model import RotaryEmbedding, TransformerBlock
from cs336_basics.nn_utils import cross_entropy
from cs336_systems.attention import use_attention
from cs336_systems.config import ModelConfig
from cs336_systems.memory.model import activation_bytes, block_activation_bytes, predict
from cs336_systems.memory.saved_tensors import SavedTensorLog

SHAPES = [(64, 4, 192, 128, 4), (32, 2, 80, 40, 3), (48, 6, 100, 17, 2)]  # d, heads, d_ff, seq, batch


@pytest.mark.parametrize("attention", ["reference", "pytorch-flash"])
@pytest.mark.parametrize("d,h,f,s,b", SHAPES)
def test_block_activations_exact(d, h, f, s, b, attention):
    cfg = ModelConfig(vocab_size=10, context_length=s, d_model=d, num_layers=1, num_heads=h, d_ff=f)
    block = TransformerBlock(d, h, f, RotaryEmbedding(s, d // h))
    x = torch.randn(b, s, d, requires_grad=True)
    with use_attention(attention), SavedTensorLog(block) as log:
        block(x)
    kind = "reference" if attention == "reference" else "flash"
    assert log.total_bytes == block_activation_bytes(cfg, b, s, kind)


def test_whole_model_activations_exact():
    cfg = ModelConfig.from_name("tiny", num_layers=3, context_length=32)
    model = cfg.build()
    tokens = torch.randint(0, cfg.vocab_size, (2, 32))
    targets = torch.randint(0, cfg.vocab_size, (2, 32))
    with SavedTensorLog(model) as log:
        cross_entropy(model(tokens), targets)
    assert log.total_bytes == activation_bytes(cfg, 2, 32)


def test_prediction_parts_and_policies():
    cfg = ModelConfig.from_name("xl", context_length=2048)
    p = predict(cfg, 4, 2048)
    params = sum(t.numel() for t in cfg.build(device="meta").parameters()) * 4
    assert p.parameters == params and p.optimizer_state == 2 * params
    none = activation_bytes(cfg, 4, 2048, "none")
    every = activation_bytes(cfg, 4, 2048, "every-block")
    nested = activation_bytes(cfg, 4, 2048, "nested")
    assert nested < every < none
    assert activation_bytes(cfg, 4, 2048, "none", "flash") < none / 3  # the s^2 terms dominate at 2048
    with pytest.raises(ValueError, match="only fp32"):
        predict(cfg, 4, 2048, dtype="bf16")
