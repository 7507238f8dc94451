"""`radixserve` command line: `radixserve demo` (and, later, `radixserve serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from radixserve.config import EngineConfig


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, with its default shown in --help."""
    for f in dataclasses.fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"(default: {default})")
        else:
            kind = int if f.name in ("max_total_tokens", "context_length") else (
                type(default) if default is not None else str)
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="load the model and run a shared-prompt demo batch")
    add_engine_options(demo)
    demo.add_argument("--max-new-tokens", type=int, default=40)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "demo":
        from radixserve.demo import main as demo_main
        max_new = args.pop("max_new_tokens")
        demo_main(max_new_tokens=max_new, **args)


if __name__ == "__main__":
    main(sys.argv[1:])
