"""JSON schemas that constrain an answer (`response_format`, and tool arguments under
`tool_choice`): checked at the edge against their JSON Schema metaschema, so that a bad one
is a 400 naming its field before any work, then sent on as `sampling_params.json_schema`,
which the scheduler enforces token by token.

Strict and non-strict schemas alike are enforced: OpenAI only tries to follow a non-strict
one, and an answer that always conforms is what a client of either wants. `strict: true`
adds what OpenAI's strict mode means beyond conformance: an object schema that does not say
otherwise admits no properties besides its own (`additionalProperties: false`)."""

from __future__ import annotations

from typing import Any

import msgspec
from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError
from jsonschema.validators import validator_for

from radixserve.chat.errors import ChatError
from radixserve.config import EngineConfig
from radixserve.messages.fields import nesting_depth

ANY_OBJECT: dict[str, Any] = {"type": "object"}
"""`response_format: json_object`: any JSON object."""

# Keywords whose values are subschemas: maps of them, lists of them, or one.
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "prefixItems")
_ONE = ("items", "additionalItems", "additionalProperties", "not", "if", "then", "else",
        "contains", "propertyNames")
# Not allOf: its branches describe one object together, so closing each would make each
# refuse the others' properties. For the same reason an object schema that composes
# branches (allOf/anyOf/oneOf beside its own keywords) is left open.
_COMPOSED = ("allOf", "anyOf", "oneOf")


def checked_schema(schema: dict[str, Any], param: str, strict: bool = False) -> dict[str, Any]:
    """`schema` if it is a valid JSON schema (of the draft its `$schema` names, 2020-12 by
    default), closed when `strict`; else a 400 naming `param` and the place in the schema.
    Its size and depth are checked first, in one pass each (the default
    `max_constraint_chars` and `max_constraint_depth` that the scheduler holds it to), so
    no metaschema walk is sized by a caller past them."""
    text = msgspec.json.encode(schema)
    limit, deepest = EngineConfig.max_constraint_chars, EngineConfig.max_constraint_depth
    if len(text) > limit:
        raise ChatError(400, f"{param} is a JSON schema of {len(text)} bytes, more than "
                        f"max_constraint_chars={limit}", param=param)
    depth = nesting_depth(text.decode())
    if depth > deepest:
        raise ChatError(400, f"{param} nests {depth} deep, more than "
                        f"max_constraint_depth={deepest}", param=param)
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except SchemaError as e:
        where = "/".join(str(p) for p in e.path)
        raise ChatError(400, f"{param} is not a valid JSON schema: {e.message}"
                        + (f" (at {where})" if where else ""), param=param) from None
    return closed(schema) if strict else schema


def closed(schema: Any) -> Any:
    """A copy of `schema` in which every object schema that does not set
    `additionalProperties` (or `unevaluatedProperties`) sets it to false."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    for key in _ONE:
        if key in out:
            out[key] = closed(out[key])
    kind = out.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind) or (
        "properties" in out)
    if (is_object and not any(k in out for k in _COMPOSED)
            and "additionalProperties" not in out and "unevaluatedProperties" not in out):
        out["additionalProperties"] = False
    return out
