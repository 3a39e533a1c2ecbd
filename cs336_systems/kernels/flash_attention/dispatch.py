"""What runs for one attention call: inputs checked, kernels chosen, buffers allocated, launches made.

Inputs are 3-D (batch, seq, d) or 4-D (batch, heads, seq, d), any strides (the model's
head-split views are read in place), fp16 / bf16 / fp32, head dim 1..256 (padded in
registers to the next power of two, at least 16; fp32 up to 128), any sequence lengths,
n_queries != n_keys allowed. fp32 dots are IEEE fp32 by default, as torch's own matmuls; "tf32x3" (near-fp32
accuracy on tensor cores) and "tf32" are chosen as `precision.py` says.

L (the row log-sum-exp) is computed and kept in fp32 whatever the input dtype: rounding
it to bf16 would put errors of several percent into the recomputed P.

`forward_launch` decides which forward kernel runs; `choose_backward` resolves the backward's options
(`BackwardOptions`, from the user's `backward=`) into its kernels (`BackwardChoice`) in one place, and
`backward_launches` builds them. `flash_forward` / `flash_backward` run them, and replay a launch plan
(`kernels/launch_plan.py`) for a signature they have seen, so repeat calls skip that work. The launch records and the
device facts they need are in launches.py, the tensors the launches write in buffers.py. The autograd Function and
the public `flash_attention` are in function.py; the C++ replay of the same plans in native_launch.py.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from cs336_systems.kernels import launch_plan
from cs336_systems.kernels._triton_utils import cdiv, check_operator_device, interpreting, next_power_of_2, runs_kernel
from cs336_systems.kernels.flash_attention import (
    gluon_common,
    hopper_backward,
    hopper_forward,
    hopper_one_pass,
)
from cs336_systems.kernels.flash_attention.backward import (
    DK_ONLY,
    DV_ONLY,
    flash_bwd_fused_kernel,
    flash_dkdv_kernel,
    flash_dq_kernel,
    flash_key_grad_kernel,
    flash_preprocess_kernel,
    flash_row_stats_kernel,
)
from cs336_systems.kernels.flash_attention.backward_tiles import WIDE_HEAD_DIM
from cs336_systems.kernels.flash_attention.buffers import backward_buffers, backward_result, dq_buffer, forward_buffers
from cs336_systems.kernels.flash_attention.forward import LOG2E, flash_forward_kernel
from cs336_systems.kernels.flash_attention.launches import (
    FixedLaunch,
    KernelLaunch,
    LaunchSequence,
    has_tma,
    install_descriptor_allocator,
    sm_count,
    tma_eligible,
)
from cs336_systems.kernels.flash_attention.precision import (
    dot_precision,
)
from cs336_systems.kernels.flash_attention.reference import (
    check_attention_inputs,
    flash_backward_tiled,
    flash_forward_tiled,
)

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = {torch.float16: 256, torch.bfloat16: 256, torch.float32: 128}


@dataclass(frozen=True)
class BackwardOptions:
    """What a caller asks of the Triton backward; `choose_backward` resolves it, once per input signature, into
    the kernels that run. None: as measured fastest (the constants of hopper_backward.py / hopper_one_pass.py).

    fused: one pass that also reduces dQ into an fp32 buffer (not bit-reproducible run to run: fp32 sums in
    arrival order) or two passes (dK/dV, then dQ). gluon: the Gluon kernels (Hopper, fp16/bf16, head dim 64 or
    128, TMA strides) where the inputs qualify; False: the `tl` kernels of backward.py everywhere. use_tma: the
    `tl` passes read their inner loop's tiles through tensor descriptors (an experiment for attention-tune).
    warp_specialised: with one Gluon pass, the warp-specialised kernel (hopper_one_pass.py) at its head dims
    (None or True) or the lockstep one (False)."""

    fused: bool | None = None
    gluon: bool | None = None
    use_tma: bool = False
    warp_specialised: bool | None = None


# The options of each `backward=` of `flash_attention` ("compile" is the torch.compile'd PyTorch backward).
BACKWARD_OPTIONS = {"triton": BackwardOptions(), "two-pass": BackwardOptions(fused=False),
                    "tl": BackwardOptions(fused=False, gluon=False), "fused": BackwardOptions(fused=True)}
BACKWARD_IMPLS = (*BACKWARD_OPTIONS, "compile")


def validate_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise a clear error, before any allocation, for inputs the kernel does not take: those every implementation
    refuses (`reference.check_attention_inputs`), a head dim past the kernel's tiles, a device the kernels do not
    run on, and bf16 under Triton's CPU interpreter, whose tl.dot multiplies bf16 bit patterns (Triton 3.6): its
    results would be wrong, silently."""
    check_attention_inputs(q, k, v, "flash attention")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"flash attention: dtype {q.dtype} is not supported; allowed: float16, bfloat16, float32")
    if q.shape[-1] > MAX_HEAD_DIM[q.dtype]:
        raise ValueError(f"flash attention: head dim {q.shape[-1]} is too large for {q.dtype}; "
                         f"at most {MAX_HEAD_DIM[q.dtype]}")
    check_operator_device("flash attention", q, k, v)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16 and interpreting():
        raise ValueError("flash attention: bfloat16 on the CPU runs under Triton's interpreter, whose tl.dot "
                         "gives wrong bf16 products (Triton 3.6); use float32 or float16 there, or a CUDA device")


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    return x if x.dim() == 4 else x.unsqueeze(1)  # (batch, 1, seq, d): a view, heads stride unused


