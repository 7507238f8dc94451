"""Shared by the examples: pick the backend from the command line, print cache figures."""

from __future__ import annotations

import argparse
from typing import Any

import radixserve.lang as sgl


def parser(doc: str) -> argparse.ArgumentParser:
    """The examples' command line; `doc`, the module's docstring, is its --help (all of it,
    with the usage lines it ends with)."""
    parser = argparse.ArgumentParser(description=doc,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", metavar="ADDRESS",
                        help="RPC address of a running `radixserve serve` (e.g. "
                             "tcp://127.0.0.1:30001); default: an in-process Engine")
    parser.add_argument("--model", default="smollm2-135m",
                        help="the model of the in-process Engine: an alias, a Hugging Face "
                             "directory or a .gguf file (default: smollm2-135m)")
    return parser


def backend_from_args(doc: str) -> tuple[sgl.Backend, argparse.Namespace]:
    """The example's backend from its command line (see `parser`)."""
    args = parser(doc).parse_args()
    if args.server:
        backend: sgl.Backend = sgl.RuntimeEndpoint(args.server)
    else:
        backend = sgl.EngineBackend(model=args.model, max_total_tokens=16384)
    sgl.set_default_backend(backend)
    return backend, args


def report(backend: sgl.Backend) -> None:
    s: dict[str, Any] = backend.stats()
    print(f"\n{s['requests']} requests, {s['prompt_tokens']} prompt tokens, "
          f"{s['cached_tokens']} served from the radix cache: "
          f"cache hit rate {s['cache_hit_rate']:.1%}")
