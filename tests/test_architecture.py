"""The shape the code keeps (docs/architecture.md): no import circles and no file over 400
lines in the packages, so a newcomer can read one concept per file and follow imports one way."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"radixserve": ROOT / "radixserve", "radixserve.router": ROOT / "router",
            "radixserve.kernels": ROOT / "kernels"}
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Every module of the packages by its installed name (router/ installs as
    radixserve.router, kernels/ as radixserve.kernels)."""
    found: dict[str, Path] = {}
    for name, top in PACKAGES.items():
        for path in top.rglob("*.py"):
            if not path.resolve().is_relative_to(top.resolve()):
                continue  # a link to another package (a worktree's radixserve/router)
            parts = list(path.relative_to(top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([name, *parts])] = path
    return found


def _imports(module: str, path: Path) -> set[str]:
    """The modules `module` names in any import statement: at the top, in a function, or
    under TYPE_CHECKING alike (each is a dependency a reader has to follow)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_no_import_circles() -> None:
    modules = _modules()
    graph = {m: {n for n in _imports(m, p) if n in modules and n != m}
             for m, p in modules.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"import circle: {' -> '.join(e.args[1])}") from None


def test_no_file_over_400_lines() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"