def _launch_shape(q: torch.Tensor, k: torch.Tensor):
    head_dim = q.shape[-1]
    block_d = max(16, next_power_of_2(head_dim))
    precision = dot_precision(q.dtype)
    buckets = (next_power_of_2(q.shape[-2]), next_power_of_2(k.shape[-2]))
    return block_d, block_d == head_dim, precision, buckets


def forward_launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool,
                   use_tma: bool | None = None, gluon: bool | None = None, warp_specialised: bool | None = None):
    """(launch, O, L): O like q, L fp32 of shape q.shape[:-1], both written when the launch runs.

    use_tma: load Q/K/V and store O through tensor descriptors (the copy engine) where the inputs
    qualify (`tma_eligible`). None (default): on Hopper and later, where `cs336-bench attention-tune`
    measured it faster (H200, bf16 causal: 16.2 against 17.7 ms at 1x32x32768x128, 10.7 against 10.9 ms
    at 4x32x16384x64; results/attention-tune.jsonl).
    gluon: the Gluon forward (hopper_forward.py: the softmax overlapping the previous tile's P V product)
    where the inputs qualify (`hopper_backward.eligible` and TMA strides). None (default): where
    `hopper_forward.GLUON_HEAD_DIMS` says it measured faster; False: never (use_tma=False implies it).
    warp_specialised: which Gluon forward (`hopper_forward.forward_pass`); None: as measured fastest."""
    if use_tma is None:
        use_tma = has_tma(q.device)  # (the interpreter runs on CPU tensors: never)
    q4, k4, v4 = _as_4d(q), _as_4d(k), _as_4d(v)
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    out, lse = forward_buffers(q)
    o4 = _as_4d(out)
    if (use_tma and gluon is not False and (gluon or head_dim in hopper_forward.GLUON_HEAD_DIMS)
            and hopper_backward.eligible(q4) and tma_eligible(q4, k4, v4, o4)):
        install_descriptor_allocator(q.device)
        launch = hopper_forward.forward_pass(q4, k4, v4, o4, lse, is_causal, 1.0 / math.sqrt(head_dim),
                                             warp_specialised, gluon_common.host_descriptors_default())
        return launch, out, lse
    block_d, even_d, precision, (nq_bucket, nk_bucket) = _launch_shape(q, k)
    qk_scale = LOG2E.value / math.sqrt(head_dim)
    args = (q4, k4, v4, o4, lse, q4.stride(), k4.stride(), v4.stride(), o4.stride(),
            heads, n_queries, n_keys, head_dim, qk_scale, nq_bucket, nk_bucket)
    flags = dict(IS_CAUSAL=bool(is_causal), BLOCK_D=block_d, EVEN_D=even_d, PRECISION=precision)
    if use_tma and tma_eligible(q4, k4, v4, o4):
        install_descriptor_allocator(q.device)
        flags["USE_TMA"] = True
    launch = KernelLaunch(flash_forward_kernel, args, flags,
                          lambda meta: (cdiv(n_queries, meta["BLOCK_M"]), batch * heads))
    return launch, out, lse


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """Returns O (like q) and L (fp32, q.shape[:-1]); bad inputs raise `validate_attention_inputs`' errors.
    Repeat calls of one input signature replay a launch plan (`launch_plan`) instead of `forward_launch`."""
    planned = launch_plan.plans_enabled() and q.device.type == "cuda"
    if planned:
        key = forward_plan_key(q, k, v, is_causal)
        plan = launch_plan.lookup(key)
        if plan is not None:  # (its signature passed validation when the plan was made)
            return plan(q, k, v)
    validate_attention_inputs(q, k, v)
    if not runs_kernel(q):  # the CPU without Triton's interpreter: the same maths in torch, in one tile
        return flash_forward_tiled(q, k, v, is_causal, max(1, q.shape[-2]), max(1, k.shape[-2]))
    launch, out, lse = forward_launch(q, k, v, is_causal)
    if not planned:
        launch()
        return out, lse
    captured = launch_plan.capture(*launch.launch_for_plan(), dict(q=q, k=k, v=v, out=out, lse=lse))
    if captured is not None:
        launch_plan.store(key, _ForwardPlan(captured))
    return out, lse


