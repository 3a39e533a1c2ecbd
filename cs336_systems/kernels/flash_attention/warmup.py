"""Compile the FlashAttention kernels' autotune candidates ahead of use, in parallel processes.

The first call with a new (head dim, dtype, causal) makes the autotuner compile its candidate configs one
after another. In fp32 that took most of the first case of a flash sweep (about 160 s at d 32 on the H200),
with the GPU idle. Triton keeps compiled binaries in its on-disk cache, keyed by source, compile-time
constants and argument specialisation. So compiling the candidates in worker processes first turns those
compiles into cache loads. Sizes and strides that are multiples of 16 share a specialisation, so one
small input per combination covers a whole sweep of such sequence lengths.

    from cs336_systems.kernels.flash_attention.warmup import precompile
    errors = precompile([(64, torch.float32, True), (128, torch.bfloat16, True)], workers=12)
"""

from __future__ import annotations

import multiprocessing
from concurrent import futures

import torch

WARM_SEQ = 128  # a multiple of 16 (so of every tile): the specialisation of any such length


def _launches(head_dim: int, dtype: torch.dtype, causal: bool, device: str = "cuda") -> dict:
    """The forward and the backward kernels' launches (as the autograd Functions make them) on small inputs."""
    from cs336_systems.kernels.flash_attention.dispatch import backward_launches, forward_launch
    from cs336_systems.kernels.flash_attention.launches import KernelLaunch, LaunchSequence

    q, k, v, grad_out = (torch.randn(1, 1, WARM_SEQ, head_dim, device=device, dtype=dtype) for _ in range(4))
    forward, out, lse = forward_launch(q, k, v, causal)
    first, dkdv, dq, _ = backward_launches(q, k, v, out, lse, grad_out, causal, gluon=False)  # (Gluon: not tuned)
    _, fused, _, _ = backward_launches(q, k, v, out, lse, grad_out, causal, fused=True, gluon=False)
    launches = dict(forward=forward, dkdv=dkdv, dq=dq, fused=fused)
    if isinstance(first, KernelLaunch):  # fp32-accurate dots: the row statistics pass, tuned as the dQ pass
        launches["row-stats"] = first
    if isinstance(dkdv, LaunchSequence):  # wide heads: the dV and the dK pass, each compiled on its own
        del launches["dkdv"]
        launches |= dict(zip(("dv", "dk"), dkdv.parts))
    if not isinstance(forward, KernelLaunch):  # the Gluon forward: one config, compiled on first use
        del launches["forward"]
    return launches


def _candidates(launch) -> list:
    """The configs the autotuner would try for this launch (after its pruning)."""
    tuner = launch.kernel
    named = dict(zip(tuner.arg_names, launch.args))
    if tuner.early_config_prune:
        return tuner.early_config_prune(tuner.configs, named, **launch.flags)
    return tuner.configs


def _compile_one(head_dim: int, dtype: torch.dtype, causal: bool, kernel: str, index: int) -> str | None:
    """Compile one candidate (no launch); an error message, or None."""
    try:
        launch = _launches(head_dim, dtype, causal)[kernel]
        config = _candidates(launch)[index]
        launch.kernel.fn.warmup(*launch.args, grid=launch.grid, **launch.flags, **config.all_kwargs())
        return None
    except Exception as error:  # a config that does not fit: the autotuner will skip it too
        return f"{kernel} d {head_dim} {dtype} config {index}: {type(error).__name__}: {str(error)[:160]}"


def precompile(combos, workers: int) -> list[str]:
    """Compile every candidate of every kernel for each (head_dim, dtype, causal) in `combos`, spread over
    `workers` processes. Returns the failures (configs that do not fit, or a pool that could not start);
    a failure only means the autotuner compiles that config itself, as it would have anyway."""
    combos = sorted(set(combos), key=str)
    if workers <= 0 or not combos or not torch.cuda.is_available():
        return []
    try:
        jobs = [(d, dtype, causal, kernel, i) for d, dtype, causal in combos
                for kernel, launch in _launches(d, dtype, causal).items() for i in range(len(_candidates(launch)))]
        context = multiprocessing.get_context("spawn")  # CUDA cannot be forked
        with futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
            return [e for e in pool.map(_compile_one, *zip(*jobs)) if e]
    except Exception as error:  # never worse than not warming
        return [f"precompile skipped: {type(error).__name__}: {str(error)[:200]}"]
