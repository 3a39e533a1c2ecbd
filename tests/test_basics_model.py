"""cs336_basics.model against torch.nn.functional and textbook formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from cs336_basics import model as M
from tests.reference_lm import rope_complex


def test_linear_matches_f_linear_and_init_is_truncated():
    torch.manual_seed(0)
    lin = M.Linear(300, 200)
    assert lin.weight.shape == (200, 300)
    std = math.sqrt(2 / 500)
    assert lin.weight.abs().max() <= 3 * std + 1e-7
    assert abs(lin.weight.std().item() - 0.9866 * std) < 0.03 * std  # cut at 3 std keeps 0.9866 std
    x = torch.randn(2, 5, 300)
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight))


def test_linear_reads_weight_at_call_time():
    lin = M.Linear(4, 3)
    x = torch.randn(2, 4)
    with torch.no_grad():
        lin.weight.zero_()
    assert torch.count_nonzero(lin(x)) == 0


def test_embedding_lookup_and_bad_ids():
    torch.manual_seed(0)
    emb = M.Embedding(50, 8)
    assert emb.weight.abs().max() <= 3.0
    ids = torch.randint(0, 50, (3, 7))
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))
    with pytest.raises(TypeError, match="token_ids"):
        emb(ids.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_matches_f_rms_norm_and_keeps_dtype(dtype):
    torch.manual_seed(0)
    norm = M.RMSNorm(32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(32))
    x = torch.randn(4, 9, 32, dtype=dtype)
    out = norm(x)
    assert out.dtype == dtype
    ref = F.rms_norm(x.float(), (32,), norm.weight, 1e-5).to(dtype)
    torch.testing.assert_close(out, ref)


def test_rope_matches_complex_rotation_and_positions():
    torch.manual_seed(0)
    rope = M.RotaryEmbedding(context_length=64, dim=16, theta=10000.0)
    assert "_freq_cis_cache" not in rope.state_dict()
    x = torch.randn(2, 3, 20, 16)
    out = rope(x, torch.arange(20))
    torch.testing.assert_close(out, rope_complex(x, 10000.0), rtol=1e-5, atol=1e-5)
    # Explicit positions: position p rotates like row p of the default.
    pos = torch.tensor([5, 0, 19])
    torch.testing.assert_close(rope(x[:, :, pos], pos), out[:, :, pos])
    shifted = rope(x[:, :, :1], torch.tensor([7]))
    expected = rope_complex(torch.cat([torch.zeros(2, 3, 7, 16), x[:, :, :1]], dim=2), 10000.0)[:, :, 7:]
    torch.testing.assert_close(shifted, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        M.RotaryEmbedding(8, 15)


def test_sdpa_matches_torch_with_and_without_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 10, 8), torch.randn(2, 3, 12, 8), torch.randn(2, 3, 12, 5)
    torch.testing.assert_close(M.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    mask = torch.rand(10, 12) > 0.3
    mask[:, 0] = True  # every query sees at least one key
    torch.testing.assert_close(M.scaled_dot_product_attention(q, k, v, mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_sdpa_is_patchable_through_module_global(monkeypatch):
    calls = []
    original = M.scaled_dot_product_attention

    def spy(Q, K, V, mask=None):
        calls.append(tuple(Q.shape))
        return original(Q, K, V, mask)

    monkeypatch.setattr(M, "scaled_dot_product_attention", spy)
    attn = M.CausalMultiHeadSelfAttention(16, 4, M.RotaryEmbedding(8, 4))
    attn(torch.randn(2, 8, 16))
    assert calls == [(2, 4, 8, 4)]


def test_causal_attention_matches_reference_and_is_causal():
    torch.manual_seed(0)
    attn = M.CausalMultiHeadSelfAttention(32, 4, M.RotaryEmbedding(16, 8))
    x = torch.randn(2, 16, 32)
    out = attn(x)
    b, s, d, h = 2, 16, 32, 4
    q, k, v = (F.linear(x, p.weight).view(b, s, h, d // h).transpose(1, 2)
               for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = rope_complex(q, 1e4), rope_complex(k, 1e4)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
    torch.testing.assert_close(out, F.linear(ref, attn.output_proj.weight), rtol=1e-5, atol=1e-5)
    # Changing a later token never changes an earlier output.
    x2 = x.clone()
    x2[:, 10:] = torch.randn(2, 6, 32)
    torch.testing.assert_close(attn(x2)[:, :10], out[:, :10])
    with pytest.raises(ValueError, match="divisible"):
        M.CausalMultiHeadSelfAttention(30, 4)


def test_swiglu_and_block():
    torch.manual_seed(0)
    ffn = M.SwiGLU(16, 40)
    x = torch.randn(3, 16)
    ref = F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)
    torch.testing.assert_close(ffn(x), ref)
    block = M.TransformerBlock(16, 2, 40, M.RotaryEmbedding(8, 8))
    assert {n.split(".")[0] for n, _ in block.named_parameters()} == {"attn", "ffn", "ln1", "ln2"}
    x = torch.randn(2, 8, 16)
    mid = x + block.attn(block.ln1(x))
    torch.testing.assert_close(block(x), mid + block.ffn(block.ln2(mid)))


def _tiny_lm(**kw):
    cfg = dict(vocab_size=100, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=48)
    cfg.update(kw)
    return M.BasicsTransformerLM(**cfg)


def test_lm_names_params_and_shared_rope():
    torch.manual_seed(0)
    lm = _tiny_lm()
    names = set(lm.state_dict())
    assert {"token_embeddings.weight", "ln_final.weight", "lm_head.weight",
            "layers.1.attn.output_proj.weight", "layers.0.ffn.w3.weight"} <= names
    assert not any("freq" in n for n in names)
    assert lm.layers[0].attn.positional_encoder is lm.layers[1].attn.positional_encoder is lm.positional_encoder
    total = sum(p.numel() for p in lm.parameters())
    assert lm.get_num_params(non_embedding=False) == total
    assert lm.get_num_params() == total - 100 * 32
    per_block = 4 * 32 * 32 + 3 * 32 * 48 + 2 * 32
    assert total == 2 * 100 * 32 + 2 * per_block + 32
    logits = lm(torch.randint(0, 100, (3, 16)))
    assert logits.shape == (3, 16, 100)


def test_lm_without_rope():
    lm = _tiny_lm(rope_theta=None)
    assert lm.positional_encoder is None
    assert lm(torch.randint(0, 100, (1, 5))).shape == (1, 5, 100)


def test_lm_bad_input():
    lm = _tiny_lm()
    with pytest.raises(TypeError, match="integers"):
        lm(torch.rand(1, 4))
    with pytest.raises(ValueError, match="context_length"):
        lm(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="num_layers"):
        _tiny_lm(num_layers=0)


def test_generate_respects_eos_top_k_and_length():
    torch.manual_seed(0)
    lm = _tiny_lm()
    prompt = torch.randint(0, 100, (5,))
    out = lm.generate(prompt, max_new_tokens=20)
    assert out.shape == (1, 20)  # runs past context_length by windowing
    # top_k=1 is greedy: equals argmax of the logits.
    greedy = lm.generate(prompt, max_new_tokens=1, top_k=1)
    assert greedy.item() == lm(prompt[None])[0, -1].argmax().item()
    stop = greedy.item()
    assert lm.generate(prompt, max_new_tokens=5, top_k=1, eos_token_id=stop).numel() == 0
