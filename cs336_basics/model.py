"""The assignment-1 Transformer LM: pre-norm blocks with RMSNorm, RoPE, causal attention and SwiGLU.

Parameter names, shapes, initialisation and maths follow the staff package, so a staff
checkpoint (`model_config.json` + `model.pt`) loads here by name and computes the same
function. `scaled_dot_product_attention` is looked up at call time as a module global:
users (and `cs336_systems`) swap attention by assigning a new function to it.
"""

from __future__ import annotations

import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import einsum

from .nn_utils import softmax


class Linear(nn.Module):
    """y = x W^T without bias. weight: (d_out, d_in), truncated normal, std sqrt(2/(d_in+d_out)), cut at 3 std."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        std = math.sqrt(2 / (d_in + d_out))
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(d_out, d_in), std=std, a=-3 * std, b=3 * std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return einsum(x, self.weight, "... d_in, d_out d_in -> ... d_out")

    def extra_repr(self) -> str:
        return f"d_in={self.weight.shape[1]}, d_out={self.weight.shape[0]}"


class Embedding(nn.Module):
    """Token lookup. weight: (vocab_size, d_model), truncated normal std 1 cut at 3."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        self.weight = nn.Parameter(nn.init.trunc_normal_(torch.empty(vocab_size, d_model), std=1.0, a=-3.0, b=3.0))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        if token_ids.dtype.is_floating_point or token_ids.dtype == torch.bool:
            raise TypeError(f"Embedding: token_ids must be integers, got dtype {token_ids.dtype}")
        vocab_size = self.weight.shape[0]
        # Checked where it is free: on the CPU. A GPU check would wait for the device every step; there
        # F.embedding's bounds check stops the run with a device-side assert instead (indexing would wrap -1
        # to the last row, silently).
        if token_ids.device.type == "cpu" and token_ids.numel() and torch.compiler.is_compiling():
            # (under torch.compile a branch on the ids' values would break the graph: an assert op instead)
            torch._assert_async(((token_ids >= 0) & (token_ids < vocab_size)).all(),
                                f"Embedding: token ids must lie in [0, {vocab_size})")
        elif token_ids.device.type == "cpu" and token_ids.numel():
            low, high = int(token_ids.min()), int(token_ids.max())
            if low < 0 or high >= vocab_size:
                raise ValueError(f"Embedding: token ids must lie in [0, {vocab_size}), got ids from {low} to {high}")
        return F.embedding(token_ids, self.weight)

    def extra_repr(self) -> str:
        return f"vocab_size={self.weight.shape[0]}, d_model={self.weight.shape[1]}"


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and returned in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        in_dtype = x.dtype
        x = x.to(torch.float32)
        rms = torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * (x / rms)).to(in_dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on interleaved pairs (x[..., 0::2], x[..., 1::2]), angle pos * theta^(-2i/dim).

    The (2, context_length, dim/2) cos/sin cache is a non-persistent buffer, so it is not in
    the state dict (as in the staff package).
    """

    def __init__(self, context_length: int, dim: int, theta: float = 10000.0):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RotaryEmbedding: dim must be even, got {dim}")
        freqs = theta ** -(torch.arange(0, dim, 2, dtype=torch.float32) / dim)  # (dim/2,)
        angles = torch.outer(torch.arange(context_length, dtype=torch.float32), freqs)  # (ctx, dim/2)
        self.register_buffer("_freq_cis_cache", torch.stack((angles.cos(), angles.sin())), persistent=False)

    def forward(self, x: torch.Tensor, pos_ids: torch.Tensor) -> torch.Tensor:
        """x: (..., seq, dim); pos_ids: integer positions broadcastable to (..., seq)."""
        x1, x2 = x[..., 0::2], x[..., 1::2]  # (..., seq, dim/2) each
        cos, sin = self._freq_cis_cache[:, pos_ids]  # (..., seq, dim/2) each
        rotated = torch.stack((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1)  # (..., seq, dim/2, 2)
        return rotated.flatten(-2).to(x.dtype)


def scaled_dot_product_attention(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor,
                                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """softmax(Q K^T / sqrt(d)) V over any leading dims.

    Q: (..., queries, d_k), K: (..., keys, d_k), V: (..., keys, d_v);
    mask: bool broadcastable to (..., queries, keys), False = excluded.
    """
    d_k = K.shape[-1]
    scores = einsum(Q, K, "... query d_k, ... key d_k -> ... query key") / math.sqrt(d_k)
    if mask is not None:
        scores = torch.where(mask, scores, float("-inf"))
    weights = softmax(scores, dim=-1)
    return einsum(weights, V, "... query key, ... key d_v -> ... query d_v")


class CausalMultiHeadSelfAttention(nn.Module):
    """Multi-head causal self-attention with optional RoPE on queries and keys."""

    def __init__(self, d_model: int, num_heads: int, positional_encoder: RotaryEmbedding | None = None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"CausalMultiHeadSelfAttention: d_model={d_model} not divisible by num_heads={num_heads}")
        self.d_model, self.num_heads = d_model, num_heads
        self.d_k = self.d_v = d_model // num_heads
        self.q_proj = Linear(d_model, num_heads * self.d_k)
        self.k_proj = Linear(d_model, num_heads * self.d_k)
        self.v_proj = Linear(d_model, num_heads * self.d_v)
        self.output_proj = Linear(num_heads * self.d_v, d_model)
        self.positional_encoder = positional_encoder

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections (Q, K, V), each (..., seq, heads * d) (a fused model may make them one product)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rotate_qk(self, Q: torch.Tensor, K: torch.Tensor, positions: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE on queries and keys by the same positions (a fused model may rotate both in one kernel)."""
        return self.positional_encoder(Q, positions), self.positional_encoder(K, positions)

    def forward(self, x: torch.Tensor, token_positions: torch.Tensor | None = None) -> torch.Tensor:
        """x: (..., seq, d_model) -> (..., seq, d_model)."""
        seq = x.shape[-2]
        # Head split and merge as views (unflatten / transpose), not einops.rearrange: under torch.compile dynamo
        # traces rearrange's parser and guards on about a hundred of einops' internals, checked on every call of a
        # compiled block (TORCH_LOGS=guards lists them: 664 guard nodes a block of ours on CPU, 585 without einops).
        Q, K, V = (t.unflatten(-1, (self.num_heads, -1)).transpose(-3, -2)  # (..., heads, seq, d)
                   for t in self.project_qkv(x))
        if self.positional_encoder is not None:
            if token_positions is None:
                token_positions = torch.arange(seq, device=x.device)
            positions = token_positions.unsqueeze(-2)  # (..., 1, seq): the same positions for every head
            Q, K = self.rotate_qk(Q, K, positions)
        # Looked up as a module global at call time so a patched version takes effect.
        attend = scaled_dot_product_attention
        if getattr(attend, "causal_without_mask", False):
            # A kernel that applies the causal mask itself: no (seq, seq) mask tensor is built.
            out = attend(Q, K, V, is_causal=True)
        else:
            idx = torch.arange(seq, device=x.device)
            causal_mask = idx[:, None] >= idx[None, :]  # (seq, seq), True = query may see key
            out = attend(Q, K, V, mask=causal_mask)
        out = out.transpose(-3, -2).flatten(-2).contiguous()  # (..., seq, heads * d_v)
        return self.output_proj(out)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x), d_ff used as given."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff)
        self.w2 = Linear(d_ff, d_model)
        self.w3 = Linear(d_model, d_ff)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(ln1(x)), then + ffn(ln2(.))."""

    def __init__(self, d_model: int, num_heads: int, d_ff: int, positional_encoder: RotaryEmbedding | None):
        super().__init__()
        self.attn = CausalMultiHeadSelfAttention(d_model, num_heads, positional_encoder)
        self.ffn = SwiGLU(d_model, d_ff)
        self.ln1 = RMSNorm(d_model)
        self.ln2 = RMSNorm(d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class BasicsTransformerLM(nn.Module):
    """Token embedding, `num_layers` TransformerBlocks sharing one RoPE, final RMSNorm, untied LM head."""

    def __init__(self, vocab_size: int, context_length: int, d_model: int, num_layers: int, num_heads: int,
                 d_ff: int, rope_theta: float | None = 10000.0):
        super().__init__()
        if num_heads < 1 or d_model % num_heads:  # (before RoPE, whose own message would name d_model // num_heads)
            raise ValueError(f"BasicsTransformerLM: d_model={d_model} must be divisible by num_heads={num_heads}")
        for name, value in (("vocab_size", vocab_size), ("context_length", context_length), ("d_model", d_model),
                            ("num_layers", num_layers), ("num_heads", num_heads), ("d_ff", d_ff)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"BasicsTransformerLM: {name} must be a positive int, got {value!r}")
        self.config = dict(vocab_size=vocab_size, context_length=context_length, d_model=d_model,
                           num_layers=num_layers, num_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta)
        self.context_length = context_length
        self.d_model = d_model
        self.token_embeddings = Embedding(vocab_size, d_model)
        self.positional_encoder = (None if rope_theta is None
                                   else RotaryEmbedding(context_length, d_model // num_heads, rope_theta))
        self.layers = nn.ModuleList(
            TransformerBlock(d_model, num_heads, d_ff, self.positional_encoder) for _ in range(num_layers)
        )
        self.ln_final = RMSNorm(d_model)
        self.lm_head = Linear(d_model, vocab_size)

    def get_num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; with `non_embedding`, the LM head's weight is left out (as in the staff package)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.lm_head.weight.numel() if non_embedding else n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (batch, seq) int64 token ids -> logits (batch, seq, vocab)."""
        if x.dtype.is_floating_point or x.dtype == torch.bool:
            raise TypeError(f"BasicsTransformerLM: token ids must be integers, got dtype {x.dtype}")
        if x.shape[-1] == 0:
            raise ValueError("BasicsTransformerLM: sequence length must be at least 1, got 0")
        if x.shape[-1] > self.context_length:
            raise ValueError(
                f"BasicsTransformerLM: sequence length {x.shape[-1]} exceeds context_length {self.context_length}"
            )
        h = self.token_embeddings(x)
        for layer in self.layers:
            h = layer(h)
        return self.lm_head(self.ln_final(h))

    @torch.no_grad()
    def generate(self, x: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 eos_token_id: int | None = None) -> torch.Tensor:
        """Sample up to `max_new_tokens` tokens after prompt x ((seq,) or (1, seq)); returns only the new ids."""
        if x.dim() == 1:
            x = x.unsqueeze(0)
        prompt_len = x.shape[-1]
        for _ in range(max_new_tokens):
            window = x[:, -self.context_length:]
            logits = self.forward(window)[:, -1] / temperature  # (batch, vocab)
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = torch.multinomial(softmax(logits, dim=-1), 1)
            if eos_token_id is not None and next_id.item() == eos_token_id:
                break
            x = torch.cat((x, next_id), dim=-1)
        return x[:, prompt_len:]

    @classmethod
    def from_pretrained(cls, pretrained_model_path: str | os.PathLike) -> BasicsTransformerLM:
        """Load the staff layout: `model_config.json` (constructor kwargs) and `model.pt` (state dict)."""
        with open(os.path.join(pretrained_model_path, "model_config.json")) as f:
            config = json.load(f)
        model = cls(**config)
        state_dict = torch.load(os.path.join(pretrained_model_path, "model.pt"), map_location="cpu")
        prefix = "_orig_mod."  # left by saving a torch.compile'd model
        state_dict = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state_dict.items()}
        model.load_state_dict(state_dict)
        return model
