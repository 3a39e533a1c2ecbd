"""Fused rotary position embedding in Triton, on interleaved pairs as cs336_basics' RotaryEmbedding:
(x[2i], x[2i+1]) -> (cos t x[2i] - sin t x[2i+1], sin t x[2i] + cos t x[2i+1]), t = pos * theta^(-2i/dim).

Reference: `rope_reference(x, pos_ids, cache)`, the eager maths of RotaryEmbedding.forward.

Why a kernel: eagerly RoPE is about eight kernels per call (two strided slices, four multiplies,
an add, a subtract, a stack and a cast) on each of Q and K; this is one read and one write.
Backward is the inverse rotation (by -t) of the incoming gradient, the same kernel with the sign
of sin flipped; only the positions and the cos/sin cache are kept for it.

Layout: x is read as (batch, heads, seq, dim) with any strides but a unit one along dim, so the
model's head-split view of the projection output ((batch, seq, heads, dim) in memory) is rotated in
place of a copy, and the output keeps x's layout (`torch.empty_like`): the attention after it reads
the same strided view, and the gradient flows back through the views without copies. A program
takes BLOCK_S positions of one batch row and walks the heads; when every head shares the
positions (the model's case: positions broadcast over heads) cos and sin are loaded once for all
its heads; where batch x position blocks give fewer than `MIN_PROGRAMS` programs, the heads are split over
programs too (a small model's call would otherwise leave most SMs idle). Rows are loaded whole (one vectorised
load) and split into their pairs in registers.
Runs under TRITON_INTERPRET=1 on CPU tensors for the tests; on the CPU otherwise the same maths in torch.
Q and K in one launch (`rope_pair`): the model rotates both by the same positions, and at a small model's size a
call's time is mostly its launch, so the pair takes the same kernel over twice the head groups (the second half
rotating K).
Layers as rmsnorm.py's: reference, kernel, launcher (`_rotate`), the operators `cs336::rope` and `cs336::rope_pair`
(each its own backward, by -t), the eager Function, `rope` and `rope_pair`.
"""

from __future__ import annotations

import functools
import weakref

import torch

from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import (
    cdiv,
    check_operator_device,
    compiling,
    launch_wrapped,
    next_power_of_2,
    runs_kernel,
    triton_installed,
    triton_ops_enabled,
)

TILE_ELEMENTS = 4096  # positions x dim per head step: BLOCK_S = TILE_ELEMENTS // padded dim
MIN_PROGRAMS = 528  # programs a launch should have (4 per SM of an H100/H200) before heads share a program


