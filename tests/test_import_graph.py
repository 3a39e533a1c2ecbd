"""The house's layers hold (scripts/import_graph.py): no import cycle, no upward import, no private name imported
from another module; and the checker finds each kind of problem in a tree made to have it."""

import textwrap

from scripts.import_graph import LAYERS, problems


def test_our_packages_have_no_cycle_upward_import_or_private_name():
    assert problems() == []


def _write(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


def test_the_checker_reports_each_kind_of_problem(tmp_path):
    _write(tmp_path, {
        "cs336_basics/__init__.py": "",
        "cs336_systems/__init__.py": "",
        "cs336_systems/kernels/__init__.py": "",
        "cs336_systems/kernels/a.py": "from cs336_systems.kernels import b\n",
        # a lazy import inside a function counts as much as one at the top
        "cs336_systems/kernels/b.py": "def f():\n    from cs336_systems.kernels.a import helper\n",
        "cs336_systems/kernels/c.py": "from cs336_systems.bench import suite\n",  # kernels below bench: upward
        "cs336_systems/bench/__init__.py": "",
        "cs336_systems/bench/suite.py": ("from cs336_systems.kernels.a import _private\n"
                                         "from cs336_systems.kernels import c\nc._hidden()\n"),
    })
    found = problems(tmp_path)
    assert "cycle: cs336_systems.kernels.a <-> cs336_systems.kernels.b" in found
    assert any(line.startswith("upward: cs336_systems/kernels/c.py:1 ") for line in found)
    assert any(line.endswith("imports cs336_systems.kernels.a._private") for line in found)
    assert any(line.endswith("imports cs336_systems.kernels.c._hidden") for line in found)
    assert "cycle: cs336_systems.bench.suite <-> cs336_systems.kernels.c" in found  # (c's upward import closes one)
    assert len(found) == 5, found


def test_layers_name_each_top_level_room_once():
    prefixes = [prefix for layer in LAYERS for prefix in layer]
    assert len(prefixes) == len(set(prefixes))
