"""What the ingress tells the request router about a call (`RouteKey`, its first argument
to the replica), and how it reads that from an HTTP request: the prompt's token ids as the
replica will tokenize them, and the cache namespace (tenant, salt, adapter) they live in.

Ray-free, so that it can be tested and used without Ray."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.chat.prompt import render
from radixserve.router.prompts import MAX_ROUTED_CHARS
from radixserve.tenants import (DEFAULT_TENANT, Tenants, adapter_namespace, cache_secret_key,
                                check_cache_salt, load_cache_secret, namespace_of)

GENERATE_PATHS = frozenset({"/generate", "/v1/completions", "/v1/chat/completions"})
"""The routes whose calls are routed by their prompt; every other goes by load alone."""


@dataclass(frozen=True)
class RouteKey:
    prompts: list[list[int]] = field(default_factory=list)
    """The call's prompts' token ids (none: route by load)."""
    namespace: str | None = None
    """Their radix cache namespace; `adapter` apart from the base model's."""
    replica: str | None = None
    """The Ray replica the caller named (`x-radixserve-replica`), for an operator's look at
    one replica; routed as any other call if no such replica serves."""

    @property
    def tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


REPLICA_HEADER = "x-radixserve-replica"
"""On a request: the replica to send it to. On every answer: the replica that gave it."""


def fleet_secret(cache_secret: str | None, secret_file: str | None) -> bytes:
    """The replicas' cache key: from the secret itself (the app's `cache_secret`), else
    from `cache_secret_file` (on every node, the replicas' own)."""
    if cache_secret is not None:
        return cache_secret_key(cache_secret)
    if secret_file is None:
        raise ValueError("the replicas' cache secret: cache_secret or cache_secret_file")
    return load_cache_secret(secret_file)


def bearer(headers: dict[str, str]) -> str | None:
    auth = headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get("x-api-key")


def _texts(path: str, body: dict[str, Any], tokenizer: Any) -> list[str] | list[list[int]]:
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return []
        return [render(tokenizer, messages, None)]
    value = body.get("text") if path == "/generate" else body.get("prompt")
    if path == "/generate" and value is None:
        value = body.get("input_ids")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return [value]
    if isinstance(value, list) and all(isinstance(t, (str, list)) for t in value):
        return value
    return []


def route_key(path: str, body: Any, headers: dict[str, str], tokenizer: Any,
              tenants: Tenants, secret: bytes) -> RouteKey:
    """The key of one HTTP call; an empty one when its prompt cannot be told (the replica
    then says what is wrong with the call, and the router picks by load)."""
    if path not in GENERATE_PATHS or not isinstance(body, dict):
        return RouteKey()
    try:
        texts = _texts(path, body, tokenizer)
        if sum(len(t) for t in texts) > MAX_ROUTED_CHARS:
            return RouteKey()
        prompts = [tokenizer.encode(t) if isinstance(t, str) else list(t) for t in texts]
        tenant = tenants.tenant_of(bearer(headers)) or DEFAULT_TENANT
        namespace = namespace_of(tenant, check_cache_salt(body.get("cache_salt")), secret)
    except Exception:  # a malformed call: the replica names what is wrong with it
        return RouteKey()
    adapter = body.get("lora_path")
    model = body.get("model")
    if adapter is None and isinstance(model, str) and ":" in model:
        adapter = model.partition(":")[2]  # SGLang's `base:adapter`
    if isinstance(adapter, str) and adapter:
        # Never matched with the base model's prefixes: the replicas key an adapter's KV by
        # its weights' fingerprint, which only they know; calls of one adapter still meet
        # (the router holds their prefixes where it sent them).
        namespace = adapter_namespace(namespace, "name-" + adapter)
    return RouteKey(prompts, namespace)