def exact_row_stats(q: torch.Tensor) -> bool:
    """Whether the backward recomputes P from its own row statistics (`backward.flash_row_stats_kernel`): fp32 with
    fp32-accurate dots ("ieee", "tf32x3"), whose error budget L's rounding exceeded; 16-bit and "tf32" use L."""
    return dot_precision(q.dtype) != "tf32"


def forward_plan_key(q, k, v, is_causal: bool) -> tuple:
    return "forward", bool(is_causal), dot_precision(q.dtype), launch_plan.tensor_signature(q, k, v)


def backward_plan_key(q, k, v, out, lse, grad_out, is_causal: bool, options: BackwardOptions) -> tuple:
    return ("backward", bool(is_causal), options, dot_precision(q.dtype),
            launch_plan.tensor_signature(q, k, v, out, lse, grad_out))


@dataclass
class _ForwardPlan:
    """A forward replayed: O and L allocated as `forward_launch` allocates them, then its one kernel."""

    launch: launch_plan.CapturedLaunch

    def __call__(self, q, k, v):
        out, lse = forward_buffers(q)
        install_descriptor_allocator(q.device)
        self.launch(dict(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr()))
        return out, lse


@dataclass(frozen=True)
class BackwardChoice:
    """The kernels of one backward, named as `cs336-bench attention-tune` names them: one pass
    (`fused-gluon-ws`, `fused-gluon`, `fused` or `fused-tma`) or a dK/dV pass and a dQ pass (`dkdv`,
    `dkdv-gluon`, `dkdv-tma` or `dkdv-split`, a dV pass then a dK pass; `dq`, `dq-gluon` or `dq-tma`). Every
    backward starts with the D preprocess."""

    kernels: tuple[str, ...]

    @property
    def accumulator(self) -> str | None:
        """Where one pass adds dQ (`dq_accum_shape`): "gluon" (the Gluon kernels), "tl" (backward.py's), or None
        (two passes write dQ)."""
        if len(self.kernels) == 2:
            return None
        return "gluon" if self.kernels[0].startswith("fused-gluon") else "tl"


