"""Fused LM head + cross-entropy: the loss of `h @ W^T` without ever holding (tokens, vocab) logits.

Reference: `lm_head_cross_entropy_reference(h, weight, targets)` = cross_entropy(h @ W^T, targets).

Fused (`LMHeadCrossEntropyFunction`, in the style of Liger-Kernel's fused linear CE): tokens are
processed in chunks of `chunk_tokens` rows. For each chunk the (chunk, vocab) logits are formed
by one matmul in the input dtype (bf16 matmuls accumulate in fp32 on tensor cores; nothing is
upcast to an fp32 GEMM), their log-sum-exp and the target logit give the loss, and, since the
loss's gradient w.r.t. those logits is known right there ((softmax - onehot) / n), the chunk's
dH rows and its dW contribution are computed in the same pass and the logits freed. Backward
only scales the stored dH, dW by the incoming gradient.

Between the GEMMs, on CUDA (and under TRITON_INTERPRET=1) one Triton kernel per chunk
(`softmax_xent_grad_kernel`, one program per token) reads the chunk's logits as the GEMM wrote them
(bf16 for a bf16 model: the same rounding as the plain model's logits), forms the row's log-sum-exp
in fp32 with an online max, writes the token's loss, and overwrites the logits in place with their
gradient: two reads and one write of the chunk, where the eager chain (fp32 copy, logsumexp, gather,
subtract, exp, scatter, scale, cast back) moved about six times as many bytes. dW accumulates in
fp32 inside the GEMM (`addmm(..., out_dtype=float32)`, where torch has it; beta 0 for the first
chunk, so the accumulator is never zeroed) rather than through a 16-bit product, an fp32 copy of it
and an add. Peak extra memory: one chunk's logits in the input dtype, dH and the fp32 dW accumulator.
Elsewhere (CPU without the interpreter, fp64) the same maths runs eagerly in fp32 (fp64 stays fp64).

`weight_grad_accumulation="weight"` trades precision for memory as Liger-Kernel does: dW accumulates in the
weight's own dtype (the GEMM's fp32 epilogue adds each chunk and rounds once per chunk, so its error grows with
the number of chunks), and the backward scales dH and dW in place: then the extra memory is one chunk's logits,
dH and dW, which is the gradient the weight gets anyway; where the loss's incoming gradient is 1 (a plain
`loss.backward()`), that scaling is a kernel that reads the 1 on the device and writes nothing. The eager
backward hands over the gradients it formed in the forward, so a second backward through the same loss
(retain_graph) is refused.

`ignore_index` targets contribute neither loss nor gradient and are left out of the mean.
`reduction` is "mean" (over non-ignored tokens) or "sum".
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import compiling, interpreting

REDUCTIONS = ("mean", "sum")
WEIGHT_GRAD_ACCUMULATIONS = ("fp32", "weight")  # dW accumulated in fp32 (fp64 for fp64), or in the weight's dtype
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_V = 4096  # vocab entries per step of a row's loops


def lm_head_cross_entropy_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                    ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """hidden (..., d), weight (vocab, d), targets (...) -> loss, via materialised logits (fp32, or fp64)."""
    logits = (hidden @ weight.T).to(torch.promote_types(hidden.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=ignore_index, reduction=reduction)


def _validate(hidden, weight, targets, reduction, chunk_tokens, weight_grad_accumulation, product_weight=None):
    if weight_grad_accumulation not in WEIGHT_GRAD_ACCUMULATIONS:
        raise ValueError(f"lm_head_cross_entropy: weight_grad_accumulation must be one of "
                         f"{', '.join(WEIGHT_GRAD_ACCUMULATIONS)}, got {weight_grad_accumulation!r}")
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
    if product_weight is not None and (product_weight.shape != weight.shape or product_weight.dtype != hidden.dtype
                                       or product_weight.device != weight.device):
        raise ValueError(f"lm_head_cross_entropy: product_weight must have the weight's shape {tuple(weight.shape)} "
                         f"and device and the hidden states' dtype {hidden.dtype}, got {tuple(product_weight.shape)} "
                         f"{product_weight.dtype} on {product_weight.device}")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def softmax_xent_grad_kernel(logits_ptr, targets_ptr, loss_ptr, n_vocab, stride_row, ignore_index, scale_ptr,
                                 BLOCK_V: tl.constexpr):
        """One token: loss = lse - logit[target] (0 if ignored); logits <- (softmax - onehot) * scale, the scale
        read on the device (the mean's 1 / count is never brought to the host)."""
        row = tl.program_id(0)
        scale = tl.load(scale_ptr).to(tl.float32)
        logits = logits_ptr + row.to(tl.int64) * stride_row
        # Online log-sum-exp, one running (max, sum) per lane, combined once at the end.
        run_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
        run_sum = tl.zeros((BLOCK_V,), tl.float32)
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits + cols, mask=cols < n_vocab, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            # Lanes still at -inf (past the vocab) rescale by 0 rather than exp(-inf - -inf) = nan.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
            run_max = new_max
        row_max = tl.max(run_max, axis=0)
        lse = row_max + tl.log(tl.sum(run_sum * tl.exp(run_max - row_max), axis=0))
        target = tl.load(targets_ptr + row)
        valid = target != ignore_index
        safe_target = tl.where(valid, target, 0)
        target_logit = tl.load(logits + safe_target).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - target_logit, 0.0))
        grad_scale = tl.where(valid, scale, 0.0)
        for start in range(0, n_vocab, BLOCK_V):
            cols = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits + cols, mask=cols < n_vocab, other=0.0).to(tl.float32)
            grad = (tl.exp(x - lse) - tl.where(cols == safe_target, 1.0, 0.0)) * grad_scale
            tl.store(logits + cols, grad.to(logits_ptr.dtype.element_ty), mask=cols < n_vocab)

    return softmax_xent_grad_kernel


