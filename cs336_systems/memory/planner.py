"""Which checkpointing policy a step should use: the recompute each policy costs, and the ladder of policies
from least to most recompute, cut where the memory model (`model.py`) says they fit.

`recompute_flops` counts the forward FLOPs a policy adds; `recompute_cost` adds the memory traffic of selective
checkpointing's pointwise recompute, priced in FLOPs; `policy_candidates` is the ladder the leaderboard step
walks (`cs336-bench leaderboard --checkpoint auto`).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from cs336_systems.config import ModelConfig
from cs336_systems.memory.model import block_activation_bytes, predict, selective_block_bytes
from cs336_systems.memory.policy import CheckpointPolicy

# Of the free memory at start: the allocator's fragmentation and the CUDA context need the rest. 0.95 ran the 8B
# step at a 133.0 GiB peak on the H200 (predicted 131.2); an out-of-memory falls back to the next policy.
FIT_FRACTION = 0.95


def recompute_flops(cfg: ModelConfig, batch: int, seq: int, policy: CheckpointPolicy | str) -> float:
    """Forward FLOPs a policy adds to the step (matmuls and causal attention of what it recomputes)."""
    policy = CheckpointPolicy.of(policy)
    tokens, d, f, n = batch * seq, cfg.d_model, cfg.d_ff, cfg.num_layers
    ffn = 2 * tokens * 3 * d * f
    attention = 2 * batch * seq * seq * d  # causal
    block = 2 * tokens * 4 * d * d + ffn + attention  # projections, SwiGLU, attention
    if policy.keep_attention:  # the recompute reuses the kept attention outputs
        block -= attention
    name = policy.scheme
    if name == "none":
        return 0.0
    if name == "ffn":
        return n * ffn
    if name == "partial":
        return policy.checkpointed_blocks(n) * block
    if name == "nested":
        return math.ceil(math.log2(max(n, 2))) * n * block / 2
    return n * block  # every-block, every-k:K, sqrt: one extra forward


# Pointwise recompute priced against products: on the H200 bf16 matmuls run at about 730-790 TFLOP/s and device
# copies at about 4 TB/s (../shared/BASELINES.md), so one byte moved costs about 200 FLOPs. Session 4's step
# suggested several times this; session 5's profile found the excess in a slow RoPE and layout copies (fixed):
# the forward's pointwise kernels now take about 1.5 ms per block, in line with this price (notes/leaderboard.md).
POINTWISE_FLOPS_PER_BYTE = 200.0


def recompute_cost(cfg: ModelConfig, batch: int, seq: int, policy: CheckpointPolicy | str, *,
                   attention: str = "flash", dtype: str = "bf16", fused: bool = True) -> float:
    """The ladder's sort key, in FLOP-equivalents: `recompute_flops`, plus for each block under selective
    checkpointing the traffic of its pointwise recompute, taken as twice what it regenerates (its
    activations less what it keeps: written once, read about once)."""
    policy = CheckpointPolicy.of(policy)
    cost = recompute_flops(cfg, batch, seq, policy)
    if policy.selective_rest:
        rest = cfg.num_layers - policy.checkpointed_blocks(cfg.num_layers)
        regenerated = (block_activation_bytes(cfg, batch, seq, attention, dtype, fused)
                       - selective_block_bytes(cfg, batch, seq, attention, dtype))
        cost += rest * 2 * regenerated * POINTWISE_FLOPS_PER_BYTE
    return cost


def policy_candidates(cfg: ModelConfig, batch: int, seq: int, device: torch.device, *, dtype: str, state_dtype: str,
                      attention: str, fused: bool, chunk_tokens: int, fit_fraction: float = FIT_FRACTION
                      ) -> list[CheckpointPolicy]:
    """Policies from least to most recompute (`recompute_cost`: none, ffn, partial:1 .. partial:N-1,
    every-block, nested; the +keep-attn variants, which recompute no attention at a few hundred MiB per
    block; and `selective` / partial:M+keep-attn+selective, whose other blocks keep their products for a
    pointwise-only recompute): the first the memory model says fits in `fit_fraction` of the free memory,
    then, as fallbacks after an out-of-memory, the costlier ones predicted to need less memory than it."""
    n = cfg.num_layers
    kind = "flash" if attention.startswith(("triton", "pytorch-flash")) else "reference"
    single = [*(CheckpointPolicy("partial", m) for m in range(1, n)), CheckpointPolicy("every-block")]
    keeping = [dataclasses.replace(p, keep_attention=True) for p in single]
    selective = [CheckpointPolicy("partial", m, keep_attention=m > 0, selective_rest=True) for m in range(n)]
    ladder = sorted([CheckpointPolicy(), CheckpointPolicy("ffn"), *single, *keeping, *selective,
                     CheckpointPolicy("nested")],
                    key=lambda p: recompute_cost(cfg, batch, seq, p, attention=kind, dtype=dtype, fused=fused))
    if device.type != "cuda":
        return ladder[:1]
    free, _ = torch.cuda.mem_get_info(device)
    peaks = [predict(cfg, batch, seq, policy=policy, attention=kind, dtype=dtype, fused=fused, loss="fused",
                     chunk_tokens=chunk_tokens, state_dtype=state_dtype).peak for policy in ladder]
    for i, peak in enumerate(peaks):
        if peak < fit_fraction * free:
            return [ladder[i], *(p for p, q in zip(ladder[i + 1:], peaks[i + 1:]) if q < peak)]
    return ladder[-1:]
