"""`radixserve` command line: `radixserve serve` (RPC and HTTP server) and `radixserve demo`."""

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
        if f.name == "api_key":
            parser.add_argument(flag, action="append", default=None, metavar="KEY[=TENANT]",
                                help="an API key, optionally with its tenant; repeatable")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=f"(default: {default})")
        else:
            kind = int if f.name in ("max_total_tokens", "context_length", "max_prompt_chars",
                                        "rpc_send_buffer_bytes") else (
                type(default) if default is not None else str)
            parser.add_argument(flag, type=kind, default=default, help=f"(default: {default})")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="radixserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the tokenizer, scheduler and worker processes "
                           "and serve the RPC and HTTP APIs")
    add_options(serve, ServerConfig)
    serve.add_argument("--demo", action="store_true",
                       help="once ready, send a demo batch through the RPC client and print it")
    demo = sub.add_parser("demo", help="load the model in-process and run a shared-prompt batch")
    add_options(demo, EngineConfig)
    demo.add_argument("--max-new-tokens", type=int, default=40)
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command == "serve":
        from radixserve.server.runtime import StopFlag, run_server

        demo = args.pop("demo")
        config = ServerConfig.from_kwargs(**args)
        flag = StopFlag()

        def ready(address: str, http_url: str) -> None:
            print(f"radixserve ready: RPC at {address} HTTP at {http_url} (model "
                  f"{config.model})", flush=True)
            if demo:
                import threading

                from radixserve.demo import against_server
                threading.Thread(target=against_server, args=(address, config.model),
                                 daemon=True).start()

        raise SystemExit(run_server(config, ready, flag))
    if command == "demo":
        from radixserve.demo import in_process
        in_process(**args)


if __name__ == "__main__":
    main(sys.argv[1:])
