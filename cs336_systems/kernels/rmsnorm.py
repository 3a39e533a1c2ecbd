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

`add_rmsnorm(x, delta, weight)` is the residual add before a norm fused into it: (h = x + delta, rmsnorm(h)) from
one pass, the same kernels with the add switched on (a constexpr): the forward reads x and delta and writes h as
well, the backward adds h's own gradient to the norm's (and writes it once more in delta's dtype where that
differs: autocast's bf16 attention output on an fp32 residual stream).

Layers: reference; kernels; launchers (`_forward`, `_backward`: kernel or CPU maths); the registered operators
`cs336::rmsnorm` / `cs336::rmsnorm_backward` (fake and autograd rules: what torch.compile traces); the eager
autograd Function; `rmsnorm`, which validates and picks the operator (compiling) or the Function (eager); then the
same layers for `add_rmsnorm`.
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
    def rmsnorm_forward_kernel(x_ptr, delta_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr, d, eps, ADD: tl.constexpr,
                               BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        mask = cols < d
        x = tl.load(x_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
        if ADD:  # h = x + delta, stored in h's dtype and normed as stored (what the unfused add hands the norm)
            x += tl.load(delta_ptr + row * d + cols, mask=mask, other=0.0).to(tl.float32)
            h = x.to(h_ptr.dtype.element_ty)
            tl.store(h_ptr + row * d + cols, h, mask=mask)
            x = h.to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / d + eps)
        tl.store(y_ptr + row * d + cols, (x * rstd * w).to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def rmsnorm_backward_kernel(x_ptr, w_ptr, dy_ptr, rstd_ptr, dh_ptr, dx_ptr, dx2_ptr, dw_partial_ptr, n_rows, d,
                                ADD_DH: tl.constexpr, SECOND_DX: tl.constexpr, BLOCK_D: tl.constexpr):
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
        if ADD_DH:
            dh_ptr += start
        if SECOND_DX:
            dx2_ptr += start
        for row in range(pid, n_rows, programs):
            x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            dy = tl.load(dy_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(rstd_ptr + row)
            x_hat = x * rstd
            g = dy * w
            dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / d))
            if ADD_DH:  # the fused add's residual path: h's own gradient joins the norm's
                dx += tl.load(dh_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                dh_ptr += step
            tl.store(dx_ptr + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if SECOND_DX:  # the same gradient in the other addend's dtype (autocast's bf16 delta of an fp32 stream)
                tl.store(dx2_ptr + cols, dx.to(dx2_ptr.dtype.element_ty), mask=mask)
                dx2_ptr += step
            dw += dy * x_hat
            x_ptr += step
            dy_ptr += step
            dx_ptr += step
        tl.store(dw_partial_ptr + pid.to(tl.int64) * d + cols, dw, mask=mask)

    return rmsnorm_forward_kernel, rmsnorm_backward_kernel


def _block_d(d: int) -> int:
    return next_power_of_2(d)


def _num_warps(block_d: int) -> int:
    # 8 elements a thread up to 2048 columns, 16 from 4096 on (at most 16 warps): at 4096 columns (xl's 2560, the 8B's
    # 4096) 8 warps move 37-42 % more bytes a second in the backward than 16 did, the forward a little more (H100,
    # scripts/rmsnorm_warps.py, notes/model_sizes.md); at 1024 and 2048 the counts measured alike.
    return max(1, block_d // 256) if block_d <= 2048 else min(16, block_d // 512)


def _forward(x2d: torch.Tensor, weight: torch.Tensor, eps: float, launch=launch_plan.launch,
             out_dtype: torch.dtype | None = None, delta2d: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h, y, rstd) of contiguous rows: h the normed rows (x itself, or with `delta2d` the sum x + delta in their
    promoted dtype, written by the same pass), y = rmsnorm(h) in `out_dtype` (default h's): the kernel where it runs
    (`runs_kernel`), the reference maths elsewhere. `launch`: `launch_plan.launch` (eager), or `launch_wrapped`
    inside a triton_op."""
    h_dtype = x2d.dtype if delta2d is None else torch.promote_types(x2d.dtype, delta2d.dtype)
    out_dtype = out_dtype or h_dtype
    if not runs_kernel(x2d):
        acc = torch.promote_types(h_dtype, torch.float32)
        h = x2d if delta2d is None else (x2d.to(acc) + delta2d.to(acc)).to(h_dtype)
        rstd = torch.rsqrt(h.to(acc).pow(2).mean(-1) + eps)
        return h, (h.to(acc) * rstd[:, None] * weight.to(acc)).to(out_dtype), rstd.to(torch.float32)
    forward_kernel, _ = _kernels()
    h = x2d if delta2d is None else torch.empty_like(x2d, dtype=h_dtype)
    y = torch.empty_like(x2d, dtype=out_dtype)
    rstd = torch.empty(x2d.shape[0], device=x2d.device, dtype=torch.float32)
    block_d = _block_d(int(x2d.shape[1]))  # (a constexpr: a traced width is specialised on)
    if x2d.shape[0]:
        launch(forward_kernel, (x2d.shape[0],), x2d, x2d if delta2d is None else delta2d, weight, h, y, rstd,
               x2d.shape[1], eps, ADD=delta2d is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    return h, y, rstd


def _backward(grad_y2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
              launch=launch_plan.launch, grad_h2d: torch.Tensor | None = None,
              second_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(dx in x's dtype, dx again in `second_dtype` or None, dw in weight's) of contiguous rows; grad_y in any float
    dtype (the output's). With `grad_h2d` (the fused add's: x is then h, and its own gradient arrives too) dx is the
    norm's input gradient plus grad_h: the gradient of both addends, one of them in `second_dtype` where given."""
    rows, d = x2d.shape
    if not runs_kernel(x2d):
        acc = torch.promote_types(x2d.dtype, torch.float32)
        x_hat = x2d.to(acc) * rstd.to(acc)[:, None]
        g = grad_y2d.to(acc) * weight.to(acc)
        dx = rstd.to(acc)[:, None] * (g - x_hat * (g * x_hat).mean(-1, keepdim=True))
        if grad_h2d is not None:
            dx = dx + grad_h2d.to(acc)
        return (dx.to(x2d.dtype), None if second_dtype is None else dx.to(second_dtype),
                (grad_y2d.to(acc) * x_hat).sum(0).to(weight.dtype))
    _, backward_kernel = _kernels()
    dx = torch.empty_like(x2d)
    dx2 = None if second_dtype is None else torch.empty_like(x2d, dtype=second_dtype)
    programs = torch.sym_max(1, torch.sym_min(DW_PROGRAMS, rows))  # (plain ints eagerly; traced sizes in a triton_op)
    dw_partial = torch.empty(programs, d, device=x2d.device, dtype=torch.float32)
    block_d = _block_d(int(d))
    if rows:
        launch(backward_kernel, (programs,), x2d, weight, grad_y2d, rstd, dx if grad_h2d is None else grad_h2d, dx,
               dx if dx2 is None else dx2, dw_partial, rows, d, ADD_DH=grad_h2d is not None,
               SECOND_DX=dx2 is not None, BLOCK_D=block_d, num_warps=_num_warps(block_d))
    else:
        dw_partial.zero_()
    return dx, dx2, dw_partial.sum(0).to(weight.dtype)


def _op_forward(x, weight, eps, out_dtype, launch=launch_plan.launch):
    """The operators' forward body (custom op and triton_op alike, by `launch`): rows flattened inside, so one graph
    serves every leading shape; (y, rstd) shaped as x and x's rows."""
    _, y, rstd = _forward(x.reshape(-1, x.shape[-1]).contiguous(), weight.contiguous(), eps, launch=launch,
                          out_dtype=out_dtype)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def _op_backward_body(grad_y, x, weight, rstd, launch=launch_plan.launch):
    """The backward operators' body, as `_op_forward`'s: (dx shaped as x, dw)."""
    d = x.shape[-1]
    dx, _, dw = _backward(grad_y.reshape(-1, d).contiguous(), x.reshape(-1, d).contiguous(), weight.contiguous(),
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
        _, y, rstd = _forward(x2d, weight, eps, out_dtype=out_dtype)
        ctx.save_for_backward(x2d, weight, rstd)
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad_y):
        x2d, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward(grad_y.reshape(x2d.shape).contiguous(), x2d, weight, rstd)
        return dx.view(ctx.x_shape), dw if ctx.needs_input_grad[1] else None, None, None


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_norm_inputs(name: str, x: torch.Tensor, weight: torch.Tensor, eps: float,
                       out_dtype: torch.dtype | None) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight must have shape ({x.shape[-1]},), got {tuple(weight.shape)}")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"{name}: the last dim must be at most {MAX_D} (one row in registers), got {x.shape[-1]}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: x must be float32, bfloat16 or float16, got {x.dtype}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: out_dtype must be None, float32, bfloat16 or float16, got {out_dtype}")
    if eps <= 0:
        raise ValueError(f"{name}: eps must be positive, got {eps}")


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
            out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Fused RMSNorm. x (..., d) fp32/bf16/fp16, weight (d,) -> (..., d) in `out_dtype` (default x's).

    out_dtype: the fp32 result rounded once to this dtype as it is stored, e.g. autocast's bf16 where the next op
    is a product that would cast it anyway: the same values, without an fp32 tensor and a cast kernel each way
    (the gradient arrives in that dtype and is read as it is). dx stays in x's dtype."""
    _check_norm_inputs("rmsnorm", x, weight, eps, out_dtype)
    check_operator_device("rmsnorm", x, weight)
    if compiling():
        return (rmsnorm_traced_op if triton_ops_enabled() else rmsnorm_op)(x, weight, eps, out_dtype)[0]
    return RMSNormFunction.apply(x, weight.contiguous(), eps, out_dtype)


# The residual add fused into the norm after it: h = x + delta, y = rmsnorm(h), in one pass. A pre-norm block's
# second norm reads the sum its first half makes (x + attn(ln1(x))); unfused, an add kernel writes h and the norm
# reads it back, and going backward the norm writes its input's gradient and an add kernel reads it back to join
# the residual path's (and casts it for autocast's bf16 delta). Fused, each direction is one pass, which reads and
# writes a quarter (forward) to a third (backward) fewer bytes (notes/model_sizes.md).
def _add_op_forward(x, delta, weight, eps, out_dtype, launch=launch_plan.launch):
    """The fused add's forward body, as `_op_forward`'s: (h, y, rstd) shaped as x, x and x's rows."""
    d = x.shape[-1]
    h, y, rstd = _forward(x.reshape(-1, d).contiguous(), weight.contiguous(), eps, launch=launch, out_dtype=out_dtype,
                          delta2d=delta.reshape(-1, d).contiguous())
    return h.view(x.shape), y.view(x.shape), rstd.view(x.shape[:-1])


def _add_op_backward_body(grad_h, grad_y, h, weight, rstd, second_dtype, launch=launch_plan.launch):
    """The fused add's backward body: (dh in h's dtype, dh in `second_dtype` -- an empty tensor where that is None:
    an operator's outputs cannot be None --, dw)."""
    d = h.shape[-1]
    dh, dh2, dw = _backward(grad_y.reshape(-1, d).contiguous(), h.reshape(-1, d).contiguous(), weight.contiguous(),
                            rstd.reshape(-1).contiguous(), launch=launch,
                            grad_h2d=None if grad_h is None else grad_h.reshape(-1, d).contiguous(),
                            second_dtype=second_dtype)
    return dh.view(h.shape), h.new_empty(0) if dh2 is None else dh2.view(h.shape), dw


@torch.library.custom_op("cs336::add_rmsnorm", mutates_args=())
def add_rmsnorm_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                   out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _add_op_forward(x, delta, weight, eps, out_dtype)


@add_rmsnorm_op.register_fake
def _(x, delta, weight, eps, out_dtype=None):
    h_dtype = torch.promote_types(x.dtype, delta.dtype)
    return (torch.empty_like(x, dtype=h_dtype, memory_format=torch.contiguous_format),
            torch.empty_like(x, dtype=out_dtype or h_dtype, memory_format=torch.contiguous_format),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("cs336::add_rmsnorm_backward", mutates_args=())
def add_rmsnorm_backward_op(grad_h: torch.Tensor | None, grad_y: torch.Tensor, h: torch.Tensor,
                            weight: torch.Tensor, rstd: torch.Tensor, second_dtype: torch.dtype | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _add_op_backward_body(grad_h, grad_y, h, weight, rstd, second_dtype)


@add_rmsnorm_backward_op.register_fake
def _(grad_h, grad_y, h, weight, rstd, second_dtype=None):
    second = h.new_empty(0) if second_dtype is None else torch.empty_like(h, dtype=second_dtype,
                                                                          memory_format=torch.contiguous_format)
    return torch.empty_like(h, memory_format=torch.contiguous_format), second, torch.empty_like(weight)


def _add_setup_context(ctx, inputs, output):
    delta, weight = inputs[1:3]
    ctx.save_for_backward(output[0], weight, output[2])
    ctx.delta_dtype = delta.dtype


def _addend_gradients(ctx, dh, dh2, dw):
    """(dx, ddelta, dw, None, None): both addends take h's gradient, delta in its own dtype where it differs
    (written by the kernel; where it is the same, one tensor serves both, as for torch's add)."""
    return dh, dh if ctx.delta_dtype == dh.dtype else dh2, dw, None, None


def _second_dtype(ctx, h):
    return None if ctx.delta_dtype == h.dtype else ctx.delta_dtype


def _add_op_backward(ctx, grad_h, grad_y, _grad_rstd):
    h, weight, rstd = ctx.saved_tensors
    return _addend_gradients(ctx, *add_rmsnorm_backward_op(grad_h, grad_y, h, weight, rstd, _second_dtype(ctx, h)))


add_rmsnorm_op.register_autograd(_add_op_backward, setup_context=_add_setup_context)

if triton_installed():
    @torch.library.triton_op("cs336::add_rmsnorm_traced", mutates_args=())
    def add_rmsnorm_traced_op(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                              out_dtype: torch.dtype | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _add_op_forward(x, delta, weight, eps, out_dtype, launch=launch_wrapped)

    @torch.library.triton_op("cs336::add_rmsnorm_traced_backward", mutates_args=())
    def add_rmsnorm_traced_backward_op(grad_h: torch.Tensor | None, grad_y: torch.Tensor, h: torch.Tensor,
                                       weight: torch.Tensor, rstd: torch.Tensor,
                                       second_dtype: torch.dtype | None = None
                                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _add_op_backward_body(grad_h, grad_y, h, weight, rstd, second_dtype, launch=launch_wrapped)

    def _traced_add_op_backward(ctx, grad_h, grad_y, _grad_rstd):
        h, weight, rstd = ctx.saved_tensors
        return _addend_gradients(ctx, *add_rmsnorm_traced_backward_op(grad_h, grad_y, h, weight, rstd,
                                                                      _second_dtype(ctx, h)))

    add_rmsnorm_traced_op.register_autograd(_traced_add_op_backward, setup_context=_add_setup_context)


class AddRMSNormFunction(torch.autograd.Function):
    """The fused add's eager path: the operators' bodies, without their dispatch cost."""

    @staticmethod
    def forward(ctx, x, delta, weight, eps: float, out_dtype=None):
        h, y, rstd = _add_op_forward(x, delta, weight, eps, out_dtype)
        ctx.save_for_backward(h, weight, rstd)
        ctx.delta_dtype = delta.dtype
        return h, y

    @staticmethod
    def backward(ctx, grad_h, grad_y):
        h, weight, rstd = ctx.saved_tensors
        return _addend_gradients(ctx, *_add_op_backward_body(grad_h, grad_y, h, weight, rstd, _second_dtype(ctx, h)))


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5, *,
                out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the RMSNorm after it in one pass: (h, y) with h = x + delta (in their promoted dtype, as
    torch's add) and y = rmsnorm(h, weight, eps, out_dtype=out_dtype). x and delta (..., d) of one shape."""
    if delta.shape != x.shape:
        raise ValueError(f"add_rmsnorm: delta must have x's shape {tuple(x.shape)}, got {tuple(delta.shape)}")
    if delta.dtype not in FLOAT_DTYPES:
        raise TypeError(f"add_rmsnorm: delta must be float32, bfloat16 or float16, got {delta.dtype}")
    _check_norm_inputs("add_rmsnorm", x, weight, eps, out_dtype)
    check_operator_device("add_rmsnorm", x, delta, weight)
    if compiling():
        op = add_rmsnorm_traced_op if triton_ops_enabled() else add_rmsnorm_op
        h, y, _ = op(x, delta, weight, eps, out_dtype)
        return h, y
    return AddRMSNormFunction.apply(x, delta, weight.contiguous(), eps, out_dtype)
