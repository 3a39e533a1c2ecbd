"""The `attention-tune` suite: every candidate tile config of each FlashAttention kernel, timed alone.

The kernels' own autotune lists are kept short so a cold cache compiles in seconds; this suite is
where their entries come from. For each shape it times the forward kernel, the dK/dV pass and the
dQ pass over a wide space (tile sizes x warps x pipeline stages), beside SDPA's cuDNN and flash
backends' forward and backward in the same run, and prints the best configs and what the best
forward + backward would add up to.

Compiling ~150 configs one after another takes minutes, so `--compile-workers` processes launch
each config once first (Triton's on-disk cache keeps the binaries); the timing process then loads
them from the cache and times one kernel at a time on an otherwise idle GPU.

Rows (suite `attention-tune`): provider `triton` with config {shape, kernel, block_m, block_n,
num_warps, num_stages} and metrics time (ms) and tflops (the FLOPs that kernel executes: forward
4*B*H*N^2*d/2 for causal; the dK/dV pass 2x that (four products), the dQ pass 1.5x (three));
failed compiles (out of shared memory) are rows with status `unsupported`. Baselines: provider
`sdpa-cudnn` / `sdpa-flash` with kernel `fwd` / `bwd`, and `triton` with kernel `fwd` / `bwd` for
the autotuned kernels as shipped.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import dataclasses
import itertools
import math
import multiprocessing
import os

import pandas as pd
import torch
from tqdm import tqdm

from cs336_systems.bench.common import DTYPES, add_common_arguments, error_message, free_memory, list_of
from cs336_systems.kernels._triton_utils import interpreting
from cs336_systems.profiling.flops import attention_flops
from cs336_systems.profiling.timing import bench_kernel
from cs336_systems.results import ResultStore, format_table

KERNELS = ("forward", "forward-tma", "forward-gluon", "forward-gluon-late", "forward-gluon-late-host",
           "forward-gluon-ws", "dkdv", "dkdv-tma",
           "dq", "dq-tma", "fused", "fused-atomic", "dkdv-gluon", "dkdv-gluon-k", "dkdv-gluon-kv", "dkdv-gluon-host",
           "dq-gluon", "dq-gluon-host",
           "dq-gluon-q", "dq-gluon-qdo", "fused-gluon", "fused-gluon-s1", "fused-gluon-s2",
           "fused-gluon-atomic", "fused-gluon-ws")
# Executed FLOPs of each kernel in units of the forward's (2 of the forward's products = 1.0); `fused` is
# the one-pass backward (dK/dV plus dQ reduced in fp32: five products) as shipped (TMA reduce-add on
# Hopper), `fused-atomic` the same with pointer atomics for the reduction; `forward-tma` the forward with
# Q/K/V loads and the O store through tensor descriptors, `forward-gluon` the Hopper forward with the softmax
# overlapping the previous tile's P V product (kernels/flash_attention/hopper_forward.py; `-late`: acc rescaled
# after that product instead of while the next S runs; `-late-host`: the same on the host's 4D tensor descriptors,
# one per tensor and launch, where the others make one per program; `-ws`: warp-specialised, a producer warp and two
# consumer
# warpgroups); `dkdv-tma` / `dq-tma`
# the backward passes with their inner loops' tiles through descriptors; `dkdv-gluon` / `dq-gluon` the Hopper
# passes with asynchronous products (kernels/flash_attention/hopper_backward.py; bf16/fp16 at head dim 64 or 128
# only), `-k` / `-kv` with K (and V) held in registers for S^T and dP^T, `-host` as shipped on the host's 4D tensor
# descriptors; `fused-gluon` the one-pass backward in
# Gluon (the dK/dV pass adding its dQ share into fp32 by TMA reduce-add; `-s1` / `-s2`: that share in 1 or 2
# column blocks; `-atomic`: added from registers with pointer atomics instead; `-ws`: warp-specialised, FA3's
# split, kernels/flash_attention/hopper_one_pass.py, head dim 64 or 128).
KERNEL_FLOP_FACTOR = {"forward": 1.0, "forward-tma": 1.0, "forward-gluon": 1.0, "forward-gluon-late": 1.0,
                      "forward-gluon-late-host": 1.0,
                      "forward-gluon-ws": 1.0,
                      "dkdv": 2.0, "dkdv-tma": 2.0, "dq": 1.5, "dq-tma": 1.5, "fused": 2.5, "fused-atomic": 2.5,
                      "dkdv-gluon": 2.0, "dkdv-gluon-k": 2.0, "dkdv-gluon-kv": 2.0, "dkdv-gluon-host": 2.0,
                      "dq-gluon": 1.5, "dq-gluon-host": 1.5, "dq-gluon-q": 1.5,
                      "dq-gluon-qdo": 1.5, "fused-gluon": 2.5, "fused-gluon-s1": 2.5,
                      "fused-gluon-s2": 2.5, "fused-gluon-atomic": 2.5, "fused-gluon-ws": 2.5}
WARPS, STAGES = (4, 8), (2, 3, 4, 5)
# (BLOCK_M, BLOCK_N): the causal loop split needs the outer tile to be a multiple of the inner one
# (forward and dQ walk key tiles: BLOCK_M % BLOCK_N == 0; dK/dV walks query tiles: BLOCK_N % BLOCK_M == 0).
TILES = {
    "forward": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)],
    "dkdv": [(16, 64), (32, 64), (64, 64), (16, 128), (32, 128), (64, 128), (128, 128)],
    "dq": [(64, 16), (64, 32), (64, 64), (128, 16), (128, 32), (128, 64), (128, 128)],
    "fused": [(16, 64), (32, 64), (64, 64), (16, 128), (32, 128), (64, 128), (128, 128)],
}
TILES["fused-atomic"] = TILES["fused"]
TILES["forward-tma"] = TILES["forward"]
TILES["dkdv-tma"] = TILES["dkdv"]
TILES["dq-tma"] = TILES["dq"]
# The Gluon passes take 16 rows of their outer tile per warp (one warpgroup per 64 rows): the space is listed.
# The one-pass Gluon backward's dQ share is a wgmma of BLOCK_M = 64 rows per warpgroup column block.
FUSED_GLUON_SPACE = [(64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3)]
# Gluon forward: BLOCK_M = 64 rows per warpgroup; 128 x 128 on 8 warps uses 234 registers at d 128 (ptxas).
FORWARD_GLUON_SPACE = [(128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2),
                       (64, 128, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3)]
GLUON_SPACE = {
    "forward-gluon": FORWARD_GLUON_SPACE, "forward-gluon-late": FORWARD_GLUON_SPACE,
    "forward-gluon-late-host": FORWARD_GLUON_SPACE,
    # warps: the first consumer's (the default partition); BLOCK_M is two consumers' 64 rows.
    "forward-gluon-ws": [(128, 128, 4, 2), (128, 128, 4, 3), (128, 64, 4, 2), (128, 64, 4, 3)],
    "fused-gluon": FUSED_GLUON_SPACE, "fused-gluon-s1": FUSED_GLUON_SPACE, "fused-gluon-s2": FUSED_GLUON_SPACE,
    "fused-gluon-atomic": FUSED_GLUON_SPACE,
    # 128 keys (two consumer warpgroups of 64) x 64 queries; 3 stages fit at d 64 only (225 KiB at d 128)
    "fused-gluon-ws": [(64, 128, 4, 2), (64, 128, 4, 3)],
    "dkdv-gluon": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (64, 128, 8, 2), (64, 128, 8, 3),
                   (32, 128, 8, 3)],
    "dkdv-gluon-k": [(64, 64, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 3)],
    "dkdv-gluon-kv": [(64, 64, 4, 2), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 3)],
    "dq-gluon": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 8, 3), (64, 32, 4, 3),
                 (128, 128, 8, 2)],
    "dq-gluon-q": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3)],
    "dkdv-gluon-host": [(64, 64, 4, 2), (64, 64, 4, 3), (32, 64, 4, 2), (32, 64, 4, 3), (32, 128, 8, 3)],
    "dq-gluon-host": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 128, 8, 2)],
    "dq-gluon-qdo": [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3)],
}
DEFAULT_SHAPES = "1x32x32768x128,4x32x16384x64"


def tuning_space(kernel: str) -> list[tuple[int, int, int, int]]:
    """(block_m, block_n, num_warps, num_stages) candidates for one kernel."""
    if kernel in GLUON_SPACE:
        return list(GLUON_SPACE[kernel])
    return [(bm, bn, w, s) for (bm, bn), w, s in itertools.product(TILES[kernel], WARPS, STAGES)]


def parse_shape(text: str) -> tuple[int, int, int, int]:
    try:
        shape = tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"--shape: got {text!r}; expected BATCHxHEADSxSEQxD, e.g. 1x32x32768x128")
    return shape


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", type=list_of(parse_shape, name="--shape"), default=list_of(parse_shape)(
        DEFAULT_SHAPES), help=f"comma-separated BATCHxHEADSxSEQxD (default {DEFAULT_SHAPES})")
    parser.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16", help="input dtype (default bf16)")
    parser.add_argument("--causal", choices=["on", "off"], default="on", help="causal masking (default on)")
    parser.add_argument("--kernel", type=list_of(str, KERNELS, "--kernel"), default=list(KERNELS),
                        help=f"comma-separated from: {', '.join(KERNELS)}")
    parser.add_argument("--compile-workers", type=int, default=min(12, os.cpu_count() or 1),
                        help="processes that compile the configs in parallel before timing (0: compile while timing)")
    parser.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per config")
    parser.add_argument("--warmup-ms", type=float, default=10.0, help="do_bench warm-up time per config")
    parser.add_argument("--top", type=int, default=5, help="configs shown per kernel in the printed table")
    parser.add_argument("--limit", type=int, default=None,
                        help="time only the first N configs of each kernel (smoke runs, e.g. under the interpreter)")
    add_common_arguments(parser)


def _inputs(shape, dtype_name: str, causal: bool, device, real_forward: bool = True):
    """Random q, k, v, dO and the forward's O, L (the backward kernels read them). Compile-only
    workers take random O and L instead: running the forward would autotune it in every worker."""
    from cs336_systems.kernels.flash_attention.dispatch import flash_forward

    torch.manual_seed(0)
    q, k, v, grad_out = (torch.randn(*shape, device=device, dtype=DTYPES[dtype_name]) for _ in range(4))
    if real_forward:
        out, lse = flash_forward(q, k, v, causal)
    else:
        out, lse = torch.randn_like(q), torch.rand(shape[:-1], device=device) + 10.0
    return q, k, v, out, lse, grad_out


def _launches(inputs, causal: bool) -> dict:
    """kernel name -> KernelLaunch, plus the backward's preprocess (a plain callable)."""
    from cs336_systems.kernels.flash_attention import hopper_backward, hopper_forward
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, forward_launch
    from cs336_systems.kernels.flash_attention.hopper_forward import flash_forward_gluon_kernel
    from cs336_systems.kernels.flash_attention.hopper_one_pass import flash_bwd_one_pass_ws_kernel
    from cs336_systems.kernels.flash_attention.launches import GluonPass

    q, k, v, out, lse, grad_out = inputs
    forward, _, _ = forward_launch(q, k, v, causal, use_tma=False)
    forward_tma, _, _ = forward_launch(q, k, v, causal, use_tma=True, gluon=False)
    forward_gluon, _, _ = forward_launch(q, k, v, causal, gluon=True, warp_specialised=False)
    forward_ws, _, _ = forward_launch(q, k, v, causal, gluon=True, warp_specialised=True)
    preprocess, dkdv, dq, _ = backward_launches(q, k, v, out, lse, grad_out, causal, gluon=False)
    gluon_preprocess, dkdv_gluon, dq_gluon, _ = backward_launches(q, k, v, out, lse, grad_out, causal, gluon=True)
    tma_preprocess, dkdv_tma, dq_tma, _ = backward_launches(q, k, v, out, lse, grad_out, causal, use_tma=True)
    fused_preprocess, fused, _, _ = backward_launches(q, k, v, out, lse, grad_out, causal, fused=True, gluon=False)
    gluon_fused_preprocess, gluon_fused, _, _ = backward_launches(q, k, v, out, lse, grad_out, causal, fused=True,
                                                                  warp_specialised=False)
    ws_fused_preprocess, ws_fused, _, _ = backward_launches(q, k, v, out, lse, grad_out, causal, fused=True,
                                                            warp_specialised=True)
    for write_delta in (preprocess, gluon_preprocess, tma_preprocess, fused_preprocess, gluon_fused_preprocess,
                        ws_fused_preprocess):
        write_delta()  # D, read by each set
    fused_atomic = dataclasses.replace(fused, flags=fused.flags | dict(DQ_REDUCE=1))
    launches = dict(forward=forward, dkdv=dkdv, dq=dq, fused=fused, preprocess=preprocess,
                    **{"fused-atomic": fused_atomic, "forward-tma": forward_tma, "dkdv-tma": dkdv_tma,
                       "dq-tma": dq_tma})
    def variant(launch, **flags):  # the same launch with other compile-time flags
        return dataclasses.replace(launch, flags=launch.flags | flags)

    if isinstance(forward_gluon, GluonPass) and forward_gluon.kernel is flash_forward_gluon_kernel:
        launches["forward-gluon"] = variant(forward_gluon, RESCALE_EARLY=True)
        launches["forward-gluon-late"] = variant(forward_gluon, RESCALE_EARLY=False)
        launches["forward-gluon-ws"] = forward_ws
        launches["forward-gluon-late-host"] = variant(
            hopper_forward.forward_pass(*forward_gluon.args[:5], causal, 1.0 / math.sqrt(q.shape[-1]),
                                        warp_specialised=False, host_descriptors=True), RESCALE_EARLY=False)
    if isinstance(dkdv_gluon, GluonPass):  # inputs the Gluon passes take (else those kernels are absent)
        launches |= {"dkdv-gluon": variant(dkdv_gluon, KV_REGS=0), "dkdv-gluon-k": variant(dkdv_gluon, KV_REGS=1),
                     "dkdv-gluon-kv": variant(dkdv_gluon, KV_REGS=2), "dq-gluon": variant(dq_gluon, QDO_REGS=0),
                     "dq-gluon-q": variant(dq_gluon, QDO_REGS=1), "dq-gluon-qdo": variant(dq_gluon, QDO_REGS=2),
                     "fused-gluon": gluon_fused, "fused-gluon-s1": variant(gluon_fused, DQ_SPLIT=1),
                     "fused-gluon-s2": variant(gluon_fused, DQ_SPLIT=2),
                     "fused-gluon-atomic": variant(gluon_fused, DQ_TMA=0)}
        host_dkdv, host_dq = hopper_backward.backward_passes(
            *dq_gluon.args[:7], dkdv_gluon.args[6], dkdv_gluon.args[7], causal, 1.0 / math.sqrt(q.shape[-1]),
            host_descriptors=True)
        launches |= {"dkdv-gluon-host": host_dkdv, "dq-gluon-host": host_dq}
        if getattr(ws_fused, "kernel", None) is flash_bwd_one_pass_ws_kernel:  # (head dim 64 or 128)
            launches["fused-gluon-ws"] = ws_fused
    return launches


