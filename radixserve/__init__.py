"""radixserve: a prefix-caching LLM serving runtime built on a global radix tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

from radixserve.config import EngineConfig
from radixserve.messages import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine import Engine
    from radixserve.server.runtime import Runtime

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
