"""Every command-line option says what it does, beyond its default: `radixserve serve`,
`router` and `demo`, and the examples' shared command line."""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import pytest

from radixserve.cli import build_parser

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _options(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {action.option_strings[-1]: action.help or "" for action in parser._actions
            if action.option_strings and action.dest != "help"}


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _described(help_text: str) -> bool:
    """More than the default: words left once '(default: ...)' is taken out."""
    return len(re.sub(r"\(default: [^)]*\)", "", help_text).split()) >= 3


@pytest.mark.parametrize("command", ["serve", "router", "demo"])
def test_every_option_is_described(command: str) -> None:
    options = _options(_commands()[command])
    assert len(options) > 5
    bare = sorted(flag for flag, text in options.items() if not _described(text))
    assert not bare, f"`radixserve {command}` options without a description: {bare}"


def test_sizes_show_as_written() -> None:
    """`--kv-disk-size` shows its default as one would type it, and takes that form."""
    serve = _commands()["serve"]
    assert "(default: 16G)" in _options(serve)["--kv-disk-size"]
    assert serve.parse_args(["--kv-disk-size", "512M"]).kv_disk_size == 512 << 20


def test_examples_help_is_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    from _common import parser

    for path in sorted(EXAMPLES.glob("[!_]*.py")):
        doc = path.read_text().split('"""')[1]
        example = parser(doc)
        assert doc.strip() in example.format_help(), path.name  # the usage lines included
        bare = [f for f, text in _options(example).items() if not _described(text)]
        assert not bare, f"{path.name}: options without a description: {bare}"
    sys.modules.pop("_common", None)
