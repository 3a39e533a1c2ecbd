"""Fused LM head + cross-entropy: the loss of `h @ W^T` without ever holding (tokens, vocab) logits.

Reference: `lm_head_cross_entropy_reference(h, weight, targets)` = cross_entropy(h @ W^T, targets).

Fused (`LMHeadCrossEntropyFunction`, in the style of Liger-Kernel's fused linear CE): tokens are
processed in chunks of `chunk_tokens` rows. For each chunk the (chunk, vocab) logits are formed
by one matmul in the input dtype (bf16 matmuls accumulate in fp32 on tensor cores; nothing is
upcast to an fp32 GEMM), their log-sum-exp and the target logit give the loss, and, since the
loss's gradient w.r.t. those logits is known right there ((softmax - onehot) / n), the chunk's
dH rows and its dW contribution are computed in the same pass and the logits freed. Backward
only scales the stored dH, dW by the incoming gradient. Peak extra memory: one chunk's logits
(fp32) plus dH and an fp32 dW accumulator, instead of the full logits and their gradient.

`ignore_index` targets contribute neither loss nor gradient and are left out of the mean.
`reduction` is "mean" (over non-ignored tokens) or "sum".
"""

from __future__ import annotations

import torch

REDUCTIONS = ("mean", "sum")


def lm_head_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                    ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """hidden (..., d), weight (vocab, d), targets (...) -> loss, via materialised logits (fp32, or fp64)."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)


def _validate(hidden, weight, targets, reduction, chunk_tokens):
    if reduction not in REDUCTIONS:
        raise ValueError(f"lm_head_cross_entropy: reduction must be one of {', '.join(REDUCTIONS)}, got {reduction!r}")
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"lm_head_cross_entropy: weight must be (vocab, {hidden.shape[-1]}), "
                         f"got {tuple(weight.shape)}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"lm_head_cross_entropy: targets must have shape {tuple(hidden.shape[:-1])}, "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point:
        raise TypeError(f"lm_head_cross_entropy: targets must be integer ids, got {targets.dtype}")
    if chunk_tokens < 1:
        raise ValueError(f"lm_head_cross_entropy: chunk_tokens must be >= 1, got {chunk_tokens}")


class LMHeadCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, reduction: str, chunk_tokens: int):
        h2d = hidden.reshape(-1, hidden.shape[-1])  # (n, d)
        t1d = targets.reshape(-1)  # (n,)
        valid = t1d != ignore_index
        count = int(valid.sum()) if reduction == "mean" else 1
        scale = 1.0 / max(count, 1)
        acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 softmax for 16-bit inputs; fp64 stays
        loss = torch.zeros((), device=hidden.device, dtype=acc)
        grad_h = torch.empty_like(h2d) if hidden.requires_grad else None
        grad_w = torch.zeros(weight.shape, device=weight.device, dtype=acc) if weight.requires_grad else None
        for start in range(0, h2d.shape[0], chunk_tokens):
            h = h2d[start:start + chunk_tokens]  # (c, d)
            t = t1d[start:start + chunk_tokens]
            ok = valid[start:start + chunk_tokens]
            logits = (h @ weight.T).to(acc)  # (c, vocab): the only vocab-wide tensor, one chunk at a time
            lse = torch.logsumexp(logits, dim=-1)
            safe_t = torch.where(ok, t, 0)
            target_logit = logits.gather(1, safe_t[:, None]).squeeze(1)
            loss += torch.where(ok, lse - target_logit, 0.0).sum()
            # d loss / d logits = (softmax - onehot) * scale, zero on ignored rows; reuse the buffer.
            probs = logits.sub_(lse[:, None]).exp_()
            probs[torch.arange(probs.shape[0], device=probs.device), safe_t] -= 1.0
            probs.mul_((ok.to(probs.dtype) * scale)[:, None])
            grad_logits = probs.to(h.dtype)
            if grad_h is not None:
                grad_h[start:start + chunk_tokens] = grad_logits @ weight
            if grad_w is not None:
                # In the input dtype (tensor cores, fp32 accumulation), added into the fp32 accumulator.
                grad_w += (grad_logits.T @ h).to(acc)
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        ctx.has = (grad_h is not None, grad_w is not None)
        return loss * scale

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        dh = (grad_h * grad_loss.to(grad_h.dtype)).view(ctx.hidden_shape) if ctx.has[0] else None
        dw = (grad_w * grad_loss).to(ctx.weight_dtype) if ctx.has[1] else None
        return dh, dw, None, None, None, None


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          ignore_index: int = -100, reduction: str = "mean", chunk_tokens: int = 4096
                          ) -> torch.Tensor:
    """cross_entropy(hidden @ weight^T, targets) without the full logits. hidden (..., d), weight (vocab, d)."""
    _validate(hidden, weight, targets, reduction, chunk_tokens)
    return LMHeadCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, reduction, chunk_tokens)