# The compile workers' longest sequence: Triton specialises integer arguments only by divisibility by 16 and equality
# to 1, so a length that is a multiple of 16 compiles the same binaries at any size. Full-size inputs in each of 12
# workers ran an H100 out of memory at 4x32x16384x64 (8.2 GiB a worker).
COMPILE_SEQ = 256


def compile_shape(shape: tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    """The shape a compile worker launches for `shape`: its sequence cut to COMPILE_SEQ where it is a multiple of 16
    (the same specialisation), else unchanged."""
    batch, heads, seq, d = shape
    return (batch, heads, min(seq, COMPILE_SEQ), d) if seq % 16 == 0 else shape


def _compile_worker(shape, dtype_name: str, causal: bool, jobs: list) -> list[tuple]:
    """Launch each (kernel, config) once, on `compile_shape(shape)`, so its binary lands in Triton's cache;
    (job, error or None)."""
    device = torch.device("cuda")  # workers only run on CUDA machines (see _precompile)
    launches = _launches(_inputs(compile_shape(shape), dtype_name, causal, device, real_forward=False), causal)
    results = []
    for kernel, config in jobs:
        try:
            launches[kernel].with_config(*config)()
            torch.cuda.synchronize()
            results.append(((kernel, config), None))
        except Exception as error:  # out of shared memory / registers: recorded, not fatal
            results.append(((kernel, config), error_message(error, 200)))
    return results


def _precompile(shape, args, jobs) -> dict:
    if args.compile_workers <= 0 or not jobs or args.device.type != "cuda":
        return {}
    chunks = [jobs[i::args.compile_workers] for i in range(args.compile_workers)]
    errors = {}
    context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
    with futures.ProcessPoolExecutor(max_workers=args.compile_workers, mp_context=context) as pool:
        pending = [pool.submit(_compile_worker, shape, args.dtype, args.causal == "on", c) for c in chunks if c]
        for done in tqdm(futures.as_completed(pending), total=len(pending), desc=f"compile {shape}",
                         disable=args.no_progress):
            errors.update(dict(done.result()))
    return errors


def run(args) -> int:
    if args.device.type != "cuda" and not interpreting():
        raise SystemExit("attention-tune: the kernels are timed on a CUDA device; got --device "
                         f"{args.device} (run the tests under TRITON_INTERPRET=1 for CPU checks)")
    if args.device.type == "cpu" and args.dtype == "bf16":
        raise SystemExit("attention-tune: --dtype bf16 on the CPU runs under Triton's interpreter, whose bf16 "
                         "products are wrong (Triton 3.6); use --dtype fp16 there")
    from cs336_systems.bench.suites.attention import attention_fn, measure_pass

    causal = args.causal == "on"
    store = ResultStore("attention-tune", args.device, args.results_dir)
    for shape in args.shape:
        batch, heads, seq, d = shape
        base = dict(batch=batch, heads=heads, seq=seq, d=d, dtype=args.dtype, causal=causal)
        flops_fwd = attention_flops(batch, heads, seq, seq, d, causal=causal)
        jobs = [(kernel, config) for kernel in args.kernel for config in tuning_space(kernel)[:args.limit]]
        errors = _precompile(shape, args, jobs)
        free_memory(args.device)
        launches = _launches(_inputs(shape, args.dtype, causal, args.device), causal)
        timing = bench_kernel(launches["preprocess"], device=args.device, warmup_ms=args.warmup_ms,
                              rep_ms=args.rep_ms)
        store.add(provider="triton", config=base | dict(kernel="preprocess"), metric="time", unit="ms",
                  stats=timing.stats())
        for kernel, config in tqdm(jobs, desc=f"time {shape}", disable=args.no_progress):
            row = base | dict(kernel=kernel, block_m=config[0], block_n=config[1], num_warps=config[2],
                              num_stages=config[3])
            error = errors.get((kernel, config))
            if error is None:
                try:
                    timing = bench_kernel(launches[kernel].with_config(*config), device=args.device,
                                          warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
                except Exception as failure:
                    error = error_message(failure, 200)
            if error is not None:
                store.add(provider="triton", config=row, metric="time", unit="ms", status="unsupported",
                          message=error)
                continue
            store.add(provider="triton", config=row, metric="time", unit="ms", stats=timing.stats())
            store.add(provider="triton", config=row, metric="tflops", unit="TFLOP/s",
                      value=flops_fwd * KERNEL_FLOP_FACTOR[kernel] / (timing.median / 1e3) / 1e12)
        launches = None
        _time_whole_passes(shape, base, args, store, attention_fn, measure_pass)
        print(shape_line(store.frame(), shape), flush=True)
    _print_summary(store.frame(), args)
    print(f"\nrows appended to {store.path}")
    return 0


def _time_whole_passes(shape, base, args, store, attention_fn, measure) -> None:
    """Forward and backward of the shipped (autotuned) kernel and of SDPA's backends, in this run."""
    for provider in ("triton", "triton-two-pass-bwd", "triton-tl-bwd", "triton-fused-bwd", "sdpa-cudnn", "sdpa-flash"):
        fn = attention_fn(provider, base["causal"])
        for p in ("fwd", "bwd"):
            free_memory(args.device)
            try:
                q, k, v = (torch.randn(*shape, device=args.device, dtype=DTYPES[args.dtype], requires_grad=True)
                           for _ in range(3))
                timing, _, _ = measure(p, fn, q, k, v, torch.randn_like(q), args)
                store.add(provider=provider, config=base | dict(kernel=p), metric="time", unit="ms",
                          stats=timing.stats())
            except Exception as error:
                store.add(provider=provider, config=base | dict(kernel=p), metric="time", unit="ms",
                          status="unsupported", message=error_message(error, 200))
            finally:
                q = k = v = None
    import triton  # (GPU only: this suite needs Triton, checked in `run`)

    from cs336_systems.kernels.flash_attention.dispatch import chosen_configs

    shape_key = f"({triton.next_power_of_2(base['seq'])}, {triton.next_power_of_2(base['seq'])}, " \
                f"{max(16, triton.next_power_of_2(base['d']))},"
    for kernel, choices in chosen_configs().items():
        for key, config in choices.items():
            if not (key.startswith(shape_key) or key == "every key"):
                continue
            store.add(provider="triton", config=base | dict(kernel=kernel, tuning_key=key),
                      metric="autotune_choice", unit="config", message=config)


def shape_line(frame: pd.DataFrame, shape: tuple[int, int, int, int]) -> str:
    """One shape's results as soon as they are in (a run cut short by a time limit still shows the shapes it
    finished): the best config of each kernel and the shipped passes against cuDNN's, in ms."""
    batch, heads, seq, d = shape
    rows = frame[(frame["metric"] == "time") & (frame["status"] == "ok") & (frame["batch"] == batch)
                 & (frame["heads"] == heads) & (frame["seq"] == seq) & (frame["d"] == d)]
    tuned = rows[rows["kernel"].isin(KERNELS)].sort_values("median").groupby("kernel", sort=False).head(1)
    parts = [f"{r.kernel} {r.median:.3f} ({r.block_m:.0f}x{r.block_n:.0f} w{r.num_warps:.0f} s{r.num_stages:.0f})"
             for r in tuned.itertuples()]  # (the frame's config columns are floats: other rows leave them empty)
    passes = rows[rows["kernel"].isin(["fwd", "bwd"]) & rows["provider"].isin(["triton", "sdpa-cudnn"])]
    parts += [f"{r.provider} {r.kernel} {r.median:.3f}" for r in passes.itertuples()]
    return f"{batch}x{heads}x{seq}x{d}: " + "; ".join(parts)


def best_configs(frame: pd.DataFrame):
    """Per shape and kernel, the configs ranked by median time (fastest first), grouped."""
    times = frame[(frame["metric"] == "time") & (frame["status"] == "ok") & frame["kernel"].isin(KERNELS)]
    keys = ["batch", "heads", "seq", "d", "dtype", "causal", "kernel"]
    return times.sort_values([*keys, "median"]).groupby(keys, sort=False)


def _print_summary(frame: pd.DataFrame, args) -> None:
    if frame.empty:
        return
    fmt = "latex" if args.latex else "markdown"
    cols = ["seq", "d", "kernel", "block_m", "block_n", "num_warps", "num_stages", "median"]
    ranked = best_configs(frame)
    print(format_table(ranked.head(args.top)[cols].rename(columns={"median": "time ms"}).round(3), fmt))
    # What the best of each kernel adds up to, against the whole passes timed in the same run.
    times = frame[(frame["metric"] == "time") & (frame["status"] == "ok")]
    summary = []
    for (batch, heads, seq, d), group in times.groupby(["batch", "heads", "seq", "d"]):
        best = group[group["kernel"].isin(KERNELS)].groupby("kernel")["median"].min()
        whole = group[group["kernel"].isin(["fwd", "bwd", "preprocess"])].set_index(["provider", "kernel"])["median"]
        preprocess = whole.get(("triton", "preprocess"), 0.0)
        best_bwd = best.get("dkdv", float("nan")) + best.get("dq", float("nan")) + preprocess
        summary.append(dict(shape=f"{batch}x{heads}x{seq}x{d}", best_fwd=best.get("forward"),
                            best_fwd_tma=best.get("forward-tma"),
                            best_fwd_gluon=best.reindex(["forward-gluon", "forward-gluon-late",
                                                         "forward-gluon-ws"]).min(),
                            best_fwd_gluon_host=best.get("forward-gluon-late-host"),
                            best_bwd=best_bwd,
                            best_fused_bwd=best.get("fused", float("nan")) + preprocess,
                            best_fused_gluon_bwd=best.reindex(["fused-gluon", "fused-gluon-s1", "fused-gluon-s2",
                                                               "fused-gluon-atomic", "fused-gluon-ws"]).min()
                            + preprocess,
                            best_gluon_bwd=best.reindex(["dkdv-gluon", "dkdv-gluon-k", "dkdv-gluon-kv"]).min()
                            + best.reindex(["dq-gluon", "dq-gluon-q", "dq-gluon-qdo"]).min()
                            + preprocess,
                            shipped_fwd=whole.get(("triton", "fwd")), shipped_bwd=whole.get(("triton", "bwd")),
                            shipped_two_pass_bwd=whole.get(("triton-two-pass-bwd", "bwd")),
                            shipped_tl_bwd=whole.get(("triton-tl-bwd", "bwd")),
                            shipped_fused_bwd=whole.get(("triton-fused-bwd", "bwd")),
                            cudnn_fwd=whole.get(("sdpa-cudnn", "fwd")), cudnn_bwd=whole.get(("sdpa-cudnn", "bwd")),
                            flash_fwd=whole.get(("sdpa-flash", "fwd")), flash_bwd=whole.get(("sdpa-flash", "bwd"))))
    print("\nmedian ms: best config per kernel vs the shipped autotuned kernels and SDPA, same run")
    print(format_table(pd.DataFrame(summary).round(3), fmt))
