"""The SwiGLU gate, fused in Triton: silu_mul(a, b) = silu(a) * b = a * sigmoid(a) * b.

Reference: `silu_mul_reference(a, b)`, the eager expression cs336_basics.model.SwiGLU uses
between its w1/w3 and w2 matmuls.

Why a kernel: eagerly that is three kernels (sigmoid, two multiplies), and autograd keeps a,
sigmoid(a), silu(a) and b: four (tokens, d_ff) tensors beside the product that w2 saves. The
fused Function saves only a and b and recomputes sigmoid in backward:
    s = sigmoid(a),  da = dy * b * s * (1 + a * (1 - s)),  db = dy * a * s.
Elementwise over the flattened tensors, fp32 in registers, results in the inputs' dtype.
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests; on the CPU otherwise the same maths in torch.
Layers as rmsnorm.py's: reference, kernels, launchers, the operators `cs336::silu_mul(_backward)` and
`cs336::silu_mul_packed(_backward)` (and their triton_op forms), the eager Functions, `silu_mul`.

`silu_mul_packed(gate_up)` is the same gate over one (..., 2 d_ff) tensor whose first half of each row is a and
second half b: the output of one product with w1 and w3 stacked (`fused_model.merged_product`). Its backward
writes (da | db) as one tensor of that shape, which the product's backward takes whole: one product each for the
input's and the weights' gradients, where two separate projections take two each and an add.
"""

from __future__ import annotations

import functools

import torch

from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import (
    check_operator_device,
    compiling,
    launch_wrapped,
    runs_kernel,
    triton_installed,
    triton_ops_enabled,
)

BLOCK = 1024


