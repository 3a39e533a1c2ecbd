"""Fused AdamW in Triton: one pass over each parameter reads p, g, m, v once and writes p, m, v once.

Two update rules, chosen by `maths`:
* "cs336": the staff/cs336_basics AdamW: p -= lr*wd*p; p -= lr*sqrt(1-b2^t)/(1-b1^t) * m/(sqrt(v)+eps).
* "torch": torch.optim.AdamW: the same decay, then p -= lr/(1-b1^t) * m/(sqrt(v)/sqrt(1-b2^t) + eps).
State (m, v) is fp32 or bf16 (`state_dtype`); arithmetic is fp32 in registers either way.

One launch per parameter tensor (BLOCK=1024 elements per program): memory-bound, 16 bytes
read and 12 written per fp32 element. (A single multi-tensor launch over all parameters, which
saves the per-tensor launch overhead on models with many small tensors, is the next step.)
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests.
"""

from __future__ import annotations

import math

import torch

from cs336_systems.kernels._triton_utils import check_kernel_device

MATHS = ("cs336", "torch")
BLOCK = 1024


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_step_kernel(p_ptr, g_ptr, m_ptr, v_ptr, n, decay, beta1, beta2, eps, step_size, bias2_sqrt,
                          TORCH_MATHS: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
        m = tl.load(m_ptr + offs, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offs, mask=mask).to(tl.float32)
        p = p * decay
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        if TORCH_MATHS:
            p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
        else:
            p = p - step_size * m / (tl.sqrt(v) + eps)
        tl.store(p_ptr + offs, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offs, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offs, v.to(v_ptr.dtype.element_ty), mask=mask)

    return adamw_step_kernel


_KERNEL = None


class FusedAdamW(torch.optim.Optimizer):
    """AdamW with the update in one Triton kernel per parameter. State keys: m, v, t (as cs336_basics)."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                 *, maths: str = "cs336", state_dtype: torch.dtype = torch.float32):
        if maths not in MATHS:
            raise ValueError(f"FusedAdamW: maths must be one of {', '.join(MATHS)}, got {maths!r}")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"FusedAdamW: state_dtype must be float32 or bfloat16, got {state_dtype}")
        if lr < 0 or eps <= 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"FusedAdamW: invalid hyper-parameters lr={lr}, betas={betas}, eps={eps}, "
                             f"weight_decay={weight_decay}")
        self.maths, self.state_dtype = maths, state_dtype
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        global _KERNEL
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if _KERNEL is None:
            _KERNEL = _kernel()
        import triton

        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not (p.is_contiguous() and p.grad.is_contiguous()):
                    raise ValueError("FusedAdamW: parameters and gradients must be contiguous")
                check_kernel_device("FusedAdamW", p, p.grad)
                state = self.state[p]
                if not state:
                    state["m"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["v"] = torch.zeros_like(p, dtype=self.state_dtype)
                    state["t"] = 0
                state["t"] += 1
                t = state["t"]
                bias1, bias2 = 1 - beta1**t, 1 - beta2**t
                step_size = lr / bias1 if self.maths == "torch" else lr * math.sqrt(bias2) / bias1
                n = p.numel()
                _KERNEL[(triton.cdiv(n, BLOCK),)](
                    p, p.grad, state["m"], state["v"], n, 1 - lr * wd, beta1, beta2, eps, step_size,
                    math.sqrt(bias2), TORCH_MATHS=self.maths == "torch", BLOCK=BLOCK)
        return loss
