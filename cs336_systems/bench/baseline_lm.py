"""The PyTorch-native baseline: what a user would write instead of our stack.

Same shapes as BasicsTransformerLM (pre-norm RMSNorm, RoPE on interleaved pairs, SwiGLU,
untied head) but with torch's fused building blocks: one QKV matmul, `F.rms_norm`,
`F.scaled_dot_product_attention(is_causal=True)`; trained with torch's fused AdamW. It
lives in bench/ because it is only ever a baseline.

For the leaderboard baseline (as `../shared/baselines/ref_lm.py leader`): `checkpoint_blocks=True`
checkpoints every block, and `chunked_cross_entropy` computes the loss over the LM head in
sequence chunks, each recomputed in backward, so the (tokens, vocab) logits never exist whole.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cs336_systems.config import ModelConfig


class _RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, 1e-5)


def _rope(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        d, self.heads = cfg.d_model, cfg.num_heads
        self.ln1, self.ln2 = _RMSNorm(d), _RMSNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.w1 = nn.Linear(d, cfg.d_ff, bias=False)
        self.w3 = nn.Linear(d, cfg.d_ff, bias=False)
        self.w2 = nn.Linear(cfg.d_ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (b, heads, s, d_head)
        a = F.scaled_dot_product_attention(_rope(q, cos, sin), _rope(k, cos, sin), v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, d))
        h = self.ln2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class BaselineLM(nn.Module):
    def __init__(self, cfg: ModelConfig, checkpoint_blocks: bool = False):
        super().__init__()
        self.checkpoint_blocks = checkpoint_blocks
        self.emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.num_layers))
        self.ln = _RMSNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        inv = cfg.rope_theta ** -(torch.arange(0, cfg.d_head, 2, dtype=torch.float32) / cfg.d_head)
        angles = torch.outer(torch.arange(cfg.context_length, dtype=torch.float32), inv)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def hidden(self, idx):
        """idx (batch, seq) -> final-norm output (batch, seq, d_model), the LM head's input."""
        s = idx.shape[1]
        cos, sin = self.cos[:s], self.sin[:s]
        x = self.emb(idx)
        for block in self.blocks:
            x = checkpoint(block, x, cos, sin, use_reentrant=False) if self.checkpoint_blocks else block(x, cos, sin)
        return self.ln(x)

    def forward(self, idx):
        return self.head(self.hidden(idx))


def chunked_cross_entropy(model: BaselineLM, hidden: torch.Tensor, targets: torch.Tensor,
                          chunk: int = 4096) -> torch.Tensor:
    """Mean cross-entropy of model.head(hidden) in sequence chunks of `chunk`, each chunk's logits
    recomputed in backward. hidden (batch, seq, d), targets (batch, seq)."""
    def piece(h, t):
        logits = model.head(h)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32 softmax; fp64 stays fp64
        return F.cross_entropy(logits.flatten(0, 1), t.flatten(), reduction="sum")

    total = 0.0
    for start in range(0, hidden.shape[1], chunk):
        total = total + checkpoint(piece, hidden[:, start:start + chunk], targets[:, start:start + chunk],
                                   use_reentrant=False)
    return total / targets.numel()


def baseline_optimizer(model: nn.Module, device: torch.device) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
