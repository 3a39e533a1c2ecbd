"""Build a C++ extension once per content, with no lock that can outlive the process that took it.

`torch.utils.cpp_extension.load` builds into one folder per extension name and guards it with a `lock` file
that later processes wait on, sleeping, for as long as it exists. An interrupted build (Ctrl-C, a timeout, a
killed job) leaves the file behind, and every later process then waits forever, silently. Its folder is also
named by the checkout's path, so each new checkout rebuilds.

Here a build runs in a private temporary folder (cpp_extension's lock is then private too: nobody else waits on
it) and is moved into place by one `rename`, which is atomic: a folder in place holds a complete binary. The
folder is named by a hash of what the binary depends on -- the sources' text, the flags, torch's and Python's
versions and any `key_parts` the caller adds -- so a new checkout or virtual environment with the same code and
torch finds it built, and changed code never loads a stale binary. Two processes that build at once both end
with a working module. So that they do not both compile, a process takes an advisory `flock` on a lock file
before it builds; the kernel releases such a lock when its owner exits or is killed, so it cannot go stale. The
others wait for it (at most LOCK_WAIT_SECONDS; past that they build anyway, with a warning) and then load what
the first one built. Temporary folders left by killed builds are removed once they are an hour old.

The cache is `$CS336_EXTENSIONS_DIR`, else `$XDG_CACHE_HOME/cs336_systems/extensions`, else
`~/.cache/cs336_systems/extensions`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch

ENV_VAR = "CS336_EXTENSIONS_DIR"
# A build takes about 30 s on a 2-core machine; a temporary folder this old belongs to a build that died.
STALE_BUILD_SECONDS = 3600
# How long a process waits for another's build of the same content before it builds too (ten builds' time).
LOCK_WAIT_SECONDS = 300.0


def cache_root() -> Path:
    """Where built extensions live (see the module docstring)."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "cs336_systems" / "extensions"


def build_key(sources: Sequence[str | Path], flags: Sequence[str] = (), key_parts: Sequence[str] = ()) -> str:
    """A short hash of everything the built binary depends on (the sources' text, not their paths)."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(Path(source).read_bytes())
    for part in (*flags, *key_parts, torch.__version__, str(torch.version.git_version), sys.version,
                 platform.machine(), platform.system()):
        digest.update(b"\0" + str(part).encode())
    return digest.hexdigest()[:16]


def _import_from(folder: Path) -> ModuleType | None:
    """The extension module built in `folder` (None when there is none)."""
    binaries = sorted(folder.glob("*.so")) + sorted(folder.glob("*.pyd"))
    if not binaries:
        return None
    path = binaries[0]
    # cpp_extension names the module after the file (it appends _v1, _v2 when one process rebuilds a name).
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        raise ImportError(f"{path} did not load ({error}); delete {folder} to rebuild it") from error
    return module


def _remove_stale_builds(root: Path, name: str) -> None:
    now = time.time()
    for folder in root.glob(f".{name}-*"):
        if not folder.is_dir():  # the lock files
            continue
        try:
            if now - folder.stat().st_mtime > STALE_BUILD_SECONDS:
                shutil.rmtree(folder, ignore_errors=True)
        except FileNotFoundError:  # another process removed it first
            pass


@contextlib.contextmanager
def _build_lock(path: Path, timeout: float) -> Iterator[None]:
    """Hold an exclusive flock on `path` inside the block, waiting at most `timeout` seconds for it. Where the lock
    cannot be had (no flock on this file system, or the wait ran out) the block runs without it: a build is then
    only repeated, never blocked."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(path, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    warnings.warn(f"{path} has been held for over {timeout:.0f} s by another build; building "
                                  "without waiting any longer", stacklevel=3)
                    yield
                    return
                time.sleep(0.1)
            except OSError:  # the file system takes no flock
                yield
                return
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def load_extension(name: str, sources: Sequence[str | Path], *, extra_cflags: Sequence[str] = (),
                   extra_ldflags: Sequence[str] = (), extra_include_paths: Sequence[str] = (),
                   key_parts: Sequence[str] = (), root: Path | None = None) -> ModuleType:
    """The extension `name` built from `sources`: loaded from the cache where this content was built before, else
    built now (a minute or less) and put in the cache. Errors from the compiler propagate.

    `extra_include_paths` are not part of the key (they differ between virtual environments holding the same
    headers); name what they stand for in `key_parts` (a package's version, say)."""
    root = Path(root) if root is not None else cache_root()
    flags = [*extra_cflags, "|", *extra_ldflags]
    final = root / f"{name}-{build_key(sources, flags, key_parts)}"
    if final.is_dir():
        module = _import_from(final)
        if module is not None:
            return module
    root.mkdir(parents=True, exist_ok=True)
    with _build_lock(root / f".{final.name}.lock", LOCK_WAIT_SECONDS):
        if final.is_dir():  # built by the process we waited for
            module = _import_from(final)
            if module is not None:
                return module
        _remove_stale_builds(root, name)
        return _build(name, sources, final, extra_cflags, extra_ldflags, extra_include_paths)


def _build(name: str, sources: Sequence[str | Path], final: Path, extra_cflags: Sequence[str],
           extra_ldflags: Sequence[str], extra_include_paths: Sequence[str]) -> ModuleType:
    """Build in a private folder beside `final` and rename it to `final`."""
    from torch.utils import cpp_extension

    private = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        module = cpp_extension.load(name=name, sources=[str(s) for s in sources], build_directory=str(private),
                                    extra_cflags=list(extra_cflags), extra_ldflags=list(extra_ldflags),
                                    extra_include_paths=list(extra_include_paths), verbose=False)
        private.chmod(0o755)  # mkdtemp's folder is private to its owner; the cache is readable like any other
        try:
            private.rename(final)  # atomic; fails where another build was put in place first (no flock here)
            private = None
        except OSError:
            pass  # keep using ours: the one in place is the same content
        return module
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
