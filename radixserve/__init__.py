"""radixserve: a prefix-caching LLM serving runtime built on a global radix tree."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

# OpenMP threads that spin between parallel regions keep cores busy that the engine's loop
# thread, the caller's threads and the other processes need on every step. Measured on 2
# cores (`bench/results/omp_policy_quick.md`, the in-process Engine on shared prefixes):
# ACTIVE served 0.72-0.81x PASSIVE's rate for 1.8x the CPU time (half, on the 2-core EPYC of
# issue 27);
# libgomp's default (spin a while, then sleep) 0.8-1.04x, the worse whenever anything else
# wanted the cores. Sleeping threads cost a wake-up per parallel region instead, which the
# kernels' work per region is sized to pay for. libgomp reads this once, when torch loads it: set
# here, before any module of this package imports torch, and inherited by every process the server
# starts. An explicit setting wins (the worker logs a warning for ACTIVE).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from radixserve.config import EngineConfig
from radixserve.messages import SamplingParams

if TYPE_CHECKING:
    from radixserve.api import Api, AsyncApi
    from radixserve.client import AsyncClient, Client
    from radixserve.engine import Engine
    from radixserve.server.runtime import Runtime

    def _keep_the_api(engine: Engine, client: Client, aio: AsyncClient
                      ) -> tuple[Api, Api, AsyncApi]:
        """Never called: mypy checks here that the Engine and both clients keep the `Api`
        protocol (the same operations, with the same arguments)."""
        return engine, client, aio

__all__ = ["Engine", "EngineConfig", "Runtime", "SamplingParams"]


def __getattr__(name: str):
    # The Engine pulls in torch and transformers; keep `import radixserve` light for the
    # processes that need neither.
    if name == "Engine":
        from radixserve.engine import Engine
        return Engine
    if name == "Runtime":
        from radixserve.server.runtime import Runtime
        return Runtime
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