def choose_backward(q, k, v, grad_out, options: BackwardOptions) -> BackwardChoice:
    """The one place the backward's kernels are chosen: from the options, the device, dtype, head dim and the
    strides of the inputs and of the gradients `buffers.backward_buffers` / `buffers.dq_buffer` will make for them."""
    q4, k4, v4, do4 = (_as_4d(t) for t in (q, k, v, grad_out))
    head_dim = q4.shape[-1]
    dk4, dv4, dq4 = (_as_4d(torch.empty_like(t, device="meta")) for t in (k, v, q))  # their strides, no memory
    gluon_one_pass_ok = (options.gluon is not False and not options.use_tma and hopper_backward.one_pass_eligible(q4)
                         and tma_eligible(q4, k4, v4, do4, dk4, dv4))
    fused = options.fused
    if fused is None:  # one pass where measured faster than the two Gluon passes (hopper_backward.py)
        batch, heads, _, _ = q4.shape
        fused = (options.gluon is None and gluon_one_pass_ok
                 and hopper_backward.one_pass_by_default(batch, heads, k4.shape[2], head_dim, sm_count(q4.device)))
    tma = "-tma" if options.use_tma and tma_eligible(q4, k4, v4, do4) else ""
    if fused and gluon_one_pass_ok:
        warp_specialised = options.warp_specialised is not False and head_dim in hopper_one_pass.HEAD_DIMS
        return BackwardChoice(("fused-gluon-ws",) if warp_specialised else ("fused-gluon",))
    if fused:
        return BackwardChoice(("fused" + tma,))
    dkdv, dq = "dkdv" + tma, "dq" + tma
    if not tma and q4.element_size() == 2 and head_dim > WIDE_HEAD_DIM // 2:
        dkdv = "dkdv-split"  # d 256 in 16 bits: one key gradient per pass, so 64-row tiles fit (backward.py)
    gluon_ok = hopper_backward.eligible(q4) and tma_eligible(q4, k4, v4, do4, dq4, dk4, dv4)
    if options.gluon is not False and not options.use_tma and gluon_ok:
        # By default only the passes measured faster than their `tl` twins (hopper_backward.GLUON_PASSES).
        if options.gluon or "dkdv" in hopper_backward.GLUON_PASSES:
            dkdv = "dkdv-gluon"
        if options.gluon or "dq" in hopper_backward.GLUON_PASSES:
            dq = "dq-gluon"
    return BackwardChoice((dkdv, dq))


def backward_launches(q, k, v, out, lse, grad_out, is_causal: bool, **options):
    """(preprocess, dK/dV pass or the one pass, dQ pass or None, finish) in launch order, as `choose_backward`
    chooses them for `BackwardOptions(**options)`; finish() returns (dq, dk, dv)."""
    choice = choose_backward(q, k, v, grad_out, BackwardOptions(**options))
    launches, buffers = _backward_launches(q, k, v, out, lse, grad_out, is_causal, choice)
    return (*launches, lambda: backward_result(q, buffers, choice.accumulator))