def rope_reference(x: torch.Tensor, pos_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """x (..., seq, dim), pos_ids broadcastable to (..., seq), cache (2, context, dim/2) of cos, sin."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cache[:, pos_ids]
    return torch.stack((cos * x1 - sin * x2, sin * x1 + cos * x2), dim=-1).flatten(-2).to(x.dtype)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def rope_kernel(x_ptr, y_ptr, pos_ptr, cache_ptr, out_ptr, out_y_ptr, n_heads, heads_per_program, head_groups,
                    seq, dim, context,
                    stride_xb, stride_xh, stride_xs, stride_ob, stride_oh, stride_os, stride_pb, stride_ph, stride_ps,
                    SIGN: tl.constexpr, HEADS_SHARE_POS: tl.constexpr, PAIR: tl.constexpr, BLOCK_S: tl.constexpr,
                    BLOCK_D: tl.constexpr):
        b = tl.program_id(1).to(tl.int64)
        group = tl.program_id(2)
        if PAIR:  # the second half of the head groups rotates y (K) into out_y, with x's (Q's) strides and positions
            if group >= head_groups:
                group -= head_groups
                x_ptr = y_ptr
                out_ptr = out_y_ptr
        first_head = group * heads_per_program  # this program's heads: first_head onwards
        s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        cols = tl.arange(0, BLOCK_D)
        mask = (s[:, None] < seq) & (cols[None, :] < dim)
        pairs = tl.arange(0, BLOCK_D // 2)
        pair_mask = (s[:, None] < seq) & (pairs[None, :] < dim // 2)
        head = first_head.to(tl.int64)
        x_rows = x_ptr + b * stride_xb + head * stride_xh + s[:, None].to(tl.int64) * stride_xs + cols[None, :]
        out_rows = out_ptr + b * stride_ob + head * stride_oh + s[:, None].to(tl.int64) * stride_os + cols[None, :]
        pos_rows = pos_ptr + b * stride_pb + head * stride_ph + s * stride_ps
        if HEADS_SHARE_POS:
            angle = tl.load(pos_rows, mask=s < seq, other=0)[:, None] * (dim // 2) + pairs[None, :]
            cos = tl.load(cache_ptr + angle, mask=pair_mask, other=0.0).to(tl.float32)
            sin = SIGN * tl.load(cache_ptr + context * (dim // 2) + angle, mask=pair_mask, other=0.0).to(tl.float32)
        # Pointers step head by head (64-bit), rather than h * stride in 32 bits, which could overflow.
        for _ in range(tl.minimum(heads_per_program, n_heads - first_head)):
            if not HEADS_SHARE_POS:
                angle = tl.load(pos_rows, mask=s < seq, other=0)[:, None] * (dim // 2) + pairs[None, :]
                cos = tl.load(cache_ptr + angle, mask=pair_mask, other=0.0).to(tl.float32)
                sin = SIGN * tl.load(cache_ptr + context * (dim // 2) + angle, mask=pair_mask,
                                     other=0.0).to(tl.float32)
            x = tl.load(x_rows, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_S, BLOCK_D)
            x1, x2 = tl.split(tl.reshape(x, (BLOCK_S, BLOCK_D // 2, 2)))  # the even and odd elements
            y = tl.reshape(tl.join(cos * x1 - sin * x2, sin * x1 + cos * x2), (BLOCK_S, BLOCK_D))
            tl.store(out_rows, y.to(out_ptr.dtype.element_ty), mask=mask)
            x_rows += stride_xh
            out_rows += stride_oh
            pos_rows += stride_ph

    return rope_kernel


def _dense_strides(shape, stride) -> tuple:
    """Strides of the output buffer: dense, in x's order of dims (the model's head view (batch, heads, seq, dim) of a
    (batch, seq, heads * dim) product: attention then reads the same layout, and gradients flow back without copies),
    also where x has gaps (a column block of a merged Q/K/V product, `fused_model.merged_projection`); contiguous
    where x has no unit stride along dim or more than 4 dims."""
    dims = range(len(shape))
    order = (sorted(dims, key=lambda i: (-stride[i], i)) if stride[-1] == 1 and len(shape) <= 4
             else list(dims))  # outermost first (empty_like's, for dense x)
    strides, step = [0] * len(shape), 1
    for i in reversed(order):
        strides[i], step = step, step * shape[i]
    return tuple(strides)


def _output_like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(x.shape, _dense_strides(x.shape, x.stride()), device=x.device, dtype=x.dtype)


def _as_3d(values, fill) -> tuple:
    """(batch, heads, seq) of a tensor's trailing sizes or strides before dim (2-4 dims of x): a missing leading dim
    takes `fill` (size 1, or stride 0)."""
    return (fill,) * (3 - len(values)) + tuple(values)


def _geometry(shape, x_stride, pos_stride, context: int, tensors: int) -> tuple[tuple, tuple, tuple, dict]:
    """For x of `shape` (2-4 dims, unit stride along dim) and x_stride, positions broadcast to shape[:-1] with
    pos_stride, a cache of `context` positions, `tensors` (1 or 2) rotated: (the outputs' strides, the grid, the
    kernel's integer arguments, its constexprs)."""
    batch, heads, seq = _as_3d(shape[:-1], 1)
    dim = shape[-1]
    out_stride = _dense_strides(shape, x_stride)
    block_d = max(2, next_power_of_2(int(dim)))  # (constexprs: a traced head dim is specialised on)
    block_s = max(1, TILE_ELEMENTS // block_d)
    # Heads split across programs where batch x position blocks alone would leave the GPU idle (small/512:
    # 32 programs walking 12 heads each, 9 us a call at 0.7 TB/s); where there are programs enough, each walks
    # every head and loads its cos/sin once. (sym_min/sym_max: no guard on a traced size.)
    position_programs = cdiv(seq, block_s) * batch * tensors
    head_groups = torch.sym_min(heads, torch.sym_max(1, cdiv(MIN_PROGRAMS, position_programs)))
    heads_per_program = cdiv(heads, head_groups)
    head_groups = cdiv(heads, heads_per_program)
    pos3 = _as_3d(pos_stride, 0)
    ints = (heads, heads_per_program, head_groups, seq, dim, context, *_as_3d(x_stride[:-1], 0),
            *_as_3d(out_stride[:-1], 0), *pos3)
    constexprs = dict(HEADS_SHARE_POS=bool(heads == 1 or pos3[1] == 0), PAIR=tensors == 2, BLOCK_S=block_s,
                      BLOCK_D=block_d)
    return out_stride, (cdiv(seq, block_s), batch, head_groups * tensors), ints, constexprs


_eager_geometry = functools.lru_cache(maxsize=256)(_geometry)  # (eager calls: a handful of signatures per model)


def _pairable(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether one launch rotates x and y: the kernel walks both with x's shape, dtype and strides."""
    return (x.shape == y.shape and x.stride() == y.stride() and x.dtype == y.dtype and x.device == y.device
            and x.stride(-1) == 1 and x.dim() <= 4)


def _rotate(xs: tuple[torch.Tensor, ...], pos: torch.Tensor, cache: torch.Tensor, sign: float,
            launch=launch_plan.launch) -> tuple[torch.Tensor, ...]:
    """Rotate each of xs (one tensor, or Q and K) by sign x the angles of pos (broadcast to x.shape[:-1], typically
    with stride 0 over heads): the kernel where it runs (`runs_kernel`), the reference maths elsewhere; two tensors of
    one shape and layout in one launch (the model's Q and K: a launch fewer per layer and direction, which is most of
    a small model's RoPE time, about 9 us a call at small/512 on an H200). `launch`: `launch_plan.launch` (eager), or
    `launch_wrapped` inside a triton_op. Eagerly the launch's geometry is cached per signature (the host time of a
    call is a small model's step time)."""
    x = xs[0]
    if not runs_kernel(x):
        cos_sin = torch.stack((cache[0], sign * cache[1]))
        return tuple(_output_like(t).copy_(rope_reference(t.to(torch.promote_types(t.dtype, cache.dtype)), pos,
                                                          cos_sin)) for t in xs)
    if len(xs) == 2 and not _pairable(*xs):
        return _rotate(xs[:1], pos, cache, sign, launch) + _rotate(xs[1:], pos, cache, sign, launch)
    if x.stride(-1) != 1 or x.dim() > 4:  # (a single tensor: a pair is unit-stride and at most 4-D)
        shape = x.shape
        x = x.contiguous().reshape(-1, *shape[-3:]) if x.dim() > 4 else x.contiguous()
        pos = pos.reshape(-1, *pos.shape[-2:]) if pos.dim() > 3 else pos
        return (_rotate((x,), pos, cache, sign, launch)[0].reshape(shape),)

    shape, stride, pos_stride = tuple(x.shape), tuple(x.stride()), tuple(pos.stride())
    # (cached for plain integers only: a traced call's symbolic sizes cannot be hashed)
    concrete = all(type(value) is int for value in (*shape, *stride, *pos_stride))
    out_stride, grid, ints, constexprs = (_eager_geometry if concrete else _geometry)(
        shape, stride, pos_stride, cache.shape[1], len(xs))
    outs = tuple(torch.empty_strided(x.shape, out_stride, device=x.device, dtype=x.dtype) for _ in xs)
    if x.numel():
        launch(_kernel(), grid, x, xs[-1], pos, cache, outs[0], outs[-1], *ints, SIGN=sign, **constexprs)
    return outs


# The registered operators: what torch.compile sees (`compiling`), for one tensor and for a pair (the model's Q and
# K, one launch). The backward of each is itself, by the opposite angle.
@torch.library.custom_op("cs336::rope", mutates_args=())
def rope_op(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, sign: float) -> torch.Tensor:
    return _rotate((x,), pos, cache.contiguous(), sign)[0]


@rope_op.register_fake
def _(x, pos, cache, sign):
    return _output_like(x)


@torch.library.custom_op("cs336::rope_pair", mutates_args=())
def rope_pair_op(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, sign: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate((q, k), pos, cache.contiguous(), sign)


@rope_pair_op.register_fake
def _(q, k, pos, cache, sign):
    return _output_like(q), _output_like(k)


def _setup_context(ctx, inputs, output):
    *_, pos, cache, sign = inputs
    ctx.save_for_backward(pos, cache)
    ctx.sign = sign


def _op_backward(ctx, grad_out):
    pos, cache = ctx.saved_tensors
    return rope_op(grad_out, pos, cache, -ctx.sign), None, None, None


def _pair_op_backward(ctx, grad_q, grad_k):
    pos, cache = ctx.saved_tensors
    return *rope_pair_op(grad_q, grad_k, pos, cache, -ctx.sign), None, None, None


rope_op.register_autograd(_op_backward, setup_context=_setup_context)
rope_pair_op.register_autograd(_pair_op_backward, setup_context=_setup_context)


# The same operators as triton_ops (`triton_ops_enabled`; rmsnorm.py's say why).
# Defined only where Triton is installed (torch warns at the definition otherwise).
if triton_installed():
    @torch.library.triton_op("cs336::rope_traced", mutates_args=())
    def rope_traced_op(x: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, sign: float) -> torch.Tensor:
        return _rotate((x,), pos, cache.contiguous(), sign, launch=launch_wrapped)[0]

    @torch.library.triton_op("cs336::rope_pair_traced", mutates_args=())
    def rope_pair_traced_op(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, cache: torch.Tensor, sign: float
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        return _rotate((q, k), pos, cache.contiguous(), sign, launch=launch_wrapped)

    def _traced_op_backward(ctx, grad_out):
        pos, cache = ctx.saved_tensors
        return rope_traced_op(grad_out, pos, cache, -ctx.sign), None, None, None

    def _traced_pair_op_backward(ctx, grad_q, grad_k):
        pos, cache = ctx.saved_tensors
        return *rope_pair_traced_op(grad_q, grad_k, pos, cache, -ctx.sign), None, None, None

    rope_traced_op.register_autograd(_traced_op_backward, setup_context=_setup_context)
    rope_pair_traced_op.register_autograd(_traced_pair_op_backward, setup_context=_setup_context)


class RoPEFunction(torch.autograd.Function):
    """The eager path: the same launcher as the operators, without their dispatch cost; one tensor or a pair."""

    @staticmethod
    def forward(ctx, pos, cache, *xs):
        ctx.save_for_backward(pos, cache)
        return _rotate(xs, pos, cache, 1.0)

    @staticmethod
    def backward(ctx, *grads):
        pos, cache = ctx.saved_tensors
        return None, None, *_rotate(grads, pos, cache, -1.0)


_last_checked: tuple | None = None  # (a weak reference to the positions' base tensor, the view's geometry and
# version, the context they fit)


def _check_positions(pos_ids: torch.Tensor, context: int) -> None:
    """Positions outside [0, context) are an error, checked on the device (no host sync that would stall eager
    launch pipelining; the kernel would read past the cache). Four small kernels a check, so eagerly once per
    positions and version: the model rotates Q and K by the same ones, and with `apply_fused_kernels` every layer
    and step by views of one cached tensor (a view is told by its base tensor and its geometry)."""
    global _last_checked
    eager = not compiling()  # (compiled: the check is in the graph, once per traced call)
    if eager:
        base = pos_ids if pos_ids._base is None else pos_ids._base
        seen = (pos_ids.shape, pos_ids.stride(), pos_ids.storage_offset(), pos_ids._version, context)
        if _last_checked is not None and _last_checked[0]() is base and _last_checked[1] == seen:
            return
    torch._assert_async(((pos_ids >= 0) & (pos_ids < context)).all(), f"rope: positions must be in [0, {context})")
    if eager:  # (after the check: positions that failed it are checked again)
        _last_checked = (weakref.ref(base), seen)


def _checked_positions(name: str, xs: tuple[torch.Tensor, ...], pos_ids: torch.Tensor, cache: torch.Tensor
                       ) -> torch.Tensor:
    """pos_ids checked against the arguments and broadcast to xs[0].shape[:-1] (a view: no copy, and stride 0 over
    the heads)."""
    dim = xs[0].shape[-1]
    if dim % 2 or cache.dim() != 3 or cache.shape[0] != 2 or cache.shape[2] != dim // 2:
        raise ValueError(f"{name}: cache must be (2, context, {dim // 2}) for x of last dim {dim} "
                         f"(even), got {tuple(cache.shape)}")
    if pos_ids.dtype.is_floating_point:
        raise TypeError(f"{name}: pos_ids must be integers, got {pos_ids.dtype}")
    check_operator_device(name, *xs, pos_ids, cache)
    pos = torch.broadcast_to(pos_ids.to(torch.int64), xs[0].shape[:-1])
    if pos_ids.numel():
        _check_positions(pos_ids, cache.shape[1])
    return pos


def rope(x: torch.Tensor, pos_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """Fused RoPE. x (..., seq, dim) with dim even; pos_ids integer, broadcastable to (..., seq);
    cache (2, context, dim/2): cos and sin, as RotaryEmbedding's `_freq_cis_cache`."""
    pos = _checked_positions("rope", (x,), pos_ids, cache)
    if compiling():
        return (rope_traced_op if triton_ops_enabled() else rope_op)(x, pos, cache, 1.0)
    return RoPEFunction.apply(pos, cache.contiguous(), x)[0]


def rope_pair(q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, cache: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rope(q, pos_ids, cache), rope(k, pos_ids, cache))`, both in one launch where q and k share shape, dtype and
    layout (the model's Q and K: column blocks of one product), forward and backward."""
    if q.shape != k.shape:
        raise ValueError(f"rope_pair: q and k must have one shape, got {tuple(q.shape)} and {tuple(k.shape)}")
    pos = _checked_positions("rope_pair", (q, k), pos_ids, cache)
    if compiling():
        return (rope_pair_traced_op if triton_ops_enabled() else rope_pair_op)(q, k, pos, cache, 1.0)
    return RoPEFunction.apply(pos, cache.contiguous(), q, k)