def silu_mul_reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a * torch.sigmoid(a) * b


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def silu_mul_forward_kernel(a_ptr, b_ptr, y_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        tl.store(y_ptr + offs, (a * s * b).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def silu_mul_backward_kernel(a_ptr, b_ptr, dy_ptr, da_ptr, db_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        a = tl.load(a_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        tl.store(da_ptr + offs, (dy * b * s * (1.0 + a * (1.0 - s))).to(da_ptr.dtype.element_ty), mask=mask)
        tl.store(db_ptr + offs, (dy * a * s).to(db_ptr.dtype.element_ty), mask=mask)

    return silu_mul_forward_kernel, silu_mul_backward_kernel


@functools.cache
def _packed_kernel():
    import triton
    import triton.language as tl

    # One program per (row, BLOCK columns of d_ff): a row's gate and up halves are read at the same offsets.
    # Forward: out (rows, d_ff) <- silu(a) * b. BACKWARD: out (rows, 2 d_ff) <- (da | db) from dy (rows, d_ff).
    @triton.jit
    def silu_mul_packed_kernel(gate_up_ptr, dy_ptr, out_ptr, d_ff, stride_gate_up, stride_dy, stride_out,
                               BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d_ff
        gate = gate_up_ptr + row * stride_gate_up + cols
        a = tl.load(gate, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(gate + d_ff, mask=mask, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-a))
        out = out_ptr + row * stride_out + cols
        if BACKWARD:
            dy = tl.load(dy_ptr + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out, (dy * b * s * (1.0 + a * (1.0 - s))).to(out_ptr.dtype.element_ty), mask=mask)
            tl.store(out + d_ff, (dy * a * s).to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out, (a * s * b).to(out_ptr.dtype.element_ty), mask=mask)

    return silu_mul_packed_kernel


def _grid(n: int):
    return ((n + BLOCK - 1) // BLOCK,)


def _forward(a: torch.Tensor, b: torch.Tensor, launch=launch_plan.launch) -> torch.Tensor:
    """silu(a) * b of contiguous a, b: the kernel where it runs (`runs_kernel`), the reference maths elsewhere.
    `launch`: `launch_plan.launch` (eager), or `launch_wrapped` inside a triton_op."""
    if not runs_kernel(a):
        acc = torch.promote_types(a.dtype, torch.float32)
        return silu_mul_reference(a.to(acc), b.to(acc)).to(a.dtype)
    forward_kernel, _ = _kernels()
    y = torch.empty_like(a)
    if a.numel():
        launch(forward_kernel, _grid(a.numel()), a, b, y, a.numel(), BLOCK=BLOCK)
    return y


def _backward(grad_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, in_place: bool = False,
              launch=launch_plan.launch) -> tuple[torch.Tensor, torch.Tensor]:
    """(da, db) of contiguous tensors; with `in_place`, written over a and b (each element is read before its
    gradient is stored at the same place), whose version counters are bumped so any other saved copy of them fails
    loudly on use instead of reading gradients."""
    if not runs_kernel(a):
        acc = torch.promote_types(a.dtype, torch.float32)
        af, bf, dy = a.to(acc), b.to(acc), grad_y.to(acc)
        s = torch.sigmoid(af)
        da, db = (dy * bf * s * (1 + af * (1 - s))).to(a.dtype), (dy * af * s).to(b.dtype)
        if not in_place:
            return da, db
        return a.copy_(da), b.copy_(db)  # (copy_ bumps their version counters itself)
    _, backward_kernel = _kernels()
    if in_place:
        for t in (a, b):  # one tensor a call: the form every torch since 2.1 takes
            torch.autograd.graph.increment_version(t)
    da, db = (a, b) if in_place else (torch.empty_like(a), torch.empty_like(b))
    if a.numel():
        launch(backward_kernel, _grid(a.numel()), a, b, grad_y, da, db, a.numel(), BLOCK=BLOCK)
    return da, db


def _packed_grid(rows: int, d_ff: int):
    return (rows, (d_ff + BLOCK - 1) // BLOCK)


def _packed_forward(gate_up: torch.Tensor, launch=launch_plan.launch) -> torch.Tensor:
    """silu(a) * b of a contiguous (..., 2 d_ff) gate_up = (a | b), as (..., d_ff). `launch` as `_forward`'s."""
    d_ff = gate_up.shape[-1] // 2
    if not runs_kernel(gate_up):
        acc = torch.promote_types(gate_up.dtype, torch.float32)
        return silu_mul_reference(gate_up[..., :d_ff].to(acc), gate_up[..., d_ff:].to(acc)).to(gate_up.dtype)
    y = gate_up.new_empty(gate_up.shape[:-1] + (d_ff,))
    rows = y.numel() // max(d_ff, 1)
    if y.numel():  # (dy is not read going forward: gate_up stands in for it)
        launch(_packed_kernel(), _packed_grid(rows, d_ff), gate_up, gate_up, y, d_ff, 2 * d_ff, 0, d_ff,
               BACKWARD=False, BLOCK=BLOCK)
    return y


def _packed_backward(grad_y: torch.Tensor, gate_up: torch.Tensor, in_place: bool,
                     launch=launch_plan.launch) -> torch.Tensor:
    """(da | db) of contiguous tensors, shaped as gate_up; with `in_place` written over gate_up (each element is
    read before its gradient is stored there; the version counter is bumped as `_backward`'s)."""
    d_ff = gate_up.shape[-1] // 2
    if not runs_kernel(gate_up):  # (in place: `_backward` copies da and db into gate_up's two halves)
        da, db = _backward(grad_y, gate_up[..., :d_ff], gate_up[..., d_ff:], in_place=in_place)
        return gate_up if in_place else torch.cat((da, db), dim=-1)
    if in_place:
        torch.autograd.graph.increment_version(gate_up)
    grad = gate_up if in_place else torch.empty_like(gate_up)
    rows = grad_y.numel() // max(d_ff, 1)
    if grad_y.numel():
        launch(_packed_kernel(), _packed_grid(rows, d_ff), gate_up, grad_y, grad, d_ff, 2 * d_ff, d_ff, 2 * d_ff,
               BACKWARD=True, BLOCK=BLOCK)
    return grad


# The registered operators: what torch.compile sees (`compiling`).
@torch.library.custom_op("cs336::silu_mul", mutates_args=())
def silu_mul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _forward(a.contiguous(), b.contiguous())


@silu_mul_op.register_fake
def _(a, b):
    return torch.empty_like(a, memory_format=torch.contiguous_format)


@torch.library.custom_op("cs336::silu_mul_backward", mutates_args=())
def silu_mul_backward_op(grad_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(grad_y.contiguous(), a.contiguous(), b.contiguous())


@silu_mul_backward_op.register_fake
def _(grad_y, a, b):
    return (torch.empty_like(a, memory_format=torch.contiguous_format),
            torch.empty_like(b, memory_format=torch.contiguous_format))


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, grad_y):
    return silu_mul_backward_op(grad_y, *ctx.saved_tensors)


silu_mul_op.register_autograd(_op_backward, setup_context=_setup_context)


# The packed gate's operators (out of place: inductor plans its own buffers).
@torch.library.custom_op("cs336::silu_mul_packed", mutates_args=())
def silu_mul_packed_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _packed_forward(gate_up.contiguous())


@silu_mul_packed_op.register_fake
def _(gate_up):
    return gate_up.new_empty(gate_up.shape[:-1] + (gate_up.shape[-1] // 2,))


@torch.library.custom_op("cs336::silu_mul_packed_backward", mutates_args=())
def silu_mul_packed_backward_op(grad_y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
    return _packed_backward(grad_y.contiguous(), gate_up.contiguous(), in_place=False)


@silu_mul_packed_backward_op.register_fake
def _(grad_y, gate_up):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _packed_op_backward(ctx, grad_y):
    return silu_mul_packed_backward_op(grad_y, *ctx.saved_tensors)


silu_mul_packed_op.register_autograd(_packed_op_backward, setup_context=_setup_context)


# The same two operators as triton_ops (`triton_ops_enabled`; rmsnorm.py's say why).
# Defined only where Triton is installed (torch warns at the definition otherwise).
if triton_installed():
    @torch.library.triton_op("cs336::silu_mul_traced", mutates_args=())
    def silu_mul_traced_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return _forward(a.contiguous(), b.contiguous(), launch=launch_wrapped)

    @torch.library.triton_op("cs336::silu_mul_traced_backward", mutates_args=())
    def silu_mul_traced_backward_op(grad_y: torch.Tensor, a: torch.Tensor, b: torch.Tensor
                                    ) -> tuple[torch.Tensor, torch.Tensor]:
        return _backward(grad_y.contiguous(), a.contiguous(), b.contiguous(), launch=launch_wrapped)

    def _traced_op_backward(ctx, grad_y):
        return silu_mul_traced_backward_op(grad_y, *ctx.saved_tensors)

    silu_mul_traced_op.register_autograd(_traced_op_backward, setup_context=_setup_context)

    @torch.library.triton_op("cs336::silu_mul_packed_traced", mutates_args=())
    def silu_mul_packed_traced_op(gate_up: torch.Tensor) -> torch.Tensor:
        return _packed_forward(gate_up.contiguous(), launch=launch_wrapped)

    @torch.library.triton_op("cs336::silu_mul_packed_traced_backward", mutates_args=())
    def silu_mul_packed_traced_backward_op(grad_y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        return _packed_backward(grad_y.contiguous(), gate_up.contiguous(), in_place=False, launch=launch_wrapped)

    def _packed_traced_op_backward(ctx, grad_y):
        return silu_mul_packed_traced_backward_op(grad_y, *ctx.saved_tensors)

    silu_mul_packed_traced_op.register_autograd(_packed_traced_op_backward, setup_context=_setup_context)


class SiluMulFunction(torch.autograd.Function):
    """The eager path: the same launchers as the operators, without their dispatch cost."""

    @staticmethod
    def forward(ctx, a, b, backward_in_place=False):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        ctx.backward_in_place = backward_in_place
        return _forward(a, b)

    @staticmethod
    def backward(ctx, grad_y):
        return *_backward(grad_y.contiguous(), *ctx.saved_tensors, in_place=ctx.backward_in_place), None


def silu_mul(a: torch.Tensor, b: torch.Tensor, *, backward_in_place: bool = False) -> torch.Tensor:
    """silu(a) * b, fused. a, b: same shape and floating dtype.

    backward_in_place: the backward writes da and db over a and b instead of two new tensors (two (tokens, d_ff)
    tensors less at the backward's peak, as Liger-Kernel's gate does). Only for a caller that owns a and b and reads
    them after the forward through nothing but this gate (our fused SwiGLU: the w1 and w3 products); leaves, the
    user's own tensors, are refused. Any other autograd user of a or b fails loudly ("modified by an inplace
    operation"). Under torch.compile the operator path stays out of place (inductor plans its own buffers)."""
    if a.shape != b.shape:
        raise ValueError(f"silu_mul: a and b must have the same shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or not a.dtype.is_floating_point:
        raise TypeError(f"silu_mul: a and b must share one floating dtype, got {a.dtype} and {b.dtype}")
    check_operator_device("silu_mul", a, b)
    if compiling():
        return (silu_mul_traced_op if triton_ops_enabled() else silu_mul_op)(a, b)
    if backward_in_place and torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        if a.is_leaf or b.is_leaf:
            raise ValueError("silu_mul: backward_in_place=True writes the gradients over a and b, so neither may be a "
                             "leaf tensor (the caller's own data); got a leaf: pass backward_in_place=False")
    return SiluMulFunction.apply(a, b, backward_in_place)


class SiluMulPackedFunction(torch.autograd.Function):
    """`silu_mul_packed`'s eager path (no operator: it is used where torch.compile is not tracing)."""

    @staticmethod
    def forward(ctx, gate_up, backward_in_place=False):
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        ctx.backward_in_place = backward_in_place
        return _packed_forward(gate_up)

    @staticmethod
    def backward(ctx, grad_y):
        return _packed_backward(grad_y.contiguous(), *ctx.saved_tensors, in_place=ctx.backward_in_place), None


def silu_mul_packed(gate_up: torch.Tensor, *, backward_in_place: bool = False) -> torch.Tensor:
    """silu(a) * b for gate_up = (a | b) along its last dim (..., 2 d_ff): the fused gate over one product of x with
    w1 and w3 stacked. Its gradient is one tensor shaped as gate_up (`backward_in_place`: written over it, as
    `silu_mul`'s; under torch.compile, where its operator runs, out of place)."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"silu_mul_packed: gate_up's last dim must be even (a | b), got shape {tuple(gate_up.shape)}")
    if not gate_up.dtype.is_floating_point:
        raise TypeError(f"silu_mul_packed: gate_up must be floating point, got {gate_up.dtype}")
    check_operator_device("silu_mul_packed", gate_up)
    if compiling():
        return (silu_mul_packed_traced_op if triton_ops_enabled() else silu_mul_packed_op)(gate_up)
    if backward_in_place and torch.is_grad_enabled() and gate_up.requires_grad and gate_up.is_leaf:
        raise ValueError("silu_mul_packed: backward_in_place=True writes the gradient over gate_up, so it may not be "
                         "a leaf tensor (the caller's own data); got a leaf: pass backward_in_place=False")
    return SiluMulPackedFunction.apply(gate_up, backward_in_place)
