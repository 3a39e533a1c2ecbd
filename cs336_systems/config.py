"""Model presets: the handout's Table-1 sizes, a CPU-sized `tiny`, and the leaderboard 8B model.

Look one up with `ModelConfig.from_name("xl")`; override fields with `dataclasses.replace`
or `ModelConfig.from_name("xl", context_length=2048)`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ModelConfig:
    """Constructor arguments of `cs336_basics.model.BasicsTransformerLM`."""

    vocab_size: int
    context_length: int
    d_model: int
    num_layers: int
    num_heads: int
    d_ff: int
    rope_theta: float = 10000.0

    def __post_init__(self):
        for field in ("vocab_size", "context_length", "d_model", "num_layers", "num_heads", "d_ff"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelConfig: {field} must be a positive int, got {value!r}")
        if self.d_model % self.num_heads:
            raise ValueError(f"ModelConfig: d_model={self.d_model} must be divisible by num_heads={self.num_heads}")
        if (self.d_model // self.num_heads) % 2:
            raise ValueError(f"ModelConfig: head dim {self.d_model // self.num_heads} must be even for RoPE")

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    @property
    def parameter_count(self) -> int:
        """Parameters of the built model: embedding, per block attention (4 d^2), SwiGLU (3 d d_ff) and two
        RMSNorm weights, the final norm, and the untied LM head."""
        d = self.d_model
        return 2 * self.vocab_size * d + self.num_layers * (4 * d * d + 3 * d * self.d_ff + 2 * d) + d

    def model_kwargs(self) -> dict:
        return dataclasses.asdict(self)

    def build(self, device=None, dtype=None):
        """Construct the BasicsTransformerLM with its parameters created on `device` (initialising
        billions of parameters on the CPU first takes minutes); seeded by torch.manual_seed."""
        import torch

        from cs336_basics.model import BasicsTransformerLM

        with torch.device(device or "cpu"):
            model = BasicsTransformerLM(**self.model_kwargs())
        return model.to(dtype=dtype) if dtype is not None else model

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; valid presets: {', '.join(PRESETS)}")
        return dataclasses.replace(PRESETS[name], **overrides)


_TABLE1_VOCAB, _TABLE1_CONTEXT = 10_000, 512

PRESETS: dict[str, ModelConfig] = {
    # Runs a training step in well under a second on a laptop CPU.
    "tiny": ModelConfig(vocab_size=512, context_length=128, d_model=64, num_layers=2, num_heads=4, d_ff=192),
    # The handout's Table 1.
    "small": ModelConfig(_TABLE1_VOCAB, _TABLE1_CONTEXT, d_model=768, num_layers=12, num_heads=12, d_ff=3072),
    "medium": ModelConfig(_TABLE1_VOCAB, _TABLE1_CONTEXT, d_model=1024, num_layers=24, num_heads=16, d_ff=4096),
    "large": ModelConfig(_TABLE1_VOCAB, _TABLE1_CONTEXT, d_model=1280, num_layers=36, num_heads=20, d_ff=5120),
    "xl": ModelConfig(_TABLE1_VOCAB, _TABLE1_CONTEXT, d_model=2560, num_layers=32, num_heads=32, d_ff=10240),
    "10B": ModelConfig(_TABLE1_VOCAB, _TABLE1_CONTEXT, d_model=4608, num_layers=50, num_heads=36, d_ff=12288),
    # The class leaderboard's model (Qwen-like vocabulary), 32k context.
    "leaderboard-8b": ModelConfig(vocab_size=151_936, context_length=32_768, d_model=4096, num_layers=34,
                                  num_heads=32, d_ff=11008),
}


def preset_names() -> list[str]:
    return list(PRESETS)
