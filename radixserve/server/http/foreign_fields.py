"""The rule for the fields of SGLang's and vLLM's request types, written once: a field
radixserve knows and honours is a plain field of its body; one it knows but cannot honour
is declared `Annotated[T, DefaultOnly(why)]` with the other server's default, accepted at
that default (clients and routers send it so: SGLang's router adds several to every
request) and refused by name, with `why`, at any other value; an unknown field stays an
error naming it (the bodies are `forbid_unknown_fields`: a typo is not silently dropped).

`errors.decode_body` refuses such a field as it decodes any body, so no route can forget
to; the OpenAPI schema reads `default_only` to document each such field as a constant."""

from __future__ import annotations

import functools
import typing
from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class DefaultOnly:
    """Marks a field accepted at its default only; `why` says what radixserve lacks."""

    why: str


@functools.cache
def default_only(body: type[msgspec.Struct]) -> dict[str, tuple[object, str]]:
    """Per field of `body` marked `DefaultOnly`: its default and why no other value is
    taken (cached: a body type's fields never change)."""
    hints = typing.get_type_hints(body, include_extras=True)
    marked: dict[str, tuple[object, str]] = {}
    for field in msgspec.structs.fields(body):
        for meta in getattr(hints[field.name], "__metadata__", ()):
            if isinstance(meta, DefaultOnly):
                assert field.default is not msgspec.NODEFAULT, f"{field.name} needs a default"
                marked[field.name] = (field.default, meta.why)
    return marked