def _backward_launches(q, k, v, out, lse, grad_out, is_causal, choice: BackwardChoice):
    """((preprocess, dK/dV pass or the one pass, dQ pass or None), buffers named for launch plans): the launches
    of `choice` and the buffers they write."""
    q4, k4, v4, o4, do4 = (_as_4d(t) for t in (q, k, v, out, grad_out))
    batch, heads, n_queries, head_dim = q4.shape
    n_keys = k4.shape[2]
    block_d, even_d, precision, (nq_bucket, nk_bucket) = _launch_shape(q, k)
    exact_rows = exact_row_stats(q)
    buffers = backward_buffers(k, v, lse, exact_rows) | dq_buffer(q, choice.accumulator)
    delta, dk4, dv4 = buffers["delta"], _as_4d(buffers["dk"]), _as_4d(buffers["dv"])
    row_max, row_inv_sum = buffers.get("row_max"), buffers.get("row_inv_sum")
    dq_accum = buffers.get("dq_accum")
    preprocess_rows = 64
    accum_args = (dq_accum, dq_accum.stride(0)) if dq_accum is not None else (None, 0)
    preprocess = FixedLaunch(
        flash_preprocess_kernel,
        (o4, do4, delta, accum_args[0], o4.stride(), do4.stride(), accum_args[1], heads, n_queries, head_dim),
        dict(BLOCK_M=preprocess_rows, BLOCK_D=block_d, ZERO_DQ=dq_accum is not None, WRITE_DELTA=not exact_rows),
        (cdiv(n_queries, preprocess_rows), batch * heads))
    sm_scale = 1.0 / math.sqrt(head_dim)
    if exact_rows:  # (m, 1 / l) and D = rowsum(P dP) first; the preprocess then only zeroes a dQ accumulator
        row_stats = KernelLaunch(
            flash_row_stats_kernel,
            (q4, k4, v4, do4, row_max, row_inv_sum, delta, q4.stride(), k4.stride(), v4.stride(), do4.stride(),
             heads, n_queries, n_keys, head_dim, sm_scale * LOG2E.value, nq_bucket, nk_bucket),
            dict(IS_CAUSAL=bool(is_causal), BLOCK_D=block_d, PRECISION=precision),
            lambda meta: (cdiv(n_queries, meta["BLOCK_M"]), batch * heads))
        preprocess = row_stats if dq_accum is None else LaunchSequence((preprocess, row_stats))
    if (any("gluon" in name or "tma" in name for name in choice.kernels)
            or choice.kernels == ("fused",) and has_tma(q.device)):  # (it reduces dQ by descriptor there)
        install_descriptor_allocator(q.device)
    if choice.accumulator == "gluon":  # adds dQ already scaled, into whole tiles of rows
        one_pass = hopper_one_pass.one_pass if choice.kernels == ("fused-gluon-ws",) else hopper_backward.fused_pass
        dkdv = one_pass(q4, k4, v4, do4, lse, delta, dq_accum, dk4, dv4, is_causal, sm_scale)
        return (preprocess, dkdv, None), buffers

    common = (q4, k4, v4, do4, lse, delta, row_max, row_inv_sum)  # (the last two None unless exact_rows)
    strides = (q4.stride(), k4.stride(), v4.stride(), do4.stride())  # each tensor's strides: one tuple argument
    sizes = (heads, n_queries, n_keys, head_dim, sm_scale * LOG2E.value, sm_scale, nq_bucket, nk_bucket)
    flags = dict(IS_CAUSAL=bool(is_causal), BLOCK_D=block_d, EVEN_D=even_d, PRECISION=precision)
    if choice.kernels[0].endswith("-tma"):
        flags["USE_TMA"] = True

    def key_grid(meta):
        return (cdiv(n_keys, meta["BLOCK_N"]), batch * heads)

    if choice.accumulator == "tl":
        # dQ reduced by TMA descriptor reduce-add on Hopper and later, by pointer atomics elsewhere.
        dkdv = KernelLaunch(flash_bwd_fused_kernel,
                            (*common, dk4, dv4, dq_accum, *strides, dk4.stride(), dv4.stride(), *sizes),
                            flags | dict(DQ_REDUCE=2 if has_tma(q.device) else 1), key_grid)
        return (preprocess, dkdv, None), buffers
    dq4 = _as_4d(buffers["dq"])
    if "gluon" in choice.kernels[0] or "gluon" in choice.kernels[1]:
        gluon_dkdv, gluon_dq = hopper_backward.backward_passes(q4, k4, v4, do4, lse, delta, dq4, dk4, dv4,
                                                               is_causal, sm_scale,
                                                               gluon_common.host_descriptors_default())
    dkdv_args = (*common, dk4, dv4, None, *strides, dk4.stride(), dv4.stride(), *sizes)
    if choice.kernels[0] == "dkdv-gluon":
        dkdv = gluon_dkdv
    elif choice.kernels[0] == "dkdv-split":
        dkdv = LaunchSequence(tuple(KernelLaunch(flash_key_grad_kernel, dkdv_args,
                                                 flags | dict(DQ_REDUCE=0, KEY_GRADS=grads.value), key_grid)
                                    for grads in (DV_ONLY, DK_ONLY)))
    else:
        dkdv = KernelLaunch(flash_dkdv_kernel, dkdv_args, flags | dict(DQ_REDUCE=0), key_grid)
    dq_pass = gluon_dq if choice.kernels[1] == "dq-gluon" else KernelLaunch(
        flash_dq_kernel, (*common, dq4, *strides, dq4.stride(), *sizes), flags,
        lambda meta: (cdiv(n_queries, meta["BLOCK_M"]), batch * heads))
    return (preprocess, dkdv, dq_pass), buffers


