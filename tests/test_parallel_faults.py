"""Fault injection on gloo: in each DDP variant, ZeRO-1 and FSDP, rank 1 raises, exits (with 0 or 1, through
sys.exit or a hard os._exit), is killed, or hangs, in the forward, the backward or the optimizer step of its second
step. Every rank must end within a bounded time, and `spawn` must name rank 1 and what it did."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.parallel import comm
from cs336_systems.parallel.ddp import VARIANTS, make_ddp
from cs336_systems.parallel.fsdp import FSDP
from cs336_systems.parallel.sharded_optimizer import ShardedOptimizer
from tests._distributed import ToyModel, local_rows, toy_batches

pytestmark = pytest.mark.distributed  # spawns gloo ranks

TIMEOUT_S = 4  # the process group's timeout in these runs: how long a peer waits for a rank that hangs
BOUND_S = 45  # start-up, the timeout, and the parent's SIGTERM/SIGKILL grace, with room for a loaded CI machine
FAULTY_RANK = 1
WRAPPERS = (*(f"ddp-{variant}" for variant in VARIANTS), "zero1", "fsdp")
PHASES = ("forward", "backward", "step")
# fault -> the text `spawn`'s error must carry after "rank1 failed first: "
FAULTS = {
    "raise": "raised RuntimeError: injected fault in the {phase}",
    "sys-exit-0": "exited with code 0 before finishing",
    "sys-exit-1": "exited with code 1",
    "os-exit-0": "exited with code 0 before finishing",
    "kill": "was killed by SIGKILL",
    "hang": "stopped responding (still running when rank0 gave up on it",
}


def _inject(fault: str, phase: str) -> None:
    if fault == "raise":
        raise RuntimeError(f"injected fault in the {phase}")
    if fault == "sys-exit-0":
        sys.exit(0)
    if fault == "sys-exit-1":
        sys.exit(1)
    if fault == "os-exit-0":
        os._exit(0)  # no cleanup, no exception: what a crash that exits cleanly looks like
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "hang":
        time.sleep(3600)


def _wrapped(wrapper: str):
    """(model, optimizer) of one data-parallel wrapper around the toy model."""
    torch.manual_seed(0)
    if wrapper == "fsdp":
        model = FSDP(ToyModel())
        return model, torch.optim.SGD(model.parameters(), lr=0.1)
    model = make_ddp(ToyModel(), "flat" if wrapper == "zero1" else wrapper.removeprefix("ddp-"))
    if wrapper == "zero1":
        return model, ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _train_with_fault(rank, world_size, wrapper, fault, phase):
    model, optimizer = _wrapped(wrapper)
    for step, (x, y) in enumerate(toy_batches(3)):
        faulty = rank == FAULTY_RANK and step == 1
        optimizer.zero_grad()
        if faulty and phase == "forward":
            _inject(fault, phase)
        loss = F.mse_loss(model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size))
        if faulty and phase == "backward":
            _inject(fault, phase)
        loss.backward()
        model.finish_gradient_synchronization()
        if faulty and phase == "step":
            _inject(fault, phase)
        optimizer.step()


# Every wrapper meets every fault; the phase turns with both, so each (wrapper, phase) and (fault, phase) pair is met.
CASES = [(wrapper, fault, PHASES[(i + j) % len(PHASES)])
         for i, wrapper in enumerate(WRAPPERS) for j, fault in enumerate(FAULTS)]


@pytest.mark.parametrize("wrapper, fault, phase", CASES, ids=["-".join(case) for case in CASES])
def test_a_failing_rank_stops_every_rank_and_is_named(wrapper, fault, phase):
    start = time.monotonic()
    with pytest.raises(RuntimeError) as raised:
        comm.spawn(_train_with_fault, 2, wrapper, fault, phase, timeout_s=TIMEOUT_S)
    elapsed = time.monotonic() - start
    expected = f"rank{FAULTY_RANK} failed first: " + FAULTS[fault].format(phase=phase)
    assert str(raised.value).startswith(expected), str(raised.value)
    assert elapsed < BOUND_S, f"took {elapsed:.1f} s"


def test_a_clean_run_raises_nothing():
    """The same training with no fault: every rank finishes, spawn returns."""
    comm.spawn(_train_with_fault, 2, "ddp-bucketed", "none", "forward", timeout_s=TIMEOUT_S)


class _Ended:
    """A rank process as `_first_failure` sees it: ended with this exit code."""

    def __init__(self, exitcode):
        self.exitcode = exitcode

    def is_alive(self):
        return self.exitcode is None


def test_first_failure_prefers_a_rank_that_failed_on_its_own(tmp_path):
    """Seen in the same instant: a killed rank against its peer that gloo aborted (SIGABRT), or that raised a
    closed-connection error; a rank still running while its peer timed out is the one that hung."""
    now = time.time()
    assert comm._first_failure([_Ended(-6), _Ended(-9)], str(tmp_path), {0: now, 1: now}) == (
        "rank1 failed first: was killed by SIGKILL")
    (tmp_path / "rank0").write_text(f"{now - 1}\nRuntimeError: Connection closed by peer [127.0.0.1]:1234")
    assert comm._first_failure([_Ended(1), _Ended(0)], str(tmp_path), {0: now, 1: now}) == (
        "rank1 failed first: exited with code 0 before finishing")
    (tmp_path / "rank0").write_text(f"{now - 1}\nRuntimeError: Connection closed by peer [127.0.0.1]:1234")
    (tmp_path / "rank1").write_text(f"{now}\nSystemExit: 1")  # then aborted in gloo's teardown
    assert comm._first_failure([_Ended(1), _Ended(-6)], str(tmp_path), {0: now, 1: now}) == (
        "rank1 failed first: exited with code 1 (the process then was killed by SIGABRT)")
    (tmp_path / "rank1").unlink()
    (tmp_path / "rank0").write_text(f"{now}\nRuntimeError: Timed out waiting 4000ms for recv operation")
    assert comm._first_failure([_Ended(1), _Ended(None)], str(tmp_path), {0: now}).startswith(
        "rank1 failed first: stopped responding (still running when rank0 gave up on it: raised RuntimeError: Timed")
