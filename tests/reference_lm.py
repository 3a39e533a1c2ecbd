"""An independent, functional re-statement of the staff Transformer LM, for parity tests.

It reads a plain state dict and uses torch.nn.functional ops and complex-number RoPE,
so it shares no code with `cs336_basics.model`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rope_complex(x: torch.Tensor, theta: float) -> torch.Tensor:
    """RoPE on interleaved pairs via complex multiplication. x: (batch, heads, seq, d)."""
    seq, d = x.shape[-2], x.shape[-1]
    freqs = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), freqs)
    rot = torch.polar(torch.ones_like(angles), angles).to(torch.complex64 if x.dtype == torch.float32
                                                          else torch.complex128)
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(xc * rot).reshape(x.shape).to(x.dtype)


def rmsnorm(x, w, eps=1e-5):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def lm_forward(sd: dict[str, torch.Tensor], config: dict, tokens: torch.Tensor) -> torch.Tensor:
    """tokens: (batch, seq) -> logits (batch, seq, vocab)."""
    H, theta = config["num_heads"], config["rope_theta"]
    x = F.embedding(tokens, sd["token_embeddings.weight"])
    b, s, d = x.shape
    for i in range(config["num_layers"]):
        p = f"layers.{i}."
        h = rmsnorm(x, sd[p + "ln1.weight"])
        q, k, v = (F.linear(h, sd[p + f"attn.{n}_proj.weight"]).view(b, s, H, d // H).transpose(1, 2)
                   for n in ("q", "k", "v"))
        q, k = rope_complex(q, theta), rope_complex(k, theta)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // H)
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)
        x = x + F.linear(a, sd[p + "attn.output_proj.weight"])
        h = rmsnorm(x, sd[p + "ln2.weight"])
        ffn = F.linear(F.silu(F.linear(h, sd[p + "ffn.w1.weight"])) * F.linear(h, sd[p + "ffn.w3.weight"]),
                       sd[p + "ffn.w2.weight"])
        x = x + ffn
    return F.linear(rmsnorm(x, sd["ln_final.weight"]), sd["lm_head.weight"])