@functools.cache
def _scale_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def scale_unless_one_kernel(x_ptr, scale_ptr, n, BLOCK: tl.constexpr):
        """x *= scale in place (in fp32, rounded to x's dtype), where the scale read on the device is not 1."""
        scale = tl.load(scale_ptr).to(tl.float32)
        if scale != 1.0:
            offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
            tl.store(x_ptr + offs, (x * scale).to(x_ptr.dtype.element_ty), mask=mask)

    return scale_unless_one_kernel


SCALE_BLOCK = 8192


def _scale_(t: torch.Tensor, grad_loss: torch.Tensor) -> torch.Tensor:
    """t *= grad_loss in place, t contiguous. The loss's incoming gradient is 1 in a plain `loss.backward()`:
    the kernel then reads that one scalar and leaves t untouched, where a multiply would read and write all of it
    (the 8B head's dW: 1.2 GB each way), without the host sync that asking the value would cost."""
    if not (_uses_kernel(t) and t.is_contiguous()):
        return t.mul_(grad_loss.to(t.dtype))
    if t.numel():
        launch_plan.launch(_scale_kernel(), (-(-t.numel() // SCALE_BLOCK),), t, grad_loss.reshape(()).float(),
                           t.numel(), BLOCK=SCALE_BLOCK, num_warps=8)
    return t


def _uses_kernel(hidden: torch.Tensor) -> bool:
    return hidden.dtype in KERNEL_DTYPES and (hidden.is_cuda or (hidden.device.type == "cpu" and interpreting()))


def _softmax_xent_grad_(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                        scale: torch.Tensor) -> torch.Tensor:
    """Per-token losses (fp32); `logits` (tokens, vocab), unit stride along vocab, becomes its gradient times
    `scale` (a one-element tensor on the logits' device)."""
    losses = torch.empty(logits.shape[0], device=logits.device, dtype=torch.float32)
    if logits.shape[0]:
        launch_plan.launch(_kernel(), (logits.shape[0],), logits, targets, losses, logits.shape[1], logits.stride(0),
                           ignore_index, scale, BLOCK_V=BLOCK_V, num_warps=8)
    return losses


def _softmax_xent_grad_eager(logits, targets, valid, scale, acc):
    """The same as the kernel, eagerly in `acc` precision: (per-token losses, gradient in logits' dtype)."""
    logits = logits.to(acc)
    lse = torch.logsumexp(logits, dim=-1)
    safe_t = torch.where(valid, targets, 0)
    losses = torch.where(valid, lse - logits.gather(1, safe_t[:, None]).squeeze(1), 0.0)
    probs = logits.sub_(lse[:, None]).exp_()  # d loss / d logits = (softmax - onehot) * scale; in place
    probs[torch.arange(probs.shape[0], device=probs.device), safe_t] -= 1.0
    probs.mul_((valid.to(probs.dtype) * scale)[:, None])
    return losses, probs


@functools.cache
def _addmm_out_dtype_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether this torch has addmm(..., out_dtype=float32) for `dtype` products on this device (cuBLAS, 2.8+)."""
    try:
        a = torch.ones(2, 2, device=device_type, dtype=dtype)
        torch.addmm(torch.zeros(2, 2, device=device_type), a, a, out_dtype=torch.float32)
        return True
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _accumulate_product_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, first: bool = False) -> None:
    """acc += a @ b, with a and b in their own dtype (tensor cores, fp32 accumulation); acc in theirs or wider.
    `first`: acc = a @ b, acc's contents never read (it may be uninitialised: the GEMM's beta is 0, so no pass
    over it to zero it first, nor a read of those zeros)."""
    beta = 0 if first else 1
    if a.dtype == acc.dtype:
        torch.addmm(acc, a, b, beta=beta, out=acc)
    elif a.is_cuda and _addmm_out_dtype_works(a.device.type, a.dtype):
        torch.addmm(acc, a, b, beta=beta, out_dtype=acc.dtype, out=acc)  # accumulated in the GEMM's epilogue
    elif first:
        acc.copy_(a @ b)
    else:
        acc += (a @ b).to(acc.dtype)


def _loss_and_gradients(hidden, weight, targets, ignore_index: int, reduction: str, chunk_tokens: int,
                        need_hidden: bool, need_weight: bool, weight_grad_accumulation: str = "fp32",
                        product_weight: torch.Tensor | None = None):
    """(loss, dLoss/dhidden as (n, d) or None, dLoss/dweight or None), chunk by chunk; dW in fp32 (fp64 for
    fp64), or in the weight's dtype for `weight_grad_accumulation="weight"`. The products read `product_weight`
    where given (the weight in the hidden states' dtype, e.g. its bf16 copy); dW is the weight's all the same."""
    h2d = hidden.reshape(-1, hidden.shape[-1])  # (n, d)
    t1d = targets.reshape(-1)  # (n,)
    valid = t1d != ignore_index
    acc = torch.promote_types(hidden.dtype, torch.float32)  # fp32 softmax for 16-bit inputs; fp64 stays
    # The mean's 1 / count stays on the device: asking its value would stall the host until the forward is done.
    scale = (1.0 / valid.sum().clamp_min(1).to(acc) if reduction == "mean"
             else torch.ones((), device=hidden.device, dtype=acc))
    product_weight = weight if product_weight is None else product_weight
    loss = torch.zeros((), device=hidden.device, dtype=acc)
    grad_h = torch.empty_like(h2d) if need_hidden else None
    grad_w_dtype = weight.dtype if weight_grad_accumulation == "weight" else acc
    grad_w = None
    if need_weight:  # (written whole by the first chunk's product; zeros only where there is no chunk)
        grad_w = (torch.empty if h2d.shape[0] else torch.zeros)(weight.shape, device=weight.device,
                                                                dtype=grad_w_dtype)
    kernel = _uses_kernel(hidden)
    for start in range(0, h2d.shape[0], chunk_tokens):
        h = h2d[start:start + chunk_tokens]  # (c, d)
        t = t1d[start:start + chunk_tokens]
        logits = h @ product_weight.T  # (c, vocab) in the input dtype: the only vocab-wide tensor, one chunk at a time
        if kernel:
            losses = _softmax_xent_grad_(logits, t, ignore_index, scale)
            grad_logits = logits  # overwritten in place
        else:
            losses, probs = _softmax_xent_grad_eager(logits, t, valid[start:start + chunk_tokens], scale, acc)
            grad_logits = probs.to(h.dtype)
            del probs  # (grad_logits itself where the dtypes match)
        loss += losses.sum()
        if grad_h is not None:
            torch.mm(grad_logits, product_weight, out=grad_h[start:start + chunk_tokens])
        if grad_w is not None:
            _accumulate_product_(grad_w, grad_logits.T, h, first=start == 0)
        # Free this chunk's logits before the next chunk's product allocates its own: otherwise both are alive at
        # that moment and the loss's peak holds two chunks (1.16 GiB each at 4096 x 151936 in bf16).
        del logits, grad_logits
    return loss * scale, grad_h, grad_w


# The registered operator: what torch.compile sees (`compiling`). It returns the gradients it
# formed on the way (the whole point of the fusion); its autograd rule only scales them.
@torch.library.custom_op("cs336::lm_head_cross_entropy", mutates_args=())
def lm_head_cross_entropy_op(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                             reduction: str, chunk_tokens: int, product_weight: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    loss, grad_h, grad_w = _loss_and_gradients(hidden, weight, targets, ignore_index, reduction, chunk_tokens,
                                               True, True, product_weight=product_weight)
    return loss, grad_h.view(hidden.shape), grad_w


@lm_head_cross_entropy_op.register_fake
def _(hidden, weight, targets, ignore_index, reduction, chunk_tokens, product_weight=None):
    acc = torch.promote_types(hidden.dtype, torch.float32)
    return (hidden.new_empty((), dtype=acc), torch.empty_like(hidden, memory_format=torch.contiguous_format),
            weight.new_empty(weight.shape, dtype=acc))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output[1], output[2])
    ctx.weight_dtype = inputs[1].dtype


def _scaled_weight_gradient(grad_w: torch.Tensor, grad_loss: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """grad_w * grad_loss in `dtype`, written straight into the result: no fp32 temporary the size of the head
    (1.16 GiB for the 8B model's 151936 x 4096 head in bf16, 2.3 GiB in fp32), one rounding as before."""
    return torch.mul(grad_w, grad_loss, out=torch.empty(grad_w.shape, dtype=dtype, device=grad_w.device))


def _op_backward(ctx, grad_loss, _grad_h, _grad_w):
    grad_h, grad_w = ctx.saved_tensors
    return (grad_h * grad_loss.to(grad_h.dtype), _scaled_weight_gradient(grad_w, grad_loss, ctx.weight_dtype),
            None, None, None, None, None)


lm_head_cross_entropy_op.register_autograd(_op_backward, setup_context=_setup_context)


class LMHeadCrossEntropyFunction(torch.autograd.Function):
    """The eager path: gradients formed only for the inputs that need them, without the operator's dispatch.
    The backward scales them in place and hands them over (they are this Function's own): no copy of dH, nor of
    dW where it is already in the weight's dtype."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, ignore_index: int, reduction: str, chunk_tokens: int,
                weight_grad_accumulation: str = "fp32", product_weight: torch.Tensor | None = None):
        loss, grad_h, grad_w = _loss_and_gradients(hidden, weight, targets, ignore_index, reduction, chunk_tokens,
                                                   hidden.requires_grad, weight.requires_grad,
                                                   weight_grad_accumulation, product_weight)
        ctx.save_for_backward(grad_h if grad_h is not None else torch.empty(0),
                              grad_w if grad_w is not None else torch.empty(0))
        ctx.hidden_shape, ctx.weight_dtype = hidden.shape, weight.dtype
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.handed_over = False
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.handed_over:
            raise RuntimeError("lm_head_cross_entropy: a second backward through the same loss is not supported: "
                               "the first one handed over the gradients formed in the forward (compute the loss "
                               "again instead of retain_graph=True)")
        ctx.handed_over = True
        grad_h, grad_w = ctx.saved_tensors
        dh = _scale_(grad_h, grad_loss).view(ctx.hidden_shape) if ctx.has[0] else None
        dw = None
        if ctx.has[1]:
            dw = (_scale_(grad_w, grad_loss) if grad_w.dtype == ctx.weight_dtype
                  else _scaled_weight_gradient(grad_w, grad_loss, ctx.weight_dtype))
        return dh, dw, None, None, None, None, None, None


def lm_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          ignore_index: int = -100, reduction: str = "mean", chunk_tokens: int = 4096,
                          weight_grad_accumulation: str = "fp32",
                          product_weight: torch.Tensor | None = None) -> torch.Tensor:
    """cross_entropy(hidden @ weight^T, targets) without the full logits. hidden (..., d), weight (vocab, d).

    weight_grad_accumulation: "fp32" (default) accumulates dW over the token chunks in fp32 and rounds once;
    "weight" accumulates it in the weight's dtype (less memory, as Liger-Kernel; one rounding per chunk).
    product_weight: what the products read in place of `weight` (same shape, the hidden states' dtype): an fp32
    weight's bf16 copy, as autocast would cast it; the gradient still goes to `weight`, in its dtype."""
    _validate(hidden, weight, targets, reduction, chunk_tokens, weight_grad_accumulation, product_weight)
    if compiling():
        if weight_grad_accumulation != "fp32":
            raise ValueError("lm_head_cross_entropy: under torch.compile dW accumulates in fp32; "
                             f"weight_grad_accumulation={weight_grad_accumulation!r} is for eager mode")
        return lm_head_cross_entropy_op(hidden, weight, targets, ignore_index, reduction, chunk_tokens,
                                        product_weight)[0]
    return LMHeadCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, reduction, chunk_tokens,
                                            weight_grad_accumulation, product_weight)
