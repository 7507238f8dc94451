"""The field types the messages share: bounded lists (bounded by the decoder itself, so a
frame holding more is refused while it is decoded) and JSON-shaped values."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from radixserve.tenants import MAX_CACHE_SALT


MAX_INPUT_IDS = 1 << 20
"""Most token ids in one call's `input_ids` (and most prompts in a batch of them), bounded
by the decoder itself: a frame holding more is refused while it is decoded, before a list
is built. Above any context length served here; the model's own limit is checked next."""

TokenIds = Annotated[list[int], Meta(max_length=MAX_INPUT_IDS)]
InputIds = Annotated[list[int | TokenIds], Meta(max_length=MAX_INPUT_IDS)]
"""A list of token ids, or a batch of such lists (msgspec allows one array type in a
union, so the items are an int or a list; a mixed list is refused at the edge)."""

MAX_BATCH = 1 << 16
"""Most prompts (and `sampling_params` and `rid` entries) in one call, bounded by the
decoder itself: each entry is an object built before anything is checked, so a frame of
millions of empty entries is refused while it is decoded. The server's own limit on a
call's outputs (`max_queued_requests`) is checked next, before any prompt is tokenized."""

Batch = Annotated[list[str], Meta(max_length=MAX_BATCH)]
"""A batch of text prompts, or of rids (one per prompt)."""

CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT)]
"""A call's `cache_salt` (tenants.namespace_of), bounded by the decoder itself."""

JsonScalar = bool | int | float | str | None
_Json1 = JsonScalar | list[JsonScalar] | dict[str, JsonScalar]
_Json2 = JsonScalar | list[_Json1] | dict[str, _Json1]
_Json3 = JsonScalar | list[_Json2] | dict[str, _Json2]
JsonValue = JsonScalar | list[_Json3] | dict[str, _Json3]
"""A JSON value nested at most 4 levels deep (msgspec on Python 3.11 takes no recursive
alias, and each level doubles the JSON schema). What SGLang's free-form settings are, and
within a `JsonObject` what the operator's control answers hold (stats, the cache view, a
snapshot: 3 levels at most); anything deeper is refused while it is decoded, naming the
field."""

JsonObject = dict[str, JsonValue]
"""A JSON object: a control call's answer (`ControlReply.payload`)."""


def nesting_depth(text: str, quoted: bool = True) -> int:
    """The deepest nesting of `{`, `[` and `(` in `text`, in one pass: escaped characters
    (after a backslash) and, with `quoted` (JSON, EBNF), those inside double-quoted
    strings do not count. Unbalanced closers are the compiler's to refuse."""
    depth = deepest = 0
    in_string = escaped = False
    for c in text:
        if escaped:
            escaped = False
        elif c == "\\":
            escaped = True
        elif in_string:
            in_string = c != '"'
        elif c == '"' and quoted:
            in_string = True
        elif c in "{[(":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "}])":
            depth = max(depth - 1, 0)
    return deepest
