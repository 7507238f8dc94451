"""docs/architecture.md names code as `path:Symbol` (the walk of one `/generate`, the homes
of concepts): each such file exists and defines that symbol, so the doc cannot drift from
the code unnoticed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
NAMED = re.compile(r"`((?:[\w]+/)*[\w]+\.py):([\w.]+)`")


def _defined(path: Path) -> set[str]:
    """Top-level names, and `Class.member` for each class's functions and attributes."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{item.name}")
                elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) \
                        and item.value.id == "self":
                    names.add(f"{node.name}.{item.attr}")
    return names


def test_every_path_and_symbol_the_architecture_doc_names_exists():
    text = (ROOT / "docs" / "architecture.md").read_text()
    named = NAMED.findall(text)
    assert len(named) > 20
    missing = []
    for file, symbol in named:
        path = next((p for p in (ROOT / "radixserve" / file, ROOT / file) if p.is_file()), None)
        if path is None or symbol not in _defined(path):
            missing.append(f"{file}:{symbol}")
    assert not missing, f"docs/architecture.md names what the code does not have: {missing}"
