"""`radixserve` command line: `radixserve serve` (RPC and HTTP server) and `radixserve demo`."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import sys
from collections.abc import Iterable
from typing import Any

from radixserve.config import EngineConfig, ServerConfig
from radixserve.router.config import RouterConfig

ROUTER_TUNING = ("policy", "cache_threshold", "balance_abs_threshold", "balance_rel_threshold",
                 "health_interval", "health_timeout", "replica_timeout")
"""The router's own options that `serve --replicas N` passes on to the router it starts."""


def option_docs(*classes: type) -> dict[str, str]:
    """Each option's docstring (the string under its field), one paragraph, from `classes`
    and their bases; the first class that documents a name wins. The flags' --help."""
    docs: dict[str, str] = {}
    for cls in classes:
        for klass in cls.__mro__:
            if not dataclasses.is_dataclass(klass):
                continue
            body = ast.parse(inspect.getsource(klass)).body[0].body  # type: ignore[attr-defined]
            for field, doc in zip(body, body[1:]):
                if (isinstance(field, ast.AnnAssign) and isinstance(field.target, ast.Name)
                        and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                        and isinstance(doc.value.value, str)):
                    docs.setdefault(field.target.id, " ".join(doc.value.value.split()))
    return docs


def add_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, config: type,
                names: Iterable[str] | None = None) -> None:
    """One flag per config field (a dataclass; or per field in `names`): its docstring is
    the help, with the default."""
    docs = option_docs(config, ServerConfig)  # the router's shared options are a server's
    for f in dataclasses.fields(config):
        if names is not None and f.name not in names:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        shown = "none" if default is None else (
            _size(default) if f.name == "kv_disk_size" and isinstance(default, int) else default)
        text = f"{docs[f.name]} (default: {shown})".replace("%", "%%")
        if f.name in ("api_key", "replica"):
            parser.add_argument(flag, action="append", default=None if f.name == "api_key"
                                else [], metavar="KEY[=TENANT]" if f.name == "api_key"
                                else "ADDR", help=text)
        elif f.name in ("lora_paths", "lora_target_modules"):
            parser.add_argument(flag, nargs="+", action="extend", default=None, help=text,
                                metavar="NAME=PATH" if f.name == "lora_paths" else "MODULE")
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default,
                                help=text)
        else:
            kind = int if f.name in ("max_total_tokens", "context_length", "max_prompt_chars",
                                        "max_call_chars", "rpc_send_buffer_bytes",
                                        "max_pinned_tokens",
                                        "max_pinned_tokens_per_tenant",
                                        "virtual_max_map_count", "max_lora_rank") else (
                byte_size if f.name == "kv_disk_size" else
                type(default) if default is not None else str)
            parser.add_argument(flag, type=kind, default=default, help=text)


def _size(n: int) -> str:
    """`n` bytes the way `byte_size` reads them back: `16G` rather than 17179869184."""
    for unit, scale in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("k", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)


def byte_size(text: str) -> int:
    """`17179869184`, `16G`, `512M`, `64k` (powers of 1024) as bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    scale = units.get(text[-1:].lower(), 1)
    try:
        return int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a size in bytes: {text!r} (e.g. 16G, 512M)") from None


def build_parser() -> argparse.ArgumentParser:
    """The `radixserve` command line: `serve`, `router` and `demo`, each option documented."""
    parser = argparse.ArgumentParser(prog="radixserve")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start the tokenizer, scheduler and worker processes "
                           "and serve the RPC and HTTP APIs")
    add_options(serve, ServerConfig)
    serve.add_argument("--demo", action="store_true",
                       help="once ready, send a demo batch through the RPC client and print it")
    serve.add_argument("--replicas", type=int, default=1,
                       help="start this many servers (one per GPU where there are several) "
                       "behind a cache-aware router on --port and --rpc-port (default: 1)")
    add_options(serve.add_argument_group("the router's options, with --replicas above 1"),
                RouterConfig, ROUTER_TUNING)
    router = sub.add_parser("router", help="route calls to replicas: the one front door over "
                            "several servers, cache-aware by default")
    add_options(router, RouterConfig)
    demo = sub.add_parser("demo", help="load the model in-process and run a shared-prompt batch")
    add_options(demo, EngineConfig)
    demo.add_argument("--max-new-tokens", type=int, default=40,
                      help="tokens generated per answer at most (default: 40)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    if command in ("serve", "router"):
        from radixserve.server.runtime import StopFlag, run_server
        from radixserve.transport.sockets import exposure_warning

        demo = args.pop("demo", False)
        replicas = args.pop("replicas", 1)
        tuning = {name: args.pop(name) for name in ROUTER_TUNING if command == "serve"}
        if replicas < 1:
            parser.error(f"--replicas must be at least 1, got {replicas}")
        config: Any = (RouterConfig if command == "router" else ServerConfig).from_kwargs(**args)
        flag = StopFlag()
        what = "radixserve router" if command == "router" or replicas > 1 else "radixserve"

        def ready(address: str, http_url: str) -> None:
            warning = exposure_warning(config)
            print(f"{what} ready: RPC at {address} HTTP at {http_url}"
                  + (f" (model {config.model})" if config.model else "")
                  + (f"; WARNING: {warning}" if warning else ""), flush=True)
            if demo:
                import threading

                from radixserve.demo import against_server
                threading.Thread(target=against_server, args=(address, config.model),
                                 daemon=True).start()

        if command == "router":
            from radixserve.router.runtime import run_router
            raise SystemExit(run_router(config, ready, flag))
        if replicas > 1:
            from radixserve.router.runtime import serve_replicas
            front = RouterConfig.from_kwargs(
                rpc_host=config.rpc_host, rpc_port=config.rpc_port, host=config.host,
                port=config.port, api_key=config.api_key,
                api_keys_file=config.api_keys_file, admin_api_key=config.admin_api_key,
                served_model_name=config.served_model_name,
                max_frame_bytes=config.max_frame_bytes, log_level=config.log_level, **tuning)
            raise SystemExit(serve_replicas(replicas, dataclasses.asdict(config), front, ready,
                                            flag))
        if config.node_rank > 0:
            from radixserve.server.supervisor import serve_node
            raise SystemExit(serve_node(config, flag))
        raise SystemExit(run_server(config, ready, flag))
    if command == "demo":
        from radixserve.demo import in_process
        in_process(**args)


if __name__ == "__main__":
    main(sys.argv[1:])
