"""One FLOP model for BasicsTransformerLM, and MFU.

Counts matrix-multiply FLOPs (2 per multiply-add). Per token and layer the dense part is
QKV and output projections (8 d^2) and the SwiGLU FFN (6 d d_ff); attention adds
QK^T and PV, 4 s d per token for full attention, half that when only the causal triangle
is counted (`causal=True`, the convention of the baselines). The LM head is 2 d V per
token. Backward is twice forward; a training step is three times, plus one extra forward
of whatever activation checkpointing recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cs336_systems.config import ModelConfig


@dataclass(frozen=True)
class StepFlops:
    dense_forward: float  # projections, FFN and LM head
    attention_forward: float  # QK^T and PV

    @property
    def forward(self) -> float:
        return self.dense_forward + self.attention_forward

    @property
    def backward(self) -> float:
        return 2 * self.forward

    @property
    def train_step(self) -> float:
        return 3 * self.forward


def attention_flops(batch: int, heads: int, n_queries: int, n_keys: int, d_head: int, *, causal: bool) -> float:
    """Forward FLOPs of QK^T and PV for one attention call."""
    full = 4.0 * batch * heads * n_queries * n_keys * d_head
    return full / 2 if causal else full


def lm_flops(cfg: ModelConfig, batch: int, seq: int, *, causal: bool = True) -> StepFlops:
    tokens = batch * seq
    per_layer_dense = 8 * cfg.d_model**2 + 6 * cfg.d_model * cfg.d_ff  # already 2 FLOPs per multiply-add
    dense = tokens * cfg.num_layers * per_layer_dense
    head = 2.0 * tokens * cfg.d_model * cfg.vocab_size
    attn = cfg.num_layers * attention_flops(batch, cfg.num_heads, seq, seq, cfg.d_head, causal=causal)
    return StepFlops(dense_forward=dense + head, attention_forward=attn)


def flops_for_mode(cfg: ModelConfig, batch: int, seq: int, mode: str, *, causal: bool = True,
                   recompute_fraction: float = 0.0) -> float:
    """FLOPs of one `forward`, `forward-backward` or `train-step` call.

    `recompute_fraction`: share of the blocks' forward that checkpointing runs again in backward.
    """
    f = lm_flops(cfg, batch, seq, causal=causal)
    if mode == "forward":
        return f.forward
    blocks_forward = f.forward - 2.0 * batch * seq * cfg.d_model * cfg.vocab_size
    extra = recompute_fraction * blocks_forward
    if mode in ("forward-backward", "train-step"):
        return f.train_step + extra
    raise ValueError(f"flops_for_mode: mode must be forward, forward-backward or train-step, got {mode!r}")


def measure_matmul_peak(device: torch.device | str, size: int | None = None) -> float:
    """Achievable dense matmul FLOP/s: bf16 8192^3 on CUDA (do_bench median), fp32 1024^3 on CPU."""
    from cs336_systems.profiling.timing import bench_kernel

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    timing = bench_kernel(lambda: a @ b, device=device)
    return 2.0 * size**3 / timing.median


def mfu(flops: float, seconds: float, peak_flops: float) -> float:
    """Model-FLOPs utilisation, a fraction."""
    return flops / seconds / peak_flops
