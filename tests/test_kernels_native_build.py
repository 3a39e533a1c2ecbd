"""kernels/native_build.py: an extension is built once per content, an interrupted build cannot make a later one
wait, and processes that build at once all end with a working module.

A tiny extension (the C API only, no torch headers) keeps each build to a second or two; one test loads the real
native launcher with the leftover lock that used to hang it.
"""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cs336_systems.kernels import native_build

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the builds run on Linux")

TINY_SOURCE = textwrap.dedent("""
    #include <Python.h>
    #define INIT_NAME(n) PyInit_##n
    #define INIT(n) INIT_NAME(n)
    #define TEXT(n) #n
    #define NAME(n) TEXT(n)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, "the answer"}, {nullptr, nullptr, 0, nullptr}};
    static struct PyModuleDef definition = {PyModuleDef_HEAD_INIT, NAME(TORCH_EXTENSION_NAME), nullptr, -1, methods};
    PyMODINIT_FUNC INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&definition); }
""")

# Builds the tiny extension in a fresh process and prints its answer and where it was loaded from:
# python -c BUILD ROOT SOURCE
BUILD = ("import sys; from cs336_systems.kernels import native_build as b; "
         "m = b.load_extension('cs336_tiny', [sys.argv[2]], root=sys.argv[1]); print(m.answer(), m.__file__)")


def _source(folder: Path, answer: int = 42) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tiny.cpp"
    path.write_text(f"#define ANSWER {answer}\n" + TINY_SOURCE)
    return path


def _build_in_subprocess(root: Path, source: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BUILD, str(root), str(source)], capture_output=True, text=True,
                          timeout=timeout, cwd=Path(__file__).parents[1])


def _entries(root: Path) -> list[str]:
    """The folders in the cache (the lock files beside them mean nothing once their owners are gone)."""
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def _answer(result) -> str:
    return result.stdout.split()[0] if result.stdout.split() else ""


def test_key_follows_content_and_flags_not_path(tmp_path):
    one, two = _source(tmp_path / "checkout-a"), _source(tmp_path / "checkout-b")
    assert native_build.build_key([one]) == native_build.build_key([two])
    assert native_build.build_key([one], ["-O2"]) != native_build.build_key([one], ["-O3"])
    assert native_build.build_key([one], key_parts=["triton 3.6.0"]) != native_build.build_key([one])
    assert native_build.build_key([_source(tmp_path / "changed", answer=7)]) != native_build.build_key([one])


