"""The `fused-ops` suite: our fused RMSNorm (alone and with the residual add before it) and SwiGLU gate against
torch and Liger-Kernel, op by op.

Each case times the op and its backward together (do_bench median) and records the peak memory above its inputs
(the tensors the op reads and the incoming gradient; CUDA only): what the op adds to a training step's peak.

Ops and providers:
  rmsnorm   ours (`kernels.rmsnorm.rmsnorm`), torch (`F.rms_norm`), liger (`liger_rms_norm`)
  add-rmsnorm
            (h, y) = (x + delta, rmsnorm(x + delta)), both outputs' gradients arriving (the residual path's and the
            norm's, as in a pre-norm block): ours (`kernels.rmsnorm.add_rmsnorm`, one pass each way), ours-unfused
            (the add in torch, then our rmsnorm), torch (the add, then `F.rms_norm`), liger
            (`liger_fused_add_rms_norm`, out of place: its in-place backward would write over the incoming gradient)
  swiglu    silu(a) * b: ours (`kernels.swiglu.silu_mul`, backward written over a and b as our fused model
            runs it), ours-out-of-place (the same kernel, new gradient tensors), torch (the eager expression),
            liger (`liger_swiglu`, whose backward also writes over a and b)
a and b reach the gate as views of leaf tensors: in a model they are the w1 and w3 products, tensors of the
step's own that the in-place backward may overwrite (ours refuses leaves). liger runs where the liger-kernel
package is installed, on CUDA; the default list takes it only then.

    cs336-bench fused-ops                                   # both ops at the leaderboard's shapes on CUDA
    cs336-bench fused-ops --op swiglu --tokens 32768 --width 11008 --provider ours,liger
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass

import pandas as pd
import torch
import torch.nn.functional as F

from cs336_systems.bench import common
from cs336_systems.bench.suites.cross_entropy import check_liger, liger_by_default
from cs336_systems.kernels.rmsnorm import add_rmsnorm, rmsnorm
from cs336_systems.kernels.swiglu import silu_mul
from cs336_systems.results import ResultStore

OPS = ("rmsnorm", "add-rmsnorm", "swiglu")
PROVIDERS = {"rmsnorm": ("ours", "torch", "liger"), "add-rmsnorm": ("ours", "ours-unfused", "torch", "liger"),
             "swiglu": ("ours", "ours-out-of-place", "torch", "liger")}
# The shapes of BASELINES.md's comparison: one 32k sequence at d_model 4096; the gate at d_ff 11008.
CUDA_WIDTH = {"rmsnorm": 4096, "add-rmsnorm": 4096, "swiglu": 11008}
CPU_TOKENS, CPU_WIDTH = 256, {"rmsnorm": 128, "add-rmsnorm": 128, "swiglu": 352}
EPS = 1e-5


@dataclass(frozen=True)
class OpCase:
    op: str
    provider: str
    tokens: int
    width: int
    dtype: str


def add_arguments(parser) -> None:
    common.add_common_arguments(parser)
    parser.add_argument("--op", type=common.list_of(str, OPS, "--op"), default=list(OPS),
                        help=f"comma-separated from: {', '.join(OPS)} (default: all)")
    parser.add_argument("--tokens", type=common.list_of(common.positive_int("--tokens"), name="--tokens"),
                        default=None, help=f"comma-separated token counts (default: 32768 on CUDA, {CPU_TOKENS} "
                                           "on CPU)")
    parser.add_argument("--width", type=common.list_of(common.positive_int("--width"), name="--width"),
                        default=None, help="comma-separated row widths (default: d_model 4096 for the norms, d_ff "
                                           "11008 for swiglu on CUDA; small on CPU)")
    parser.add_argument("--dtype", type=common.list_of(str, tuple(common.DTYPES), "--dtype"), default=None,
                        help="comma-separated from: fp32, bf16, fp16 (default: bf16 on CUDA, fp32 on CPU)")
    every = sorted({p for providers in PROVIDERS.values() for p in providers})
    parser.add_argument("--provider", type=common.list_of(str, tuple(every), "--provider"), default=None,
                        help=f"comma-separated from: {', '.join(every)} (default: each op's; liger only where "
                             "liger-kernel is installed)")
    parser.add_argument("--warmup-ms", type=float, default=100.0, help="do_bench warm-up time per case")
    parser.add_argument("--rep-ms", type=float, default=500.0, help="do_bench repetition time per case")


def cases(args) -> list[OpCase]:
    on_cuda = args.device.type == "cuda"
    listed = []
    for op in args.op:
        if args.provider is None:
            providers = [p for p in PROVIDERS[op] if p != "liger" or liger_by_default(args.device)]
        else:
            providers = [p for p in PROVIDERS[op] if p in args.provider]
        widths = args.width or [CUDA_WIDTH[op] if on_cuda else CPU_WIDTH[op]]
        for tokens, width, dtype, provider in itertools.product(args.tokens or [32768 if on_cuda else CPU_TOKENS],
                                                                widths, args.dtype or ["bf16" if on_cuda else "fp32"],
                                                                providers):
            listed.append(OpCase(op, provider, tokens, width, dtype))
    return listed


def step_fn(case: OpCase, device: torch.device):
    """(step, the leaves whose gradients are reset between calls) for one case."""
    generator = torch.Generator(device).manual_seed(0)
    dtype = common.DTYPES[case.dtype]

    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=generator)

    grad = tensor(case.tokens, case.width)
    grad_h = None  # (add-rmsnorm's second output, the sum, takes its own gradient)
    if case.op == "rmsnorm":
        x, weight = tensor(case.tokens, case.width).requires_grad_(), (tensor(case.width) + 1).requires_grad_()
        if case.provider == "ours":
            def forward():
                return rmsnorm(x, weight, EPS)
        elif case.provider == "torch":
            def forward():
                return F.rms_norm(x, (case.width,), weight, EPS)
        else:
            from liger_kernel.transformers.functional import liger_rms_norm

            def forward():
                return liger_rms_norm(x, weight, EPS)
        leaves = [x, weight]
    elif case.op == "add-rmsnorm":
        x, delta = tensor(case.tokens, case.width).requires_grad_(), tensor(case.tokens, case.width).requires_grad_()
        weight, grad_h = (tensor(case.width) + 1).requires_grad_(), tensor(case.tokens, case.width)
        if case.provider == "ours":
            def forward():
                return add_rmsnorm(x, delta, weight, EPS)
        elif case.provider in ("ours-unfused", "torch"):
            def forward():
                h = x + delta
                if case.provider == "torch":
                    return h, F.rms_norm(h, (case.width,), weight, EPS)
                return h, rmsnorm(h, weight, EPS)
        else:
            from liger_kernel.transformers.functional import liger_fused_add_rms_norm

            def forward():
                y, h = liger_fused_add_rms_norm(delta, x, weight, EPS, in_place=False)
                return h, y
        leaves = [x, delta, weight]
    else:
        a_leaf, b_leaf = tensor(case.tokens, case.width).requires_grad_(), tensor(case.tokens, case.width)
        b_leaf.requires_grad_()
        a, b = a_leaf.view_as(a_leaf), b_leaf.view_as(b_leaf)  # the gate's inputs as a model's products
        if case.provider in ("ours", "ours-out-of-place"):
            in_place = case.provider == "ours"

            def forward():
                return silu_mul(a, b, backward_in_place=in_place)
        elif case.provider == "torch":
            def forward():
                return F.silu(a) * b
        else:
            from liger_kernel.transformers.functional import liger_swiglu

            def forward():
                return liger_swiglu(a, b)
        leaves = [a_leaf, b_leaf]

    def step():
        outputs = forward()
        if isinstance(outputs, tuple):  # (h, y) of add-rmsnorm: the residual path's gradient and the norm's
            torch.autograd.backward(outputs, (grad_h, grad))
        else:
            outputs.backward(grad)

    return step, leaves


def run(args) -> int:
    check_liger(args.provider, args.device, "fused-ops")
    _print_table(common.run_cases("fused-ops", args, cases(args), _run_case), args)
    return 0


def _run_case(case: OpCase, args, store: ResultStore) -> None:
    config = {k: v for k, v in asdict(case).items() if k != "provider"}
    common.time_and_peak(lambda: step_fn(case, args.device), args.device, store, case.provider, config,
                         warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)


CASE_KEYS = ["op", "tokens", "width", "dtype"]


def summary_table(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per op and shape: each provider's median ms (or its status) and peak GiB above the inputs."""
    times = frame[frame["metric"] == "time"]
    cells = times.assign(cell=[f"{m:.3f}" if s == "ok" else s for m, s in zip(times["median"], times["status"])])
    table = cells.pivot_table(index=CASE_KEYS, columns="provider", values="cell", aggfunc="last")
    table = table.fillna("")  # a provider the op does not have
    table.columns = [f"{c} ms" for c in table.columns]
    peaks = frame[frame["metric"] == "peak_above_inputs"]
    if not peaks.empty:
        wide = peaks.pivot_table(index=CASE_KEYS, columns="provider", values="median", aggfunc="last")
        for provider in wide.columns:
            table[f"{provider} GiB"] = wide[provider].round(2)
    return table.reset_index()


def _print_table(store: ResultStore, args) -> None:
    frame = store.frame()
    if frame.empty:
        return
    common.print_tables(store, args, ("median ms per op + backward; GiB above the inputs at the peak (CUDA)",
                                      summary_table(frame)))
