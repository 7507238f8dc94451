"""The tokenizer side of pins and the cache view, shared by the front door and the Engine:
turning a pin's prompt into the request that prefills it, and the scheduler's token-id
summary of the tree into text a person can read."""

from __future__ import annotations

from typing import Any

from radixserve.config import EngineConfig
from radixserve.messages import TokenizedRequest, WorkerInfo
from radixserve.tokenizer.requests import build_requests


def pin_request(tokenizer: Any, info: WorkerInfo, config: EngineConfig, *, text: Any,
                input_ids: Any, rid: str, namespace: str | None) -> TokenizedRequest:
    """The request that prefills a pin's prefix (max_new_tokens 0), validated like a
    generate call's prompt; ValueError/TypeError naming the field. One prompt only."""
    if isinstance(text, list) or (isinstance(input_ids, list) and input_ids
                                  and isinstance(input_ids[0], list)):
        raise ValueError("a pin takes one prefix (text or input_ids), not a batch")
    (request,), _ = build_requests(tokenizer, info, config, prompt=text, input_ids=input_ids,
                                   sampling_params={"max_new_tokens": 0}, rid=rid,
                                   namespace=namespace)
    return request


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
