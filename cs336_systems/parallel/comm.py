"""Process-group set-up for torchrun (env://, one node or many), mp.spawn, and world size 1,
plus the few collectives gloo lacks.

* `setup(...)` reads RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (torchrun sets
  them), picks NCCL for CUDA and gloo otherwise, pins the device to the local rank, and uses
  a bounded timeout so a rank that dies makes the others fail instead of hanging.
* `spawn(fn, world_size, ...)` runs `fn(rank, world_size, *args)` in fresh processes that meet at a
  rendezvous store this process binds first (on a free port, so no other process can take it in between),
  and watches them: the first rank that raises, exits early, is killed or hangs stops them all, and its
  rank and what it did are raised here.
* `reduce_scatter` / `all_gather_into` fall back to all-reduce + slice and list all-gather
  on gloo, which has no reduce-scatter.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import connection as mp_connection

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
                 status_dir: str, timeout_s: float) -> None:
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"] = str(rank), str(world_size), str(rank)
    device = "cuda" if backend == "nccl" else "cpu"
    finished = False
    try:
        # The parent holds the store's port from before the spawn to the end (see `spawn`): every rank,
        # rank 0 included, joins it as a client.
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=max(timeout_s, DEFAULT_TIMEOUT_S)))
        # Everyone started before timeout_s counts: it bounds the wait for a peer that stopped, not a slow start
        # (importing torch on a loaded machine). A rank that dies before arriving is the parent's to see.
        store.add("spawn/arrived", 1)
        while store.add("spawn/arrived", 0) < world_size:
            time.sleep(0.01)
        store.set_timeout(datetime.timedelta(seconds=timeout_s))
        setup(backend, rank=rank, world_size=world_size, device=device, store=store, timeout_s=timeout_s)
        fn(rank, world_size, *args)
        if dist.is_initialized():
            # Every rank done before any tears down: a gloo rank destroying its group while a peer still talks
            # to it aborted once in CI ("terminate called without an active exception", SIGABRT, 2026-12-04).
            dist.barrier()
        open(os.path.join(status_dir, f"done{rank}"), "w").close()  # finished, as opposed to exited early
        finished = True
    except BaseException as error:
        # When and why this rank failed: the parent reports the first failure, the cause, not a peer's
        # "connection closed" that followed it.
        record = os.path.join(status_dir, f"rank{rank}")
        with open(record + ".partial", "w") as f:
            f.write(f"{time.time()}\n{type(error).__name__}: {error}")
        os.replace(record + ".partial", record)  # whole or absent: the parent may read it at any moment
        raise
    finally:
        if not finished:
            teardown()
    # A finished rank leaves without gloo's teardown: destroy_process_group (or its threads' destructors at exit)
    # aborted ranks that had done all their work, 2 runs in 20 of the distributed tests after the barrier above
    # ("was killed by SIGABRT", FSDP, notes/runs/repeat_tests_0d36018.jsonl). The parent needs only the marker.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Errors a rank raises because another rank stopped: a closed connection, or a collective that timed out waiting.
_KNOCK_ON = re.compile(r"connection (closed|reset|refused)|timed out|timeout|broken pipe|peer|end of file",
                       re.IGNORECASE)


@dataclass(frozen=True)
class _Failure:
    when: float
    rank: int
    what: str

    @property
    def knock_on(self) -> bool:
        # gloo's own threads abort a rank whose peer vanished mid-collective ("terminate called without an active
        # exception"): a SIGABRT follows another rank's failure more often than it starts one.
        return bool(_KNOCK_ON.search(self.what)) or self.what == "was killed by SIGABRT"


def _exit_description(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with code {exitcode}" + (" before finishing" if exitcode == 0 else "")


def _first_failure(procs: list, status_dir: str, exited: dict[int, float]) -> str:
    """'rankN failed first: what it did', from the ranks' own records and the exits the parent saw. A rank's own
    error beats a peer's knock-on error (closed connection, timeout) whatever the clock says; where every record
    is a knock-on and a rank is still running, that rank is the one that stopped responding."""
    failures = []
    for rank, proc in enumerate(procs):
        if rank not in exited and proc.exitcode is not None:  # ended while the parent looked at another rank
            exited[rank] = time.time()
        record = os.path.join(status_dir, f"rank{rank}")
        if os.path.exists(record):
            with open(record) as f:
                when, message = f.read().split("\n", 1)
            if message.startswith("SystemExit"):  # sys.exit(code) inside fn: say the code it asked for
                asked = message.partition(": ")[2]
                code = 0 if asked in ("", "None") else int(asked) % 256 if asked.lstrip("-").isdigit() else 1
                message = _exit_description(code)
                if rank in exited and proc.exitcode != code:  # gloo's teardown can abort it afterwards
                    message += f" (the process then {_exit_description(proc.exitcode)})"
            else:
                message = f"raised {message}"
            failures.append(_Failure(float(when), rank, message))
        elif rank in exited:
            failures.append(_Failure(exited[rank], rank, _exit_description(proc.exitcode)))
    first = min(failures, key=lambda f: (f.knock_on, f.when))
    still_running = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    if first.knock_on and still_running:
        return (f"rank{still_running[0]} failed first: stopped responding (still running when rank{first.rank} "
                f"gave up on it: {first.what})")
    return f"rank{first.rank} failed first: {first.what}"


def spawn(fn: Callable, world_size: int, *args, backend: str | None = "gloo", port: int | None = None,
          timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Run fn(rank, world_size, *args) on `world_size` processes, each already in the process group
    (gloo on CPU by default; "nccl" for one GPU per rank). A rank that raises, exits before finishing (with any
    code), is killed, or hangs (its peers' collectives time out after timeout_s) stops every rank, and
    `RuntimeError("rankN failed first: what it did")` is raised here."""
    if world_size < 1:
        raise ValueError(f"spawn: world_size must be >= 1, got {world_size}")
    # The rendezvous store lives in this process, bound before any rank starts (port 0: the system picks a free
    # one). Choosing a free port and letting rank 0 bind it later raced other processes for it (EADDRINUSE in
    # about 1 of 32 fresh runs).
    try:
        store = dist.TCPStore("127.0.0.1", port or 0, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as error:
        raise RuntimeError(f"spawn: could not listen on port {port or 0} for the ranks' rendezvous "
                           f"({str(error).splitlines()[0][:200]}); pass another port or none") from None
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as status_dir:
        procs = [context.Process(target=_spawn_entry, name=f"rank{rank}",
                                 args=(rank, fn, world_size, store.port, backend, args, status_dir, timeout_s))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        failure = None
        try:
            running = {proc.sentinel: rank for rank, proc in enumerate(procs)}
            exited: dict[int, float] = {}
            while running and failure is None:
                for sentinel in mp_connection.wait(list(running)):  # every rank that ended since the last look
                    rank = running.pop(sentinel)
                    procs[rank].join()
                    exited[rank] = time.time()
                if any(procs[rank].exitcode != 0 or not os.path.exists(os.path.join(status_dir, f"done{rank}"))
                       for rank in exited):
                    failure = _first_failure(procs, status_dir, exited)
        finally:
            _stop(procs)
    if failure is not None:
        raise RuntimeError(failure)


def _stop(procs: list, grace_s: float = 5.0) -> None:
    """End every rank still running: SIGTERM, then SIGKILL after grace_s (a rank stuck in a collective)."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.time() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.time()))
        if proc.is_alive():
            proc.kill()
            proc.join()


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
