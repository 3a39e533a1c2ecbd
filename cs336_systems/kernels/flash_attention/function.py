"""Our Triton FlashAttention-2 as PyTorch sees it: `flash_attention`, the autograd Function, and the registered
operators `cs336::flash_attention_forward` / `cs336::flash_attention_backward` (fake and autograd rules: what
torch.compile traces, with dynamic shapes and no graph break). Which kernels a call runs, and how, is
dispatch.py's (on the CPU without Triton's interpreter: the reference maths); native_launch.py replays repeat
calls from C++.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

from cs336_systems.kernels.flash_attention import dispatch, native_launch
from cs336_systems.kernels.flash_attention.precision import (
    checked,
    dot_precision,
    fp32_dot_precision,
    fp32_dot_precision_override,
)
from cs336_systems.kernels.flash_attention.reference import compiled_backward

# Defined through `torch.library.Library`, not `torch.library.custom_op`: the same schema, fake and autograd rules
# (opcheck tests them), without custom_op's Python wrapper around each call (its output-aliasing check and its
# dynamo-disabling decorator), which cost about 15 us a call on a 2-core CPU (52 against 37 us, a trivial body,
# with the autograd rule) and runs twice a layer and step in every compiled graph.
_LIBRARY = torch.library.Library("cs336", "FRAGMENT")
_LIBRARY.define("flash_attention_forward(Tensor q, Tensor k, Tensor v, bool is_causal, str backward='triton') "
                "-> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIBRARY.define("flash_attention_backward(Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor grad_out, "
                "bool is_causal, str backward='triton') -> (Tensor, Tensor, Tensor)",
                tags=(torch.Tag.pt2_compliant_tag,))


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                  backward: str = "triton") -> tuple[torch.Tensor, torch.Tensor]:
    """`cs336::flash_attention_forward`, (O, L), differentiable through `cs336::flash_attention_backward` with the
    `backward` implementation (one of `dispatch.BACKWARD_IMPLS`). torch.compile traces it (`flash_attention`
    calls it while tracing), and selective checkpointing (`every-block+keep-attn`) sees one op per attention
    call and saves its outputs instead of recomputing them. On CUDA a native plan replays its kernels from C++
    (`native_launch.forward`): no Python launch path between a compiled graph and the launches."""
    if native_launch.native_enabled() and _native_plannable(q):
        result = native_launch.forward(q, k, v, is_causal, backward)
        if result is not None:
            return result
    return dispatch.flash_forward(q, k, v, is_causal)


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                   grad_out: torch.Tensor, is_causal: bool,
                   backward: str = "triton") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`cs336::flash_attention_backward`: (dQ, dK, dV) of the forward's (O, L) and dO, by the `backward`
    implementation."""
    if native_launch.native_enabled() and _native_plannable(q):
        result = native_launch.backward(q, k, v, out, lse, grad_out, is_causal, backward)
        if result is not None:
            return result
    return _attention_backward(q, k, v, out, lse, grad_out, is_causal, backward, dot_precision(q.dtype))


# (CompositeExplicitAutograd: one body for every device, as custom_op registers it; the CPU runs the reference maths)
_LIBRARY.impl("flash_attention_forward", _forward_impl, "CompositeExplicitAutograd")
_LIBRARY.impl("flash_attention_backward", _backward_impl, "CompositeExplicitAutograd")
flash_attention_forward_op = torch.ops.cs336.flash_attention_forward.default
flash_attention_backward_op = torch.ops.cs336.flash_attention_backward.default


@torch.library.register_fake("cs336::flash_attention_forward", lib=_LIBRARY)
def _(q, k, v, is_causal, backward="triton"):
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.register_fake("cs336::flash_attention_backward", lib=_LIBRARY)
def _(q, k, v, out, lse, grad_out, is_causal, backward="triton"):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _native_plannable(q: torch.Tensor) -> bool:
    """Whether a call on these inputs may take a native plan: CUDA, and for fp32 no dot precision set for the call
    (the native plans key on `allow_tf32` only)."""
    return q.device.type == "cuda" and (q.dtype != torch.float32 or fp32_dot_precision_override() is None)


def _setup_context(ctx, inputs, output):
    q, k, v, is_causal, backward = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.is_causal, ctx.backward_impl = is_causal, backward


