"""Shared by the examples: pick the backend from the command line, print cache figures."""

from __future__ import annotations

import argparse
from typing import Any

import radixserve.lang as sgl


def backend_from_args(description: str) -> tuple[sgl.Backend, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--server", metavar="ADDRESS",
                        help="RPC address of a running `radixserve serve` (e.g. "
                             "tcp://127.0.0.1:30001); default: an in-process Engine")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
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
