"""`radixserve` command line: `radixserve demo` (and, later, `radixserve serve`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from radixserve.config import EngineConfig, ServerConfig


def add_options(parser: argparse.ArgumentParser, config: type[EngineConfig]) -> None:
    """One flag per config field, with its default shown in --help."""
    for f in dataclasses.fields(config):
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
    serve = sub.add_parser("serve", help="start the tokenizer, scheduler and worker processes "
                           "and serve the RPC API")
    add_options(serve, ServerConfig)
    demo = sub.add_parser("demo", help="load the model in-process and run a shared-prompt batch")
    add_options(demo, EngineConfig)
    demo.add_argument("--max-new-tokens", type=int, default=40)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "serve":
        from radixserve.server.runtime import StopFlag, run_server

        config = ServerConfig.from_kwargs(**args)
        flag = StopFlag()

        def ready(address: str) -> None:
            print(f"radixserve ready: RPC at {address} (model {config.model})", flush=True)

        raise SystemExit(run_server(config, ready, flag))
    if command == "demo":
        from radixserve.demo import main as demo_main
        max_new = args.pop("max_new_tokens")
        demo_main(max_new_tokens=max_new, **args)


if __name__ == "__main__":
    main(sys.argv[1:])