def test_a_second_checkout_loads_the_first_build_without_building(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    first = _build_in_subprocess(root, _source(tmp_path / "checkout-a"))
    assert first.returncode == 0 and _answer(first) == "42", first.stderr[-2000:]
    (built,) = _entries(root)  # one folder in place, no temporary folder left

    from torch.utils import cpp_extension

    def no_build(*args, **kwargs):
        raise AssertionError("built again although this content was in the cache")

    monkeypatch.setattr(cpp_extension, "load", no_build)
    module = native_build.load_extension("cs336_tiny", [_source(tmp_path / "checkout-b")], root=root)
    assert module.answer() == 42 and Path(module.__file__).parent.name == built
    changed = _build_in_subprocess(root, _source(tmp_path / "changed", answer=7))
    assert _answer(changed) == "7", changed.stderr[-2000:]  # new content: its own build, not the stale one
    assert len(_entries(root)) == 2


def test_a_leftover_lock_from_a_killed_build_does_not_hang_the_next(tmp_path):
    root, source = tmp_path / "cache", _source(tmp_path / "checkout")
    key = native_build.build_key([source], ["|"])
    # What a build killed half-way leaves: its private folder, holding cpp_extension's lock. Recent (it could be
    # a build still running) and an old one; neither may make this build wait.
    for age in (0, 2 * native_build.STALE_BUILD_SECONDS):
        leftover = root / f".cs336_tiny-{key}-dead{age}"
        leftover.mkdir(parents=True)
        (leftover / "lock").touch()
        os.utime(leftover, (time.time() - age, time.time() - age))
    started = time.monotonic()
    result = _build_in_subprocess(root, source, timeout=120)
    assert result.returncode == 0 and _answer(result) == "42", result.stderr[-2000:]
    assert time.monotonic() - started < 120
    assert _entries(root) == [f".cs336_tiny-{key}-dead0", f"cs336_tiny-{key}"]  # the stale one was cleaned up


def test_a_build_killed_half_way_leaves_nothing_that_blocks(tmp_path):
    root, source = tmp_path / "cache", _source(tmp_path / "checkout")
    process = subprocess.Popen([sys.executable, "-c", BUILD, str(root), str(source)], cwd=Path(__file__).parents[1],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not (root.is_dir() and any(root.glob(".cs336_tiny-*"))) and time.monotonic() < deadline:
        time.sleep(0.01)
    process.kill()  # during the build where the timing allows, else just after it
    process.wait()
    result = _build_in_subprocess(root, source, timeout=120)
    assert result.returncode == 0 and _answer(result) == "42", result.stderr[-2000:]


def test_processes_building_at_once_all_get_a_working_module(tmp_path):
    root, source = tmp_path / "cache", _source(tmp_path / "checkout")
    processes = [subprocess.Popen([sys.executable, "-c", BUILD, str(root), str(source)], cwd=Path(__file__).parents[1],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [process.communicate(timeout=240) for process in processes]
    for process, (stdout, stderr) in zip(processes, outputs):
        assert process.returncode == 0 and stdout.split()[0] == "42", stderr[-2000:]
    (built,) = _entries(root)  # one build in place; no temporary folder left
    loaded_from = [Path(stdout.split()[1]).parent.name for stdout, _ in outputs]
    assert sorted(name == built for name in loaded_from) == [False, True, True]  # one built, two waited and loaded


def test_a_build_held_by_another_process_is_waited_for_boundedly(tmp_path, monkeypatch):
    """A live holder of the lock (a build that hangs, say) delays a build by LOCK_WAIT_SECONDS at most."""
    import fcntl

    root, source = tmp_path / "cache", _source(tmp_path / "checkout")
    root.mkdir()
    key = native_build.build_key([source], ["|"])
    monkeypatch.setattr(native_build, "LOCK_WAIT_SECONDS", 0.5)
    with open(root / f".cs336_tiny-{key}.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        started = time.monotonic()
        with pytest.warns(UserWarning, match="held for over 0 s by another build"):
            module = native_build.load_extension("cs336_tiny", [source], root=root)
    assert module.answer() == 42 and time.monotonic() - started < 60
    assert _entries(root) == [f"cs336_tiny-{key}"]


def test_a_compile_error_propagates_and_leaves_no_folder(tmp_path):
    root, broken = tmp_path / "cache", tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    with pytest.raises(RuntimeError, match="Error building extension 'cs336_broken'"):
        native_build.load_extension("cs336_broken", [broken], root=root)
    assert _entries(root) == []


def test_native_launcher_loads_despite_a_leftover_torch_extensions_lock(tmp_path):
    """The report in issue 36: a `lock` left in cpp_extension's own folder for our extension made every later
    `load_module()` wait forever. The launcher no longer builds there, so the lock is ignored."""
    pytest.importorskip("triton")
    legacy = tmp_path / "torch_extensions"
    for folder in ("", "py311_cpu", "py312_cpu", "py311_cu128"):
        (legacy / folder / "cs336_flash_native").mkdir(parents=True, exist_ok=True)
        (legacy / folder / "cs336_flash_native" / "lock").touch()
    code = ("from cs336_systems.kernels.flash_attention import native_launch as n; "
            "m = n.load_module(); print(m is not None and m.plan_count())")
    # The user's extension cache is kept (a build there is reused by every later run); only the old location
    # gets the leftover lock.
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TORCH_EXTENSIONS_DIR": str(legacy)}, cwd=Path(__file__).parents[1])
    assert result.returncode == 0 and result.stdout.strip() == "0", result.stderr[-2000:]
