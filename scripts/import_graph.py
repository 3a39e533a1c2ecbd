"""The import graph of our packages, checked against the house's layers.

Reads every module of `cs336_basics` and `cs336_systems` with `ast` (nothing is imported or run), including the
imports inside functions, and reports:

* cycles: modules that import each other, directly or through others;
* upward imports: a module importing from a higher layer (LAYERS, bottom up);
* private names: `from a.b import _name`, or `b._name` on an imported module `b`, where `a.b` is another module
  (a private *module*, such as `kernels/_triton_utils.py`, is a package's shared helper and may be imported).

    python scripts/import_graph.py            # the problems, exit 1 if any
    python scripts/import_graph.py --edges    # every edge, "importer -> imported"
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cs336_basics", "cs336_systems")
# Bottom up. A module may import from its own layer or below; the first matching prefix gives a module's layer.
LAYERS = [
    ("cs336_basics",),
    ("cs336_systems.config",),
    ("cs336_systems.kernels",),
    ("cs336_systems.attention", "cs336_systems.fused_model", "cs336_systems.weight_copies"),
    ("cs336_systems.memory", "cs336_systems.parallel", "cs336_systems.profiling", "cs336_systems.analysis",
     "cs336_systems.step_graph"),
    ("cs336_systems.recipe", "cs336_systems.results", "cs336_systems.plots"),
    ("cs336_systems.bench",),
    ("cs336_systems.report",),
]


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every module of PACKAGES."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def layer_of(module: str) -> int:
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return len(LAYERS)  # unknown: above everything, so importing it is upward and flagged


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(modules: dict[str, Path]) -> list[tuple[str, str, str | None, int]]:
    """(importer, imported module, imported name or None, line) for every import of one of our modules, and for
    every private attribute read on a name bound to one of our modules (`function._OPTIONS`)."""
    found = []
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> our module it stands for
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in PACKAGES:
                        found.append((module, _nearest(alias.name, modules), None, node.lineno))
                        if alias.asname:
                            bound[alias.asname] = _nearest(alias.name, modules)
            elif isinstance(node, ast.ImportFrom):
                source = _resolve(module, is_package, node)
                if source.split(".")[0] not in PACKAGES:
                    continue
                for alias in node.names:
                    submodule = f"{source}.{alias.name}"
                    if submodule in modules:  # `from package import module`
                        found.append((module, submodule, None, node.lineno))
                        bound[alias.asname or alias.name] = submodule
                    else:
                        found.append((module, _nearest(source, modules), alias.name, node.lineno))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append((module, bound[node.value.id], node.attr, node.lineno))
    return found


def _nearest(name: str, modules: dict[str, Path]) -> str:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, result, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in sorted(edges.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                result.append(sorted(component))

    sys.setrecursionlimit(10000)
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(result)


def _is_ancestor(package: str, module: str) -> bool:
    return module.startswith(package + ".")


def problems(root: Path = ROOT) -> list[str]:
    """Every cycle, upward import and cross-module private name, one line each."""
    modules = module_files(root)
    found = imports(modules)
    edges: dict[str, set[str]] = defaultdict(set)
    lines = []
    for importer, imported, name, line in found:
        # A package's __init__ re-exporting its modules, or a module importing its own package, is no edge.
        if imported == importer or _is_ancestor(importer, imported) or _is_ancestor(imported, importer):
            continue
        edges[importer].add(imported)
        where = f"{modules[importer].relative_to(root)}:{line}"
        if layer_of(imported) > layer_of(importer):
            lines.append(f"upward: {where} {importer} imports {imported}")
        if name and name.startswith("_") and not name.startswith("__"):
            lines.append(f"private: {where} {importer} imports {imported}.{name}")
    lines += [f"cycle: {' <-> '.join(component)}" for component in cycles(edges)]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edges", action="store_true", help="print every edge instead of the problems")
    args = parser.parse_args(argv)
    if args.edges:
        for importer, imported, name, _ in sorted(set(imports(module_files()))):
            print(f"{importer} -> {imported}" + (f" ({name})" if name else ""))
        return 0
    found = problems()
    print("\n".join(found) if found else "no cycles, no upward imports, no private names imported across modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
