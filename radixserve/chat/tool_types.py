"""The tools of a chat request as OpenAI's API declares them (`tools`, `tool_choice`):
the request shapes the planner reads, decoded strictly (an unknown field is refused)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import Meta, Struct

FunctionName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_-]{1,64}$")]
"""OpenAI's rule for function (and response schema) names."""

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}
"""The arguments schema of a function declared without `parameters`."""


class FunctionDef(Struct, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """A JSON schema of the arguments object; none means the function takes none."""
    strict: bool | None = None


class ToolDef(Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class FunctionChoice(Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(Struct, tag_field="type", tag="function", forbid_unknown_fields=True):
    function: FunctionChoice


class AllowedTools(Struct, forbid_unknown_fields=True):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice]


class AllowedToolsChoice(Struct, tag_field="type", tag="allowed_tools",
                         forbid_unknown_fields=True):
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice
