"""An analytic memory model of BasicsTransformerLM training: parameters, gradients, AdamW state,
activations per block (reference attention or our FlashAttention; eager or with our fused
RMSNorm/SwiGLU kernels), the LM head and loss, for a preset, context, batch, parameter dtype and
checkpointing policy; and the predicted peak.

Activations are counted op by op from what autograd saves in our model (see
tests/test_memory_model.py, which checks the counts against SavedTensorLog exactly, in fp32 and
in a bf16 model). Per token and block, in elements (d = d_model, h = heads, s = sequence,
f = d_ff); e = bytes of the model's dtype, fp32 where marked:
    ln1, ln2, eager RMSNorm: fp32 x, x_hat and rms ................ 2 x (2d + 1) fp32
             fused RMSNorm: x and rstd ............................ 2 x (d e + 1 fp32)
    q/k/v input, output-projection input, w1/w3 input .............. 3d
    attention, reference: rotated Q, K, V, P for PV, softmax's
        amax input/output, exp, sum ................................ 3d + 3hs + 2h
    attention, flash: Q, K, V, O, and L (fp32) ..................... 4d + h fp32
    SwiGLU, eager: w1 out, sigmoid, silu, w3 out, product .......... 5f
            fused: w1 out, w3 out, product ......................... 3f
plus, per block and independent of the batch, the (s, s) bool mask (reference only) and RoPE's
cos/sin gathers (4 x s x d/(2h), in the model's dtype: its buffers are cast with it). The plain
loss keeps three fp32 vocab-wide tensors per token (logits, shifted logits, log-probabilities);
the embedding and the loss keep the int64 ids. The fused LM-head loss keeps dH (tokens x d) and
an fp32 dW instead, and never more than one chunk of logits.
Mixed precision by bf16 autocast (fp32 parameters, casts saved per use) is not modelled op by op:
`predict` refuses it rather than guess; a bf16 *model* (parameters in bf16) is modelled exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from cs336_systems.config import ModelConfig
from cs336_systems.memory.policy import NO_CHECKPOINTING, CheckpointPolicy

FP32 = 4
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
ATTENTION_KINDS = ("reference", "flash")


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"memory model: dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    return DTYPE_BYTES[dtype]


def _norm_bytes(d: int, e: int, fused: bool) -> int:
    """Per token, one RMSNorm's saved bytes."""
    return d * e + FP32 if fused else (2 * d + 1) * FP32


