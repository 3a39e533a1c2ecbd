"""An analytic memory model of BasicsTransformerLM training: parameters, gradients, AdamW state,
activations per block (reference attention or our FlashAttention), the LM head and loss, for a
preset, context, batch and checkpointing policy; and the predicted peak.

Activations are counted op by op from what autograd saves in our model (fp32; see
tests/test_memory_model.py, which checks the counts against SavedTensorLog exactly). Per token
and block, in elements (d = d_model, h = heads, s = sequence, f = d_ff):
    ln1, ln2 (RMSNorm): x, x_hat, rms ............................. 2 x (2d + 1)
    q/k/v input, output-projection input, w1/w3 input .............. 3d
    attention, reference: rotated Q, K, V, P for PV, softmax's
        amax input/output, exp, sum ................................ 3d + 3hs + 2h
    attention, flash: Q, K, V, O and L ............................. 4d + h
    SwiGLU: w1 out, sigmoid, silu, w3 out, product ................. 5f
plus, per block and independent of the batch, the (s, s) bool mask (reference only) and RoPE's
cos/sin gathers (4 x s x d/(2h) floats). The loss keeps three vocab-wide tensors per token
(logits, shifted logits, log-probabilities); the embedding and the loss keep the int64 ids.
bf16 autocast is not modelled op by op yet (casts are saved per use): `predict` refuses it
rather than guess.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.config import ModelConfig
from cs336_systems.memory.checkpointing import group_size, parse_policy

FP32 = 4


def block_activation_bytes(cfg: ModelConfig, batch: int, seq: int, attention: str = "reference") -> int:
    d, h, f = cfg.d_model, cfg.num_heads, cfg.d_ff
    tokens = batch * seq
    norms = 2 * (2 * d + 1)
    matmul_inputs = 3 * d
    if attention == "reference":
        attn = 3 * d + 3 * h * seq + 2 * h
        mask = seq * seq  # bool
    elif attention == "flash":
        attn = 4 * d + h
        mask = 0
    else:
        raise ValueError(f"block_activation_bytes: attention must be reference or flash, got {attention!r}")
    ffn = 5 * f
    rope = 4 * seq * (cfg.d_head // 2) * FP32
    return tokens * (norms + matmul_inputs + attn + ffn) * FP32 + mask + rope


def ffn_activation_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """What checkpointing the SwiGLU alone removes from a block (its input stays as the boundary)."""
    return batch * seq * 5 * cfg.d_ff * FP32


def head_and_loss_bytes(cfg: ModelConfig, batch: int, seq: int) -> int:
    """Final norm, LM-head input, the loss's three vocab-wide tensors (amax and logsumexp inputs,
    gather's log-probabilities) with two row scalars, and the int64 token ids and targets."""
    tokens = batch * seq
    floats = (2 * cfg.d_model + 1) + cfg.d_model + 3 * cfg.vocab_size + 2
    return tokens * floats * FP32 + 2 * tokens * 8


@dataclass(frozen=True)
class MemoryPrediction:
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # saved for backward at the end of forward, plus the largest recompute
    logits: int  # the logits and their gradient, alive together at the start of backward

    @property
    def peak(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.logits

    def as_dict(self) -> dict[str, int]:
        return dict(parameters=self.parameters, gradients=self.gradients, optimizer_state=self.optimizer_state,
                    activations=self.activations, logits=self.logits, peak=self.peak)


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, policy: str = "none", attention: str = "reference"
                     ) -> int:
    """Activation bytes live at the worst point of a step under `policy`."""
    name, _ = parse_policy(policy)
    n = cfg.num_layers
    block = block_activation_bytes(cfg, batch, seq, attention)
    boundary = batch * seq * cfg.d_model * FP32
    head = head_and_loss_bytes(cfg, batch, seq)
    if name == "none":
        return n * block + head
    if name == "ffn":
        saved = n * (block - ffn_activation_bytes(cfg, batch, seq))
        return saved + ffn_activation_bytes(cfg, batch, seq) + head
    if name == "attn":
        attn_part = block - ffn_activation_bytes(cfg, batch, seq) - batch * seq * (2 * (2 * cfg.d_model + 1)) * FP32
        return n * (block - attn_part) + attn_part + head
    if name == "nested":
        return (math.ceil(math.log2(max(n, 1))) + 1) * boundary + block + head
    k = group_size(policy, n)
    return math.ceil(n / k) * boundary + k * block + head


def predict(cfg: ModelConfig, batch: int, seq: int, *, policy: str = "none", attention: str = "reference",
            dtype: str = "fp32", optimizer_states: int = 2, with_gradients: bool = True) -> MemoryPrediction:
    """Peak-memory prediction for one training step of fp32 parameters with an Adam-style optimizer."""
    if dtype != "fp32":
        raise ValueError(f"predict: only fp32 activations are modelled so far, got dtype {dtype!r}")
    n_params = sum(p for p in _param_counts(cfg))
    params = n_params * FP32
    return MemoryPrediction(parameters=params, gradients=params if with_gradients else 0,
                            optimizer_state=optimizer_states * params,
                            activations=activation_bytes(cfg, batch, seq, policy, attention),
                            logits=2 * batch * seq * cfg.vocab_size * FP32)


def _param_counts(cfg: ModelConfig):
    d = cfg.d_model
    yield cfg.vocab_size * d  # embedding
    yield cfg.num_layers * (4 * d * d + 3 * d * cfg.d_ff + 2 * d)
    yield d  # final norm
    yield cfg.vocab_size * d  # LM head