def _op_backward(ctx, grad_out, _grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    return (*flash_attention_backward_op(q, k, v, out, lse, grad_out, ctx.is_causal, ctx.backward_impl),
            None, None)


torch.library.register_autograd("cs336::flash_attention_forward", _op_backward, setup_context=_setup_context,
                                lib=_LIBRARY)


def _attention_forward(q, k, v, is_causal: bool, backward: str):
    """The forward through the registered op where something above the dispatcher needs to see it (a
    torch dispatch mode such as selective checkpointing or fake tensors, or torch.compile), else the launcher
    directly: the op's eager dispatch costs about as much host time as the kernel launch itself, which is
    what a short sequence's call is made of (`scripts/attention_host_overhead.py`)."""
    if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
        return flash_attention_forward_op(q, k, v, is_causal, backward)
    return dispatch.flash_forward(q, k, v, is_causal)


def _attention_backward(q, k, v, out, lse, grad_out, is_causal: bool, backward: str, precision: str):
    if backward == "compile":
        return compiled_backward(q, k, v, out, lse, grad_out, is_causal)
    with fp32_dot_precision(precision):  # (16-bit inputs: "tf32", which their dots ignore)
        return dispatch.flash_backward(q, k, v, out, lse, grad_out, is_causal, dispatch.BACKWARD_OPTIONS[backward])


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and backward (`dispatch.choose_backward`'s default: two passes, or one
    pass where `hopper_backward.one_pass_by_default` says).

    `apply(q, k, v, is_causal=False, backward="triton")`, backward one of `BACKWARD_IMPLS` (see
    `flash_attention`); saves (L, Q, K, V, O) with L of shape q.shape[:-1].
    """

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False, backward="triton"):
        if torch.compiler.is_compiling() or is_in_torch_dispatch_mode():
            dispatch.validate_attention_inputs(q, k, v)  # (fake tensors never reach flash_forward, which validates)
        out, lse = _attention_forward(q, k, v, bool(is_causal), backward)
        ctx.save_for_backward(lse, q, k, v, out)
        ctx.is_causal = bool(is_causal)
        ctx.backward_impl = backward
        ctx.precision = dot_precision(q.dtype)  # the backward's dots match the forward's, whatever is set by then
        return out

    @staticmethod
    def backward(ctx, grad_out):
        lse, q, k, v, out = ctx.saved_tensors
        dq, dk, dv = _attention_backward(q, k, v, out, lse, grad_out, ctx.is_causal, ctx.backward_impl,
                                         ctx.precision)
        return dq, dk, dv, None, None


LAUNCHERS = ("python", "native")


def flash_attention(q, k, v, is_causal: bool = False, *, backward: str = "triton",
                    launcher: str | None = None, fp32_precision: str | None = None) -> torch.Tensor:
    """Our Triton FlashAttention-2. backward: "triton" (the fastest measured: two deterministic passes, in Gluon
    on Hopper where the inputs qualify, but one pass where `hopper_backward.one_pass_by_default` says), "two-pass"
    (always the two passes: bit-reproducible), "tl" (the two passes in `tl` everywhere), "fused" (one pass, dQ
    reduced across key tiles in fp32) or "compile" (torch.compile'd PyTorch, the handout's first step).
    launcher: "python" (this module's autograd Function; repeat calls replay `launch_plan` plans), "native"
    (repeat calls replayed by a C++ autograd node, `native_launch.py`, where a plan can be made: CUDA, not
    under torch.compile or a dispatch mode, not backward="compile"; else the Python path) or None (default:
    "native" unless `native_launch.use_native(False)` or CS336_FLASH_NATIVE=0 turned it off).
    fp32_precision: the dot precision of fp32 inputs for this call ("ieee", "tf32x3" or "tf32"; `precision.py`),
    None: as set for the process. fp32 calls with a precision set take the Python launcher (the native plans
    key on `allow_tf32` only)."""
    if checked(fp32_precision, "flash_attention: fp32_precision") is not None:
        with fp32_dot_precision(fp32_precision):
            return flash_attention(q, k, v, is_causal, backward=backward, launcher=launcher)
    if backward not in dispatch.BACKWARD_IMPLS:
        raise ValueError(f"flash_attention: backward must be one of {', '.join(dispatch.BACKWARD_IMPLS)}, "
                         f"got {backward!r}")
    if launcher is None:
        launcher = "native" if native_launch.native_enabled() else "python"
    elif launcher not in LAUNCHERS:
        raise ValueError(f"flash_attention: launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    if torch.compiler.is_compiling():  # the registered operator and its autograd rule: fullgraph, dynamic shapes
        dispatch.validate_attention_inputs(q, k, v)
        return flash_attention_forward_op(q, k, v, bool(is_causal), backward)[0]
    # (Under a torch dispatch mode, selective checkpointing's, the Function path runs: the mode must see the
    # forward operator, which the C++ node would not show it.)
    if (launcher == "native" and isinstance(q, torch.Tensor) and _native_plannable(q)
            and not is_in_torch_dispatch_mode()):
        out = native_launch.attention(q, k, v, is_causal, backward)
        if out is not None:
            return out
    return FlashAttentionTriton.apply(q, k, v, is_causal, backward)
