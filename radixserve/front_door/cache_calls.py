"""The tokenizer side of pins and the cache view, shared by the front door and the Engine:
a pin's or an unpin's prompt made token ids (validated like a generate call's), the
caller's scope and bounds for the scheduler, and the scheduler's token-id summary of the
tree made text a person can read."""

from __future__ import annotations

from typing import Any

import msgspec

from radixserve.config import EngineConfig, ServerConfig
from radixserve.messages import (CacheInfoCall, CacheScope, Caller, ControlOp, PinCall,
                                 UnpinCall, WorkerInfo)
from radixserve.front_door import admin
from radixserve.tenants import (DEFAULT_TENANT, Tenants, check_cache_salt, namespace_of,
                                tenant_namespace_prefix)
from radixserve.front_door.requests import build_requests


def pin_ids(tokenizer: Any, info: WorkerInfo, config: EngineConfig, *, text: Any,
            input_ids: Any, namespace: str | None) -> list[int]:
    """A pin's prefix as token ids, validated like a generate call's prompt (the request
    that prefills it has max_new_tokens 0); ValueError/TypeError naming the field. One
    prompt only."""
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids
                                  and isinstance(input_ids[0], list)):
        raise ValueError("a pin takes one prefix (text or input_ids), not a batch")
    (request,), _ = build_requests(tokenizer, info, config, prompt=text, input_ids=input_ids,
                                   sampling_params={"max_new_tokens": 0}, namespace=namespace)
    return request.input_ids


def unpin_ids(tokenizer: Any, text: Any, input_ids: Any) -> list[int]:
    """The token ids an unpin names (exactly one of `text` and `input_ids`)."""
    if (text is None) == (input_ids is None):
        raise ValueError("pass exactly one of text or input_ids")
    if text is not None:
        if not isinstance(text, str):
            raise TypeError("text must be a string")
        return tokenizer.encode(text)
    if not isinstance(input_ids, list) or not all(type(t) is int for t in input_ids):
        raise TypeError("input_ids must be a list of ints")
    return input_ids


class CacheCalls:
    """A server's pin, unpin and cache_info calls, made the scheduler's operations."""

    def __init__(self, tokenizer: Any, config: ServerConfig, tenants: Tenants,
                 secret: bytes) -> None:
        self.tokenizer, self.config, self.tenants, self.secret = tokenizer, config, tenants, secret

    def control(self, call: PinCall | UnpinCall | CacheInfoCall, tenant: str, operator: bool,
                info: WorkerInfo) -> tuple[ControlOp, Caller]:
        """The operation and its caller. Pins live in the caller's namespace; the cache view
        (and unpin all) reaches, with API keys, only the caller's tenant's namespaces (the
        default tenant's include the default one), without keys every namespace. A tenant's
        pins (anyone's but the operator's) have the tenant as owner: a quota, a longest
        ttl, their own total. ValueError/TypeError naming what is wrong with the call."""
        prefix = tenant_namespace_prefix(tenant, self.secret)
        scope = (CacheScope(prefix, tenant == DEFAULT_TENANT) if self.tenants.enabled
                 else CacheScope())
        owner = None if operator else prefix
        if isinstance(call, CacheInfoCall):
            return msgspec.structs.replace(call, api_key=None), Caller(scope=scope)
        if isinstance(call, UnpinCall) and call.all:
            if call.text is not None or call.input_ids is not None:
                raise ValueError("pass all or a prefix (text or input_ids), not both")
            return UnpinCall(call_id=call.call_id, all=True), Caller(scope=scope, owner=owner)
        namespace = namespace_of(tenant, check_cache_salt(call.cache_salt), self.secret)
        if isinstance(call, UnpinCall):
            ids = unpin_ids(self.tokenizer, call.text, call.input_ids)
            return (UnpinCall(call_id=call.call_id, input_ids=ids),
                    Caller(namespace=namespace, owner=owner))
        ttl, quota = call.ttl, None
        if owner is not None:  # a tenant's bounds (admin.tenant_pin)
            ttl, quota = admin.tenant_pin(self.config, call.ttl,
                                          info.num_blocks * info.page_size,
                                          len(self.tenants.names))
        ids = pin_ids(self.tokenizer, info, self.config, text=call.text,
                      input_ids=call.input_ids, namespace=namespace)
        return (PinCall(call_id=call.call_id, input_ids=ids, ttl=ttl),
                Caller(namespace=namespace, owner=owner, quota=quota))

    def describe(self, payload: dict) -> dict:
        return describe_cache(payload, self.tokenizer)


def _text(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False)


def describe_cache(info: dict, tokenizer: Any) -> dict:
    """`CacheService.cache_info`'s answer with text: each node's and pin's `head_ids` become
    `text` (the first words of the prefix) and a node's `edge_ids` its `edge_text` (the
    first words of its own edge, where it branches off its parent)."""
    nodes = [{**{k: v for k, v in n.items() if k not in ("head_ids", "edge_ids")},
              "text": _text(tokenizer, n["head_ids"]),
              "edge_text": _text(tokenizer, n["edge_ids"])} for n in info["nodes"]]
    pins = [{**{k: v for k, v in p.items() if k != "head_ids"},
             "text": _text(tokenizer, p["head_ids"])} for p in info["pins"]]
    return {**info, "nodes": nodes, "pins": pins}