def block_activation_bytes(cfg: ModelConfig, batch: int, seq: int, attention: str = "reference",
                           dtype: str = "fp32", fused: bool = False) -> int:
    d, h, f = cfg.d_model, cfg.num_heads, cfg.d_ff
    e = _dtype_bytes(dtype)
    tokens = batch * seq
    norms = 2 * _norm_bytes(d, e, fused)
    matmul_inputs = 3 * d * e
    if attention == "reference":
        attn = (3 * d + 3 * h * seq + 2 * h) * e
        mask = seq * seq  # bool
    elif attention == "flash":
        attn = 4 * d * e + h * FP32
        mask = 0
    else:
        raise ValueError(f"block_activation_bytes: attention must be one of {', '.join(ATTENTION_KINDS)}, "
                         f"got {attention!r}")
    ffn = (3 if fused else 5) * f * e
    rope = 4 * seq * (cfg.d_head // 2) * e
    return tokens * (norms + matmul_inputs + attn + ffn) + mask + rope


def block_backward_transient_bytes(cfg: ModelConfig, batch: int, seq: int, attention: str = "reference",
                                   dtype: str = "fp32", fused: bool = False) -> int:
    """Gradients alive inside one block's backward beyond what the block saved: the SwiGLU's three
    (tokens, d_ff) gradients (w1 out, w3 out, their product; with our fused gate only the product's, as it
    writes the other two over its saved inputs) and, for reference attention, three
    (batch, heads, s, s) score gradients (of P, of the softmax input, of the masked scores). The
    count of three for the scores is what the H200 showed: xl at ctx 2048 (fp32, batch 4) peaked
    6.7 GiB above the model without this term, against 6.9 GiB for it."""
    e = _dtype_bytes(dtype)
    ffn = (1 if fused else 3) * batch * seq * cfg.d_ff * e
    scores = 3 * batch * cfg.num_heads * seq * seq * e if attention == "reference" else 0
    return ffn + scores


def boundary_bytes(cfg: ModelConfig, batch: int, seq: int, dtype: str = "fp32") -> int:
    """One block's input (the residual stream), what a checkpoint keeps."""
    return batch * seq * cfg.d_model * _dtype_bytes(dtype)


def kept_attention_bytes(cfg: ModelConfig, batch: int, seq: int, policy: CheckpointPolicy | str,
                         attention: str = "flash", dtype: str = "fp32") -> int:
    """What `policy` keeps per checkpointed block beyond its input: the attention output for +keep-attn."""
    keep = CheckpointPolicy.of(policy).keep_attention
    return attention_output_bytes(cfg, batch, seq, attention, dtype) if keep else 0


def attention_output_bytes(cfg: ModelConfig, batch: int, seq: int, attention: str = "flash",
                           dtype: str = "fp32") -> int:
    """What a `+keep-attn` policy keeps per checkpointed block: the flash attention's O (tokens x d) and
    its fp32 L (tokens x heads); nothing for the reference attention, whose ops it does not keep."""
    if attention != "flash":
        return 0
    return batch * seq * (cfg.d_model * _dtype_bytes(dtype) + cfg.num_heads * FP32)


def selective_block_bytes(cfg: ModelConfig, batch: int, seq: int, attention: str = "flash",
                          dtype: str = "fp32") -> int:
    """What a block under selective checkpointing (`selective`, `...+selective`) keeps beyond its input:
    the outputs of its weight products but w2 (q, k, v, output projection: 4d; w1, w3: 2f) and the flash
    attention's O and L."""
    products = batch * seq * (4 * cfg.d_model + 2 * cfg.d_ff) * _dtype_bytes(dtype)
    return products + attention_output_bytes(cfg, batch, seq, attention, dtype)


def ffn_activation_bytes(cfg: ModelConfig, batch: int, seq: int, dtype: str = "fp32", fused: bool = False) -> int:
    """What checkpointing the SwiGLU alone removes from a block (its input stays as the boundary)."""
    return batch * seq * (3 if fused else 5) * cfg.d_ff * _dtype_bytes(dtype)


def head_and_loss_bytes(cfg: ModelConfig, batch: int, seq: int, dtype: str = "fp32", fused: bool = False,
                        loss: str = "plain") -> int:
    """Final norm and LM-head input; then for the plain loss its three fp32 vocab-wide tensors (amax
    and logsumexp inputs, gather's log-probabilities) with two row scalars and the int64 token ids
    and targets; for the fused loss the dH it saves (its fp32 dW is counted with the logits)."""
    tokens = batch * seq
    e = _dtype_bytes(dtype)
    head = tokens * (_norm_bytes(cfg.d_model, e, fused) + cfg.d_model * e)
    if loss == "fused":
        return head + tokens * cfg.d_model * e + tokens * 8
    if loss != "plain":
        raise ValueError(f"head_and_loss_bytes: loss must be plain or fused, got {loss!r}")
    return head + tokens * (3 * cfg.vocab_size + 2) * FP32 + 2 * tokens * 8


@dataclass(frozen=True)
class MemoryPrediction:
    """The parts of one training step's memory and its predicted peak.

    The parts are each at their largest; they are never all alive together: without
    checkpointing the peak is at the start of backward (every activation, few gradients yet),
    with checkpointing near its end (every gradient, a few boundaries). `peak` walks the backward
    pass group by group (see `_backward_walk`) and takes the worst point; `sum_of_parts` is the
    conservative bound.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int  # saved for backward at the end of forward, plus the largest recompute
    logits: int  # the logits and their gradient, alive together at the start of backward
    peak: int

    @property
    def sum_of_parts(self) -> int:
        return self.parameters + self.gradients + self.optimizer_state + self.activations + self.logits

    def as_dict(self) -> dict[str, int]:
        return dict(parameters=self.parameters, gradients=self.gradients, optimizer_state=self.optimizer_state,
                    activations=self.activations, logits=self.logits, peak=self.peak,
                    sum_of_parts=self.sum_of_parts)


def activation_bytes(cfg: ModelConfig, batch: int, seq: int, policy: CheckpointPolicy | str = NO_CHECKPOINTING,
                     attention: str = "reference", dtype: str = "fp32", fused: bool = False,
                     loss: str = "plain") -> int:
    """Activation bytes live at the worst point of a step under `policy`."""
    policy = CheckpointPolicy.of(policy)
    name = policy.scheme
    n = cfg.num_layers
    block = block_activation_bytes(cfg, batch, seq, attention, dtype, fused)
    boundary = boundary_bytes(cfg, batch, seq, dtype)
    # With +keep-attn a checkpointed block keeps its attention output beside its input; the group being
    # recomputed reuses its own (already in `block`).
    kept = kept_attention_bytes(cfg, batch, seq, policy, attention, dtype)
    head = head_and_loss_bytes(cfg, batch, seq, dtype, fused, loss)
    ffn = ffn_activation_bytes(cfg, batch, seq, dtype, fused)
    if name == "none":
        return n * block + head
    if name == "ffn":
        return n * (block - ffn) + ffn + head
    if name == "attn":
        norms = batch * seq * 2 * _norm_bytes(cfg.d_model, _dtype_bytes(dtype), fused)
        attn_part = block - ffn - norms
        return n * (block - attn_part) + attn_part + head
    if name == "nested":
        return (math.ceil(math.log2(max(n, 1))) + 1) * boundary + block + head
    if name == "partial":
        m = policy.checkpointed_blocks(n)
        if policy.selective_rest:
            rest = boundary + selective_block_bytes(cfg, batch, seq, attention, dtype)
            return m * (boundary + kept) + (n - m) * rest + block - (kept if m else rest) + head
        return m * (boundary + kept) + (n - m) * block + (block - kept if m else 0) + head
    k = policy.group_size(n)
    return math.ceil(n / k) * boundary + (n - k) * kept + k * block + head


def _groups(policy: CheckpointPolicy, n: int, block: int, boundary: int, ffn: int, kept: int = 0, selective: int = 0
            ) -> list[tuple[int, int, int]] | None:
    """(blocks, bytes kept after forward, bytes live during its backward) per group in forward order,
    for the policies the walk covers; None for nested and attn (the sum of parts estimates them).
    `kept`: what the policy keeps per checkpointed block beyond its input (`kept_attention_bytes`; its
    recompute reuses it, so a group's live bytes are unchanged); `selective`: the same for the blocks
    under selective checkpointing (`selective_block_bytes`)."""
    name = policy.scheme
    if name == "none":
        return [(1, block, block)] * n
    if name == "partial":
        m = policy.checkpointed_blocks(n)
        rest = (1, boundary + selective, block) if policy.selective_rest else (1, block, block)
        return [(1, boundary + kept, block)] * m + [rest] * (n - m)
    if name == "ffn":  # the SwiGLU's activations are recomputed inside each block's backward
        return [(1, block - ffn, block)] * n
    k = policy.group_size(n)
    if k is None:
        return None
    return [(min(k, n - i), boundary + min(k, n - i) * kept, min(k, n - i) * block) for i in range(0, n, k)]


def _backward_walk(groups, block_grads: int, head_saved: int, logits: int, head_grads: int, embedding_grads: int,
                   transient: int = 0) -> int:
    """Largest activations + gradients + logits alive at once during one step (parameters and
    optimizer state excluded), at three kinds of point: the start of backward (all that forward
    kept, the logits and their gradient, the LM head's gradient); the backward of each group, from
    the last (what earlier groups kept, this group's activations, recomputed where it was
    checkpointed, the gradients of this and every later group, and one block's backward transients);
    and the end (every gradient)."""
    kept = [g[1] for g in groups]
    worst = sum(kept) + head_saved + logits + head_grads
    grads_after = head_grads
    for i in range(len(groups) - 1, -1, -1):
        k, _, live_here = groups[i]
        grads_after += k * block_grads
        worst = max(worst, sum(kept[:i]) + live_here + grads_after + transient)
    return max(worst, grads_after + embedding_grads)


def predict(cfg: ModelConfig, batch: int, seq: int, *, policy: CheckpointPolicy | str = NO_CHECKPOINTING,
            attention: str = "reference",
            dtype: str = "fp32", fused: bool = False, loss: str = "plain", chunk_tokens: int = 4096,
            state_dtype: str | None = None, optimizer_states: int = 2, with_gradients: bool = True,
            autocast: bool = False) -> MemoryPrediction:
    """Peak-memory prediction for one training step of a model whose parameters are in `dtype`, with an
    Adam-style optimizer holding `optimizer_states` tensors per parameter in `state_dtype` (default: `dtype`).

    `loss="fused"` is our LM-head cross-entropy on the GPU (one chunk of logits in `dtype`, overwritten by
    its gradient, plus the fp32 dW accumulator); `loss="plain"` materialises fp32 logits and their gradient.
    Gradients are taken as freed before the step (zero_grad(set_to_none=True)) and filled in by backward.
    """
    policy = CheckpointPolicy.of(policy)
    if autocast:
        raise ValueError("predict: bf16/fp16 autocast over fp32 parameters is not modelled (casts are saved per "
                         "use); model a bf16 model with dtype='bf16' instead")
    e = _dtype_bytes(dtype)
    state_e = _dtype_bytes(state_dtype or dtype)
    n_params = cfg.parameter_count
    tokens = batch * seq
    if loss == "fused":
        chunk = min(chunk_tokens, tokens)
        logits = chunk * cfg.vocab_size * e + cfg.vocab_size * cfg.d_model * FP32  # gradient written in place
    else:
        logits = 2 * tokens * cfg.vocab_size * FP32
    activations = activation_bytes(cfg, batch, seq, policy, attention, dtype, fused, loss)
    params, states = n_params * e, optimizer_states * n_params * state_e
    grads = params if with_gradients else 0
    block = block_activation_bytes(cfg, batch, seq, attention, dtype, fused)
    groups = _groups(policy, cfg.num_layers, block, boundary_bytes(cfg, batch, seq, dtype),
                     ffn_activation_bytes(cfg, batch, seq, dtype, fused),
                     kept_attention_bytes(cfg, batch, seq, policy, attention, dtype),
                     selective_block_bytes(cfg, batch, seq, attention, dtype))
    if groups is None:
        peak = params + states + grads + activations + logits
    else:
        g = e if with_gradients else 0
        d = cfg.d_model
        peak = params + states + _backward_walk(
            groups, (4 * d * d + 3 * d * cfg.d_ff + 2 * d) * g,
            head_and_loss_bytes(cfg, batch, seq, dtype, fused, loss), logits, (cfg.vocab_size + 1) * d * g,
            cfg.vocab_size * d * g, block_backward_transient_bytes(cfg, batch, seq, attention, dtype, fused))
    return MemoryPrediction(parameters=params, gradients=grads, optimizer_state=states, activations=activations,
                            logits=logits, peak=peak)


