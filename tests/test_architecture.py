"""The shape the code keeps (docs/architecture.md): no import circles, between modules or
between packages, each package in its layer (it imports only its own layer and those
below), no file over 400 lines, so a newcomer can read one concept per file and follow
imports one way."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"radixserve": ROOT / "radixserve"}
MAX_LINES = 400
LAYERS = [
    {"results", "messages", "config", "config_checks", "tenants", "rids", "stop_strings",
     "disk_layout", "local_cache", "api"},                          # schema and settings
    {"native", "kernels"},                                          # compute kernels
    {"cache", "model", "lora", "speculative", "chat"},             # plain parts: no sockets
    {"worker", "scheduler", "front_door", "transport", "client"},  # the processes' parts
    {"engine", "server"},                                           # the runtimes
    {"router", "ray", "lang", "demo", "cli", "__main__", "radixserve"},  # on a runtime
]
"""The packages (and top-level modules) of radixserve/, lowest first, as
docs/architecture.md states them: each imports only from its own layer and those below."""


def _modules() -> dict[str, Path]:
    """Every module of the packages by its import name."""
    found: dict[str, Path] = {}
    for name, top in PACKAGES.items():
        for path in top.rglob("*.py"):
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


def _package(module: str) -> str:
    """`radixserve.scheduler.kv` -> `scheduler`; `radixserve` is the package's `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _package_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for m, p in modules.items():
        deps = graph.setdefault(_package(m), set())
        deps.update(_package(n) for n in _imports(m, p) if n in modules)
    return {pkg: deps - {pkg} for pkg, deps in graph.items()}


def test_no_circles_between_packages() -> None:
    try:
        graphlib.TopologicalSorter(_package_graph()).prepare()
    except graphlib.CycleError as e:
        raise AssertionError(f"package circle: {' -> '.join(e.args[1])}") from None


def test_each_package_imports_only_its_layer_and_those_below() -> None:
    layer = {pkg: i for i, pkgs in enumerate(LAYERS) for pkg in pkgs}
    graph = _package_graph()
    assert not set(graph) - set(layer), f"packages in no layer: {set(graph) - set(layer)}"
    upward = sorted(f"{a} -> {b}" for a, deps in graph.items() for b in deps
                    if layer[b] > layer[a])
    assert not upward, f"imports from a higher layer: {upward}"


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


def test_bench_and_tools_keep_the_same_shape(monkeypatch) -> None:
    """bench/ and tools/ (the soak) under the packages' rules (whatever they are): no import
    circle, no file over 400 lines."""
    for name in ("bench", "tools"):
        monkeypatch.setitem(globals(), "PACKAGES", {name: ROOT / name})
        assert {m.split(".")[0] for m in _modules()} == {name}  # this folder, not radixserve
        test_no_import_circles()
        test_no_file_over_400_lines()
