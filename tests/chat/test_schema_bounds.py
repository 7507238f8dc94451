"""Issue 41, finding 3: a caller's JSON schema is bounded in size and depth before the
metaschema check walks it (which the HTTP routes run off the event loop)."""

from __future__ import annotations

import time

import pytest

from radixserve.chat.errors import ChatError
from radixserve.chat.schemas import checked_schema


def test_a_huge_schema_is_refused_by_its_size_before_any_walk():
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(200_000)}}
    began = time.perf_counter()
    with pytest.raises(ChatError, match="response_format is a JSON schema of .* bytes, more "
                       "than max_constraint_chars=131072"):
        checked_schema(huge, "response_format")
    small = {"type": "object", "properties": {"p": {"type": "string"}}}
    walked = time.perf_counter()
    checked_schema(small, "response_format")
    # one encode of 5 MB, not a metaschema walk of 200,000 subschemas (seconds)
    assert time.perf_counter() - began < 50 * max(time.perf_counter() - walked, 0.01)


def test_a_deep_schema_is_refused_by_its_depth():
    schema: dict = {"type": "integer"}
    for _ in range(100):
        schema = {"type": "array", "items": schema}
    with pytest.raises(ChatError, match=r"tools\[0\].function.parameters nests 101 deep"):
        checked_schema(schema, "tools[0].function.parameters")
