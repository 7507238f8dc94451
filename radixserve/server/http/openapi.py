"""The OpenAPI schema of the HTTP API (`/openapi.json`), describing the bodies the routes
really take and the answers they really give.

The routes read their bodies themselves (`decode_body` into msgspec Structs, so that every
error has the one shape of `errors`), which FastAPI cannot see: left alone, its schema says
the POST routes take no body and every answer is JSON. Here each route declares its body
through `openapi_extra` (`request_body`), the Structs' JSON schemas (`msgspec.json`) join
the schema's components (`install`), and the routes declare their answers' media types and
the error shape every failure has (`ERRORS`). Property-based tests (schemathesis,
tests/server/test_fuzz.py) generate their requests from this schema."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from msgspec import Struct

from radixserve.config_checks import LORA_NAME
from radixserve.messages import MAX_BATCH, MAX_INPUT_IDS, SamplingParams

REF = "#/components/schemas/{name}"
TOKEN = {"type": "integer", "minimum": 0}
"""A token id (the vocabulary's size is the worker's to say: larger ids are a 400)."""


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None
    code: str | int
    """The RPC error code, or the HTTP status when there is none."""


class ErrorBody(Struct):
    """Every error answer of every route (`errors.ApiError`): OpenAI's shape."""

    error: ErrorDetail


class AnthropicErrorDetail(Struct):
    type: str
    message: str


class AnthropicErrorBody(Struct):
    """Every error answer of the Messages API's routes (`messages_protocol.AnthropicError`):
    Anthropic's shape."""

    type: str
    error: AnthropicErrorDetail


def _ref(kind: type) -> dict[str, Any]:
    return {"$ref": REF.format(name=kind.__name__)}


def request_body(kind: type, required: bool = True) -> dict[str, Any]:
    """A route's `openapi_extra`: its JSON body is a `kind` (a msgspec Struct that
    `install` adds to the components)."""
    return {"requestBody": {"required": required,
                            "content": {"application/json": {"schema": _ref(kind)}}}}


ERRORS: dict[int | str, dict[str, Any]] = {"default": {
    "description": "An error, in the one shape of every route",
    "content": {"application/json": {"schema": _ref(ErrorBody)}}}}
"""The `responses` of every route (the app's own 401, 404, 405 and 413 share the shape)."""
ANTHROPIC_ERRORS: dict[int | str, dict[str, Any]] = {"default": {
    "description": "An error, in Anthropic's shape",
    "content": {"application/json": {"schema": _ref(AnthropicErrorBody)}}}}
"""The `responses` of the Messages API's routes, whose errors have Anthropic's shape."""

STREAMED: dict[int | str, dict[str, Any]] = {200: {
    "description": "The answer; with `stream: true`, server-sent events ending in [DONE]",
    "content": {"text/event-stream": {"itemSchema": {  # each event (OpenAPI 3.2's way)
        "type": "object", "required": ["data"],
        "properties": {"data": {"type": "string", "contentMediaType": "application/json"},
                       "event": {"type": "string"}, "id": {"type": "string"},
                       "retry": {"type": "integer", "minimum": 0}}}}}}}
"""The `responses` of a route that streams on request (FastAPI adds its JSON answer)."""


def install(app: FastAPI, bodies: list[type], model_names: list[str],
            refused: dict[str, Iterable[str]], adapters: bool = False) -> None:
    """Make `app.openapi()` add the JSON schemas of `bodies` (and of what they refer to)
    to its components, with what the routes check beyond the Structs' types (`_refine`).
    `refused`: per body name, the fields its route accepts only at their defaults.
    `adapters`: the server serves LoRA adapters, which a `model` may also name."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            _, components = msgspec.json.schema_components(
                [*bodies, ErrorBody, AnthropicErrorBody, SamplingParams], ref_template=REF)
            _refine(components, model_names, refused, adapters)
            ours = schema.setdefault("components", {}).setdefault("schemas", {})
            clash = set(ours) & set(components)
            assert not clash, f"schema names taken twice: {clash}"
            ours.update(components)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _default_only(field: dict[str, Any]) -> dict[str, Any]:
    """A field accepted at its default only (clients send it so), refused by name else."""
    return {"const": field.get("default"), "description": "Not supported: only its default"}


def _refine(components: dict[str, Any], model_names: list[str],
            refused: dict[str, Iterable[str]], adapters: bool) -> None:
    """What the routes check beyond the Structs' types: a generate call's `sampling_params`
    are `SamplingParams` (the front door decodes them as such) and it takes exactly one of
    `text` and `input_ids`; the features refused by name (`refused`, per body) only at
    their defaults; an OpenAI request's `model` is one of `model_names` or, with
    `adapters`, a LoRA adapter's name (any other is a 404), a completion's prompt one of
    its four forms, a chat's messages not empty."""
    params = _ref(SamplingParams)
    generate = components["GenerateBody"]
    fields = generate["properties"]
    fields["sampling_params"] = {"anyOf": [params, {"type": "array", "items": params}]}
    text = {"type": "string", "minLength": 1}
    ids = {"type": "array", "items": TOKEN, "minItems": 1, "maxItems": MAX_INPUT_IDS}
    # Exactly one of text and input_ids (null is the same as absent); no empty prompt.
    fields["text"] = {"anyOf": [text, {"type": "array", "items": text, "minItems": 1,
                                       "maxItems": MAX_BATCH}]}
    fields["input_ids"] = {"anyOf": [ids, {**ids, "items": ids, "maxItems": MAX_BATCH}]}
    generate["oneOf"] = [{"required": ["text"]}, {"required": ["input_ids"]}]
    for body, names in refused.items():
        fields = components[body]["properties"]
        for name in names:
            if name in fields:
                fields[name] = _default_only(fields[name])
    model: dict[str, Any] = {"enum": sorted(model_names)}
    if adapters:
        model = {"anyOf": [model, {"type": "string", "pattern": f"^{LORA_NAME.pattern}$"}],
                 "description": "The base model, or a loaded LoRA adapter (GET /v1/models)"}
    for name in ("CompletionRequest", "ChatRequest"):
        components[name]["properties"]["model"] = model
    fields = components["CompletionRequest"]["properties"]
    fields["prompt"] = {"anyOf": [
        text, {"type": "array", "items": text, "minItems": 1},
        {"type": "array", "items": TOKEN, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": TOKEN, "minItems": 1},
         "minItems": 1}]}
    components["ChatRequest"]["properties"]["messages"]["minItems"] = 1
