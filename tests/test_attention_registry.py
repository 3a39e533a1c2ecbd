"""Choosing attention by name, and the drop-in for the model."""

import warnings

import pytest
import torch

import cs336_basics.model as basics_model
from cs336_systems.attention import (
    attention_names,
    flash_scaled_dot_product_attention,
    get_attention,
    is_causal_mask,
    use_attention,
)
from cs336_systems.config import ModelConfig
from tests._support import kernel_device


def test_unknown_name_lists_valid_ones():
    with pytest.raises(ValueError, match="unknown attention implementation 'sdpa'; valid: reference, compile"):
        get_attention("sdpa")
    assert {"reference", "pytorch-flash", "triton", "triton-two-pass-bwd", "triton-fused-bwd", "triton-compile-bwd",
            "compile"} == set(
        attention_names())


def test_use_attention_swaps_and_restores():
    original = basics_model.scaled_dot_product_attention
    with use_attention("pytorch-flash") as fn:
        assert basics_model.scaled_dot_product_attention is fn
    assert basics_model.scaled_dot_product_attention is original


def test_is_causal_mask():
    tri = torch.ones(5, 7, dtype=torch.bool).tril()
    assert is_causal_mask(tri, 5, 7) and is_causal_mask(tri[None, None], 5, 7)
    assert not is_causal_mask(tri.T, 7, 5) and not is_causal_mask(~tri, 5, 7)
    assert not is_causal_mask(tri.float(), 5, 7) and not is_causal_mask(tri.expand(2, 5, 7), 5, 7)


def _model_outputs(name, device):
    torch.manual_seed(0)
    model = ModelConfig.from_name("tiny", context_length=40).build(device=device)
    tokens = torch.randint(0, 512, (2, 40), device=device)
    with use_attention(name):
        logits = model(tokens)
        logits.float().pow(2).mean().backward()
    return logits, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name", ["pytorch-flash", "triton"])
def test_model_with_flash_attention_matches_reference(name):
    device = "cpu" if name == "pytorch-flash" else kernel_device()
    ref_logits, ref_grads = _model_outputs("reference", device)
    logits, grads = _model_outputs(name, device)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5)


def test_drop_in_recognises_causal_mask_and_falls_back_otherwise():
    device = kernel_device()
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 16, device=device) for _ in range(3))
    causal = torch.ones(24, 24, dtype=torch.bool, device=device).tril()
    ref = basics_model.scaled_dot_product_attention(q, k, v, causal)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # the causal mask must not fall back
        torch.testing.assert_close(flash_scaled_dot_product_attention(q, k, v, causal), ref, rtol=1e-4, atol=1e-4)
    other = torch.rand(24, 24, device=device) > 0.5
    other[:, 0] = True
    with pytest.warns(UserWarning, match="falling back to the reference"):
        out = flash_scaled_dot_product_attention(q, k, v, other)
    torch.testing.assert_close(out, basics_model.scaled_dot_product_attention(q, k, v, other))