def flash_backward(q, k, v, out, lse, grad_out, is_causal: bool, options: BackwardOptions = BackwardOptions()):
    """Triton backward (`choose_backward`'s kernels). Returns (dq, dk, dv) like the inputs. Repeat calls of one
    input signature replay a launch plan (`launch_plan`)."""
    planned = launch_plan.plans_enabled() and q.device.type == "cuda"
    if planned:
        key = backward_plan_key(q, k, v, out, lse, grad_out, is_causal, options)
        plan = launch_plan.lookup(key)
        if plan is not None:
            return plan(q, k, v, out, lse, grad_out)
    if not runs_kernel(q):  # the CPU without Triton's interpreter: the same maths in torch, in one tile
        return flash_backward_tiled(q, k, v, out, lse, grad_out, is_causal, max(1, q.shape[-2]), max(1, k.shape[-2]))
    choice = choose_backward(q, k, v, grad_out, options)
    launches, buffers = _backward_launches(q, k, v, out, lse, grad_out, is_causal, choice)
    launches = [part for launch in launches if launch is not None for part in getattr(launch, "parts", (launch,))]
    if not planned:
        for launch in launches:
            launch()
        return backward_result(q, buffers, choice.accumulator)
    tensors = dict(q=q, k=k, v=v, out=out, lse=lse, grad_out=grad_out) | buffers
    captured = [launch_plan.capture(*launch.launch_for_plan(), tensors) for launch in launches]
    if all(c is not None for c in captured):
        launch_plan.store(key, _BackwardPlan(tuple(captured), choice.accumulator, "row_max" in buffers))
    return backward_result(q, buffers, choice.accumulator)


@dataclass
class _BackwardPlan:
    """A backward replayed: its buffers allocated as `_backward_launches` allocates them, its kernels in order,
    then dQ cast from the accumulator where there is one."""

    launches: tuple[launch_plan.CapturedLaunch, ...]
    accum: str | None  # `buffers.dq_buffer`'s accumulator kind
    exact_rows: bool  # `exact_row_stats`: row statistics buffers too

    def __call__(self, q, k, v, out, lse, grad_out):
        buffers = backward_buffers(k, v, lse, self.exact_rows) | dq_buffer(q, self.accum)
        addresses = {name: t.data_ptr() for name, t in buffers.items()}
        addresses.update(q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), out=out.data_ptr(), lse=lse.data_ptr(),
                         grad_out=grad_out.data_ptr())
        install_descriptor_allocator(q.device)
        for launch in self.launches:
            launch(addresses)
        return backward_result(q, buffers, self.accum)


def chosen_configs() -> dict[str, dict]:
    """The autotuner's choices so far: kernel -> {tuning key: 'BLOCK_M=.., BLOCK_N=.., warps, stages'}."""
    chosen = {}
    for name, kernel in (("forward", flash_forward_kernel), ("dkdv", flash_dkdv_kernel), ("dq", flash_dq_kernel),
                         ("fused", flash_bwd_fused_kernel), ("dkdv-split", flash_key_grad_kernel),
                         ("row-stats", flash_row_stats_kernel)):
        chosen[name] = {str(key): str(config) for key, config in getattr(kernel, "cache", {}).items()}
        if not chosen[name] and len(kernel.configs) == 1:  # one candidate (the interpreter): never tuned
            chosen[name] = {"every key": str(kernel.configs[0])}
    return chosen
