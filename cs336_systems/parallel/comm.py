"""Process-group set-up for torchrun (env://, one node or many), mp.spawn, and world size 1,
plus the few collectives gloo lacks.

* `setup(...)` reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun sets
  them), picks NCCL for CUDA and gloo otherwise, pins the device to the local rank, and uses
  a bounded timeout so a rank that dies makes the others fail instead of hanging.
* `spawn(fn, world_size, ...)` runs `fn(rank, world_size, *args)` in fresh processes that meet at a
  rendezvous store this process binds first (on a free port, so no other process can take it in between);
  if one raises, torch's spawn terminates the rest and re-raises its error here.
* `reduce_scatter` / `all_gather_into` fall back to all-reduce + slice and list all-gather
  on gloo, which has no reduce-scatter.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 120


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str | None  # None: single process, no group


def setup(backend: str | None = None, *, rank: int | None = None, world_size: int | None = None,
          device: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
          store: dist.Store | None = None) -> DistContext:
    """Join (or skip, at world size 1) the default process group; returns where this rank runs. Rendezvous
    through `store` where given (`spawn`'s), else torchrun's environment (MASTER_ADDR / MASTER_PORT)."""
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    want_cuda = (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if want_cuda:
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dev = torch.device("cuda", torch.cuda.current_device())
    else:
        dev = torch.device("cpu")
    if backend is None:
        backend = "nccl" if want_cuda else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"setup: backend must be nccl or gloo, got {backend!r}")
    if world_size == 1 and not dist.is_initialized():
        return DistContext(0, 1, 0, dev, None)
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "localhost")
        os.environ.setdefault("MASTER_PORT", "12390")
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=dev if backend == "nccl" else None)
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev, dist.get_backend())


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _spawn_entry(rank: int, fn: Callable, world_size: int, port: int, backend: str | None, args: tuple,
                 error_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world_size), str(rank)
    device = "cuda" if backend == "nccl" else "cpu"
    try:
        # The parent holds the store's port from before the spawn to the end (see `spawn`): every rank,
        # rank 0 included, joins it as a client.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
        setup(backend, rank=rank, world_size=world_size, device=device, store=store)
        fn(rank, world_size, *args)
        if dist.is_initialized():
            # Every rank done before any tears down: a gloo rank destroying its group while a peer still talks
            # to it aborted once in CI ("terminate called without an active exception", SIGABRT, 2026-12-04).
            dist.barrier()
    except BaseException as error:
        # Record when and why this rank failed: the parent reports the first failure, the cause,
        # not a peer's "connection closed" that followed it.
        with open(os.path.join(error_dir, f"rank{rank}"), "w") as f:
            f.write(f"{time.time()}\n{type(error).__name__}: {error}")
        raise
    finally:
        teardown()


def spawn(fn: Callable, world_size: int, *args, backend: str | None = "gloo", port: int | None = None) -> None:
    """Run fn(rank, world_size, *args) on `world_size` processes, each already in the process group
    (gloo on CPU by default; "nccl" for one GPU per rank); the first error is re-raised here."""
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    # The rendezvous store lives in this process, bound before any rank starts (port 0: the system picks a free
    # one). Choosing a free port and letting rank 0 bind it later raced other processes for it (EADDRINUSE in
    # about 1 of 32 fresh runs).
    try:
        store = dist.TCPStore("127.0.0.1", port or 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    except (RuntimeError, OSError) as error:
        raise RuntimeError(f"spawn: could not listen on port {port or 0} for the ranks' rendezvous "
                           f"({str(error).splitlines()[0][:200]}); pass another port or none") from None
    with tempfile.TemporaryDirectory() as error_dir:
        try:
            mp.spawn(_spawn_entry, args=(fn, world_size, store.port, backend, args, error_dir),
                     nprocs=world_size, join=True)
        except mp.ProcessRaisedException as error:
            failures = []
            for name in os.listdir(error_dir):
                with open(os.path.join(error_dir, name)) as f:
                    when, message = f.read().split("\n", 1)
                failures.append((float(when), name, message))
            if not failures:
                raise
            when, name, message = min(failures)
            raise RuntimeError(f"{name} failed first: {message}") from error


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def is_gloo() -> bool:
    return dist.is_initialized() and dist.get_backend() == "gloo"


def all_reduce(tensor: torch.Tensor, op=None, async_op: bool = False):
    """In-place sum (default) over ranks; a no-op handle at world size 1."""
    if world_size() == 1:
        return _Done() if async_op else None
    return dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM, async_op=async_op)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """output (n,) <- rank's slice of the sum over ranks of input (world*n,). gloo: all-reduce + slice."""
    ws = world_size()
    if ws == 1:
        output.copy_(input)
        return _Done() if async_op else None
    if is_gloo():
        summed = input.clone()
        dist.all_reduce(summed)
        output.copy_(summed.view(ws, -1)[rank()])
        return _Done() if async_op else None
    return dist.reduce_scatter_tensor(output, input, async_op=async_op)


def all_gather_into(output: torch.Tensor, input: torch.Tensor, async_op: bool = False):
    """output (world*n,) <- every rank's input (n,), in rank order."""
    ws = world_size()
    if ws == 1:
        output.copy_(input)
        return _Done() if async_op else None
    if is_gloo():
        dist.all_gather(list(output.view(ws, -1).unbind(0)), input.contiguous())
        return _Done() if async_op else None
    return dist.all_gather_into_tensor(output, input, async_op=async_op)


def broadcast(tensor: torch.Tensor, src: int, async_op: bool = False):
    if world_size() == 1:
        return _Done() if async_op else None
    return dist.broadcast(tensor, src=src, async_op=async_op)


class _Done:
    """The handle of a collective that already completed."""

    def wait(self):
        return None

    def is_completed(self) -> bool:
        return True


@contextlib.contextmanager
def distributed(backend: str | None = None, **kwargs):
    """`with distributed() as ctx:` set up, yield the context, tear down."""
    ctx = setup(backend, **kwargs)
    try:
        yield ctx
    finally:
        teardown()
