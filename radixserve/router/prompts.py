"""What the router reads of a generate call it routes: its prompts as the replica will
tokenize them (for the page hashes the policy matches), and the rids it names."""

from __future__ import annotations

from typing import Any

from radixserve.messages import GenerateCall

MAX_ROUTED_CHARS = 1 << 20
"""A longer text prompt is not tokenized for routing (the replica refuses it anyway)."""


def routed_prompts(call: GenerateCall, tokenizer: Any) -> list[list[int]] | None:
    """The call's prompts as the replica will tokenize them; None when they cannot be
    told (a malformed call: the replica will say what is wrong with it)."""
    if call.text is not None:
        texts = [call.text] if isinstance(call.text, str) else call.text
        if not texts or sum(len(t) for t in texts) > MAX_ROUTED_CHARS:
            return None
        return [tokenizer.encode(t) for t in texts]
    ids = call.input_ids
    if not ids:
        return None
    if all(type(t) is int for t in ids):
        return [ids]  # type: ignore[list-item]
    if all(isinstance(t, list) for t in ids):
        return ids  # type: ignore[return-value]
    return None


def call_rids(call: GenerateCall) -> list[str]:
    """The rids a generate call names (none, one, or one per prompt)."""
    return [] if call.rid is None else [call.rid] if isinstance(call.rid, str) else list(call.rid)
