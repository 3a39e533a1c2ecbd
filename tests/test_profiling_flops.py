"""The FLOP model against hand-computed counts."""

import pytest

from cs336_systems.config import ModelConfig
from cs336_systems.profiling.flops import attention_flops, flops_for_mode, lm_flops, mfu


def test_tiny_forward_by_hand():
    # tiny: vocab 512, d 64, 2 layers, 4 heads, d_ff 192; batch 1, seq 8.
    cfg = ModelConfig.from_name("tiny")
    per_token_layer = 2 * (4 * 64 * 64) + 2 * (3 * 64 * 192)  # q,k,v,o projections + w1,w2,w3
    dense = 8 * 2 * per_token_layer + 8 * 2 * 64 * 512  # two layers + LM head
    attn_causal = 2 * (2 * 8 * 8 * 64)  # per layer: (QK^T + PV) over half the 8x8 scores
    f = lm_flops(cfg, batch=1, seq=8)
    assert f.dense_forward == dense
    assert f.attention_forward == attn_causal
    assert flops_for_mode(cfg, 1, 8, "forward") == dense + attn_causal
    assert flops_for_mode(cfg, 1, 8, "train-step") == 3 * (dense + attn_causal)
    assert lm_flops(cfg, 1, 8, causal=False).attention_forward == 2 * attn_causal


def test_xl_step_is_about_six_n_d():
    cfg = ModelConfig.from_name("xl")
    n_params = cfg.num_layers * (4 * cfg.d_model**2 + 3 * cfg.d_model * cfg.d_ff) + cfg.vocab_size * cfg.d_model
    step = flops_for_mode(cfg, 4, 512, "train-step")
    dense_only = 6 * n_params * 4 * 512
    assert dense_only < step < 1.1 * dense_only  # attention is small at context 512


def test_recompute_adds_block_forward():
    cfg = ModelConfig.from_name("small")
    base = flops_for_mode(cfg, 2, 128, "train-step")
    head = 2 * 2 * 128 * cfg.d_model * cfg.vocab_size
    full = flops_for_mode(cfg, 2, 128, "train-step", recompute_fraction=1.0)
    assert full - base == pytest.approx(lm_flops(cfg, 2, 128).forward - head)


def test_attention_flops_and_mfu():
    assert attention_flops(2, 3, 5, 7, 16, causal=False) == 4 * 2 * 3 * 5 * 7 * 16
    assert mfu(1e12, 2.0, 1e12) == 0.5
    with pytest.raises(ValueError, match="mode"):
        flops_for_mode(ModelConfig.from_name("tiny"), 1, 8, "backward-only")
