"""Fused RMSNorm in Triton: y = x * rstd * weight with rstd = 1 / sqrt(mean(x^2) + eps), fp32 inside.

Reference: `rmsnorm_reference(x, weight, eps)` = cs336_basics.model.RMSNorm's maths (upcast to
fp32, normalise, scale, cast back to x's dtype).

Why a kernel: the eager module runs ~8 kernels per call and autograd keeps two fp32 copies of
x (16 bytes per element of a bf16 model); this one reads x once, writes y once, and saves only
x (in its own dtype) and one fp32 rstd per row for backward.

Layout: one program per row (rows = all leading dims), the whole row in registers
(BLOCK_D = next power of two >= d: fine up to d = 16k). Backward, per row:
    x_hat = x * rstd,   g = dy * w,   dx = rstd * (g - x_hat * mean(g * x_hat)),
and dw = sum over rows of dy * x_hat, accumulated per program in fp32 over a strided set of
rows into a (programs, d) buffer that one torch sum reduces (deterministic, no atomics). (Contiguous runs of rows
taken several a step, 16 warps, were tried: 26 us a call at small/512 on an H100 against about 9 for this form on an
H200; notes/model_sizes.md.)
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests; on the CPU otherwise the same maths in torch.

Layers: reference; kernels; launchers (`_forward`, `_backward`: kernel or CPU maths); the registered operators
`cs336::rmsnorm` / `cs336::rmsnorm_backward` (fake and autograd rules: what torch.compile traces); the eager
autograd Function; `rmsnorm`, which validates and picks the operator (compiling) or the Function (eager).
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import (
    check_operator_device,
    compiling,
    launch_wrapped,
    next_power_of_2,
    runs_kernel,
    triton_installed,
    triton_ops_enabled,
)

MAX_D = 16384
DW_PROGRAMS = 256  # partial dW rows: enough programs to fill 132 SMs twice, small enough to reduce cheaply


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """x (..., d), weight (d,) -> (..., d) in x's dtype; fp32 maths (fp64 stays fp64)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(acc) * (xf / rms)).to(x.dtype)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def rmsnorm_forward_kernel(x_ptr, w_ptr, y_ptr, rstd_ptr, d, eps, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
        tl.store(y_ptr + row * d + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def rmsnorm_backward_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, dw_partial_ptr, n_rows, d,
                                BLOCK_D: tl.constexpr):
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        dw = tl.zeros((BLOCK_D,), dtype=tl.float32)
        # Row pointers advance by `programs` rows per iteration; 64-bit pointer arithmetic, so no
        # int32 overflow of row * d on large inputs.
        step = programs * d
        start = pid.to(tl.int64) * d
        x_ptr += start
        dy_ptr += start
        dx_ptr += start
        for row in range(pid, n_rows, programs):
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            g = dy * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / d))
            tl.store(dx_ptr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            dw += dy * x_hat
            x_ptr += step
            dy_ptr += step
            dx_ptr += step
        tl.store(dw_partial_ptr + pid.to(tl.int64) * d + cols, dw, mask=mask)

    return rmsnorm_forward_kernel, rmsnorm_backward_kernel


def _block_d(d: int) -> int:
    return next_power_of_2(d)


def _num_warps(block_d: int) -> int:
    return min(16, max(1, block_d // 256))


def _forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, launch=launch_plan.launch,
             out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of contiguous rows, y in `out_dtype` (default x's): the kernel where it runs (`runs_kernel`), the
    reference maths elsewhere. `launch`: `launch_plan.launch` (eager), or `launch_wrapped` inside a triton_op."""
    out_dtype = out_dtype or x2d.dtype
    if not runs_kernel(x2d):
        acc = torch.promote_types(x2d.dtype, torch.float32)
        rstd = torch.rsqrt(x2d.to(acc).pow(2).mean(-1) + eps)
        return (x2d.to(acc) * rstd[:, None] * weight.to(acc)).to(out_dtype), rstd.to(torch.float32)
    forward_kernel, _ = _kernels()
    y = torch.empty_like(x2d, dtype=out_dtype)
    rstd = torch.empty(x2d.shape[0], device=x2d.device, dtype=torch.float32)
    block_d = _block_d(int(x2d.shape[1]))  # (a constexpr: a traced width is specialised on)
    if x2d.shape[0]:
        launch(forward_kernel, (x2d.shape[0],), x2d, weight, y, rstd, x2d.shape[1], eps,
                           BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return y, rstd


def _backward(grad_y2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
              launch=launch_plan.launch) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype, dw in weight's) of contiguous rows; grad_y in any float dtype (the output's)."""
    rows, d = x2d.shape
    if not runs_kernel(x2d):
        acc = torch.promote_types(x2d.dtype, torch.float32)
        x_hat = x2d.to(acc) * rstd.to(acc)[:, None]
        g = grad_y2d.to(acc) * weight.to(acc)
        dx = rstd.to(acc)[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        return dx.to(x2d.dtype), (grad_y2d.to(acc) * x_hat).sum(0).to(weight.dtype)
    _, backward_kernel = _kernels()
    dx = torch.empty_like(x2d)
    programs = torch.sym_max(1, torch.sym_min(DW_PROGRAMS, rows))  # (plain ints eagerly; traced sizes in a triton_op)
    dw_partial = torch.empty(programs, d, device=x2d.device, dtype=torch.float32)
    block_d = _block_d(int(d))
    if rows:
        launch(backward_kernel, (programs,), x2d, weight, grad_y2d, rstd, dx, dw_partial, rows, d,
               BLOCK_D=block_d, num_warps=_num_warps(block_d))
    else:
        dw_partial.zero_()
    return dx, dw_partial.sum(0).to(weight.dtype)


def _op_forward(x, weight, eps, out_dtype, launch=launch_plan.launch):
    """The operators' forward body (custom op and triton_op alike, by `launch`): rows flattened inside, so one graph
    serves every leading shape; (y, rstd) shaped as x and x's rows."""
    y, rstd = _forward(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps, launch=launch,
                       out_dtype=out_dtype)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _op_backward_body(grad_y, x, weight, rstd, launch=launch_plan.launch):
    """The backward operators' body, as `_op_forward`'s: (dx shaped as x, dw)."""
    d = x.shape[-1]
    dx, dw = _backward(grad_y.reshape(-1, d).contiguous(), x.reshape(-1, d).contiguous(), weight.contiguous(),
                       rstd.reshape(-1).contiguous(), launch=launch)
    return dx.view(x.shape), dw


# The registered operators: what torch.compile sees (`compiling`). The forward returns rstd too,
# so the backward operator reuses it; rows are flattened inside, so one graph serves every leading shape.
@torch.library.custom_op("cs336::rmsnorm", mutates_args=())
def rmsnorm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    return _op_forward(x, weight, eps, out_dtype)


@rmsnorm_op.register_fake
def _(x, weight, eps, out_dtype=None):
    return (torch.empty_like(x, dtype=out_dtype or x.dtype, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("cs336::rmsnorm_backward", mutates_args=())
def rmsnorm_backward_op(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                        rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _op_backward_body(grad_y, x, weight, rstd)


@rmsnorm_backward_op.register_fake
def _(grad_y, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight = inputs[:2]
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, grad_y, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rmsnorm_backward_op(grad_y, x, weight, rstd)
    return dx, dw, None, None


rmsnorm_op.register_autograd(_op_backward, setup_context=_setup_context)


# The same two operators as triton_ops (`triton_ops_enabled`): torch.compile traces their bodies, so inductor launches
# the kernels from its own code (no Python of ours per call). No fake rules: the bodies trace on fake tensors.
# Defined only where Triton is installed (torch warns at the definition otherwise).
if triton_installed():
    @torch.library.triton_op("cs336::rmsnorm_traced", mutates_args=())
    def rmsnorm_traced_op(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        return _op_forward(x, weight, eps, out_dtype, launch=launch_wrapped)

    @torch.library.triton_op("cs336::rmsnorm_traced_backward", mutates_args=())
    def rmsnorm_traced_backward_op(grad_y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                                   rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _op_backward_body(grad_y, x, weight, rstd, launch=launch_wrapped)

    def _traced_op_backward(ctx, grad_y, _grad_rstd):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rmsnorm_traced_backward_op(grad_y, x, weight, rstd)
        return dx, dw, None, None

    rmsnorm_traced_op.register_autograd(_traced_op_backward, setup_context=_setup_context)


class RMSNormFunction(torch.autograd.Function):
    """The eager path: the same launchers as the operators, without their dispatch cost."""

    @staticmethod
    def forward(ctx, x, weight, eps: float, out_dtype=None):
        x2d = x.reshape(-1, x.shape[-1]).contiguous()  # (rows, d)
        y, rstd = _forward(x2d, weight, eps, out_dtype=out_dtype)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x2d, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(grad_y.reshape(x2d.shape).contiguous(), x2d, weight, rstd)
        return dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None, None


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused RMSNorm. x (..., d) fp32/bf16/fp16, weight (d,) -> (..., d) in `out_dtype` (default x's).

    out_dtype: the fp32 result rounded once to this dtype as it is stored, e.g. autocast's bf16 where the next op
    is a product that would cast it anyway: the same values, without an fp32 tensor and a cast kernel each way
    (the gradient arrives in that dtype and is read as it is). dx stays in x's dtype."""
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rmsnorm: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"rmsnorm: the last dim must be at most {MAX_D} (one row in registers), got {x.shape[-1]}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"rmsnorm: x must be float32, bfloat16 or float16, got {x.dtype}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"rmsnorm: out_dtype must be None, float32, bfloat16 or float16, got {out_dtype}")
    if eps <= 0:
        raise ValueError(f"rmsnorm: eps must be positive, got {eps}")
    check_operator_device("rmsnorm", x, weight)
    if compiling():
        return (rmsnorm_traced_op if triton_ops_enabled() else rmsnorm_op)(x, weight, eps, out_dtype)[0]
    return RMSNormFunction.apply(x, weight.contiguous(), eps, out_dtype)
