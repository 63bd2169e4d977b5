"""No import cycle inside `polar_mitm`, read from the modules' own import statements.

Every import counts — module level and inside functions alike (a lazy import that dodges a cycle at run time is
still two modules that need each other) — except those under `if TYPE_CHECKING:`, which never run. A submodule
that imports a name from its own package's `__init__` while that `__init__` imports the submodule is a cycle too:
import siblings directly.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent.parent / "polar_mitm"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every `.py` under the package `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that can run: everything but the bodies of `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import | ast.ImportFrom):
            found.append(node)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports."""
    modules = module_files(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        package = name if is_package else name.rpartition(".")[0]
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    origin = ".".join(base + ([node.module] if node.module else []))
                else:
                    origin = node.module or ""
                # `from pkg import sub` imports the submodule; `from pkg import name` imports pkg itself.
                targets = [
                    f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin for a in node.names
                ]
            for target in targets:
                # `import a.b.c` runs a, a.b and a.b.c; the closest module we know stands for it.
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                connect(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return components


def describe(cycle: list[str], graph: dict[str, set[str]]) -> str:
    members = set(cycle)
    return "; ".join(f"{m} → {', '.join(sorted(graph[m] & members))}" for m in cycle)


def test_polar_mitm_has_no_import_cycle():
    graph = import_graph(PACKAGE_ROOT)
    assert len(graph) > 50, "the package was not found where the test looks for it"
    cycles = find_cycles(graph)
    assert not cycles, "import cycles inside polar_mitm:\n" + "\n".join(describe(c, graph) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_the_cycle_check_finds_lazy_and_relative_cycles(tmp_path):
    """The check must be able to fail: a cycle hidden in a function-level relative import is found."""
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg import a\n",
            "pkg/a.py": "from pkg.sub import b\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/b.py": "def f():\n    from .. import a\n    return a\n",
            "pkg/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import d\n",
            "pkg/d.py": "import pkg.c\n",
        },
    )
    assert find_cycles(import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


def test_the_cycle_check_finds_a_submodule_importing_its_package(tmp_path):
    pkg = _write(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import REGISTRY\n",
            "pkg/a.py": "from pkg.base import Base\nREGISTRY = [Base]\n",
            "pkg/base.py": "",
            "pkg/b.py": "from pkg import REGISTRY\n",
        },
    )
    assert find_cycles(import_graph(pkg)) == []
    (pkg / "base.py").write_text("from pkg import REGISTRY\n")
    assert find_cycles(import_graph(pkg)) == [["pkg", "pkg.a", "pkg.base"]]
