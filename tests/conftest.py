"""Without a GPU, run our Triton kernels through Triton's interpreter on CPU tensors.

The flag must be set before any kernel module is imported (Triton reads it when a kernel
is decorated), hence here. Tests that need the interpreter skip cleanly if it is off.

Bytecode for the suite's child processes: the suite starts a few hundred Python processes
(distributed ranks, CLI runs, inductor's compile workers). Where PYTHONDONTWRITEBYTECODE is set
(many container images set it) and the packages were installed without bytecode (README's `pip
install --no-compile`), each of them compiled torch's sources again: about 2 s a process, and the
suite took 26 minutes in a fresh clone against 16 in a venv with bytecode. The children now share
one bytecode cache in a directory of the session's own (PYTHONPYCACHEPREFIX), so nothing is written
beside the user's sources or into their environment, and the cache goes when the session ends.
"""

import os
import shutil
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_session_pycache: str | None = None
_users_setting: str | None = None  # PYTHONDONTWRITEBYTECODE as found, put back at the end


def pytest_configure(config):
    global _session_pycache, _users_setting
    if os.environ.get("PYTHONDONTWRITEBYTECODE") and not os.environ.get("PYTHONPYCACHEPREFIX"):
        _session_pycache = tempfile.mkdtemp(prefix="cs336-test-pycache-")
        _users_setting = os.environ.pop("PYTHONDONTWRITEBYTECODE")
        os.environ["PYTHONPYCACHEPREFIX"] = _session_pycache


def pytest_unconfigure(config):
    global _session_pycache
    if _session_pycache is not None:
        os.environ["PYTHONDONTWRITEBYTECODE"] = _users_setting
        os.environ.pop("PYTHONPYCACHEPREFIX", None)
        shutil.rmtree(_session_pycache, ignore_errors=True)
        _session_pycache = None
