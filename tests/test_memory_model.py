"""The analytic memory model against what autograd really saves (SavedTensorLog), exactly, in fp32."""

import pytest
import torch

from cs336_basics.model import RotaryEmbedding, TransformerBlock
from cs336_basics.nn_utils import cross_entropy
from cs336_systems.attention import use_attention
from cs336_systems.config import ModelConfig
from cs336_systems.memory.model import (
    activation_bytes,
    block_activation_bytes,
    block_backward_transient_bytes,
    predict,
)
from cs336_systems.memory.saved_tensors import SavedTensorLog

SHAPES = [(64, 4, 192, 128, 4), (32, 2, 80, 40, 3), (48, 6, 100, 17, 2)]  # d, heads, d_ff, seq, batch


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("attention", ["reference", "pytorch-flash"])
@pytest.mark.parametrize("d,h,f,s,b", SHAPES)
def test_block_activations_exact(d, h, f, s, b, attention, dtype):
    cfg = ModelConfig(vocab_size=10, context_length=s, d_model=d, num_layers=1, num_heads=h, d_ff=f)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    block = TransformerBlock(d, h, f, RotaryEmbedding(s, d // h)).to(torch_dtype)
    x = torch.randn(b, s, d, requires_grad=True, dtype=torch_dtype)
    with use_attention(attention), SavedTensorLog(block) as log:
        block(x)
    kind = "reference" if attention == "reference" else "flash"
    assert log.total_bytes == block_activation_bytes(cfg, b, s, kind, dtype)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("d,h,f,s,b", SHAPES[:2])
def test_fused_block_activations_exact(d, h, f, s, b, dtype):
    from cs336_systems.fused_model import apply_fused_kernels
    from tests._support import kernel_device

    device = kernel_device()
    cfg = ModelConfig(vocab_size=10, context_length=s, d_model=d, num_layers=1, num_heads=h, d_ff=f)
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    block = apply_fused_kernels(TransformerBlock(d, h, f, RotaryEmbedding(s, d // h)).to(device, torch_dtype))
    x = torch.randn(b, s, d, requires_grad=True, dtype=torch_dtype, device=device)
    with use_attention("pytorch-flash"), SavedTensorLog(block) as log:
        block(x)
    assert log.total_bytes == block_activation_bytes(cfg, b, s, "flash", dtype, fused=True)


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
    with pytest.raises(ValueError, match="autocast over fp32 parameters is not modelled"):
        predict(cfg, 4, 2048, dtype="bf16", autocast=True)
    partial = [activation_bytes(cfg, 4, 2048, f"partial:{m}") for m in (0, 16, 32)]
    assert partial[0] == none and partial[2] == every and every < partial[1] < none


def test_bf16_leaderboard_prediction_parts():
    cfg = ModelConfig.from_name("leaderboard-8b")
    p = predict(cfg, 1, 32768, policy="every-block", attention="flash", dtype="bf16", fused=True, loss="fused")
    n = sum(t.numel() for t in cfg.build(device="meta").parameters())
    assert p.parameters == p.gradients == 2 * n and p.optimizer_state == 4 * n
    fp32_state = predict(cfg, 1, 32768, policy="every-block", attention="flash", dtype="bf16", state_dtype="fp32")
    assert fp32_state.optimizer_state == 8 * n
    # Fused kernels keep fewer bytes per block than the eager ops.
    assert (block_activation_bytes(cfg, 1, 32768, "flash", "bf16", fused=True)
            < 0.7 * block_activation_bytes(cfg, 1, 32768, "flash", "bf16"))


def test_peak_walk_places_the_worst_point():
    cfg = ModelConfig.from_name("xl", context_length=512)
    none = predict(cfg, 4, 512)
    every = predict(cfg, 4, 512, policy="every-block")
    # Without checkpointing the worst point is the start of backward: every activation, the logits,
    # and only the LM head's gradient.
    lm_head_grad = (cfg.vocab_size + 1) * cfg.d_model * 4
    start_of_backward = none.parameters + none.optimizer_state + none.activations + none.logits + lm_head_grad
    # ... or just after it, in the last block's backward, with that block's gradients and transients.
    d = cfg.d_model
    last_block = (4 * d * d + 3 * d * cfg.d_ff + 2 * d) * 4 + block_backward_transient_bytes(cfg, 4, 512)
    assert start_of_backward <= none.peak <= start_of_backward + last_block
    # With every block checkpointed it is near the end: (almost) every gradient exists.
    assert every.peak > every.parameters + every.optimizer_state + 0.9 * every.gradients
    ffn = predict(cfg, 4, 512, policy="ffn")
    assert every.peak < ffn.peak < none.peak
    for p in (none, every, ffn, predict(cfg, 4, 512, policy="every-k:4"), predict(cfg, 4, 512, policy="nested")):
        assert p.peak <= p.sum_of_parts
    assert predict(cfg, 4, 512, policy="nested").peak == predict(cfg, 4, 512, policy="nested").sum_of_parts


def test_keep_attn_adds_the_attention_outputs_of_checkpointed_blocks():
    from cs336_systems.memory.model import attention_output_bytes

    cfg = ModelConfig.from_name("xl")
    per_block = attention_output_bytes(cfg, 4, 2048, "flash", "bf16")
    assert per_block == 4 * 2048 * (cfg.d_model * 2 + cfg.num_heads * 4)
    assert attention_output_bytes(cfg, 4, 2048, "reference", "bf16") == 0  # its ops are not kept
    for policy, checkpointed in (("every-block", cfg.num_layers), ("partial:10", 10), ("every-k:4", cfg.num_layers)):
        plain = predict(cfg, 4, 2048, policy=policy, attention="flash", dtype="bf16", fused=True)
        kept = predict(cfg, 4, 2048, policy=policy + "+keep-attn", attention="flash", dtype="bf16", fused=True)
        # Kept outputs add at most one per checkpointed block; the peak moves only where the walk's worst
        # point still holds them (not at the very end of backward, where only gradients remain).
        assert 0 <= kept.peak - plain.peak <= checkpointed * per_block
        assert 0 < kept.activations - plain.activations <= checkpointed * per_block
    lb = ModelConfig.from_name("leaderboard-8b")
    plain = predict(lb, 1, 32768, policy="partial:18", attention="flash", dtype="bf16", fused=True, loss="fused")
    kept = predict(lb, 1, 32768, policy="partial:18+keep-attn", attention="flash", dtype="bf16", fused=True,
                   loss="fused")
    assert kept.peak - plain.peak == 18 * attention_output_bytes(lb, 1, 32768, "flash", "bf16")
    same = predict(cfg, 4, 2048, policy="every-block+keep-attn", attention="reference", dtype="bf16")
    assert same == predict(cfg, 4, 2048, policy="every-block", attention="reference", dtype="bf16")


def test_selective_blocks_keep_their_products_and_attention_outputs():
    from cs336_systems.memory.model import attention_output_bytes, boundary_bytes, selective_block_bytes

    lb = ModelConfig.from_name("leaderboard-8b")
    kw = dict(attention="flash", dtype="bf16", fused=True, loss="fused")
    d, f, tokens = lb.d_model, lb.d_ff, 32768
    per_block = selective_block_bytes(lb, 1, tokens, "flash", "bf16")
    assert per_block == tokens * (4 * d + 2 * f) * 2 + attention_output_bytes(lb, 1, tokens, "flash", "bf16")
    # partial:M+selective holds, at the start of backward, what partial:M+keep-attn holds with its
    # whole blocks each replaced by boundary + products: the peak drops by that difference per block.
    whole = block_activation_bytes(lb, 1, tokens, "flash", "bf16", fused=True)
    rest = boundary_bytes(lb, 1, tokens, "bf16") + per_block
    plain = predict(lb, 1, tokens, policy="partial:20+keep-attn", **kw)
    selective = predict(lb, 1, tokens, policy="partial:20+keep-attn+selective", **kw)
    assert plain.peak - selective.peak == (lb.num_layers - 20) * (whole - rest)
    peaks = [predict(lb, 1, tokens, policy=p, **kw).peak
             for p in ("none", "selective", "partial:10+keep-attn+selective", "every-block+keep-attn")]
    assert peaks == sorted(peaks, reverse=True)
